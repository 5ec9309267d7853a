package router

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

// Two routers as two gateways: what one learns, handed to the other as a
// remote decision, routes the other's next turn of the conversation to the
// same replica.
func TestSharedDecisionsReachAnotherRouter(t *testing.T) {
	var shared []Learned
	a := newRouter(t, "ttft", 4)
	a.cfg.OnLearn = func(l Learned) {
		l.Blocks = slices.Clone(l.Blocks)
		shared = append(shared, l)
	}
	b := newRouter(t, "ttft", 4)
	turn1 := strings.Repeat("the system prompt of a long conversation. ", 40)
	turn2 := turn1 + strings.Repeat("and the user's second question. ", 20)

	tk, err := a.Route(a.Prepare(parse(t, turn1), "", ""))
	if err != nil {
		t.Fatal(err)
	}
	if len(shared) != 1 || shared[0].Held != 0 || len(shared[0].Blocks) != len(tk.Request().Blocks) {
		t.Fatalf("first decision shared as %+v", shared)
	}
	for _, l := range shared {
		i, ok := b.Lookup(a.Name(l.Replica))
		if !ok {
			t.Fatalf("replica %q unknown to b", a.Name(l.Replica))
		}
		b.ApplyRemote(i, l.Model, 0, l.Blocks, l.Tokens, b.Now())
	}
	req := b.Prepare(parse(t, turn2), "", "")
	tk2, err := b.Route(req)
	if err != nil {
		t.Fatal(err)
	}
	if tk2.Replica != tk.Replica {
		t.Fatalf("turn 2 on b went to %d, turn 1 on a to %d", tk2.Replica, tk.Replica)
	}
	// Turn 2 routed on a too, after turn 1's answer (while turn 1 is
	// still in prefill ttft's copy_inflight may send it elsewhere): the
	// whole prompt is shared, and how much of it the replica held in a's
	// view.
	tk.FirstToken(a.Now())
	shared = nil
	if _, err := a.Route(a.Prepare(parse(t, turn2), "", "")); err != nil {
		t.Fatal(err)
	}
	n1 := len(tk.Request().Blocks)
	if len(shared) != 1 || shared[0].Held != n1 || len(shared[0].Blocks) != len(req.Blocks) {
		t.Fatalf("turn 2 shared %d blocks, %d held; want %d, %d", len(shared[0].Blocks), shared[0].Held, len(req.Blocks), n1)
	}
}

// Remote load adds to the views and goes away when set to zero; the
// router's own counts stay its own.
func TestRemoteLoadAddsToViews(t *testing.T) {
	rt := newRouter(t, "least_load", 2)
	rt.SetRemoteLoad(0, Load{InFlight: 5, InFlightTokens: 500, PendingPrefill: 300, PendingCount: 2})
	req := rt.Prepare(parse(t, "hello there"), "", "")
	v := rt.Views(req)
	if v[0].InFlight != 5 || v[0].PendingPrefill != 300 || v[0].PendingCount != 2 || v[0].InFlightTokens != 500 || v[1].InFlight != 0 {
		t.Fatalf("views %+v", v)
	}
	tk, err := rt.Route(req)
	if err != nil {
		t.Fatal(err)
	}
	if tk.Replica != 1 {
		t.Fatalf("least_load took the remotely loaded replica")
	}
	if got := rt.LocalLoad(1); got.InFlight != 1 || rt.LocalLoad(0).InFlight != 0 {
		t.Fatalf("local loads %+v %+v", rt.LocalLoad(0), got)
	}
	rt.SetRemoteLoad(0, Load{})
	if v := rt.Views(req); v[0].InFlight != 0 || rt.RemoteLoad(0) != (Load{}) {
		t.Fatalf("remote load kept: %+v", v[0])
	}
	tk.Done(time.Unix(1, 0), Outcome{CachedTokens: -1})
}

