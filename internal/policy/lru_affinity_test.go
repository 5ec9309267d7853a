package policy

import (
	"strconv"
	"testing"

	"pgregory.net/rapid"
)

// referenceRoute is the seed function written as plainly as possible: lists
// ordered least recent first, linear scans.
func referenceRoute(hashes []string, n, capacity int) ([]int, int, float64) {
	lrus := make([][]string, n)
	load := make([]int, n)
	var out []int
	hits := 0
	for _, h := range hashes {
		best := -1
		for r := 0; r < n; r++ {
			for _, x := range lrus[r] {
				if x == h && (best < 0 || load[r] < load[best]) {
					best = r
				}
			}
		}
		hit := best >= 0
		if hit {
			hits++
		} else {
			for r := 0; r < n; r++ {
				if best < 0 || load[r] < load[best] {
					best = r
				}
			}
		}
		load[best]++
		l := lrus[best]
		pos := -1
		for i, x := range l {
			if x == h {
				pos = i
			}
		}
		if pos >= 0 {
			l = append(l[:pos], l[pos+1:]...)
		} else if len(l) >= capacity && len(l) > 0 {
			l = l[1:]
		}
		if capacity > 0 {
			l = append(l, h)
		}
		lrus[best] = l
		out = append(out, best)
	}
	ratio := 0.0
	if len(hashes) > 0 {
		ratio = Round4(float64(hits) / float64(len(hashes)))
	}
	return out, hits, ratio
}

func TestRouteEdgeCases(t *testing.T) {
	tests := []struct {
		name     string
		hashes   []string
		n, cap   int
		want     []int
		wantHits int
		ratio    float64
	}{
		{"no requests", nil, 3, 2, []int{}, 0, 0},
		{"contract example", []string{"a", "b"}, 3, 2, []int{0, 1}, 0, 0},
		{"one replica", []string{"a", "a", "b", "a"}, 1, 2, []int{0, 0, 0, 0}, 2, 0.5},
		{"capacity 1 evicts", []string{"a", "b", "a"}, 1, 1, []int{0, 0, 0}, 0, 0},
		{"capacity 0 never hits", []string{"a", "a", "a"}, 2, 0, []int{0, 1, 0}, 0, 0},
		// Misses go to the least loaded, lowest index on ties; a stays on its holder.
		{"miss tie lowest index", []string{"a", "b", "a", "c", "a", "d"}, 2, 4, []int{0, 1, 0, 1, 0, 1}, 2, 0.3333},
		// A holder is preferred even when more loaded than a non-holder.
		{"holder beats less loaded", []string{"a", "a", "a"}, 3, 2, []int{0, 0, 0}, 2, 0.6667},
		{"rounding ties to even", append(repeat("x", 1), repeat("y", 31)...), 32, 1, nil, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			res, err := Route(tc.hashes, tc.n, tc.cap)
			if err != nil {
				t.Fatal(err)
			}
			ref, hits, ratio := referenceRoute(tc.hashes, tc.n, tc.cap)
			if tc.want != nil {
				ref = tc.want
				hits, ratio = tc.wantHits, tc.ratio
			}
			if len(res.Assignments) != len(ref) || res.CacheHits != hits || res.HitRatio != ratio {
				t.Fatalf("got %v %d %v, want %v %d %v", res.Assignments, res.CacheHits, res.HitRatio, ref, hits, ratio)
			}
			for i := range ref {
				if res.Assignments[i] != ref[i] {
					t.Fatalf("assignment %d: %d want %d", i, res.Assignments[i], ref[i])
				}
			}
		})
	}
	if Round4(1.0/32) != 0.0312 || Round4(2.0/3) != 0.6667 || Round4(1) != 1 {
		t.Fatalf("Round4: %v %v", Round4(1.0/32), Round4(2.0/3))
	}
	if _, err := Route(nil, 0, 1); err == nil {
		t.Fatal("0 replicas accepted")
	}
	if _, err := Route(nil, 1, -1); err == nil {
		t.Fatal("negative capacity accepted")
	}
}

