package hashtab

import (
	"testing"

	"pgregory.net/rapid"
)

type entry struct{ first int32 }

func TestTableAgainstMap(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		tb := New[entry]()
		ref := map[uint64]entry{}
		keys := rapid.SliceOfN(rapid.Uint64Range(0, 5000), 1, 3000).Draw(t, "keys")
		for i, k := range keys {
			if i%3 == 2 {
				tb.Del(k)
				delete(ref, k)
				continue
			}
			e, _ := tb.Upsert(k)
			e.first = int32(i)
			ref[k] = entry{first: int32(i)}
		}
		if tb.Len() != len(ref) {
			t.Fatalf("len %d, map %d", tb.Len(), len(ref))
		}
		for k, v := range ref {
			if e := tb.Get(k); e == nil || e.first != v.first {
				t.Fatalf("key %d: %v, want %v", k, e, v)
			}
		}
		for _, k := range keys {
			if _, ok := ref[k]; !ok && tb.Get(k) != nil {
				t.Fatalf("deleted key %d found", k)
			}
		}
	})
}
