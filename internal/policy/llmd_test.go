package policy

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

func peerNear(a, b []float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Abs(a[i]-b[i]) > 1e-12 {
			return false
		}
	}
	return true
}

// TestLLMDWeights: hand-computed scores. Replica 0 holds the prompt's 4
// chunks of 64 characters (prefix 1), replica 1 its first 2 (0.5), replica 2
// none. Metrics: waiting 4, 2, 0 → queue 0, 0.5, 1; KV usage 0.5, 0.3, 0.75
// → kv 0.5, 0.7, 0.25.
func TestLLMDWeights(t *testing.T) {
	text := peerText(rand.New(rand.NewPCG(4, 4)), 0, 400)
	cases := []struct {
		name    string
		params  map[string]any
		metrics bool
		waiting []int
		scores  []float64
		want    int
		matched int
	}{
		// 2·0 + 2·0.5 + 3·1 = 4; 2·0.5 + 2·0.7 + 3·0.5 = 3.9; 2·1 + 2·0.25 + 0 = 2.5.
		{"defaults 2:2:3", nil, true, []int{4, 2, 0}, []float64{4, 3.9, 2.5}, 0, 4},
		// No scrape yet: queue 1 and kv 1 everywhere: 4 + 3·prefix.
		{"no metrics", nil, false, []int{4, 2, 0}, []float64{7, 5.5, 4}, 0, 4},
		{"prefix weight 0", map[string]any{"prefix_weight": 0}, true, []int{4, 2, 0}, []float64{1, 2.4, 2.5}, 2, 0},
		{"queue weight 10", map[string]any{"queue_weight": 10}, true, []int{4, 2, 0}, []float64{4, 7.9, 10.5}, 2, 0},
		// Equal waiting: queue 1 for all.
		{"equal waiting", nil, true, []int{3, 3, 3}, []float64{6, 4.9, 2.5}, 0, 4},
		// 2 chunks at most: replicas 0 and 1 both hold all of them.
		{"max_prefix_blocks 2", map[string]any{"max_prefix_blocks": 2}, true, []int{4, 2, 0}, []float64{4, 5.4, 2.5}, 1, 2},
		// An LRU of 3 chunks keeps the head: replica 0 holds 3 of 4.
		{"lru capacity 3", map[string]any{"lru_capacity_per_server": 3}, false, []int{0, 0, 0}, []float64{6.25, 5.5, 4}, 0, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "llmd", c.params)
			rs := peerViews(3)
			sgRouted(p, rs, 0, text[:256], peerT0)
			sgRouted(p, rs, 1, text[:128]+strings.Repeat("#", 64), peerT0)
			kv := []float64{0.5, 0.3, 0.75}
			for i := range rs {
				rs[i].HaveMetrics, rs[i].Waiting, rs[i].KVUsage = c.metrics, c.waiting[i], kv[i]
			}
			got, d := peerPick(t, p, peerReq(1, text[:286], peerT0), rs)
			if got != c.want || !peerNear(d.Scores, c.scores) || d.Matched != c.matched {
				t.Fatalf("picked %d scores %v matched %d, want %d %v %d", got, d.Scores, d.Matched, c.want, c.scores, c.matched)
			}
		})
	}
}

// TestLLMDIndex: chunk boundaries, partitions and unhealthy holders.
func TestLLMDIndex(t *testing.T) {
	text := peerText(rand.New(rand.NewPCG(5, 5)), 0, 1000)
	cases := []struct {
		name   string
		stored string
		req    func() *Request
		prefix float64 // replica 0's prefix score
	}{
		{"same text", text, func() *Request { return peerReq(1, text, peerT0) }, 1},
		{"a partial chunk is not hashed", text[:127], func() *Request { return peerReq(1, text[:200], peerT0) }, 1.0 / 3},
		{"change in chunk 3", text[:500], func() *Request { return peerReq(1, text[:192]+"!"+text[193:500], peerT0) }, 3.0 / 7},
		{"another model", text, func() *Request { r := peerReq(1, text, peerT0); r.Model = "other"; return r }, 0},
		{"another adapter", text, func() *Request { r := peerReq(1, text, peerT0); r.Adapter = "a"; return r }, 0},
		{"the 256-chunk cap", strings.Repeat(text, 20)[:256*64],
			func() *Request { return peerReq(1, strings.Repeat(text, 20), peerT0) }, 1},
		{"shorter than a chunk", "", func() *Request { return peerReq(1, text[:63], peerT0) }, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "llmd", nil)
			rs := peerViews(2)
			sgRouted(p, rs, 0, c.stored, peerT0)
			_, d := peerPick(t, p, c.req(), rs)
			// No metrics: score = 2 + 2 + 3·prefix.
			if want := 4 + 3*c.prefix; math.Abs(d.Scores[0]-want) > 1e-12 || d.Scores[1] != 4 {
				t.Fatalf("scores %v, want [%v 4]", d.Scores, want)
			}
		})
	}
}

