// Package hashtab is an open-addressing hash table keyed by 64-bit hashes,
// shared by the prefix index and the engine model's block pool (both are
// dominated by hash-table probes when a trace is replayed).
package hashtab

import "iter"

// Table is an open-addressing hash table from block hash to V, with
// linear probing and backward-shift deletion (no tombstones). Keys are
// already uniformly distributed 64-bit hashes, so their low bits index the
// slots directly with no rehash. Against Go's map it makes a touch one probe
// sequence (find-or-insert) instead of a look-up and an assignment, and a
// removal one probe plus a short shift: the approximate index's insert path
// is dominated by these probes (cache misses), so halving them matters.
// Not safe for concurrent use.
//
// Key 0 marks an empty slot; the one real key 0 is kept aside.
type Table[V any] struct {
	slots []slot[V]
	n     int // keys stored in slots
	shift uint
	zero  V // the value of key 0
	has0  bool
}

type slot[V any] struct {
	key uint64
	e   V
}

const minSlots = 1 << 10

// New returns an empty table.
func New[V any]() *Table[V] {
	t := &Table[V]{}
	t.resize(minSlots)
	return t
}

func (t *Table[V]) resize(size int) {
	old := t.slots
	t.slots = make([]slot[V], size)
	t.shift = uint(64 - bitsLen(size-1))
	t.n = 0
	for _, s := range old {
		if s.key != 0 {
			*t.insertNew(s.key) = s.e
		}
	}
}

func bitsLen(x int) int {
	n := 0
	for x > 0 {
		x >>= 1
		n++
	}
	return n
}

// home is the key's first slot: its top bits (Fibonacci hashing spreads any
// residual structure).
func (t *Table[V]) home(key uint64) int { return int((key * 0x9E3779B97F4A7C15) >> t.shift) }

// Len is the number of keys.
func (t *Table[V]) Len() int {
	if t.has0 {
		return t.n + 1
	}
	return t.n
}

// Get returns the key's value, or nil.
func (t *Table[V]) Get(key uint64) *V {
	if key == 0 {
		if t.has0 {
			return &t.zero
		}
		return nil
	}
	mask := len(t.slots) - 1
	for i := t.home(key); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.key == key {
			return &s.e
		}
		if s.key == 0 {
			return nil
		}
	}
}

// Upsert returns the key's value, inserting a zero value if absent, and
// whether it was present; the pointer is valid until the next Upsert or Del.
func (t *Table[V]) Upsert(key uint64) (*V, bool) {
	if key == 0 {
		found := t.has0
		if !found {
			var zero V
			t.has0, t.zero = true, zero
		}
		return &t.zero, found
	}
	mask := len(t.slots) - 1
	for i := t.home(key); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.key == key {
			return &s.e, true
		}
		if s.key == 0 {
			if (t.n+1)*4 > len(t.slots)*3 { // keep the load ≤ 3/4
				t.resize(len(t.slots) * 2)
				return t.insertNew(key), false
			}
			var zero V
			s.key, s.e = key, zero
			t.n++
			return &s.e, false
		}
	}
}

// insertNew inserts a key known to be absent, without growing.
func (t *Table[V]) insertNew(key uint64) *V {
	mask := len(t.slots) - 1
	i := t.home(key)
	for t.slots[i].key != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = slot[V]{key: key}
	t.n++
	return &t.slots[i].e
}

// Del removes the key, shifting later keys of its probe run back so that
// no tombstone is left; it shrinks the table when it is mostly empty.
func (t *Table[V]) Del(key uint64) {
	if key == 0 {
		t.has0 = false
		return
	}
	mask := len(t.slots) - 1
	i := t.home(key)
	for {
		if t.slots[i].key == 0 {
			return
		}
		if t.slots[i].key == key {
			break
		}
		i = (i + 1) & mask
	}
	// Backward shift: move each following key whose home is at or before the
	// hole into it, until an empty slot ends the run.
	for j := (i + 1) & mask; ; j = (j + 1) & mask {
		k := t.slots[j].key
		if k == 0 {
			break
		}
		h := t.home(k)
		// k may move to i if its home is not in the cyclic range (i, j].
		if (j > i && (h <= i || h > j)) || (j < i && (h <= i && h > j)) {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = slot[V]{}
	t.n--
	if len(t.slots) > minSlots && t.n*8 < len(t.slots) {
		t.resize(len(t.slots) / 2)
	}
}

// All iterates over the keys and values (tests, debugging); the table must
// not change during the iteration.
func (t *Table[V]) All() iter.Seq2[uint64, V] {
	return func(yield func(uint64, V) bool) {
		if t.has0 && !yield(0, t.zero) {
			return
		}
		for _, s := range t.slots {
			if s.key != 0 && !yield(s.key, s.e) {
				return
			}
		}
	}
}
