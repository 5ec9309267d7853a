package policy

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
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

// llmdReq is a request for text under model, as the router builds it
// (approximate tokenizer: 4 characters a token, 16-token blocks).
func llmdReq(id uint64, model, text string) *Request {
	return &Request{
		ID: id, Now: peerT0, Model: model, Text: text, KeyText: text,
		Blocks: prompt.ApproxBlockHashes(nil, prompt.Key{Model: model}.Root(), text, 16),
		Tokens: prompt.Approx{}.Count(text), MaxTokens: 64,
	}
}

// llmdRouted reports req Routed to the replica at position pos.
func llmdRouted(p Policy, rs []ReplicaView, pos int, req *Request) {
	peerObserve(p, Event{Kind: Routed, At: req.Now, Req: req, Decision: Decision{Replica: rs[pos].Index}, Replica: rs[pos].Index})
}

// TestLLMDDefaults pins llm-d's defaults as users run it: the Helm chart's
// default profile (queue 2, kv-cache 2, prefix 3, no no-hit-lru scorer) and
// the approx-prefix-cache-producer's defaultConfig (llm-d-router
// approximateprefix/types.go: autoTune on, blockSizeTokens 16,
// maxPrefixTokensToMatch 131072, lruCapacityPerServer 31250; plugin.go:
// minBlockSizeTokens 64), its block laid over kvgate's blocks, and the
// scheduler's 50 ms metrics period.
func TestLLMDDefaults(t *testing.T) {
	cases := []struct {
		name               string
		blockSize          int
		params             map[string]any
		tokens, per, maxBl int
	}{
		// vLLM's 16-token blocks are raised to 64: 4 kvgate blocks each, 131072/64 blocks at most.
		{"defaults", 16, nil, 64, 4, 2048},
		{"server blocks of 32", 32, nil, 64, 2, 2048},
		{"server blocks of 128 stay", 128, nil, 128, 1, 1024},
		// 64 is no multiple of 24: rounded up to 3 blocks of 24.
		{"server blocks of 24", 24, nil, 72, 3, 1820},
		{"auto-tune off: block_size_tokens 16 → 64", 16, map[string]any{"auto_tune": false}, 64, 4, 2048},
		{"auto-tune off: block_size_tokens 256", 16, map[string]any{"auto_tune": false, "block_size_tokens": 256}, 256, 16, 512},
		{"max_prefix_tokens 640", 16, map[string]any{"max_prefix_tokens": 640}, 64, 4, 10},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, err := New("llmd", Options{BlockSize: c.blockSize, Params: c.params})
			if err != nil {
				t.Fatal(err)
			}
			l := p.(*LLMD)
			if l.blockTokens != c.tokens || l.per != c.per || l.maxBlocks != c.maxBl {
				t.Fatalf("block %d tokens, %d per block, %d blocks at most; want %d, %d, %d",
					l.blockTokens, l.per, l.maxBlocks, c.tokens, c.per, c.maxBl)
			}
			if c.params == nil {
				want := llmdParams{
					scorerWeights: scorerWeights{Queue: 2, KV: 2, Prefix: 3}, Index: "llm-d", AutoTune: true,
					BlockSizeTokens: 16, MaxPrefixTokens: 131072, LRUCapacity: 31250,
					BlockSizeChars: 64, MaxPrefixBlocks: 256, NonCachedTokens: 16, CPULRUCapacity: 31250,
				}
				if l.params != want {
					t.Fatalf("params %+v, want %+v", l.params, want)
				}
			}
			if d := MetricsRefresh(p); d != 50*time.Millisecond {
				t.Fatalf("metrics every %v, want 50ms", d)
			}
		})
	}
}

