package policy

import (
	"errors"
	"math"
	"strings"
	"testing"
	"time"
)

// ttftReq is a 1,600-token prompt (100 blocks).
func ttftReq(id uint64) *Request {
	return peerReq(id, strings.Repeat("abcd", 1600), peerT0)
}

// The holder of the prefix wins while its queue costs less than the
// prefill it saves; past that the other replica wins. With the default
// profile the saving is ≈1,599 tokens × c1, so the switch happens when the
// holder's queued prefill passes ≈1,600 tokens.
func TestTTFTPrefersHolderUntilQueueOutweighsSaving(t *testing.T) {
	cases := []struct {
		queued int // holder's pending prefill tokens
		want   int // position chosen
	}{
		{0, 0}, {500, 0}, {1400, 0}, // the saving outweighs the queue
		{1900, 1}, {3000, 1}, {20000, 1}, // the queue outweighs the saving
	}
	for _, c := range cases {
		p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "decode_weight": 0})
		rs := peerViews(2)
		req := ttftReq(1)
		rs[0].Match = len(req.Blocks)
		rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = c.queued, 1, 1
		pos, d := peerPick(t, p, req, rs)
		if pos != c.want {
			t.Errorf("holder queue %d: chose %d, want %d (scores %v)", c.queued, pos, c.want, d.Scores)
		}
		if d.EstTTFT <= 0 || math.Abs(d.Scores[pos]-float64(d.EstTTFT)/float64(time.Millisecond)) > 1e-6 {
			t.Errorf("EstTTFT %v does not match the chosen score %v", d.EstTTFT, d.Scores[pos])
		}
		if pos == 0 && d.Matched != len(req.Blocks) {
			t.Errorf("holder chosen with %d blocks credited, want %d", d.Matched, len(req.Blocks))
		}
	}
}

// The estimate is the cost model's prefill time for the uncached tokens.
func TestTTFTEstimateMatchesCostModel(t *testing.T) {
	p := peerNew(t, "ttft", nil).(*TTFT)
	req := ttftReq(1)
	v := ReplicaView{Healthy: true, Match: 40} // 640 tokens cached, 960 to compute
	ms, matched := p.Estimate(req, &v, 0)
	want := p.o.Profile.PrefillMs(960, 640, p.o.MaxBatchTokens)
	if matched != 40 || math.Abs(ms-want) > 1e-9 {
		t.Fatalf("estimate %v ms (matched %d), cost model %v ms", ms, matched, want)
	}
	// A fully cached prompt still computes its last token, as vLLM does.
	v.Match = len(req.Blocks)
	if ms, _ := p.Estimate(req, &v, 0); math.Abs(ms-p.o.Profile.PrefillMs(1, 1599, 8192)) > 1e-9 {
		t.Fatalf("fully cached: %v ms", ms)
	}
	// Running decodes slow the prefill steps down.
	busy := ReplicaView{Healthy: true, InFlight: 50, InFlightTokens: 50 * 2000}
	idle := ReplicaView{Healthy: true}
	b, _ := p.Estimate(req, &busy, 0)
	i, _ := p.Estimate(req, &idle, 0)
	if b <= i {
		t.Fatalf("50 decodes did not slow the estimate: %v vs %v", b, i)
	}
}

// Within the margin the deeper match wins; outside it, the faster replica.
func TestTTFTMarginPrefersDeeperMatch(t *testing.T) {
	req := ttftReq(1)
	rs := peerViews(2)
	rs[0].Match = 90 // a little slower (less cached) than replica 1 ...
	rs[1].Match = 100
	rs[1].PendingPrefill, rs[1].PendingCount, rs[1].InFlight = 200, 1, 1 // ... but replica 1 has a queue
	tight := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "decode_weight": 0})
	if pos, d := peerPick(t, tight, req, rs); pos != 0 {
		t.Fatalf("no margin: chose %d (scores %v)", pos, d.Scores)
	}
	loose := peerNew(t, "ttft", map[string]any{"margin_rel": 0.5, "margin_ms": 0, "decode_weight": 0})
	if pos, d := peerPick(t, loose, req, rs); pos != 1 || !strings.Contains(d.Reason, "deepest") {
		t.Fatalf("wide margin: chose %d (%s)", pos, d.Reason)
	}
}

// Observed TTFTs twice the estimate on a replica double its estimates.
func TestTTFTCorrectionLearnsFromFirstTokens(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "correction_alpha": 0.5, "decode_weight": 0})
	rs := peerViews(2)
	req := ttftReq(1)
	rs[0].Match = 50 // replica 0 saves 800 of 1,600 tokens: faster on paper
	if pos, _ := peerPick(t, p, req, rs); pos != 0 {
		t.Fatalf("chose %d before any correction", pos)
	}
	obs := p.(Observer)
	raw, _ := p.(*TTFT).Estimate(req, &rs[0], 0) // what replica 0 should take, ms
	for k := range 12 {
		r := ttftReq(uint64(100 + k))
		_, dk := peerPick(t, p, r, rs)
		// Routed to replica 0 with the (corrected) estimate of the moment; it takes 3× the model.
		routed := Decision{Replica: rs[0].Index, EstTTFT: time.Duration(dk.Scores[0] * float64(time.Millisecond))}
		obs.Observe(Event{Kind: Routed, Req: r, Decision: routed, Replica: rs[0].Index})
		obs.Observe(Event{Kind: FirstToken, Req: r, Replica: rs[0].Index, TTFT: time.Duration(3 * raw * float64(time.Millisecond))})
	}
	pos, d2 := peerPick(t, p, req, rs)
	if pos != 1 {
		t.Fatalf("replica 0 answers 3× slower than estimated, still chosen (scores %v)", d2.Scores)
	}
	if c := p.(*TTFT).corr(rs[0].Index); c < 2.5 || c > 3.01 {
		t.Fatalf("correction %v, want ≈3", c)
	}
}

// The decode cost spreads load: an idle replica beats one decoding many
// requests when neither holds the prefix.
func TestTTFTDecodeCostSpreadsLoad(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0})
	rs := peerViews(3)
	rs[0].InFlight, rs[0].InFlightTokens = 40, 40*1700
	rs[1].InFlight, rs[1].InFlightTokens = 10, 10*1700
	if pos, d := peerPick(t, p, ttftReq(1), rs); pos != 2 {
		t.Fatalf("chose %d over the idle replica (scores %v)", pos, d.Scores)
	}
}

func TestTTFTUnhealthyAndErrors(t *testing.T) {
	p := peerNew(t, "ttft", nil)
	rs := peerViews(2)
	req := ttftReq(1)
	rs[0].Match = len(req.Blocks)
	rs[0].Healthy = false
	if pos, d := peerPick(t, p, req, rs); pos != 1 || d.Scores[0] != -1 {
		t.Fatalf("chose %d, scores %v", pos, d.Scores)
	}
	rs[1].Healthy = false
	if _, err := p.Pick(req, rs); !errors.Is(err, ErrNoReplica) {
		t.Fatalf("no healthy replica: %v", err)
	}
	for _, bad := range []map[string]any{{"margin_rel": -1}, {"correction_alpha": 2}, {"decode_weight": -1}, {"nope": 1}} {
		if _, err := New("ttft", Options{Params: bad}); err == nil {
			t.Errorf("params %v accepted", bad)
		}
	}
}
