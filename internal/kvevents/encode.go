package kvevents

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// ErrInvalidBatch is returned by Encode for a batch that vLLM could not have
// sent (a nil event, a negative block size).
var ErrInvalidBatch = errors.New("kvevents: invalid batch")

// Encode writes b as vLLM's msgspec encoder does: the batch as a positional
// array [ts, events, data_parallel_rank] (the rank left out when nil, as
// msgspec's omit_defaults does), the events in form f. Integers take their
// shortest msgpack encoding and the timestamp is always a float64, as
// msgspec writes them, so the bytes equal msgspec's for the same values.
func Encode(b Batch, f Form) ([]byte, error) {
	if f != FormMap && f != FormArray {
		return nil, fmt.Errorf("%w: %s", ErrUnknownForm, f)
	}
	var buf bytes.Buffer
	buf.Grow(64 + 16*len(b.Events))
	enc := msgpack.NewEncoder(&buf)
	w := &writer{enc: enc}

	n := 2
	if b.DataParallelRank != nil {
		n = 3
	}
	w.arrayLen(n)
	w.float(b.Timestamp)
	w.arrayLen(len(b.Events))
	for i, ev := range b.Events {
		if err := w.event(ev, f); err != nil {
			return nil, fmt.Errorf("%w: event %d: %v", ErrInvalidBatch, i, err)
		}
	}
	if b.DataParallelRank != nil {
		w.int(int64(*b.DataParallelRank))
	}
	if w.err != nil {
		return nil, w.err
	}
	return buf.Bytes(), nil
}

// writer wraps the msgpack encoder and keeps its first error, so the field
// lists below read as the wire layout they produce. Writes go to a
// bytes.Buffer, which cannot fail, but the error is kept all the same.
type writer struct {
	enc *msgpack.Encoder
	err error
}

func (w *writer) keep(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *writer) arrayLen(n int)  { w.keep(w.enc.EncodeArrayLen(n)) }
func (w *writer) mapLen(n int)    { w.keep(w.enc.EncodeMapLen(n)) }
func (w *writer) float(v float64) { w.keep(w.enc.EncodeFloat64(v)) }
func (w *writer) int(v int64)     { w.keep(w.enc.EncodeInt(v)) }
func (w *writer) uint(v uint64)   { w.keep(w.enc.EncodeUint(v)) }
func (w *writer) str(s string)    { w.keep(w.enc.EncodeString(s)) }
func (w *writer) nil()            { w.keep(w.enc.EncodeNil()) }
func (w *writer) key(name string) { w.str(name) }
func (w *writer) hashes(h []uint64) {
	w.arrayLen(len(h))
	for _, v := range h {
		w.uint(v)
	}
}

// optStr writes "" as nil: vLLM's medium and lora_name are `str | None`.
func (w *writer) optStr(s string) {
	if s == "" {
		w.nil()
		return
	}
	w.str(s)
}

func (w *writer) optUint(p *uint64) {
	if p == nil {
		w.nil()
		return
	}
	w.uint(*p)
}

func (w *writer) optInt(p *int) {
	if p == nil {
		w.nil()
		return
	}
	w.int(int64(*p))
}

// event writes one event, after checking that vLLM could have sent it.
func (w *writer) event(ev Event, f Form) error {
	asMap := f == FormMap
	switch e := ev.(type) {
	case *BlockStored:
		if e == nil {
			return errors.New("nil *BlockStored")
		}
		if e.BlockSize < 0 {
			return fmt.Errorf("negative block size %d", e.BlockSize)
		}
		w.blockStored(e, asMap)
	case *BlockRemoved:
		if e == nil {
			return errors.New("nil *BlockRemoved")
		}
		w.blockRemoved(e, asMap)
	case *AllBlocksCleared:
		if e == nil {
			return errors.New("nil *AllBlocksCleared")
		}
		w.eventHeader(TagAllBlocksCleared, 0, asMap)
	case nil:
		return errors.New("nil event")
	default:
		// Unreachable: Event's method is unexported.
		return fmt.Errorf("unsupported event type %T", ev)
	}
	return nil
}

// eventHeader starts an event of nFields fields after its tag. In map form
// the tag comes first under "type" and the fields follow in declaration
// order, as msgspec writes a tagged struct; in array form the same values
// are written positionally, the tag first.
func (w *writer) eventHeader(tag string, nFields int, asMap bool) {
	if asMap {
		w.mapLen(1 + nFields)
		w.key("type")
	} else {
		w.arrayLen(1 + nFields)
	}
	w.str(tag)
}

// fieldKey writes the key of the next field in map form, and nothing in
// array form, where the position says which field it is.
func (w *writer) fieldKey(name string, asMap bool) {
	if asMap {
		w.key(name)
	}
}

// blockStored writes the fields in the order of vLLM's BlockStored:
// block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
// lora_name.
func (w *writer) blockStored(e *BlockStored, asMap bool) {
	w.eventHeader(TagBlockStored, 7, asMap)
	w.fieldKey("block_hashes", asMap)
	w.hashes(e.BlockHashes)
	w.fieldKey("parent_block_hash", asMap)
	w.optUint(e.ParentBlockHash)
	w.fieldKey("token_ids", asMap)
	w.arrayLen(len(e.TokenIDs))
	for _, t := range e.TokenIDs {
		w.uint(uint64(t))
	}
	w.fieldKey("block_size", asMap)
	w.int(int64(e.BlockSize))
	w.fieldKey("lora_id", asMap)
	w.optInt(e.LoraID)
	w.fieldKey("medium", asMap)
	w.optStr(e.Medium)
	w.fieldKey("lora_name", asMap)
	w.optStr(e.LoraName)
}

// blockRemoved writes the fields in the order of vLLM's BlockRemoved:
// block_hashes, medium.
func (w *writer) blockRemoved(e *BlockRemoved, asMap bool) {
	w.eventHeader(TagBlockRemoved, 2, asMap)
	w.fieldKey("block_hashes", asMap)
	w.hashes(e.BlockHashes)
	w.fieldKey("medium", asMap)
	w.optStr(e.Medium)
}