// TestLLMDTokenBlocks pins llm-d ≥ v0.9's index (llm-d-router
// dataproducer/prefixhash/hashing.go: blocks of 64 tokens, the last one
// partial, chained from the model; approximateprefix/plugin.go: at most
// maxPrefixTokensToMatch tokens) and the prefix score matched/total
// (scheduling/scorer/prefix/plugin.go). Replica 0 holds a 1,000-token
// prompt: 15 full blocks and a partial one of 40 tokens. No metrics, so
// score = 2 + 2 + 3·prefix.
func TestLLMDTokenBlocks(t *testing.T) {
	text := peerText(rand.New(rand.NewPCG(6, 6)), 0, 8000) // 2,000 tokens
	stored := text[:4000]                                  // 1,000 tokens
	cases := []struct {
		name    string
		params  map[string]any
		req     *Request
		prefix  float64 // replica 0's prefix score
		matched int     // in 16-token blocks
	}{
		{"the same prompt, partial block included", nil, llmdReq(1, "m", stored), 1, 62},
		// 1,100 tokens: 18 blocks, the stored prompt's 15 full ones match, not its partial one.
		{"a longer prompt", nil, llmdReq(1, "m", text[:4400]), 15.0 / 18, 60},
		// 1,024 tokens: 16 full blocks.
		{"a prompt of whole blocks", nil, llmdReq(1, "m", text[:4096]), 15.0 / 16, 60},
		// Token 200 sits in block 3 (tokens 192–255).
		{"a change in block 3", nil, llmdReq(1, "m", stored[:800]+"#"+stored[801:]), 3.0 / 16, 12},
		// The last 8 tokens differ: only the partial block misses.
		{"a change in the partial block", nil, llmdReq(1, "m", stored[:3968]+strings.Repeat("#", 32)), 15.0 / 16, 60},
		{"another model", nil, llmdReq(1, "other", stored), 0, 0},
		// 640 tokens at most: 10 blocks, all held.
		{"max_prefix_tokens 640", map[string]any{"max_prefix_tokens": 640}, llmdReq(1, "m", text), 1, 40},
		// Shorter than a block: one partial block, which only the same prompt matches.
		{"one partial block", nil, llmdReq(1, "m", stored[:100]), 0, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "llmd", c.params)
			rs := peerViews(2)
			llmdRouted(p, rs, 0, llmdReq(0, "m", stored))
			_, d := peerPick(t, p, c.req, rs)
			if want := 4 + 3*c.prefix; math.Abs(d.Scores[0]-want) > 1e-12 || d.Scores[1] != 4 {
				t.Fatalf("scores %v, want [%v 4]", d.Scores, want)
			}
			if c.prefix > 0 && (d.Replica != rs[0].Index || d.Matched != c.matched) {
				t.Fatalf("chose %d with %d blocks matched, want %d with %d", d.Replica, d.Matched, rs[0].Index, c.matched)
			}
		})
	}
	// A repeated token-id prompt (no text) matches its partial block too.
	t.Run("token ids", func(t *testing.T) {
		p := peerNew(t, "llmd", nil)
		rs := peerViews(2)
		req := llmdReq(0, "m", stored)
		req.Text = ""
		llmdRouted(p, rs, 0, req)
		if _, d := peerPick(t, p, req, rs); d.Scores[0] != 7 {
			t.Fatalf("scores %v, want [7 4]", d.Scores)
		}
	})
}

// TestLLMDLRUCapacity: each server's LRU is created at its first insert
// with the server's block count (auto-tune; approximateprefix/plugin.go
// makeserver, indexer.go Add), else lruCapacityPerServer, and is not
// resized afterwards. A 16-block prompt on an LRU of 3 keeps its head.
func TestLLMDLRUCapacity(t *testing.T) {
	text := peerText(rand.New(rand.NewPCG(7, 7)), 0, 4000)
	cases := []struct {
		name      string
		params    map[string]any
		numBlocks int // replica 0's, at the first insert
		want      float64
	}{
		{"the server's block count", nil, 3, 3.0 / 16},
		{"unknown block count: lru_capacity_per_server", map[string]any{"lru_capacity_per_server": 5}, 0, 5.0 / 16},
		{"auto-tune off: lru_capacity_per_server", map[string]any{"auto_tune": false, "lru_capacity_per_server": 5}, 3, 5.0 / 16},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "llmd", c.params)
			rs := peerViews(2)
			rs[0].NumBlocks = c.numBlocks
			req := llmdReq(1, "m", text)
			peerPick(t, p, req, rs) // the router's view before routing
			llmdRouted(p, rs, 0, req)
			rs[0].NumBlocks = 1000 // a later, larger count does not resize it
			peerPick(t, p, req, rs)
			llmdRouted(p, rs, 0, req)
			if _, d := peerPick(t, p, req, rs); math.Abs(d.Scores[0]-(4+3*c.want)) > 1e-12 {
				t.Fatalf("scores %v, want replica 0's prefix %v", d.Scores, c.want)
			}
		})
	}
}

