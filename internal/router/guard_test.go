package router

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// panicky is a policy whose Pick and PickPair panic.
type panicky struct{}

func (panicky) Name() string { return "panicky" }

func (panicky) Pick(*policy.Request, []policy.ReplicaView) (policy.Decision, error) {
	panic("panicky: Pick")
}

func (panicky) PickPair(*policy.Request, []policy.ReplicaView, []policy.ReplicaView) (policy.PairDecision, error) {
	panic("panicky: PickPair")
}

// TestPolicyPanicRoutesByLeastLoad: a policy that panics costs each
// request its policy, not the request: it is routed by least load among
// the candidates, every panic is reported, and the stack is reported on
// the first panic and then at most once a minute of the router's clock.
func TestPolicyPanicRoutesByLeastLoad(t *testing.T) {
	now := time.Unix(1000, 0)
	var got []PolicyPanic
	rt, err := New(Config{Replicas: []string{"a", "b", "c", "d"}, Policy: panicky{}, Now: func() time.Time { return now },
		OnPolicyPanic: func(p PolicyPanic) { got = append(got, p) }})
	if err != nil {
		t.Fatal(err)
	}
	// Replica 3 is down; of the others, 1 has the fewest requests in flight.
	rt.SetHealthy(3, false)
	rt.SetRemoteLoad(0, Load{InFlight: 5})
	rt.SetRemoteLoad(2, Load{InFlight: 3})
	p := &prompt.Parsed{Model: "m", Text: "hello there"}
	steps := []struct {
		at         time.Duration // since the first panic
		stack      bool          // reported with its stack
		suppressed int
	}{
		{0, true, 0},
		{30 * time.Second, false, 0},
		{59 * time.Second, false, 0},
		{61 * time.Second, true, 2},
		{90 * time.Second, false, 0},
	}
	t0 := now
	for k, s := range steps {
		now = t0.Add(s.at)
		tk, err := rt.Route(rt.Prepare(p, "", ""))
		if err != nil {
			t.Fatalf("step %d: Route: %v", k, err)
		}
		if tk.Replica != 1 || tk.Decision.Reason != "fewest in flight" {
			t.Fatalf("step %d: routed to %d (%q), want 1 by least load", k, tk.Replica, tk.Decision.Reason)
		}
		tk.Done(now, Outcome{CachedTokens: -1})
		if len(got) != k+1 {
			t.Fatalf("step %d: %d panics reported, want %d", k, len(got), k+1)
		}
		r := got[k]
		if r.Policy != "panicky" || r.Value != "panicky: Pick" || (r.Stack != nil) != s.stack || r.Suppressed != s.suppressed {
			t.Fatalf("step %d: reported %q %v, stack %v, suppressed %d; want stack %v, suppressed %d",
				k, r.Policy, r.Value, r.Stack != nil, r.Suppressed, s.stack, s.suppressed)
		}
		if s.stack && !bytes.Contains(r.Stack, []byte("panicky.Pick")) {
			t.Fatalf("step %d: the stack does not show the panic:\n%s", k, r.Stack)
		}
	}
	// A dry run (/debug/route) is guarded too.
	if d, _, err := rt.DryRun(rt.Prepare(p, "", "")); err != nil || d.Replica != 1 {
		t.Fatalf("DryRun: %+v, %v", d, err)
	}
}

// TestPolicyPanicInPickPair: a pair picker that panics: the pair is
// chosen by least load on each side (decode first), and the panic is
// reported under the policy's name.
func TestPolicyPanicInPickPair(t *testing.T) {
	var got []PolicyPanic
	rt := newPDRouter(t, panicky{}, "ppdd", Config{NonCachedTokens: -1,
		OnPolicyPanic: func(p PolicyPanic) { got = append(got, p) }})
	rt.SetRemoteLoad(0, Load{InFlight: 2})
	rt.SetRemoteLoad(3, Load{InFlight: 2})
	req := rt.Prepare(&prompt.Parsed{Model: "m", Text: strings.Repeat("a long enough prompt ", 20)}, "", "")
	pd, err := rt.RoutePD(req)
	if err != nil {
		t.Fatal(err)
	}
	if pd.Prefill == nil || pd.Prefill.Replica != 1 || pd.Decode.Replica != 2 {
		t.Fatalf("pair %+v, want prefill 1 and decode 2 (least load on each side)", pd.Decision)
	}
	if len(got) != 1 || got[0].Policy != "panicky" || got[0].Value != "panicky: PickPair" || got[0].Stack == nil {
		t.Fatalf("reported %+v, want one PickPair panic with its stack", got)
	}
	endPD(pd, rt.Now())
	assertIdle(t, rt)
}

// observePanicky routes by least load and panics in every Observe.
type observePanicky struct{ policy.Policy }

func (observePanicky) Name() string         { return "observe_panicky" }
func (observePanicky) Observe(policy.Event) { panic("observe_panicky: Observe") }

// TestObservePanicCostsOnlyTheLesson: a policy whose Observe panics (on
// routing, first token and completion alike) keeps its requests: each is
// routed, its ticket ends and its replica's counts return to zero, and
// every panic is reported.
func TestObservePanicCostsOnlyTheLesson(t *testing.T) {
	var got []PolicyPanic
	ll, err := policy.New("least_load", policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rt, err := New(Config{Replicas: []string{"a", "b"}, Policy: observePanicky{ll},
		OnPolicyPanic: func(p PolicyPanic) { got = append(got, p) }})
	if err != nil {
		t.Fatal(err)
	}
	p := &prompt.Parsed{Model: "m", Text: "hello there"}
	for k := range 3 {
		tk, err := rt.Route(rt.Prepare(p, "", ""))
		if err != nil {
			t.Fatalf("request %d: Route: %v", k, err)
		}
		now := time.Now()
		tk.FirstToken(now)
		tk.Done(now, Outcome{OutputTokens: 1})
	}
	if len(got) != 9 {
		t.Fatalf("%d panics reported, want 9 (routed, first token, done × 3)", len(got))
	}
	for _, r := range got {
		if r.Policy != "observe_panicky" || r.Value != "observe_panicky: Observe" {
			t.Fatalf("reported %q %v", r.Policy, r.Value)
		}
	}
	for i := range 2 {
		if n := rt.Replica(i).InFlight(); n != 0 {
			t.Fatalf("replica %d: %d in flight after every request ended", i, n)
		}
	}
}
