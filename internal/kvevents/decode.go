package kvevents

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

var (
	// ErrMalformed: the payload is not one well-formed msgpack value
	// (truncated, reserved code, trailing bytes, nesting deeper than 32).
	ErrMalformed = errors.New("kvevents: malformed msgpack")
	// ErrSchema: valid msgpack that is not a KV-event batch (wrong type, value
	// out of range, required field missing).
	ErrSchema = errors.New("kvevents: payload does not match the KV-event schema")
)

// DecodeError locates a decoding failure. It wraps ErrMalformed or
// ErrSchema, so callers test it with errors.Is.
type DecodeError struct {
	Err    error  // ErrMalformed or ErrSchema
	Path   string // for ErrSchema: msgspec-style path, "$" is the batch, e.g. "$[1][0].token_ids[3]"
	Offset int    // for ErrMalformed: byte offset in the payload
	Detail string
}

func (e *DecodeError) Error() string {
	if errors.Is(e.Err, ErrMalformed) {
		return fmt.Sprintf("%v at byte %d: %s", e.Err, e.Offset, e.Detail)
	}
	return fmt.Sprintf("%v at %s: %s", e.Err, e.Path, e.Detail)
}

func (e *DecodeError) Unwrap() error { return e.Err }

// Decode parses one payload in either form (see the package doc). Unknown
// event types and unknown fields are skipped; everything it does read is
// checked, and any failure is a *DecodeError. It never panics, and the
// memory it allocates is bounded by a small multiple of len(data).
func Decode(data []byte) (Batch, error) {
	if err := checkWellFormed(data); err != nil {
		return Batch{}, err
	}
	r := &reader{data: data, cur: rawCursor{b: data}}
	return r.batch()
}

// seg is one step of a path: a field name or, with name == "", an index.
type seg struct {
	name string
	idx  int
}

// reader decodes one batch. Map keys may come in any order and the meaning
// of an event's fields depends on its tag, so an event's fields are first
// located (as byte spans) and then interpreted.
type reader struct {
	data []byte
	cur  rawCursor
	path []seg
}

func (r *reader) push(s seg) { r.path = append(r.path, s) }
func (r *reader) pop()       { r.path = r.path[:len(r.path)-1] }

func (r *reader) pathString(extra string) string {
	var sb strings.Builder
	sb.WriteByte('$')
	for _, s := range r.path {
		if s.name != "" {
			sb.WriteByte('.')
			sb.WriteString(s.name)
			continue
		}
		sb.WriteByte('[')
		sb.WriteString(strconv.Itoa(s.idx))
		sb.WriteByte(']')
	}
	sb.WriteString(extra)
	return sb.String()
}

func (r *reader) schemaErr(format string, args ...any) error {
	return &DecodeError{Err: ErrSchema, Path: r.pathString(""), Detail: fmt.Sprintf(format, args...)}
}

// wrap turns an error from a value reader into a DecodeError at the current
// path. A *valueErr carries the position inside the value ("[3]"); errShort
// cannot happen after checkWellFormed, and is reported as malformed if it
// does.
func (r *reader) wrap(err error) error {
	var ve *valueErr
	if errors.As(err, &ve) {
		return &DecodeError{Err: ErrSchema, Path: r.pathString(ve.sub), Detail: ve.msg}
	}
	var de *DecodeError
	if errors.As(err, &de) {
		return err
	}
	return &DecodeError{Err: ErrMalformed, Offset: r.cur.pos, Detail: err.Error()}
}