// A remote decision reaches an Observer policy marked Remote, with its
// offset; an unknown slot is ignored.
func TestApplyRemoteTellsTheObserver(t *testing.T) {
	p, _ := policy.New("round_robin", policy.Options{Seed: 1})
	rec := &recorder{Policy: p}
	rt, err := New(Config{Replicas: []string{"a", "b"}, Policy: rec})
	if err != nil {
		t.Fatal(err)
	}
	rt.ApplyRemote(1, "m", 3, []uint64{7, 8}, 80, time.Unix(5, 0))
	rt.ApplyRemote(9, "m", 0, []uint64{1}, 16, time.Unix(5, 0))
	if len(rec.evs) != 1 {
		t.Fatalf("%d events", len(rec.evs))
	}
	ev := rec.evs[0]
	if !ev.Remote || ev.Kind != policy.Routed || ev.Replica != 1 || ev.Req.BlockOffset != 3 || ev.Req.Tokens != 80 || ev.Decision.Matched != 3 {
		t.Fatalf("event %+v req %+v", ev, ev.Req)
	}
	if !rt.Index().Holds(1, 8) || rt.Index().Holds(0, 8) {
		t.Fatal("index did not learn the remote blocks on replica 1 only")
	}
}

// Finding 1 of #22: a peer gateway (anyone who can write to the shared
// Redis) reported -1,000,000 requests in flight on one replica; the
// default ttft policy's scores went negative, its margin fell below the
// best score, and every Pick indexed scores[-1]. Peer loads are clamped
// when applied, and the policy computes on sane counts: whatever a peer
// reports, every request gets a healthy replica, and no policy panics
// (the router's recovery is not what saves it).
func TestForgedRemoteLoadsRouteEveryRequest(t *testing.T) {
	const m = -1_000_000
	cases := []struct {
		name string
		load Load
	}{
		{"in flight -1e6", Load{InFlight: m}},
		{"every count -1e6", Load{InFlight: m, InFlightTokens: m, PendingPrefill: m, PendingCount: m}},
		{"pending prefill -1e6", Load{PendingPrefill: m}},
		{"min int64", Load{math.MinInt64, math.MinInt64, math.MinInt64, math.MinInt64}},
		{"max int64", Load{math.MaxInt64, math.MaxInt64, math.MaxInt64, math.MaxInt64}},
		{"mixed", Load{InFlight: math.MaxInt64, InFlightTokens: m, PendingPrefill: math.MinInt64, PendingCount: math.MaxInt64}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rt := newRouter(t, policy.Default, 4)
			panics := 0
			rt.cfg.OnPolicyPanic = func(PolicyPanic) { panics++ }
			rt.SetHealthy(3, false)
			rt.SetRemoteLoad(1, c.load)
			var open []*Ticket
			for k := range 400 {
				text := strings.Repeat(fmt.Sprintf("conversation %d. ", k%7), 20+k%50)
				tk, err := rt.Route(rt.Prepare(parse(t, text), "", ""))
				if err != nil {
					t.Fatalf("request %d: %v", k, err)
				}
				if tk.Replica == 3 || tk.Decision.EstTTFT < 0 {
					t.Fatalf("request %d: replica %d (3 is down), estimate %v", k, tk.Replica, tk.Decision.EstTTFT)
				}
				open = append(open, tk)
				if k%3 == 0 { // some requests end, others stay in flight
					open[0].Done(rt.Now(), Outcome{CachedTokens: -1, OutputTokens: 16})
					open = open[1:]
				}
			}
			if panics != 0 {
				t.Fatalf("%d policy panics recovered", panics)
			}
			if got := rt.RemoteLoad(1); min(got.InFlight, got.InFlightTokens, got.PendingPrefill, got.PendingCount) < 0 ||
				max(got.InFlight, got.PendingCount) > remoteMaxRequests || max(got.InFlightTokens, got.PendingPrefill) > remoteMaxTokens {
				t.Fatalf("remote load applied as %+v", got)
			}
			for _, tk := range open {
				tk.Done(rt.Now(), Outcome{CachedTokens: -1})
			}
		})
	}
}

