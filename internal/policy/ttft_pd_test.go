package policy

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
)

// pdViews is a fleet of the given roles ("p", "d", "b") as RoutePD passes
// it: every replica on both sides, Healthy only where its role serves.
func pdViews(roles string) (prefill, decode []ReplicaView) {
	all := peerViews(len(roles))
	for i, c := range roles {
		all[i].Role = map[rune]Role{'p': RolePrefill, 'd': RoleDecode, 'b': RoleBoth}[c]
	}
	prefill, decode = append([]ReplicaView(nil), all...), append([]ReplicaView(nil), all...)
	for i := range all {
		prefill[i].Healthy, decode[i].Healthy = all[i].Role.Prefills(), all[i].Role.Decodes()
	}
	return prefill, decode
}

// both sets a field of replica i on both sides.
func both(prefill, decode []ReplicaView, i int, f func(v *ReplicaView)) {
	f(&prefill[i])
	f(&decode[i])
}

// pdReq is an 8,000-token prompt (500 blocks) expecting 128 output tokens,
// with RoutePD's skip threshold.
func pdReq(id uint64) *Request {
	req := peerReq(id, strings.Repeat("wxyz", 8000), peerT0)
	req.MaxTokens, req.SkipPrefillBelow = 128, 16
	return req
}

func pickPair(t *testing.T, p Policy, req *Request, prefill, decode []ReplicaView) PairDecision {
	t.Helper()
	pd, err := p.(PairPicker).PickPair(req, prefill, decode)
	if err != nil {
		t.Fatal(err)
	}
	return pd
}

// A long uncached prompt goes to the idle prefill replica and to the decode
// replica that holds most of it.
func TestTTFTPairIdlePrefillAndHoldingDecode(t *testing.T) {
	p := peerNew(t, "ttft", nil)
	req := pdReq(1)
	prefill, decode := pdViews("ppdd")
	both(prefill, decode, 0, func(v *ReplicaView) { v.PendingPrefill, v.PendingCount, v.InFlight = 16000, 2, 2 })
	both(prefill, decode, 3, func(v *ReplicaView) { v.Match = 300 })
	pd := pickPair(t, p, req, prefill, decode)
	if pd.SkipPrefill || pd.Prefill.Replica != prefill[1].Index || pd.Decode.Replica != decode[3].Index {
		t.Fatalf("pair %d → %d (skip %v: %s), want the idle prefill %d and the holder %d",
			pd.Prefill.Replica, pd.Decode.Replica, pd.SkipPrefill, pd.Reason, prefill[1].Index, decode[3].Index)
	}
	if pd.Decode.Matched != 300 || pd.Decode.EstTTFT <= pd.Prefill.EstTTFT {
		t.Fatalf("decode credited %d blocks; path %v not beyond the prefill's %v",
			pd.Decode.Matched, pd.Decode.EstTTFT, pd.Prefill.EstTTFT)
	}
	// The path: the prefill (8,000 tokens on an idle replica), the pull of
	// the 3,200 tokens the decode replica lacks, the last token's step.
	prof := costmodel.MustLookup(costmodel.Default)
	want := prof.PrefillMs(8000, 0, 8192) + prof.TransferMs(3200) + prof.C0 + prof.C1 + prof.C2*8000
	if got := float64(pd.Decode.EstTTFT) / float64(time.Millisecond); math.Abs(got-want) > 1e-3 {
		t.Fatalf("estimated path %.3f ms, want %.3f", got, want)
	}
	if pd.Prefill.Scores[0] <= pd.Prefill.Scores[1] || pd.Decode.Scores[0] != -1 || pd.Prefill.Scores[2] != -1 {
		t.Fatalf("scores %v / %v", pd.Prefill.Scores, pd.Decode.Scores)
	}
}

// A follow-up the decode replica holds wholly (it lacks fewer than
// SkipPrefillBelow tokens) skips the prefill step; below no threshold it
// does not.
func TestTTFTPairSkipsPrefillForAHeldPrompt(t *testing.T) {
	req := pdReq(1)
	req.Tokens += 10 // 10 tokens beyond the last full block
	prefill, decode := pdViews("ppdd")
	both(prefill, decode, 2, func(v *ReplicaView) { v.Match = len(req.Blocks) })
	pd := pickPair(t, peerNew(t, "ttft", nil), req, prefill, decode)
	if !pd.SkipPrefill || pd.Decode.Replica != decode[2].Index || pd.Prefill.Replica != -1 {
		t.Fatalf("held prompt: %+v", pd)
	}
	if !strings.Contains(pd.Reason, "lacks 10 prompt tokens") {
		t.Fatalf("reason %q", pd.Reason)
	}
	req.SkipPrefillBelow = 0
	if pd := pickPair(t, peerNew(t, "ttft", nil), req, prefill, decode); pd.SkipPrefill || pd.Decode.Replica != decode[2].Index {
		t.Fatalf("no skipping allowed: %+v", pd)
	}
}