func (r *reader) batch() (Batch, error) {
	c := &r.cur
	code, err := c.peek()
	if err != nil {
		return Batch{}, r.wrap(err)
	}
	var b Batch
	switch {
	case isArray(code):
		n, err := c.arrayLen("batch array")
		if err != nil {
			return Batch{}, r.wrap(err)
		}
		if n < 2 {
			return Batch{}, r.schemaErr("batch array has %d elements, want [ts, events] or [ts, events, data_parallel_rank]", n)
		}
		for i := range n {
			r.push(seg{idx: i})
			switch i {
			case 0:
				b.Timestamp, err = c.float("float timestamp")
			case 1:
				b.Events, err = r.events()
			case 2:
				b.DataParallelRank, err = readOptInt(c)
			default: // a field appended by a newer vLLM
				err = c.skip()
			}
			if err != nil {
				return Batch{}, r.wrap(err)
			}
			r.pop()
		}
	case isMap(code):
		// Not what vLLM sends today (EventBatch is array_like), accepted in
		// case the envelope follows the events to map encoding.
		n, err := c.mapLen("batch map")
		if err != nil {
			return Batch{}, r.wrap(err)
		}
		var haveTS, haveEvents bool
		for range n {
			key, err := r.mapKey()
			if err != nil {
				return Batch{}, err
			}
			r.push(seg{name: key})
			switch key {
			case "ts":
				b.Timestamp, err = c.float("float timestamp")
				haveTS = true
			case "events":
				b.Events, err = r.events()
				haveEvents = true
			case "data_parallel_rank":
				b.DataParallelRank, err = readOptInt(c)
			default:
				err = c.skip()
			}
			if err != nil {
				return Batch{}, r.wrap(err)
			}
			r.pop()
		}
		if !haveTS || !haveEvents {
			return Batch{}, r.schemaErr("batch map lacks ts or events")
		}
	default:
		return Batch{}, r.schemaErr("expected batch array, got %s", kindOf(code))
	}
	if b.Events == nil {
		b.Events = []Event{}
	}
	return b, nil
}

// mapKey reads a map key, which must be a string.
func (r *reader) mapKey() (string, error) {
	k, err := r.cur.str("string map key")
	if err != nil {
		return "", r.wrap(err)
	}
	return k, nil
}

func (r *reader) events() ([]Event, error) {
	n, err := r.cur.arrayLen("events array")
	if err != nil {
		return nil, err
	}
	evs := make([]Event, 0, n)
	for i := range n {
		r.push(seg{idx: i})
		ev, err := r.event()
		if err != nil {
			return nil, r.wrap(err)
		}
		if ev != nil {
			evs = append(evs, ev)
		}
		r.pop()
	}
	return evs, nil
}

// Field slots of the known event structs.
const (
	fBlockHashes = iota
	fParentBlockHash
	fTokenIDs
	fBlockSize
	fLoraID
	fMedium
	fLoraName
	numFields
)

var fieldNames = [numFields]string{
	fBlockHashes:     "block_hashes",
	fParentBlockHash: "parent_block_hash",
	fTokenIDs:        "token_ids",
	fBlockSize:       "block_size",
	fLoraID:          "lora_id",
	fMedium:          "medium",
	fLoraName:        "lora_name",
}

// Positional layouts, after the tag, in vLLM's declaration order. Positions
// past the end of a layout (extra_keys, group_idx, ...) are skipped.
var (
	storedLayout  = []int{fBlockHashes, fParentBlockHash, fTokenIDs, fBlockSize, fLoraID, fMedium, fLoraName}
	removedLayout = []int{fBlockHashes, fMedium}
)

func fieldByName(name string) int {
	for i, n := range fieldNames {
		if n == name {
			return i
		}
	}
	return -1
}

// span locates one field's bytes in the payload.
type span struct {
	start, end int
	ok         bool
}

// event reads one event. It returns (nil, nil) for an event of an unknown
// type, which is skipped.
func (r *reader) event() (Event, error) {
	code, err := r.cur.peek()
	if err != nil {
		return nil, err
	}
	var (
		tag    string
		fields [numFields]span
	)
	switch {
	case isArray(code):
		tag, err = r.arrayEvent(&fields)
	case isMap(code):
		tag, err = r.mapEvent(&fields)
	default:
		return nil, &valueErr{msg: "expected event array or map, got " + kindOf(code)}
	}
	if err != nil {
		return nil, err
	}
	switch tag {
	case TagBlockStored:
		return r.blockStored(&fields)
	case TagBlockRemoved:
		return r.blockRemoved(&fields)
	case TagAllBlocksCleared:
		return &AllBlocksCleared{}, nil
	}
	return nil, nil // unknown event type: forward compatible, skip it
}

// arrayEvent reads the tag of an event in array form and locates its fields,
// which follow in the positions of the tag's layout.
func (r *reader) arrayEvent(fields *[numFields]span) (tag string, err error) {
	n, err := r.cur.arrayLen("event")
	if err != nil {
		return "", err
	}
	if n == 0 {
		return "", &valueErr{msg: "empty event array: no tag"}
	}
	if tag, err = r.tag(seg{idx: 0}); err != nil {
		return "", err
	}
	layout := layoutOf(tag)
	for i := 1; i < n; i++ {
		f := -1
		if i-1 < len(layout) {
			f = layout[i-1]
		}
		if err := r.locate(fields, f); err != nil {
			return "", err
		}
	}
	return tag, nil
}