// TestPreciseWeights: the llmd scorers with prefix = Match / prompt blocks.
func TestPreciseWeights(t *testing.T) {
	cases := []struct {
		name    string
		params  map[string]any
		blocks  int
		match   []int
		scores  []float64
		want    int
		matched int
	}{
		{"defaults", nil, 10, []int{10, 5, 0}, []float64{4, 3.9, 2.5}, 0, 10},
		{"a match past the prompt counts as all of it", nil, 10, []int{12, 5, 0}, []float64{4, 3.9, 2.5}, 0, 12},
		{"no full block: no prefix score", nil, 0, []int{0, 0, 0}, []float64{1, 2.4, 2.5}, 2, 0},
		{"kv weight 0", map[string]any{"kv_cache_weight": 0}, 10, []int{10, 5, 0}, []float64{3, 2.5, 2}, 0, 10},
		{"half match on replica 2", nil, 10, []int{0, 0, 5}, []float64{1, 2.4, 4}, 2, 5},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rs := peerViews(3)
			waiting, kv := []int{4, 2, 0}, []float64{0.5, 0.3, 0.75}
			for i := range rs {
				rs[i].HaveMetrics, rs[i].Waiting, rs[i].KVUsage, rs[i].Match = true, waiting[i], kv[i], c.match[i]
			}
			req := peerReq(1, "", peerT0)
			req.Blocks = make([]uint64, c.blocks)
			got, d := peerPick(t, peerNew(t, "precise", c.params), req, rs)
			if got != c.want || !peerNear(d.Scores, c.scores) || d.Matched != c.matched {
				t.Fatalf("picked %d scores %v matched %d, want %d %v %d", got, d.Scores, d.Matched, c.want, c.scores, c.matched)
			}
		})
	}
}

// TestScoreWeights: cache = match/blocks, load = 1 − in flight/max in flight.
func TestScoreWeights(t *testing.T) {
	cases := []struct {
		name     string
		params   map[string]any
		blocks   int
		inflight []int
		scores   []float64
		want     int
	}{
		// cache 1, 0.5, 0; load 0, 0.75, 1.
		{"defaults 1:1", nil, 10, []int{4, 1, 0}, []float64{1, 1.25, 1}, 1},
		{"cache weight 2", map[string]any{"cache_weight": 2}, 10, []int{4, 1, 0}, []float64{2, 1.75, 1}, 0},
		{"load weight 3", map[string]any{"load_weight": 3}, 10, []int{4, 1, 0}, []float64{1, 2.75, 3}, 2},
		{"nothing in flight: load 1", nil, 10, []int{0, 0, 0}, []float64{2, 1.5, 1}, 0},
		{"no blocks: cache 0", nil, 0, []int{4, 1, 0}, []float64{0, 0.75, 1}, 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rs := peerViews(4)
			for i, m := range []int{10, 5, 0} {
				rs[i].Match, rs[i].InFlight = min(m, c.blocks), c.inflight[i]
			}
			rs[3].Healthy, rs[3].InFlight = false, 100 // not in max load
			req := peerReq(1, "", peerT0)
			req.Blocks = make([]uint64, c.blocks)
			got, d := peerPick(t, peerNew(t, "score", c.params), req, rs)
			if got != c.want || !peerNear(d.Scores, append(c.scores, 0)) {
				t.Fatalf("picked %d scores %v, want %d %v", got, d.Scores, c.want, c.scores)
			}
		})
	}
}
