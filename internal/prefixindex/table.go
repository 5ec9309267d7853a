package prefixindex

// table is an open-addressing hash table from block hash to entry, with
// linear probing and backward-shift deletion (no tombstones). Keys are
// already uniformly distributed 64-bit hashes, so their low bits index the
// slots directly with no rehash. Against Go's map it makes a touch one probe
// sequence (find-or-insert) instead of a look-up and an assignment, and a
// removal one probe plus a short shift: the approximate index's insert path
// is dominated by these probes (cache misses), so halving them matters.
//
// Key 0 marks an empty slot; the one real key 0 is kept aside.
type table struct {
	slots []slot
	n     int // keys stored in slots
	shift uint
	zero  entry // the entry of key 0
	has0  bool
}

type slot struct {
	key uint64
	e   entry
}

const minSlots = 1 << 10

func newTable() *table {
	t := &table{}
	t.resize(minSlots)
	return t
}

func (t *table) resize(size int) {
	old := t.slots
	t.slots = make([]slot, size)
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
func (t *table) home(key uint64) int { return int((key * 0x9E3779B97F4A7C15) >> t.shift) }

// len is the number of keys.
func (t *table) len() int {
	if t.has0 {
		return t.n + 1
	}
	return t.n
}

// get returns the key's entry, or nil.
func (t *table) get(key uint64) *entry {
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

// upsert returns the key's entry, inserting a zero entry if absent; the
// pointer is valid until the next upsert or del.
func (t *table) upsert(key uint64) (*entry, bool) {
	if key == 0 {
		found := t.has0
		if !found {
			t.has0, t.zero = true, entry{}
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
			s.key, s.e = key, entry{}
			t.n++
			return &s.e, false
		}
	}
}

// insertNew inserts a key known to be absent, without growing.
func (t *table) insertNew(key uint64) *entry {
	mask := len(t.slots) - 1
	i := t.home(key)
	for t.slots[i].key != 0 {
		i = (i + 1) & mask
	}
	t.slots[i] = slot{key: key}
	t.n++
	return &t.slots[i].e
}

// del removes the key, shifting later keys of its probe run back so that
// no tombstone is left; it shrinks the table when it is mostly empty.
func (t *table) del(key uint64) {
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
	t.slots[i] = slot{}
	t.n--
	if len(t.slots) > minSlots && t.n*8 < len(t.slots) {
		t.resize(len(t.slots) / 2)
	}
}