// layoutOf returns the positional layout of an event type. An unknown type
// has none: all its fields are skipped.
func layoutOf(tag string) []int {
	switch tag {
	case TagBlockStored:
		return storedLayout
	case TagBlockRemoved:
		return removedLayout
	}
	return nil
}

// mapEvent reads the tag of an event in map form, under the key "type", and
// locates its fields. Keys may come in any order, so the fields can only be
// interpreted once the whole map has been read.
func (r *reader) mapEvent(fields *[numFields]span) (tag string, err error) {
	n, err := r.cur.mapLen("event")
	if err != nil {
		return "", err
	}
	haveTag := false
	for range n {
		key, err := r.mapKey()
		if err != nil {
			return "", err
		}
		if key == "type" {
			if tag, err = r.tag(seg{name: "type"}); err != nil {
				return "", err
			}
			haveTag = true
			continue
		}
		if err := r.locate(fields, fieldByName(key)); err != nil {
			return "", err
		}
	}
	if !haveTag {
		return "", &valueErr{msg: `event map has no "type" key`}
	}
	return tag, nil
}

// tag reads an event's tag; s is where the tag stands in the event, for the
// path of an error.
func (r *reader) tag(s seg) (string, error) {
	r.push(s)
	defer r.pop()
	tag, err := r.cur.str("event tag str")
	if err != nil {
		return "", r.wrap(err)
	}
	return tag, nil
}

// locate records the bytes of the value under the cursor as field f (f < 0:
// not a field we read) and steps over them.
func (r *reader) locate(fields *[numFields]span, f int) error {
	start := r.cur.pos
	if err := r.cur.skip(); err != nil {
		return err
	}
	if f >= 0 {
		fields[f] = span{start: start, end: r.cur.pos, ok: true}
	}
	return nil
}

// field runs read on the bytes of field f, with the path extended by the
// field's name. A missing optional field leaves its zero value.
func (r *reader) field(fields *[numFields]span, f int, required bool, read func(c *rawCursor) error) error {
	sp := fields[f]
	if !sp.ok {
		if required {
			return r.schemaErr("missing field %s", fieldNames[f])
		}
		return nil
	}
	r.push(seg{name: fieldNames[f]})
	defer r.pop()
	c := rawCursor{b: r.data[:sp.end], pos: sp.start}
	if err := read(&c); err != nil {
		return r.wrap(err)
	}
	return nil
}

func (r *reader) blockStored(fields *[numFields]span) (Event, error) {
	e := &BlockStored{}
	var err error
	steps := []struct {
		f        int
		required bool
		read     func(c *rawCursor) error
	}{
		{fBlockHashes, true, func(c *rawCursor) error { e.BlockHashes, err = readHashes(c); return err }},
		{fParentBlockHash, false, func(c *rawCursor) error { e.ParentBlockHash, err = readOptHash(c); return err }},
		{fTokenIDs, true, func(c *rawCursor) error { e.TokenIDs, err = readTokenIDs(c); return err }},
		{fBlockSize, true, func(c *rawCursor) error { e.BlockSize, err = readBlockSize(c); return err }},
		{fLoraID, false, func(c *rawCursor) error { e.LoraID, err = readOptInt(c); return err }},
		{fMedium, false, func(c *rawCursor) error { e.Medium, err = readOptString(c); return err }},
		{fLoraName, false, func(c *rawCursor) error { e.LoraName, err = readOptString(c); return err }},
	}
	for _, s := range steps {
		if err := r.field(fields, s.f, s.required, s.read); err != nil {
			return nil, err
		}
	}
	return e, nil
}

func (r *reader) blockRemoved(fields *[numFields]span) (Event, error) {
	e := &BlockRemoved{}
	var err error
	if err := r.field(fields, fBlockHashes, true, func(c *rawCursor) error {
		e.BlockHashes, err = readHashes(c)
		return err
	}); err != nil {
		return nil, err
	}
	if err := r.field(fields, fMedium, false, func(c *rawCursor) error {
		e.Medium, err = readOptString(c)
		return err
	}); err != nil {
		return nil, err
	}
	return e, nil
}

