package sharedstate

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/kvgate/kvgate/internal/router"
)

// The wire format of batches and snapshots. Every gateway of a deployment
// reads what every other writes, possibly across a rolling upgrade: the
// first byte is the format version, the second the kind, and a decoder
// refuses a version it does not know rather than guess.
//
//	batch:    version 'B' strings gateway seq at loads decisions
//	strings:  n, then n × (len, bytes): every replica and model name once
//	loads:    n, then n × (replica-index, in-flight, in-flight-tokens, pending-prefill, pending-count)
//	decision: replica-index model-index offset tokens [program] nblocks, nblocks × 8 bytes
//	snapshot: version 'S' position at n, then n × (name nblocks, nblocks × 8 bytes)
//
// Version 2 (a batch whose decisions name programs: router.Learned.Program)
// adds each decision's program, 8 bytes (0: none); a batch without one is
// written as version 1, which gateways before it read, so that a rolling
// upgrade loses only the batches that carry programs on the old gateways.
//
// Integers are varints (loads zig-zag, since a count may dip below zero for
// an instant), times Unix nanoseconds (0: the zero time). Block hashes are
// 64-bit chained hashes, as random as their bits: raw little-endian 8 bytes
// each, which no varint would shorten. Replica and model names repeat in
// every decision of a batch; the string table makes each repetition one
// byte. A decision of 60 new blocks costs 480 bytes of hashes and about 6
// of everything else.
const (
	codecVersion         = 1
	codecVersionPrograms = 2 // batches with programs
	kindBatch            = 'B'
	kindSnapshot         = 'S'
)

// ErrCorrupt is what the decoders return for input they cannot read
// (wrapped with where it went wrong).
var ErrCorrupt = errors.New("sharedstate: corrupt encoding")

// AppendBatch appends the encoding of b to dst.
func AppendBatch(dst []byte, b *Batch) []byte {
	var buf [stringTableScan]string
	st := stringTable{list: buf[:0]}
	st.add(b.Gateway)
	for i := range b.Loads {
		st.add(b.Loads[i].Replica)
	}
	for i := range b.Decisions {
		st.add(b.Decisions[i].Replica)
		st.add(b.Decisions[i].Model)
	}
	version := byte(codecVersion)
	for i := range b.Decisions {
		if b.Decisions[i].Program != 0 {
			version = codecVersionPrograms
		}
	}
	dst = append(dst, version, kindBatch)
	dst = binary.AppendUvarint(dst, uint64(len(st.list)))
	for _, s := range st.list {
		dst = appendString(dst, s)
	}
	dst = binary.AppendUvarint(dst, st.add(b.Gateway))
	dst = binary.AppendUvarint(dst, b.Seq)
	dst = appendTime(dst, b.At)
	dst = binary.AppendUvarint(dst, uint64(len(b.Loads)))
	for i := range b.Loads {
		l := &b.Loads[i]
		dst = binary.AppendUvarint(dst, st.add(l.Replica))
		dst = binary.AppendVarint(dst, l.Load.InFlight)
		dst = binary.AppendVarint(dst, l.Load.InFlightTokens)
		dst = binary.AppendVarint(dst, l.Load.PendingPrefill)
		dst = binary.AppendVarint(dst, l.Load.PendingCount)
	}
	dst = binary.AppendUvarint(dst, uint64(len(b.Decisions)))
	for i := range b.Decisions {
		d := &b.Decisions[i]
		dst = binary.AppendUvarint(dst, st.add(d.Replica))
		dst = binary.AppendUvarint(dst, st.add(d.Model))
		dst = binary.AppendUvarint(dst, uint64(max(d.Offset, 0)))
		dst = binary.AppendUvarint(dst, uint64(max(d.Tokens, 0)))
		if version == codecVersionPrograms {
			dst = binary.LittleEndian.AppendUint64(dst, d.Program)
		}
		dst = appendBlocks(dst, d.Blocks)
	}
	return dst
}

