package hashtab

import (
	"math/rand/v2"
	"testing"
)

// TestSetAgainstMap: the set agrees with Go's map over random keys with
// repeats, key 0 included, across several growths.
func TestSetAgainstMap(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	s, m := NewSet(), map[uint64]bool{}
	for i := range 200000 {
		k := r.Uint64N(80000) * 0x9E3779B97F4A7C15 // repeats, and 0
		if i%7 == 0 {
			k = r.Uint64()
		}
		if had := s.Add(k); had != m[k] {
			t.Fatalf("Add(%#x) = %v, map has %v", k, had, m[k])
		}
		m[k] = true
		if q := r.Uint64N(90000) * 0x9E3779B97F4A7C15; s.Has(q) != m[q] {
			t.Fatalf("Has(%#x) = %v, map has %v", q, s.Has(q), m[q])
		}
	}
	if s.Len() != len(m) {
		t.Fatalf("Len %d, map %d", s.Len(), len(m))
	}
	for k := range m {
		if !s.Has(k) {
			t.Fatalf("lost %#x", k)
		}
	}
	for i := range s.parts {
		if p := &s.parts[i]; len(p.slots) <= setMinSlots {
			t.Fatalf("part %d: %d slots: the test never grew it", i, len(p.slots))
		}
	}
}