// A replica of role both may serve the request aggregated, and does when
// that is faster than any path through the busy prefill replica.
func TestTTFTPairAggregatedOnBoth(t *testing.T) {
	req := pdReq(1)
	prefill, decode := pdViews("pbd")
	both(prefill, decode, 0, func(v *ReplicaView) { v.PendingPrefill, v.PendingCount, v.InFlight = 40000, 5, 5 })
	both(prefill, decode, 1, func(v *ReplicaView) { v.Match = 400 })
	pd := pickPair(t, peerNew(t, "ttft", nil), req, prefill, decode)
	if !pd.SkipPrefill || pd.Reason != "aggregated" || pd.Decode.Replica != decode[1].Index {
		t.Fatalf("want aggregated on the both replica holding the prompt: %+v", pd)
	}
}

// A slow KV link makes the decode replica that holds more of the prompt
// worth its busier batch; on a fast link the idle one wins.
func TestTTFTPairSlowLinkPrefersTheHolder(t *testing.T) {
	for _, c := range []struct {
		gbps float64
		want int
	}{{costmodel.DefaultTransferGBps, 2}, {0.5, 3}} {
		prof := costmodel.MustLookup(costmodel.Default)
		prof.TransferGBps = c.gbps
		p, err := New("ttft", Options{Seed: 7, Profile: prof, Params: map[string]any{"margin_rel": 0, "margin_ms": 0, "saturated_rel": 0}})
		if err != nil {
			t.Fatal(err)
		}
		req := pdReq(1)
		prefill, decode := pdViews("ppdd")
		both(prefill, decode, 3, func(v *ReplicaView) {
			v.Match, v.InFlight, v.InFlightTokens = 400, 50, 50*2000 // holds 80%, 50 decodes running
		})
		pd := pickPair(t, p, req, prefill, decode)
		if pd.SkipPrefill || pd.Decode.Replica != decode[c.want].Index {
			t.Fatalf("%v GB/s: decode on %d, want %d (scores %v)", c.gbps, pd.Decode.Replica, decode[c.want].Index, pd.Decode.Scores)
		}
	}
}

// Pulls pending on a decode replica's link delay a new pull there.
func TestTTFTPairLinkBacklog(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0})
	req := pdReq(1)
	prefill, decode := pdViews("pdd")
	both(prefill, decode, 1, func(v *ReplicaView) {
		v.PendingTransfer, v.PendingPrefill, v.PendingCount, v.InFlight = 2_000_000, 4, 4, 4
	})
	if pd := pickPair(t, p, req, prefill, decode); pd.Decode.Replica != decode[2].Index {
		t.Fatalf("decode on %d behind a backlog of 2M tokens", pd.Decode.Replica)
	}
}

// The whole path's estimate is learnt against the decode step's first
// token, for the prefill replica; the prefill step's events teach nothing.
func TestTTFTPairLearnsTheWholePath(t *testing.T) {
	p := peerNew(t, "ttft", nil).(*TTFT)
	req := pdReq(1)
	prefill, decode := pdViews("pd")
	pd := pickPair(t, p, req, prefill, decode)
	preq := *req
	preq.ID, preq.MaxTokens = 99, 1
	at := peerT0
	p.Observe(Event{Kind: Routed, At: at, Req: &preq, Decision: pd.Prefill, Replica: pd.Prefill.Replica, Phase: PhasePrefill})
	p.Observe(Event{Kind: Routed, At: at, Req: req, Decision: pd.Decode, Replica: pd.Decode.Replica, Phase: PhaseDecode})
	if len(p.pending) != 1 || p.meanPrompt != float64(req.Tokens) {
		t.Fatalf("pending %v, mean prompt %v (the prefill step's uncached prompt)", p.pending, p.meanPrompt)
	}
	p.Observe(Event{Kind: Done, At: at.Add(time.Second), Req: &preq, Decision: pd.Prefill, Replica: pd.Prefill.Replica,
		Phase: PhasePrefill, OutputTokens: 1})
	if len(p.pending) != 1 || p.meanOutput != 0 {
		t.Fatal("the prefill step's answer counted as an outcome")
	}
	ttft := 2 * pd.Decode.EstTTFT
	p.Observe(Event{Kind: FirstToken, At: at.Add(ttft), Req: req, Decision: pd.Decode, Replica: pd.Decode.Replica,
		Phase: PhaseDecode, TTFT: ttft})
	if want := math.Exp(0.1 * math.Log(2)); math.Abs(p.fleetFac-want) > 1e-9 {
		t.Fatalf("fleet correction %v, want %v", p.fleetFac, want)
	}
	var learnt []int
	for i, sl := range p.slots {
		if sl.learnt {
			learnt = append(learnt, i)
		}
	}
	if len(learnt) != 1 || learnt[0] != pd.Prefill.Replica {
		t.Fatalf("learnt for %v, want the prefill replica %d", learnt, pd.Prefill.Replica)
	}
	// The next estimate of the same path carries the correction.
	if next := pickPair(t, p, pdReq(2), prefill, decode); math.Abs(float64(next.Decode.EstTTFT)/float64(pd.Decode.EstTTFT)-p.fleetFac) > 1e-6 {
		t.Fatalf("corrected path %v, uncorrected %v, correction %v", next.Decode.EstTTFT, pd.Decode.EstTTFT, p.fleetFac)
	}
}