func repeat(s string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = s + strconv.Itoa(i%3)
	}
	return out
}

func TestRouteMatchesReference(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.IntRange(1, 8).Draw(t, "replicas")
		capacity := rapid.IntRange(0, 6).Draw(t, "capacity")
		hashes := rapid.SliceOfN(rapid.SampledFrom([]string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"}), 0, 200).Draw(t, "hashes")
		res, err := Route(hashes, n, capacity)
		if err != nil {
			t.Fatal(err)
		}
		ref, hits, ratio := referenceRoute(hashes, n, capacity)
		if res.CacheHits != hits || res.HitRatio != ratio {
			t.Fatalf("hits %d/%v want %d/%v", res.CacheHits, res.HitRatio, hits, ratio)
		}
		for i := range ref {
			if res.Assignments[i] != ref[i] {
				t.Fatalf("request %d: %d want %d", i, res.Assignments[i], ref[i])
			}
		}
	})
}

// The live lru_affinity policy is the seed function: with requests that
// never finish, in-flight load equals the seed's count, and the policy makes
// the same choices as Route.
func TestLRUAffinityAgreesWithRoute(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		n := rapid.IntRange(1, 6).Draw(t, "replicas")
		capacity := rapid.IntRange(1, 5).Draw(t, "capacity")
		keys := rapid.SliceOfN(rapid.IntRange(0, 9), 0, 120).Draw(t, "keys")
		pol, err := New("lru_affinity", Options{Params: map[string]any{"cache_capacity": capacity, "prefix_tokens": 16}})
		if err != nil {
			t.Fatal(err)
		}
		obs := pol.(Observer)
		views := make([]ReplicaView, n)
		for i := range views {
			views[i] = ReplicaView{Index: i, Healthy: true}
		}
		hashes := make([]string, len(keys))
		for i, k := range keys {
			hashes[i] = strconv.Itoa(k)
			req := &Request{ID: uint64(i), Blocks: []uint64{uint64(k) + 1000}, Tokens: 16}
			d, err := pol.Pick(req, views)
			if err != nil {
				t.Fatal(err)
			}
			again, _ := pol.Pick(req, views)
			if again.Replica != d.Replica {
				t.Fatal("Pick changed state")
			}
			obs.Observe(Event{Kind: Routed, Req: req, Decision: d, Replica: d.Replica})
			views[d.Replica].InFlight++
			keys[i] = d.Replica
		}
		res, _ := Route(hashes, n, capacity)
		for i := range keys {
			if keys[i] != res.Assignments[i] {
				t.Fatalf("request %d: policy %d, route %d", i, keys[i], res.Assignments[i])
			}
		}
	})
}

// Thousands of random inputs, against the plain reference.
func TestRouteMatchesReferenceSeeded(t *testing.T) {
	rng := newRNG(42)
	for c := range 5000 {
		n, capacity := 1+rng.IntN(8), rng.IntN(7)
		hashes := make([]string, rng.IntN(120))
		for i := range hashes {
			hashes[i] = strconv.Itoa(rng.IntN(1 + rng.IntN(16)))
		}
		res, err := Route(hashes, n, capacity)
		if err != nil {
			t.Fatal(err)
		}
		ref, hits, ratio := referenceRoute(hashes, n, capacity)
		if res.CacheHits != hits || res.HitRatio != ratio || len(res.Assignments) != len(ref) {
			t.Fatalf("case %d: hits %d/%v want %d/%v", c, res.CacheHits, res.HitRatio, hits, ratio)
		}
		for i := range ref {
			if res.Assignments[i] != ref[i] {
				t.Fatalf("case %d request %d: %d want %d", c, i, res.Assignments[i], ref[i])
			}
		}
	}
}