// A remote decision is bounded as a request is: a negative offset or
// token count is 0, and an offset, token count or block list past the
// longest prompt is cut there.
func TestApplyRemoteClampsTheDecision(t *testing.T) {
	p, _ := policy.New("round_robin", policy.Options{Seed: 1})
	rec := &recorder{Policy: p}
	rt, err := New(Config{Replicas: []string{"a", "b"}, Policy: rec})
	if err != nil {
		t.Fatal(err)
	}
	maxBlocks := remoteMaxPrompt / rt.cfg.BlockSize
	long := make([]uint64, maxBlocks+5)
	for i := range long {
		long[i] = uint64(i + 1)
	}
	cases := []struct {
		offset, tokens       int
		blocks               []uint64
		wantOff, wantTok, nB int
	}{
		{-5, -80, []uint64{1, 2, 3}, 0, 0, 3},
		{math.MinInt, math.MinInt, nil, 0, 0, 0},
		{math.MaxInt, math.MaxInt, []uint64{1, 2}, maxBlocks, remoteMaxPrompt, 0},
		{0, 16 * len(long), long, 0, remoteMaxPrompt, maxBlocks},
		{maxBlocks - 2, 100, long[:10], maxBlocks - 2, 100, 2},
		{3, 80, []uint64{7, 8}, 3, 80, 2},
	}
	for k, c := range cases {
		rt.ApplyRemote(1, "m", c.offset, c.blocks, c.tokens, time.Unix(5, 0))
		ev := rec.evs[len(rec.evs)-1]
		if len(rec.evs) != k+1 || ev.Req.BlockOffset != c.wantOff || ev.Req.Tokens != c.wantTok || len(ev.Req.Blocks) != c.nB ||
			ev.Decision.Matched != c.wantOff {
			t.Fatalf("case %d: event offset %d, tokens %d, %d blocks, matched %d; want %d, %d, %d",
				k, ev.Req.BlockOffset, ev.Req.Tokens, len(ev.Req.Blocks), ev.Decision.Matched, c.wantOff, c.wantTok, c.nB)
		}
	}
}

// InFlightKV counts what each request adds beyond the prefix it was
// credited (a shared prefix once, not once per request as InFlightTokens),
// returns to zero when the requests end, and the other gateways' contexts
// count at this gateway's ratio of KV to contexts.
func TestInFlightKVCountsSharedPrefixesOnce(t *testing.T) {
	rt := newRouter(t, "least_load", 1)
	text := strings.Repeat("a", 4*640) // 640 tokens, 40 blocks
	var tickets []*Ticket
	for range 4 {
		req := rt.Prepare(parse(t, text), "", "")
		req.MaxTokens = 100
		if err := rt.Index().Insert(0, req.Blocks); err != nil {
			t.Fatal(err)
		}
		tk, err := rt.Route(req)
		if err != nil {
			t.Fatal(err)
		}
		tickets = append(tickets, tk)
	}
	v := rt.Views(rt.Prepare(parse(t, "x"), "", ""))[0]
	// Each: 640 − 639 cached (all but the last token) = 1, + 100 out.
	if v.InFlightTokens != 4*740 || v.InFlightKV != 4*101 {
		t.Fatalf("in flight %d tokens, %d KV; want %d, %d", v.InFlightTokens, v.InFlightKV, 4*740, 4*101)
	}
	rt.SetRemoteLoad(0, Load{InFlight: 2, InFlightTokens: 2 * 740})
	if v := rt.Views(rt.Prepare(parse(t, "x"), "", ""))[0]; v.InFlightKV != 6*101 {
		t.Errorf("with a peer's 2 requests: KV %d, want %d", v.InFlightKV, 6*101)
	}
	rt.SetRemoteLoad(0, Load{})
	for _, tk := range tickets {
		tk.Done(time.Time{}, Outcome{})
	}
	if v := rt.Views(rt.Prepare(parse(t, "x"), "", ""))[0]; v.InFlightKV != 0 || v.InFlightTokens != 0 {
		t.Errorf("after the requests: %+v", v)
	}
}