// TestLLMDNoHitLRU pins the no-hit-lru-scorer (llm-d-router
// scheduling/scorer/nohitlru/no_hit_lru.go), weight 2 as the
// optimized-baseline guide sets it: a request no candidate holds any block
// of is cold; never-used candidates score 1 − i/(n−1) in order, the others
// 1 − (never-used + LRU position, oldest first)/(n−1), at least 0; a warm
// request scores 0.5 everywhere; a cold request moves its server to the
// LRU's most recent end. No metrics: base score 4 + 3·prefix.
func TestLLMDNoHitLRU(t *testing.T) {
	r := rand.New(rand.NewPCG(8, 8))
	cold := func(i int) *Request { return llmdReq(uint64(i), "m", peerText(r, 10+i, 800)) }
	p := peerNew(t, "llmd", map[string]any{"no_hit_lru_weight": 2})
	rs := peerViews(4)
	steps := []struct {
		name   string
		req    *Request
		down   int // position taken out of rotation (-1: none)
		scores []float64
		want   int
	}{
		// All never used: 1, 2/3, 1/3, 0.
		{"first cold request", cold(1), -1, []float64{6, 4 + 4.0/3, 4 + 2.0/3, 4}, 0},
		// LRU [0]: never used 1, 2, 3 score 1, 2/3, 1/3; replica 0 rank 3 → 0.
		{"second cold request", cold(2), -1, []float64{4, 6, 4 + 4.0/3, 4 + 2.0/3}, 1},
		// LRU [0 1]: 2, 3 → 1, 2/3; 0 rank 2 → 1/3; 1 rank 3 → 0.
		{"third cold request", cold(3), -1, []float64{4 + 2.0/3, 4, 6, 4 + 4.0/3}, 2},
		// LRU [0 1 2], replica 0 down: n = 3; 3 → 1; 1 rank 1+1 → 0; 2 rank 1+2 → 0 (clamped).
		{"a candidate down", cold(4), 0, []float64{0, 4, 4, 6}, 3},
	}
	for _, s := range steps {
		for i := range rs {
			rs[i].Healthy = i != s.down
		}
		got, d := peerPick(t, p, s.req, rs)
		if got != s.want || !peerNear(d.Scores, s.scores) {
			t.Fatalf("%s: picked %d scores %v, want %d %v", s.name, got, d.Scores, s.want, s.scores)
		}
		llmdRouted(p, rs, got, s.req)
	}
	for i := range rs {
		rs[i].Healthy = true
	}
	// LRU [0 1 2 3]. A request sharing replica 1's prompt is warm: 0.5 each
	// (+1), and prefix 1 on replica 1; routing it leaves the LRU alone.
	warm := llmdReq(9, "m", steps[1].req.Text)
	got, d := peerPick(t, p, warm, rs)
	if want := []float64{5, 8, 5, 5}; got != 1 || !peerNear(d.Scores, want) {
		t.Fatalf("warm: picked %d scores %v, want 1 %v", got, d.Scores, want)
	}
	llmdRouted(p, rs, 1, warm)
	// Still [0 1 2 3]: 0 ranks first.
	if got, d := peerPick(t, p, cold(5), rs); got != 0 || !peerNear(d.Scores, []float64{6, 4 + 4.0/3, 4 + 2.0/3, 4}) {
		t.Fatalf("after the warm request: picked %d scores %v", got, d.Scores)
	}
	// Weight 0 (the Helm chart's default profile): no such term.
	if _, d := peerPick(t, peerNew(t, "llmd", nil), cold(6), rs); !peerNear(d.Scores, []float64{4, 4, 4, 4}) {
		t.Fatalf("weight 0: scores %v", d.Scores)
	}
}

