package policy

import (
	"math"
	"testing"
	"time"
)

// prebleReqT is a request of tokens prompt tokens and maxTokens output.
func prebleReqT(id uint64, tokens, maxTokens int, at time.Time) *Request {
	return &Request{ID: id, Now: at, Model: "m", Tokens: tokens, MaxTokens: maxTokens, Blocks: make([]uint64, tokens/16)}
}

// TestPrebleLoadCost: hand-computed load costs with the default profile
// (c1 = 0.04 ms/token, c3 = 3e-6 ms/context token), 16-token blocks, a
// 180 s window. A request of 1000 tokens, 100 output tokens, uncached:
//
//	prefill 1000 × 0.04 = 40 ms; decode 100 × (0.04 + 3e-6 × (1000 + 100/2)) = 4.315 ms.
func TestPrebleLoadCost(t *testing.T) {
	sec := func(s int) time.Time { return peerT0.Add(time.Duration(s) * time.Second) }
	type ev struct {
		kind      EventKind
		at        int
		id        uint64
		tokens    int
		maxTokens int
		matched   int  // Decision.Matched
		elsewhere bool // Decision.Replica is another replica (a retry)
		out       int  // Done: OutputTokens
	}
	cases := []struct {
		name   string
		params map[string]any
		events []ev
		at     int
		cost   float64 // replica 1's
	}{
		{"uncached prefill + decode", nil, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 0, 44.315},
		// 50 cached blocks = 800 tokens: 200 × 0.04 = 8.
		{"cached blocks are free", nil, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100, matched: 50}}, 0, 12.315},
		{"another replica's match is not credited", nil,
			[]ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100, matched: 50, elsewhere: true}}, 0, 44.315},
		// Default expected output 128: 128 × (0.04 + 3e-6 × 1064).
		{"no max_tokens: the default output", nil, []ev{{kind: Routed, id: 1, tokens: 1000}}, 0, 40 + 128*(0.04+3e-6*1064)},
		{"done: no decode work", nil,
			[]ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Done, at: 5, id: 1, out: 100}}, 5, 40},
		{"one of two done", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, id: 2, tokens: 1000, maxTokens: 100},
			{kind: Done, at: 5, id: 1, out: 100}}, 5, 80 + 4.315},
		{"179 s later: still in the window", nil, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 179, 44.315},
		{"180 s later: out of the window", nil, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 180, 4.315},
		{"window_secs 10", map[string]any{"window_secs": 10}, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 10, 4.315},
		// Observed output 228 becomes the expectation: 228 × (0.04 + 3e-6 × 1114).
		{"mean observed output", nil, []ev{
			{kind: Routed, id: 1, tokens: 10, maxTokens: 5}, {kind: Done, at: 1, id: 1, out: 228},
			{kind: Routed, at: 2, id: 2, tokens: 1000}}, 2, 0.4 + 40 + 228*(0.04+3e-6*1114)},
		{"two requests add up", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, at: 100, id: 2, tokens: 1000, maxTokens: 100}}, 100, 2 * 44.315},
		{"the older leaves the window first", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, at: 100, id: 2, tokens: 1000, maxTokens: 100}}, 200, 44.315 + 4.315},
		// Not Done within a window: forgotten (its Done was lost).
		{"lost request forgotten", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, at: 181, id: 2, tokens: 1000, maxTokens: 100}}, 181, 44.315},
		{"max_tracked bounds decode tracking", map[string]any{"max_tracked": 1}, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, id: 2, tokens: 1000, maxTokens: 100}}, 0, 44.315 + 40},
		{"re-routed request counted once", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 0, 40 + 44.315},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "preble", c.params)
			rs := peerViews(2)
			for _, e := range c.events {
				req := prebleReqT(e.id, e.tokens, e.maxTokens, sec(e.at))
				d := Decision{Replica: rs[1].Index, Matched: e.matched}
				if e.elsewhere {
					d.Replica = rs[0].Index
				}
				peerObserve(p, Event{Kind: e.kind, At: sec(e.at), Req: req, Decision: d, Replica: rs[1].Index, OutputTokens: e.out})
			}
			_, d := peerPick(t, p, prebleReqT(99, 100, 10, sec(c.at)), rs)
			if math.Abs(d.Scores[1]-c.cost) > 1e-9 || d.Scores[0] != 0 {
				t.Fatalf("costs %v, want [0 %v]", d.Scores, c.cost)
			}
			if pp := p.(*Preble); len(pp.inflight) > pp.params.MaxTracked {
				t.Fatalf("%d tracked, max %d", len(pp.inflight), pp.params.MaxTracked)
			}
		})
	}
}

// TestPrebleE2: exploit when the longest cached prefix is longer than the
// new tokens, else explore; rebalance when the exploit choice's load cost is
// over 1.5 × the least loaded's. Load costs set up by routed requests:
// 1000 tokens → 44.315, 700 → 32.225, 600 → 28.195 (100 output tokens).
func TestPrebleE2(t *testing.T) {
	cases := []struct {
		name   string
		params map[string]any
		loads  []int // tokens routed to each replica first (0: none)
		match  []int
		tokens int
		want   int
		reason string
	}{
		// 10 blocks = 160 tokens > 300 − 160.
		{"exploit the holder though busier", nil, []int{1000, 700}, []int{10, 0}, 300, 0, "exploit"},
		// 44.315 > 1.5 × 28.195 = 42.29.
		{"rebalance off an overloaded holder", nil, []int{1000, 600}, []int{10, 0}, 300, 1, "rebalance"},
		{"rebalance_ratio 2 keeps it", map[string]any{"rebalance_ratio": 2}, []int{1000, 600}, []int{10, 0}, 300, 0, "exploit"},
		// 160 is not > 320 − 160: explore.
		{"explore: cached equals new", nil, []int{0, 700}, []int{10, 0}, 320, 0, "explore"},
		{"explore: the least load cost", nil, []int{1000, 700}, []int{10, 0}, 320, 1, "explore"},
		// 32.225 < 1.5 × 28.195.
		{"exploit: least cost among the holders", nil, []int{1000, 600, 700}, []int{10, 5, 10}, 300, 2, "exploit"},
		{"the same, rebalanced to the idle replica", nil, []int{1000, 0, 700}, []int{10, 5, 10}, 300, 1, "rebalance"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "preble", c.params)
			rs := peerViews(len(c.loads))
			for i, tok := range c.loads {
				if tok > 0 {
					peerObserve(p, Event{Kind: Routed, At: peerT0, Req: prebleReqT(uint64(i+1), tok, 100, peerT0),
						Decision: Decision{Replica: rs[i].Index}, Replica: rs[i].Index})
				}
				rs[i].Match = c.match[i]
			}
			got, d := peerPick(t, p, prebleReqT(99, c.tokens, 10, peerT0), rs)
			if got != c.want || len(d.Reason) < len(c.reason) || d.Reason[:len(c.reason)] != c.reason {
				t.Fatalf("picked %d (%s, costs %v), want %d (%s)", got, d.Reason, d.Scores, c.want, c.reason)
			}
			if d.Matched != c.match[got] || d.Load != d.Scores[got] {
				t.Fatalf("decision %+v", d)
			}
		})
	}
}
