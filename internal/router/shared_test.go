package router

import (
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
	// Turn 2 routed on a too: the whole prompt is shared, and how much of
	// it the replica held in a's view.
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