// DecodeBatch decodes an encoding AppendBatch made. It never panics, and it
// allocates at most a small multiple of len(p): every count is checked
// against the bytes left before anything is made of that size.
func DecodeBatch(p []byte) (Batch, error) {
	d := decoder{p: p}
	var b Batch
	programs := d.header(kindBatch, codecVersionPrograms) == codecVersionPrograms
	n := d.count(1) // an empty string is one byte
	strs := make([]string, 0, n)
	for range n {
		strs = append(strs, d.string())
	}
	str := func() string {
		i := d.uvarint()
		if d.err == nil && i >= uint64(len(strs)) {
			d.fail("string index %d of %d", i, len(strs))
		}
		if d.err != nil {
			return ""
		}
		return strs[i]
	}
	b.Gateway = str()
	b.Seq = d.uvarint()
	b.At = d.time()
	if n := d.count(5); n > 0 {
		b.Loads = make([]ReplicaLoad, n)
		for i := range b.Loads {
			l := &b.Loads[i]
			l.Replica = str()
			l.Load = router.Load{InFlight: d.varint(), InFlightTokens: d.varint(), PendingPrefill: d.varint(), PendingCount: d.varint()}
		}
	}
	if n := d.count(5); n > 0 { // a decision is at least 5 bytes (13 with a program)
		b.Decisions = make([]Decision, n)
		for i := range b.Decisions {
			x := &b.Decisions[i]
			x.Replica = str()
			x.Model = str()
			x.Offset = d.int()
			x.Tokens = d.int()
			if programs {
				x.Program = d.uint64()
			}
			x.Blocks = d.blocks()
		}
	}
	if err := d.finish(); err != nil {
		return Batch{}, err
	}
	return b, nil
}

// Snapshot is a copy of a router's approximate index, by replica name: what
// a gateway that starts loads before it reports ready (from Redis, or from
// a local file).
type Snapshot struct {
	// Position is what the snapshot covers: the ID of the last stream entry
	// applied before it was taken ("" for a local file).
	Position string
	At       time.Time
	Replicas []ReplicaBlocks
}

// ReplicaBlocks are the blocks one replica holds in the index.
type ReplicaBlocks struct {
	Replica string
	Blocks  []uint64 // most recent first, as prefixindex.Index.Snapshot returns
}

// Len is the number of blocks in the snapshot.
func (s Snapshot) Len() int {
	n := 0
	for _, r := range s.Replicas {
		n += len(r.Blocks)
	}
	return n
}

// AppendSnapshot appends the encoding of s to dst.
func AppendSnapshot(dst []byte, s *Snapshot) []byte {
	dst = append(dst, codecVersion, kindSnapshot)
	dst = appendString(dst, s.Position)
	dst = appendTime(dst, s.At)
	dst = binary.AppendUvarint(dst, uint64(len(s.Replicas)))
	for _, r := range s.Replicas {
		dst = appendString(dst, r.Replica)
		dst = appendBlocks(dst, r.Blocks)
	}
	return dst
}

// DecodeSnapshot decodes an encoding AppendSnapshot made; like DecodeBatch,
// it never panics and bounds its allocations by len(p).
func DecodeSnapshot(p []byte) (Snapshot, error) {
	d := decoder{p: p}
	var s Snapshot
	d.header(kindSnapshot)
	s.Position = d.string()
	s.At = d.time()
	if n := d.count(2); n > 0 {
		s.Replicas = make([]ReplicaBlocks, n)
		for i := range s.Replicas {
			s.Replicas[i] = ReplicaBlocks{Replica: d.string(), Blocks: d.blocks()}
		}
	}
	if err := d.finish(); err != nil {
		return Snapshot{}, err
	}
	return s, nil
}

// TakeSnapshot copies rt's approximate index: every replica slot's blocks,
// most recent first, under the slot's name.
func TakeSnapshot(rt *router.Router, position string, at time.Time) Snapshot {
	s := Snapshot{Position: position, At: at, Replicas: make([]ReplicaBlocks, 0, rt.Replicas())}
	for i := range rt.Replicas() {
		if rt.Replica(i).Vacant() {
			continue // a forgotten replica's slot, free for the next one added
		}
		s.Replicas = append(s.Replicas, ReplicaBlocks{Replica: rt.Name(i), Blocks: rt.Index().Snapshot(i)})
	}
	return s
}

// Restore inserts the snapshot's blocks into rt's approximate index, each
// replica's under the slot of the same name (names rt does not know are
// skipped), keeping their LRU order: Index.Insert touches its blocks last
// to first, so the snapshot's most recent block ends most recent. It
// returns the number of blocks restored.
func (s Snapshot) Restore(rt *router.Router) int {
	n := 0
	for _, r := range s.Replicas {
		slot, ok := rt.Lookup(r.Replica)
		if !ok || len(r.Blocks) == 0 {
			continue
		}
		if rt.Index().Insert(slot, r.Blocks) == nil {
			n += len(r.Blocks)
		}
	}
	return n
}

