package policy

import (
	"math/rand/v2"
	"testing"
	"time"
)

// TestPreciseDefaults pins the precise-prefix-cache-aware guide's profile
// (llm-d/llm-d guides/precise-prefix-cache-aware/scheduler/
// precise-prefix-cache-aware.values.yaml: precise-prefix-cache-scorer 2,
// kv-cache-utilization-scorer 1, queue-scorer 1, speculativeIndexing true)
// with llm-d ≥ v0.9's scorer (llm-d-router scheduling/scorer/
// preciseprefixcache: absoluteScoredPods, defaultSpeculativeTTL 2 s), KV
// events, the cpu tier weighed 0.8 (llm-d-kv-cache's LongestPrefixScorer),
// and the scheduler's 50 ms metrics period.
func TestPreciseDefaults(t *testing.T) {
	p := peerNew(t, "precise", nil).(*Precise)
	want := preciseParams{
		scorerWeights: scorerWeights{Queue: 1, KV: 1, Prefix: 2},
		PrefixScore:   "ratio", SpeculativeIndexing: true, SpeculativeTTLSecs: 2, CPUWeight: 0.8,
	}
	if p.params != want || p.ttl != 2*time.Second {
		t.Fatalf("params %+v ttl %v, want %+v 2s", p.params, p.ttl, want)
	}
	if !WantsKVEvents(p) || MetricsRefresh(p) != 50*time.Millisecond {
		t.Fatalf("KV events %v, metrics every %v", WantsKVEvents(p), MetricsRefresh(p))
	}
}

// TestPreciseWeights: hand-computed scores. Metrics: waiting 4, 2, 0 →
// queue 0, 0.5, 1; KV usage 0.5, 0.3, 0.75 → kv 0.5, 0.7, 0.25. The prefix
// score is matched / prompt blocks (llm-d-router preciseprefixcache
// utils.go absoluteScoredPods), or with prefix_score "min-max" v0.8's
// normalisation over the candidates matching a block (llm-d-inference-scheduler
// pkg/plugins/scorer/utils.go indexedScoresToNormalizedScoredPods): 1 for
// all when equal, 0 without a match.
func TestPreciseWeights(t *testing.T) {
	minMax := map[string]any{"prefix_score": "min-max"}
	cases := []struct {
		name    string
		params  map[string]any
		blocks  int
		match   []int
		scores  []float64
		want    int
		matched int
	}{
		// prefix 1, 0.5, 0: 0 + 0.5 + 2 = 2.5; 0.5 + 0.7 + 1 = 2.2; 1 + 0.25 = 1.25.
		{"defaults 2:1:1", nil, 10, []int{10, 5, 0}, []float64{2.5, 2.2, 1.25}, 0, 10},
		{"a match past the prompt counts as all of it", nil, 10, []int{12, 5, 0}, []float64{2.5, 2.2, 1.25}, 0, 12},
		{"no full block: no prefix score", nil, 0, []int{0, 0, 0}, []float64{0.5, 1.2, 1.25}, 2, 0},
		{"half match on replica 2", nil, 10, []int{0, 0, 5}, []float64{0.5, 1.2, 2.25}, 2, 5},
		{"a lone holder of one block", nil, 10, []int{0, 0, 1}, []float64{0.5, 1.2, 1.45}, 2, 1},
		// llmd's weights 3:2:2 by parameters.
		{"weights 3:2:2", map[string]any{"prefix_weight": 3, "kv_cache_weight": 2, "queue_weight": 2},
			10, []int{10, 5, 0}, []float64{4, 3.9, 2.5}, 0, 10},
		// min-max: 1, 0, 0.
		{"min-max", minMax, 10, []int{10, 5, 0}, []float64{2.5, 1.2, 1.25}, 0, 10},
		// Equal matches: 1 each (replica 3, down with 10, is no candidate).
		{"min-max: equal matches", minMax, 10, []int{5, 5, 0}, []float64{2.5, 3.2, 1.25}, 1, 5},
		// A lone holder scores 1 however little it holds.
		{"min-max: a lone holder of one block", minMax, 10, []int{0, 0, 1}, []float64{0.5, 1.2, 3.25}, 2, 1},
		{"min-max: three holders", minMax, 10, []int{9, 6, 3}, []float64{2.5, 2.2, 1.25}, 0, 9},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rs := peerViews(4)
			waiting, kv := []int{4, 2, 0}, []float64{0.5, 0.3, 0.75}
			for i := range 3 {
				rs[i].HaveMetrics, rs[i].Waiting, rs[i].KVUsage, rs[i].Match = true, waiting[i], kv[i], c.match[i]
			}
			// Down, holding more than any: no candidate.
			rs[3].Healthy, rs[3].Match = false, 20
			req := peerReq(1, "", peerT0)
			req.Blocks = make([]uint64, c.blocks)
			got, d := peerPick(t, peerNew(t, "precise", c.params), req, rs)
			if got != c.want || !peerNear(d.Scores, append(c.scores, 0)) || d.Matched != c.matched {
				t.Fatalf("picked %d scores %v matched %d, want %d %v %d", got, d.Scores, d.Matched, c.want, c.scores, c.matched)
			}
		})
	}
}

