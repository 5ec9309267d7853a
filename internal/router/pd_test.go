package router

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

// newPDRouter is a router over replicas of the given roles ("p", "d", "b").
func newPDRouter(t testing.TB, pol policy.Policy, roles string, cfg Config) *Router {
	t.Helper()
	for i, c := range roles {
		role := map[rune]policy.Role{'p': policy.RolePrefill, 'd': policy.RoleDecode, 'b': policy.RoleBoth}[c]
		cfg.Specs = append(cfg.Specs, Spec{URL: "http://r" + string(rune('a'+i)), Role: role})
	}
	clock := time.Unix(0, 0)
	cfg.Policy, cfg.Now = pol, func() time.Time { return clock }
	if cfg.BlocksPerReplica == 0 {
		cfg.BlocksPerReplica = 1 << 16
	}
	rt, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return rt
}

func mustPolicy(t testing.TB, name string) policy.Policy {
	t.Helper()
	p, err := policy.New(name, policy.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// endPD ends a routed pair as the gateway does on success: the prefill
// answer, then the decode stream's first token and end.
func endPD(pd PD, at time.Time) {
	if pd.Prefill != nil {
		pd.Prefill.Done(at, Outcome{CachedTokens: -1, OutputTokens: 1})
	}
	pd.Decode.FirstToken(at.Add(time.Millisecond))
	pd.Decode.Done(at.Add(time.Second), Outcome{CachedTokens: -1, OutputTokens: 16})
}

func assertIdle(t *testing.T, rt *Router) {
	t.Helper()
	for i, r := range rt.reps() {
		if r.inFlight.Load() != 0 || r.inFlightTokens.Load() != 0 || r.pendingPrefill.Load() != 0 ||
			r.pendingCount.Load() != 0 || r.pendingTransfer.Load() != 0 {
			t.Fatalf("replica %d counters not back to zero: %+v, transfer %d", i, rt.LocalLoad(i), r.pendingTransfer.Load())
		}
	}
}

// Prefill steps go to prefill (and both) replicas, decode steps to decode
// (and both) replicas, for a policy picking per side.
func TestRoutePDCandidatesByRole(t *testing.T) {
	for _, pol := range []string{"least_load", "round_robin", "random", "ttft", "sglang", "dynamo", "llmd", "preble"} {
		t.Run(pol, func(t *testing.T) {
			rt := newPDRouter(t, mustPolicy(t, pol), "ppdd", Config{})
			seen := map[int]bool{}
			for i := range 40 {
				req := rt.Prepare(parse(t, fmt.Sprintf("request %d ", i)+strings.Repeat("v", 400+i)), "", "")
				pd, err := rt.RoutePD(req)
				if err != nil {
					t.Fatal(err)
				}
				if pd.Prefill == nil || pd.Decision.SkipPrefill {
					t.Fatalf("request %d: prefill skipped (%s) on a cold fleet", i, pd.Decision.Reason)
				}
				if p, d := pd.Prefill.Replica, pd.Decode.Replica; p > 1 || d < 2 {
					t.Fatalf("request %d: prefill on %d, decode on %d; want 0-1 and 2-3", i, p, d)
				}
				if pd.Prefill.Phase() != policy.PhasePrefill || pd.Decode.Phase() != policy.PhaseDecode {
					t.Fatalf("phases %q %q", pd.Prefill.Phase(), pd.Decode.Phase())
				}
				if pd.Prefill.Request().ID == req.ID || pd.Prefill.Request().MaxTokens != 1 {
					t.Fatalf("the prefill step's request: ID %d (decode %d), max tokens %d",
						pd.Prefill.Request().ID, req.ID, pd.Prefill.Request().MaxTokens)
				}
				seen[pd.Prefill.Replica], seen[pd.Decode.Replica] = true, true
				endPD(pd, time.Unix(int64(i), 0))
			}
			if pol == "round_robin" && len(seen) != 4 {
				t.Fatalf("round robin used %v", seen)
			}
			assertIdle(t, rt)
		})
	}
}

func TestRoutePDExclusion(t *testing.T) {
	rt := newPDRouter(t, mustPolicy(t, "least_load"), "ppdd", Config{})
	long := strings.Repeat("x", 2000)
	for range 10 {
		pd, err := rt.RoutePD(rt.Prepare(parse(t, long+"a"), "", ""), 0)
		if err != nil {
			t.Fatal(err)
		}
		if pd.Prefill.Replica != 1 {
			t.Fatalf("prefill on %d, 0 excluded", pd.Prefill.Replica)
		}
		// A prefill failure before the decode step: the decode ticket is
		// rejected, both end, nothing stays counted.
		pd.Decode.Reject()
		pd.Prefill.Done(time.Unix(1, 0), Outcome{CachedTokens: -1, Err: errors.New("refused")})
		pd.Decode.Done(time.Unix(1, 0), Outcome{CachedTokens: -1, Err: errors.New("refused")})
	}
	assertIdle(t, rt)
	// Both prefill replicas out: the decode replica takes the whole request.
	rt.SetHealthy(1, false)
	req := rt.Prepare(parse(t, long+"b"), "", "")
	pd, err := rt.RoutePD(req, 0)
	if err != nil {
		t.Fatal(err)
	}
	if pd.Prefill != nil || !pd.Decision.SkipPrefill || pd.Decode.Phase() != policy.PhaseNone || pd.Decode.Replica < 2 {
		t.Fatalf("no prefill replica: %+v, decode on %d (%s)", pd.Decision, pd.Decode.Replica, pd.Decision.Reason)
	}
	if pd.Decode.UncachedTokens() != req.Tokens || pd.Decode.TransferTokens() != 0 {
		t.Fatalf("the decode replica computes %d tokens and pulls %d; want %d and 0",
			pd.Decode.UncachedTokens(), pd.Decode.TransferTokens(), req.Tokens)
	}
	endPD(pd, time.Unix(2, 0))
	// No decode replica: no pair.
	if _, err := rt.RoutePD(rt.Prepare(parse(t, long), "", ""), 2, 3); !errors.Is(err, policy.ErrNoReplica) {
		t.Fatalf("no decode replica: %v", err)
	}
	assertIdle(t, rt)
}

// The prefill step is skipped when the decode replica lacks fewer than
// NonCachedTokens of the prompt: a repeated prompt, whose blocks the decode
// replica pulled the first time.
func TestRoutePDSkipThreshold(t *testing.T) {
	text := strings.Repeat("y", 4*1000+8) // 1002 tokens: 62 full blocks, 10 tokens beyond
	for _, c := range []struct {
		threshold int
		skip      bool
	}{{0, true}, {11, true}, {10, false}, {-1, false}} {
		rt := newPDRouter(t, mustPolicy(t, "least_load"), "pd", Config{NonCachedTokens: c.threshold})
		first, err := rt.RoutePD(rt.Prepare(parse(t, text), "", ""))
		if err != nil || first.Prefill == nil {
			t.Fatalf("first request: %+v %v", first.Decision, err)
		}
		endPD(first, time.Unix(1, 0))
		again, err := rt.RoutePD(rt.Prepare(parse(t, text), "", ""))
		if err != nil {
			t.Fatal(err)
		}
		if again.Decision.SkipPrefill != c.skip || (again.Prefill == nil) != c.skip {
			t.Fatalf("threshold %d: skip %v (%s), want %v", c.threshold, again.Decision.SkipPrefill, again.Decision.Reason, c.skip)
		}
		if c.skip && (again.Decode.UncachedTokens() != 10 || again.Decision.Prefill.Replica != -1) {
			t.Fatalf("skipped: the decode replica computes %d tokens, prefill decision %+v",
				again.Decode.UncachedTokens(), again.Decision.Prefill)
		}
		endPD(again, time.Unix(2, 0))
		assertIdle(t, rt)
	}
}

// A replica of role both chosen for both sides serves the request
// aggregated: here the only replica.
func TestRoutePDAggregatedOnBoth(t *testing.T) {
	rt := newPDRouter(t, mustPolicy(t, "least_load"), "b", Config{})
	if rt.Disaggregated() {
		t.Fatal("a fleet of both replicas is not disaggregated")
	}
	for i := range 10 {
		req := rt.Prepare(parse(t, fmt.Sprintf("%d", i)+strings.Repeat("z", 400)), "", "")
		pd, err := rt.RoutePD(req)
		if err != nil {
			t.Fatal(err)
		}
		if pd.Prefill != nil || !pd.Decision.SkipPrefill || pd.Decision.Reason != "aggregated" || pd.Decode.Phase() != policy.PhaseNone {
			t.Fatalf("both replicas: %+v", pd.Decision)
		}
		if pd.Decode.UncachedTokens() != req.Tokens || pd.Decode.TransferTokens() != 0 {
			t.Fatalf("aggregated: uncached %d, transfer %d", pd.Decode.UncachedTokens(), pd.Decode.TransferTokens())
		}
		endPD(pd, time.Unix(1, 0))
	}
	assertIdle(t, rt)
	if !newPDRouter(t, mustPolicy(t, "least_load"), "bpd", Config{}).Disaggregated() {
		t.Fatal("a fleet with prefill and decode replicas is disaggregated")
	}
}

// The prefill step counts its uncached prompt on its replica until the
// prefill answer; the decode step counts the last token as pending prefill
// and what it pulls as pending transfer until its first token; the index
// learns the prompt on both; OnLearn hears both; all returns to zero.
func TestRoutePDAccounting(t *testing.T) {
	var learned []Learned
	rt := newPDRouter(t, mustPolicy(t, "least_load"), "pd", Config{OnLearn: func(l Learned) { learned = append(learned, l) }})
	text := strings.Repeat("a", 4*800) // 800 tokens, 50 blocks
	req := rt.Prepare(parse(t, text), "", "")
	// The decode replica holds the first 20 blocks already.
	if err := rt.Index().Insert(1, req.Blocks[:20]); err != nil {
		t.Fatal(err)
	}
	pd, err := rt.RoutePD(req)
	if err != nil {
		t.Fatal(err)
	}
	v := rt.Views(rt.Prepare(parse(t, "other"), "", ""))
	// The KV each step adds: the prefill its prompt and one output
	// token; the decode its last token, what it pulls and its output.
	if v[0].PendingPrefill != 800 || v[0].InFlight != 1 || v[0].InFlightTokens != 801 || v[0].InFlightKV != 801 || v[0].PendingTransfer != 0 {
		t.Fatalf("prefill replica %+v", v[0])
	}
	if v[1].PendingPrefill != 1 || v[1].PendingCount != 1 || v[1].PendingTransfer != 800-320 || v[1].InFlightTokens != 816 ||
		v[1].InFlightKV != 1+480+16 {
		t.Fatalf("decode replica %+v", v[1])
	}
	if pd.Decode.TransferTokens() != 480 || pd.Decode.UncachedTokens() != 1 || pd.Prefill.UncachedTokens() != 800 {
		t.Fatalf("tickets: transfer %d, decode computes %d, prefill computes %d",
			pd.Decode.TransferTokens(), pd.Decode.UncachedTokens(), pd.Prefill.UncachedTokens())
	}
	for i := range 2 {
		if m := rt.Views(req)[i].Match; m != len(req.Blocks) {
			t.Fatalf("the index holds %d blocks of the prompt on replica %d, want %d", m, i, len(req.Blocks))
		}
	}
	if len(learned) != 2 || learned[0].Replica != 0 || learned[1].Replica != 1 || learned[1].Held != 20 {
		t.Fatalf("OnLearn heard %+v", learned)
	}
	pd.Prefill.Done(time.Unix(1, 0), Outcome{CachedTokens: 0, OutputTokens: 1})
	if rt.Pending(0) != 0 || rt.InFlight(0) != 0 || rt.Pending(1) != 1 {
		t.Fatalf("after the prefill answer: pending %d, %d; in flight %d", rt.Pending(0), rt.Pending(1), rt.InFlight(0))
	}
	pd.Decode.FirstToken(time.Unix(2, 0))
	if rt.Views(req)[1].PendingTransfer != 0 || rt.InFlight(1) != 1 {
		t.Fatal("the first token ends the transfer, not the request")
	}
	pd.Decode.Done(time.Unix(3, 0), Outcome{CachedTokens: 799, OutputTokens: 16})
	assertIdle(t, rt)
}

// Observers hear Routed for both steps, prefill first, with their phases,
// and FirstToken and Done as usual.
func TestRoutePDObserversHearBothPhases(t *testing.T) {
	rec := &recorder{Policy: mustPolicy(t, "least_load")}
	rt := newPDRouter(t, rec, "pd", Config{})
	pd, err := rt.RoutePD(rt.Prepare(parse(t, strings.Repeat("q", 800)), "", ""))
	if err != nil {
		t.Fatal(err)
	}
	endPD(pd, time.Unix(5, 0))
	type step struct {
		kind    policy.EventKind
		phase   policy.Phase
		replica int
	}
	want := []step{{policy.Routed, policy.PhasePrefill, 0}, {policy.Routed, policy.PhaseDecode, 1},
		{policy.Done, policy.PhasePrefill, 0}, {policy.FirstToken, policy.PhaseDecode, 1}, {policy.Done, policy.PhaseDecode, 1}}
	if len(rec.evs) != len(want) {
		t.Fatalf("%d events, want %d", len(rec.evs), len(want))
	}
	for i, ev := range rec.evs {
		if got := (step{ev.Kind, ev.Phase, ev.Replica}); got != want[i] {
			t.Fatalf("event %d: %+v, want %+v", i, got, want[i])
		}
	}
	if rec.evs[3].TTFT != 5*time.Second+time.Millisecond {
		t.Fatalf("the decode step's TTFT %v counts from routing", rec.evs[3].TTFT)
	}
	if rec.evs[0].Req == rec.evs[1].Req || rec.evs[0].Req.ID == rec.evs[1].Req.ID {
		t.Fatal("the two steps share a request")
	}
}

// pairPolicy is a PairPicker answering a fixed pair.
type pairPolicy struct {
	policy.Policy
	pd policy.PairDecision
}

func (p *pairPolicy) PickPair(*policy.Request, []policy.ReplicaView, []policy.ReplicaView) (policy.PairDecision, error) {
	return p.pd, nil
}

func TestRoutePDChecksThePairPickersChoice(t *testing.T) {
	pp := &pairPolicy{Policy: mustPolicy(t, "least_load")}
	rt := newPDRouter(t, pp, "pbd", Config{})
	req := func() *policy.Request { return rt.Prepare(parse(t, strings.Repeat("w", 800)), "", "") }
	for _, c := range []struct {
		p, d    int
		skip    bool
		ok, agg bool
	}{
		{0, 2, false, true, false}, {1, 1, false, true, true}, {-1, 2, true, true, false},
		{2, 1, false, false, false}, // a decode replica as the prefill side
		{0, 0, false, false, false}, // a prefill replica as the decode side
		{0, 7, false, false, false},
	} {
		pp.pd = policy.PairDecision{Prefill: policy.Decision{Replica: c.p}, Decode: policy.Decision{Replica: c.d}, SkipPrefill: c.skip}
		pd, err := rt.RoutePD(req())
		if (err == nil) != c.ok {
			t.Fatalf("pair %d/%d: %v", c.p, c.d, err)
		}
		if err != nil {
			continue
		}
		if c.agg != (pd.Decision.Reason == "aggregated") || (pd.Prefill == nil) != (c.agg || c.skip) {
			t.Fatalf("pair %d/%d: %+v", c.p, c.d, pd.Decision)
		}
		endPD(pd, time.Unix(1, 0))
	}
	assertIdle(t, rt)
}

// Route ignores roles: an aggregated decision on a P/D fleet stays the
// caller's choice.
func TestRouteIgnoresRoles(t *testing.T) {
	rt := newPDRouter(t, mustPolicy(t, "round_robin"), "pd", Config{})
	seen := map[int]bool{}
	for range 4 {
		tk, err := rt.Route(rt.Prepare(parse(t, "hello"), "", ""))
		if err != nil {
			t.Fatal(err)
		}
		seen[tk.Replica] = true
		tk.Done(time.Unix(1, 0), Outcome{CachedTokens: -1})
	}
	if len(seen) != 2 {
		t.Fatalf("Route used %v", seen)
	}
}

// BenchmarkDecisionPD measures a P/D decision with ttft (every pair
// estimated) over P prefill and D decode replicas, a 32,000-character
// prompt held in part by one replica of each side.
func BenchmarkDecisionPD(b *testing.B) {
	for _, size := range []struct{ p, d int }{{2, 6}, {16, 48}} {
		b.Run(fmt.Sprintf("%dP%dD", size.p, size.d), func(b *testing.B) {
			rt := newPDRouter(b, mustPolicy(b, "ttft"), strings.Repeat("p", size.p)+strings.Repeat("d", size.d), Config{})
			text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 32000/45+1)[:32000]
			req := rt.Prepare(parse(b, text), "", "")
			_ = rt.Index().Insert(0, req.Blocks[:300])
			_ = rt.Index().Insert(size.p, req.Blocks[:100])
			for b.Loop() {
				if _, _, err := rt.DryRunPD(rt.Prepare(parse(b, text), "", "")); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// RouteDecode routes a decode step alone, pulling a completed prefill's
// KV: to a decode-capable replica other than the prefill replica and the
// ones excluded, as a decode step (transfer pending), for every policy
// (pair pickers included); ErrNoReplica once none is left.
func TestRouteDecodeAlone(t *testing.T) {
	for _, pol := range []string{"least_load", "round_robin", "ttft", "sglang", "dynamo", "llmd", "preble"} {
		t.Run(pol, func(t *testing.T) {
			rt := newPDRouter(t, mustPolicy(t, pol), "bpdd", Config{}) // slot 0 both: the prefill replica
			req := rt.Prepare(parse(t, "request "+strings.Repeat("v", 600)), "", "")
			var exclude []int
			for range 2 {
				tk, err := rt.RouteDecode(req, 0, exclude...)
				if err != nil {
					t.Fatal(err)
				}
				if d := tk.Replica; d < 2 || tk.Phase() != policy.PhaseDecode || tk.TransferTokens() == 0 {
					t.Fatalf("decode on %d, phase %v, transfer %d; want 2-3, a decode step pulling the prompt",
						d, tk.Phase(), tk.TransferTokens())
				}
				if rt.reps()[tk.Replica].pendingTransfer.Load() == 0 {
					t.Fatal("the pull is not pending on the decode replica")
				}
				tk.Reject()
				tk.Done(time.Unix(1, 0), Outcome{CachedTokens: -1})
				exclude = append(exclude, tk.Replica)
			}
			if _, err := rt.RouteDecode(req, 0, exclude...); !errors.Is(err, policy.ErrNoReplica) {
				t.Fatalf("every decode replica excluded: %v", err)
			}
			assertIdle(t, rt)
		})
	}
}
