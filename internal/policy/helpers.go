package policy

import (
	"math/rand/v2"
	"sync"
	"unsafe"
)

// rng is a seeded random source safe for concurrent use.
type rng struct {
	mu sync.Mutex
	r  *rand.Rand
}

func newRNG(seed uint64) *rng {
	return &rng{r: rand.New(rand.NewPCG(seed, 0x6b766761746521))}
}

func (g *rng) IntN(n int) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.r.IntN(n)
}

func (g *rng) Float64() float64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.r.Float64()
}

// scratchLen is the length of the arrays Picks declare for per-replica
// scratch slices: up to that many replicas, the slices allocate nothing.
const scratchLen = 64

// scratch returns buf[:n] when n ≤ len(buf), else a new slice of length n.
// Callers declare buf as a local array (zero, so the slice is zero either
// way); it stays on their stack as long as the slice does not escape.
func scratch[T any](buf *[scratchLen]T, n int) []T {
	if n <= len(buf) {
		return buf[:n]
	}
	return make([]T, n)
}

// healthy returns the positions (in replicas) of healthy replicas, in buf
// when they fit (see scratch).
func healthy(replicas []ReplicaView, buf *[scratchLen]int) []int {
	out := scratch(buf, len(replicas))[:0]
	for i := range replicas {
		if replicas[i].Healthy {
			out = append(out, i)
		}
	}
	return out
}

// argBest returns the candidate in cands whose val is lowest (lower true)
// or highest (lower false), or -1 when cands is empty. Candidates with
// exactly the best value tie, and one of them is taken uniformly at random
// by reservoir sampling: each tie after the first draws g.IntN(number of
// ties so far) and takes the candidate on 0, so g is drawn from only on
// ties. val must not return NaN.
func argBest(cands []int, val func(int) float64, lower bool, g *rng) int {
	best, seen := -1, 0
	var bv float64
	for _, i := range cands {
		v := val(i)
		switch {
		case best < 0 || (lower && v < bv) || (!lower && v > bv):
			best, bv, seen = i, v, 1
		case v == bv:
			seen++
			if g.IntN(seen) == 0 {
				best = i
			}
		}
	}
	return best
}

// viewCeiling bounds the counts a policy computes with (requests, tokens,
// blocks of one replica): 2^40, about a million times what any real
// replica holds or queues (a few million tokens of KV, thousands of
// requests), and low enough that a product of two such counts stays far
// within float64's range and a sum of a few within int64's. The router
// bounds what enters its views (peer gateways' loads, scrapes) well below
// it; a policy clamps again, where its arithmetic would break on an
// impossible number (a negative queue, an overflowing sum), so that its
// answer never depends on every door being right.
const viewCeiling = 1 << 40

// count is x within [0, viewCeiling].
func count(x int) int { return min(max(x, 0), viewCeiling) }

// fraction is x within [0, 1]; NaN is 0 (Go's min and max keep a NaN).
func fraction(x float64) float64 {
	if !(x > 0) {
		return 0
	}
	return min(x, 1)
}

// decide builds a Decision for position i.
func decide(replicas []ReplicaView, i int, reason string, matched int, load float64) Decision {
	return Decision{Replica: replicas[i].Index, Reason: reason, Matched: matched, Load: load}
}

// posOf returns the position in rs of the replica in slot idx (-1: absent).
func posOf(rs []ReplicaView, idx int) int {
	if idx >= 0 && idx < len(rs) && rs[idx].Index == idx {
		return idx
	}
	for i := range rs {
		if rs[i].Index == idx {
			return i
		}
	}
	return -1
}

// strBytes views s as bytes without copying; the bytes must not be written.
func strBytes(s string) []byte { return unsafe.Slice(unsafe.StringData(s), len(s)) }