// TestPreciseSpeculative: with speculative indexing a Routed request's
// blocks count for its replica for 2 s (the scorer's PreRequest adds them
// to the index, a TTL cache evicts them; llm-d-router preciseprefixcache
// precise_prefix_cache.go), extending the events' match. No metrics:
// score = 1 + 1 + 2·prefix.
func TestPreciseSpeculative(t *testing.T) {
	text := peerText(rand.New(rand.NewPCG(3, 3)), 0, 2000) // 31 blocks
	routed := peerReq(1, text, peerT0)
	n := len(routed.Blocks)
	later := func(d time.Duration, s string) *Request { return peerReq(2, s, peerT0.Add(d)) }
	cases := []struct {
		name    string
		params  map[string]any
		req     *Request
		match   []int // the events' matches
		scores  []float64
		matched int // replica 1's
	}{
		{"routed, no event yet", nil, later(time.Second, text), []int{0, 0}, []float64{2, 4}, n},
		// A change at character 500 (token 125, block 7): 7 of 15 blocks shared.
		{"a request sharing its head", nil, later(time.Second, text[:500]+"#"+text[501:1000]), []int{0, 0}, []float64{2, 2 + 14.0/15}, 7},
		// Events say 20 blocks on replica 0 and 3 on 1, speculation 31 on 1.
		{"events and speculation", nil, later(time.Second, text), []int{20, 3}, []float64{2 + 40.0/31, 4}, n},
		{"expired after 2 s", nil, later(2*time.Second, text), []int{0, 0}, []float64{2, 2}, 0},
		{"speculative_ttl_secs 30", map[string]any{"speculative_ttl_secs": 30}, later(2*time.Second, text), []int{0, 0}, []float64{2, 4}, n},
		{"speculative_indexing off", map[string]any{"speculative_indexing": false}, later(time.Second, text), []int{0, 3}, []float64{2, 2 + 6.0/31}, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "precise", c.params)
			rs := peerViews(2)
			peerObserve(p, Event{Kind: Routed, At: peerT0, Req: routed, Decision: Decision{Replica: rs[1].Index}, Replica: rs[1].Index})
			for i := range rs {
				rs[i].Match = c.match[i]
			}
			_, d := peerPick(t, p, c.req, rs)
			if !peerNear(d.Scores, c.scores) {
				t.Fatalf("scores %v, want %v", d.Scores, c.scores)
			}
			if c.scores[1] > c.scores[0] && d.Matched != c.matched {
				t.Fatalf("matched %d, want %d", d.Matched, c.matched)
			}
		})
	}
}
