package policy

import (
	"errors"
	"math"
	"testing"
	"time"
)

// churn reports n requests of 1,600 uncached tokens and 128 output tokens
// routed to replica slot over the second before at: a replica writing
// about n × 108 blocks a second.
func churn(p Policy, slot, n int, at time.Time) {
	for i := range n {
		req := ttftReq(uint64(1000 + i))
		req.MaxTokens, req.Now = 128, at.Add(-time.Second+time.Duration(i)*time.Second/time.Duration(n))
		peerObserve(p, Event{Kind: Routed, At: req.Now, Req: req, Decision: Decision{Replica: slot}, Replica: slot})
	}
}

// A replica whose cache turns over faster than a prefix stays in use loses
// what it is given: a request that would stay with the holder of its
// system prompt (it saves 960 tokens of prefill and evicts less there)
// goes to the other replica once the holder has written 10,800 blocks in
// the last second into a cache of 3,000 (its turnover: 5.6 s, against a
// prefix life of 40 s), and back to the holder once that churn has passed
// (a few windows later). Without the term (future_weight 0) it stays
// throughout.
func TestTTFTLostPrefixesLeaveAChurningCache(t *testing.T) {
	views := func(req *Request) []ReplicaView {
		rs := peerViews(2)
		for i := range rs {
			rs[i].NumBlocks, rs[i].Cached = 3000, 3000
		}
		rs[0].Match = 60 // the system prompt: 960 of the request's 1,600 tokens
		return rs
	}
	for _, c := range []struct {
		name   string
		params map[string]any
		later  time.Duration // the request arrives this long after the churn
		want   int
	}{
		{"no churn", nil, -1, 0},
		{"holder churning", nil, 0, 1},
		{"churn passed", nil, 5 * time.Minute, 0},
		{"without the term", map[string]any{"future_weight": 0}, 0, 0},
	} {
		params := map[string]any{"margin_rel": 0, "margin_ms": 0}
		for k, v := range c.params {
			params[k] = v
		}
		p := peerNew(t, "ttft", params)
		if c.later >= 0 {
			churn(p, peerBase, 100, peerT0)
		}
		req := ttftReq(1)
		req.MaxTokens, req.Now = 128, peerT0.Add(max(c.later, 0))
		if pos, d := peerPick(t, p, req, views(req)); pos != c.want {
			t.Errorf("%s: chose %d, want %d (scores %v)", c.name, pos, c.want, d.Scores)
		}
	}
}

// The rates the price of the future reads are what flowed into each
// replica: a routed request's uncached prompt and expected output blocks,
// every gateway's decisions alike, the blocks a replica recomputed beyond
// the credited prefix when the request ends; nothing for a failed request
// or an unknown cached count; all decaying by e every window_s.
func TestTTFTFlowCountsWrites(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"window_s": 10}).(*TTFT)
	req := ttftReq(1) // 1,600 tokens
	req.MaxTokens = 160
	routed := Event{Kind: Routed, At: peerT0, Req: req, Decision: Decision{Replica: 3, Matched: 40}, Replica: 3}
	p.Observe(routed) // 960 uncached + 160 out = 70 blocks
	remote := routed
	remote.Remote = true
	p.Observe(remote) // another gateway's decision: 70 more
	done := Event{Kind: Done, At: peerT0, Req: req, Decision: routed.Decision, Replica: 3, CachedTokens: 320, OutputTokens: 160}
	p.Observe(done) // 640 credited, 320 cached: 20 blocks recomputed
	failed := done
	failed.Err, failed.CachedTokens = errors.New("x"), 0
	p.Observe(failed)
	unknown := done
	unknown.CachedTokens = -1
	p.Observe(unknown)
	p.mu.Lock()
	defer p.mu.Unlock()
	w, lam := p.rates(3, peerT0)
	if math.Abs(w-160.0/10) > 1e-9 || math.Abs(lam-2.0/10) > 1e-9 {
		t.Fatalf("rates %v blocks/s, %v requests/s; want 16 and 0.2", w, lam)
	}
	w, lam = p.rates(3, peerT0.Add(10*time.Second))
	if math.Abs(w-16/math.E) > 1e-9 || math.Abs(lam-0.2/math.E) > 1e-9 {
		t.Fatalf("a window later: %v blocks/s, %v requests/s; want 16/e and 0.2/e", w, lam)
	}
	if w, lam := p.rates(4, peerT0); w != 0 || lam != 0 {
		t.Fatalf("a replica nothing was sent to: %v, %v", w, lam)
	}
}

// A cold prefill waits on a busy replica's arrivals: with wait_weight the
// request's 1,600 tokens go to the replica nobody has sent requests to
// lately, though its estimate is a little worse (it decodes a few
// requests); without it they go to the busy one, whose estimate is better.
func TestTTFTWaitKeepsColdPrefillsOffBusyReplicas(t *testing.T) {
	for _, c := range []struct {
		weight float64
		want   int
	}{{0, 0}, {1, 1}} {
		p := peerNew(t, "ttft", map[string]any{"wait_weight": c.weight, "margin_rel": 0, "margin_ms": 0})
		for i := range 200 { // 200 requests a second, each 10 tokens: no lost prefixes
			req := peerReq(uint64(100+i), "tiny", peerT0.Add(-time.Second+time.Duration(i)*5*time.Millisecond))
			peerObserve(p, Event{Kind: Routed, At: req.Now, Req: req, Decision: Decision{Replica: peerBase}, Replica: peerBase})
		}
		rs := peerViews(2)
		rs[1].InFlight, rs[1].InFlightTokens = 3, 3*1700
		if pos, d := peerPick(t, p, ttftReq(1), rs); pos != c.want {
			t.Errorf("wait_weight %v: chose %d, want %d (scores %v)", c.weight, pos, c.want, d.Scores)
		}
	}
}

// The price of the future's parameters are checked where they enter.
func TestTTFTFutureParams(t *testing.T) {
	for _, bad := range []map[string]any{
		{"future_weight": -1}, {"future_weight": 1e7}, {"wait_weight": -0.5},
		{"prefix_life_s": 0}, {"prefix_life_s": 1e6}, {"window_s": 0}, {"window_s": -3},
	} {
		if _, err := New("ttft", Options{Params: bad}); !errors.Is(err, ErrParam) {
			t.Errorf("%v: %v, want ErrParam", bad, err)
		}
	}
}