// valueErr is a type or range error inside one value; sub locates it inside
// the value ("[3]" for the fourth list element), the reader adds the path.
type valueErr struct {
	sub string
	msg string
}

func (e *valueErr) Error() string { return e.sub + ": " + e.msg }

func wrongType(want string, code byte) error {
	return &valueErr{msg: "expected " + want + ", got " + kindOf(code)}
}

func atIndex(i int, err error) error {
	var ve *valueErr
	if errors.As(err, &ve) {
		return &valueErr{sub: "[" + strconv.Itoa(i) + "]" + ve.sub, msg: ve.msg}
	}
	return err
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

// kindOf names the msgpack type of code c for error messages.
func kindOf(c byte) string {
	switch {
	case c == msgpcode.Nil:
		return "nil"
	case c == msgpcode.True || c == msgpcode.False:
		return "bool"
	case c <= msgpcode.PosFixedNumHigh || c >= msgpcode.NegFixedNumLow,
		c >= msgpcode.Uint8 && c <= msgpcode.Int64:
		return "int"
	case c == msgpcode.Float || c == msgpcode.Double:
		return "float"
	case msgpcode.IsString(c):
		return "str"
	case msgpcode.IsBin(c):
		return "bytes"
	case isArray(c):
		return "array"
	case isMap(c):
		return "map"
	case msgpcode.IsExt(c):
		return "ext"
	}
	return fmt.Sprintf("code 0x%02x", c)
}

// integer is a msgpack integer of any width and sign.
type integer struct {
	neg bool
	u   uint64 // the value when !neg
	i   int64  // the value when neg
}

func (n integer) String() string {
	if n.neg {
		return strconv.FormatInt(n.i, 10)
	}
	return strconv.FormatUint(n.u, 10)
}

// asInt converts to a Go int, rejecting values below lo or outside int.
func (n integer) asInt(lo int64) (int, bool) {
	if n.neg {
		if n.i < lo || n.i < math.MinInt {
			return 0, false
		}
		return int(n.i), true
	}
	if n.u > math.MaxInt || (lo > 0 && n.u < uint64(lo)) {
		return 0, false
	}
	return int(n.u), true
}

func readOptInt(c *rawCursor) (*int, error) {
	if isNil, err := c.nilValue(); isNil || err != nil {
		return nil, err
	}
	n, err := c.integer("int or nil")
	if err != nil {
		return nil, err
	}
	v, ok := n.asInt(math.MinInt64)
	if !ok {
		return nil, &valueErr{msg: "int " + n.String() + " out of range"}
	}
	return &v, nil
}

func readBlockSize(c *rawCursor) (int, error) {
	n, err := c.integer("int")
	if err != nil {
		return 0, err
	}
	v, ok := n.asInt(0)
	if !ok {
		return 0, &valueErr{msg: "block size " + n.String() + " out of range"}
	}
	return v, nil
}

func readOptString(c *rawCursor) (string, error) {
	if isNil, err := c.nilValue(); isNil || err != nil {
		return "", err
	}
	return c.str("str or nil")
}

func readOptHash(c *rawCursor) (*uint64, error) {
	if isNil, err := c.nilValue(); isNil || err != nil {
		return nil, err
	}
	h, err := c.hash()
	if err != nil {
		return nil, err
	}
	return &h, nil
}

func readHashes(c *rawCursor) ([]uint64, error) {
	n, err := c.arrayLen("array of block hashes")
	if err != nil {
		return nil, err
	}
	hs := make([]uint64, n)
	for i := range hs {
		if hs[i], err = c.hash(); err != nil {
			return nil, atIndex(i, err)
		}
	}
	return hs, nil
}

func readTokenIDs(c *rawCursor) ([]uint32, error) {
	n, err := c.arrayLen("array of token ids")
	if err != nil {
		return nil, err
	}
	ts := make([]uint32, n)
	for i := range ts {
		v, err := c.integer("int token id")
		if err != nil {
			return nil, atIndex(i, err)
		}
		if v.neg || v.u > math.MaxUint32 {
			return nil, atIndex(i, &valueErr{msg: "token id " + v.String() + " outside [0, 2^32)"})
		}
		ts[i] = uint32(v.u)
	}
	return ts, nil
}