// stringTable numbers the distinct strings of a batch in order of first
// use. A batch names a few replicas and models: a linear scan beats a map
// until the table grows.
type stringTable struct {
	list  []string
	index map[string]uint64 // once the list is long
}

const stringTableScan = 16

func (t *stringTable) add(s string) uint64 {
	if t.index != nil {
		if i, ok := t.index[s]; ok {
			return i
		}
	} else {
		for i, x := range t.list {
			if x == s {
				return uint64(i)
			}
		}
	}
	i := uint64(len(t.list))
	t.list = append(t.list, s)
	if t.index != nil {
		t.index[s] = i
	} else if len(t.list) > stringTableScan {
		t.index = make(map[string]uint64, 2*len(t.list))
		for j, x := range t.list {
			t.index[x] = uint64(j)
		}
	}
	return i
}

func appendString(dst []byte, s string) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

func appendTime(dst []byte, t time.Time) []byte {
	if t.IsZero() {
		return binary.AppendVarint(dst, 0)
	}
	return binary.AppendVarint(dst, t.UnixNano())
}

func appendBlocks(dst []byte, blocks []uint64) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(blocks)))
	for _, h := range blocks {
		dst = binary.LittleEndian.AppendUint64(dst, h)
	}
	return dst
}

// decoder reads p front to back; the first error sticks and every later
// read returns a zero value, so the decoding functions read straight
// through and check once.
type decoder struct {
	p   []byte
	off int
	err error
}

func (d *decoder) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: at byte %d: %s", ErrCorrupt, d.off, fmt.Sprintf(format, args...))
	}
}

func (d *decoder) left() int { return len(d.p) - d.off }

// header reads the version and the kind: codecVersion, or also upTo for
// a kind that has later versions; it returns the version.
func (d *decoder) header(kind byte, upTo ...byte) byte {
	if d.left() < 2 {
		d.fail("%d bytes: too short", len(d.p))
		return 0
	}
	top := byte(codecVersion)
	if len(upTo) > 0 {
		top = upTo[0]
	}
	if v := d.p[0]; v < codecVersion || v > top {
		d.fail("format version %d (this kvgate reads %d to %d)", v, codecVersion, top)
		return 0
	}
	if k := d.p[1]; k != kind {
		d.fail("kind %q, want %q", k, kind)
		return 0
	}
	d.off = 2
	return d.p[0]
}

// uint64 reads 8 little-endian bytes.
func (d *decoder) uint64() uint64 {
	if d.err != nil {
		return 0
	}
	if d.left() < 8 {
		d.fail("%d bytes left, want 8", d.left())
		return 0
	}
	v := binary.LittleEndian.Uint64(d.p[d.off:])
	d.off += 8
	return v
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.p[d.off:])
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	d.off += n
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.p[d.off:])
	if n <= 0 {
		d.fail("bad varint")
		return 0
	}
	d.off += n
	return v
}

func (d *decoder) int() int {
	v := d.uvarint()
	if v > math.MaxInt32 {
		d.fail("integer %d out of range", v)
		return 0
	}
	return int(v)
}

// count reads a count of items each at least min bytes long, and fails
// unless that many could fit in what is left.
func (d *decoder) count(min int) int {
	v := d.uvarint()
	if d.err == nil && v > uint64(d.left()/min) {
		d.fail("count %d exceeds the %d bytes left", v, d.left())
	}
	if d.err != nil {
		return 0
	}
	return int(v)
}

func (d *decoder) string() string {
	n := d.uvarint()
	if d.err == nil && n > uint64(d.left()) {
		d.fail("string of %d bytes, %d left", n, d.left())
	}
	if d.err != nil {
		return ""
	}
	s := string(d.p[d.off : d.off+int(n)])
	d.off += int(n)
	return s
}

func (d *decoder) time() time.Time {
	ns := d.varint()
	if d.err != nil || ns == 0 {
		return time.Time{}
	}
	return time.Unix(0, ns)
}

func (d *decoder) blocks() []uint64 {
	n := d.uvarint()
	if d.err == nil && n > uint64(d.left()/8) {
		d.fail("%d blocks, %d bytes left", n, d.left())
	}
	if d.err != nil || n == 0 {
		return nil
	}
	out := make([]uint64, n)
	for i := range out {
		out[i] = binary.LittleEndian.Uint64(d.p[d.off:])
		d.off += 8
	}
	return out
}

func (d *decoder) finish() error {
	if d.err == nil && d.left() != 0 {
		d.fail("%d trailing bytes", d.left())
	}
	return d.err
}