// TestLLMDGIE15: the inference extension's prefix index of GIE ≤ v1.5,
// kept as index "gie-1.5" (gateway-api-inference-extension
// pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go: 64-character
// chunks, the first 256, an LRU of 31,250 per server), with hand-computed
// scores. Replica 0 holds the prompt's 4 chunks (prefix 1), replica 1 its
// first 2 (0.5), replica 2 none. Metrics: waiting 4, 2, 0 → queue 0, 0.5,
// 1; KV usage 0.5, 0.3, 0.75 → kv 0.5, 0.7, 0.25.
func TestLLMDGIE15(t *testing.T) {
	text := peerText(rand.New(rand.NewPCG(4, 4)), 0, 400)
	gie := func(kv ...any) map[string]any {
		m := map[string]any{"index": "gie-1.5"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i].(string)] = kv[i+1]
		}
		return m
	}
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
		{"defaults 2:2:3", gie(), true, []int{4, 2, 0}, []float64{4, 3.9, 2.5}, 0, 4},
		// No scrape yet: queue 1 and kv 1 everywhere: 4 + 3·prefix.
		{"no metrics", gie(), false, []int{4, 2, 0}, []float64{7, 5.5, 4}, 0, 4},
		{"prefix weight 0", gie("prefix_weight", 0), true, []int{4, 2, 0}, []float64{1, 2.4, 2.5}, 2, 0},
		{"queue weight 10", gie("queue_weight", 10), true, []int{4, 2, 0}, []float64{4, 7.9, 10.5}, 2, 0},
		// Equal waiting: queue 1 for all.
		{"equal waiting", gie(), true, []int{3, 3, 3}, []float64{6, 4.9, 2.5}, 0, 4},
		// 2 chunks at most: replicas 0 and 1 both hold all of them.
		{"max_prefix_blocks 2", gie("max_prefix_blocks", 2), true, []int{4, 2, 0}, []float64{4, 5.4, 2.5}, 1, 2},
		// An LRU of 3 chunks keeps the head: replica 0 holds 3 of 4.
		{"lru capacity 3", gie("lru_capacity_per_server", 3), false, []int{0, 0, 0}, []float64{6.25, 5.5, 4}, 0, 3},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "llmd", c.params)
			rs := peerViews(3)
			llmdRouted(p, rs, 0, peerReq(0, text[:256], peerT0))
			llmdRouted(p, rs, 1, peerReq(0, text[:128]+strings.Repeat("#", 64), peerT0))
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
	// Chunk boundaries, partitions and the chunk cap.
	long := peerText(rand.New(rand.NewPCG(5, 5)), 0, 1000)
	idx := []struct {
		name   string
		stored string
		req    func() *Request
		prefix float64 // replica 0's prefix score
	}{
		{"same text", long, func() *Request { return peerReq(1, long, peerT0) }, 1},
		{"a partial chunk is not hashed", long[:127], func() *Request { return peerReq(1, long[:200], peerT0) }, 1.0 / 3},
		{"change in chunk 3", long[:500], func() *Request { return peerReq(1, long[:192]+"!"+long[193:500], peerT0) }, 3.0 / 7},
		{"another model", long, func() *Request { r := peerReq(1, long, peerT0); r.Model = "other"; return r }, 0},
		{"another adapter", long, func() *Request { r := peerReq(1, long, peerT0); r.Adapter = "a"; return r }, 0},
		{"the 256-chunk cap", strings.Repeat(long, 20)[:256*64],
			func() *Request { return peerReq(1, strings.Repeat(long, 20), peerT0) }, 1},
		{"shorter than a chunk", "", func() *Request { return peerReq(1, long[:63], peerT0) }, 0},
	}
	for _, c := range idx {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "llmd", gie())
			rs := peerViews(2)
			llmdRouted(p, rs, 0, peerReq(0, c.stored, peerT0))
			_, d := peerPick(t, p, c.req(), rs)
			if want := 4 + 3*c.prefix; math.Abs(d.Scores[0]-want) > 1e-12 || d.Scores[1] != 4 {
				t.Fatalf("scores %v, want [%v 4]", d.Scores, want)
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
