package router

import (
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// deferring sends to replica 0 unless some prefill is pending anywhere,
// when it defers (unless told not to).
type deferring struct{ asked int }

func (*deferring) Name() string { return "deferring" }

func (d *deferring) Pick(req *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
	d.asked++
	for _, r := range rs {
		if r.PendingPrefill > 0 && !req.NoDefer {
			return policy.Decision{}, policy.ErrDefer
		}
	}
	return policy.Decision{Replica: 0}, nil
}

func TestQueueFirstComeFirstServed(t *testing.T) {
	now := time.Unix(0, 0)
	rt, err := New(Config{Replicas: []string{"a", "b"}, Policy: &deferring{}, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	req := func(s string) *policy.Request {
		return rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: s, KeyText: s, Prompts: 1}, "", "")
	}
	t1, w, err := rt.Submit(req("first request, routed at once"))
	if err != nil || w != nil || t1 == nil {
		t.Fatalf("first: %v %v %v", t1, w, err)
	}
	_, w2, _ := rt.Submit(req("second, deferred while the first prefills"))
	_, w3, _ := rt.Submit(req("third, behind the second"))
	if w2 == nil || w3 == nil || rt.Queued() != 2 {
		t.Fatalf("queue %d, want 2 waiting", rt.Queued())
	}
	var order []string
	w2.OnRouted = func(*Ticket, error) { order = append(order, "second") }
	w3.OnRouted = func(*Ticket, error) { order = append(order, "third") }
	t1.FirstToken(now) // the first's prefill ends: the second goes, the third waits for it
	if len(order) != 1 || order[0] != "second" || rt.Queued() != 1 {
		t.Fatalf("after the first token: %v, %d waiting", order, rt.Queued())
	}
	t2, _ := w2.Result()
	select {
	case <-w2.Done():
	default:
		t.Fatal("the second's Done not closed")
	}
	// The third's client leaves: out of the queue; nothing else to route.
	if !rt.Cancel(w3) || rt.Queued() != 0 || rt.Cancel(w3) {
		t.Fatal("cancel")
	}
	t2.FirstToken(now)
	if len(order) != 1 {
		t.Fatalf("a cancelled request was routed: %v", order)
	}
	t1.Done(now, Outcome{CachedTokens: -1})
	t2.Done(now, Outcome{CachedTokens: -1})
}

// A deferral with nothing in flight would never be released: overruled.
func TestQueueNeverWaitsForNothing(t *testing.T) {
	pol := &deferring{}
	rt, err := New(Config{Replicas: []string{"a"}, Policy: pol})
	if err != nil {
		t.Fatal(err)
	}
	// Pending prefill without a request in flight cannot happen through
	// tickets; a policy deferring on scraped state can: defer on anything.
	always := policyFunc(func(req *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
		if !req.NoDefer {
			return policy.Decision{}, policy.ErrDefer
		}
		return policy.Decision{Replica: 0}, nil
	})
	rt.SetPolicy(always)
	tk, w, err := rt.Submit(rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: "x", KeyText: "x", Prompts: 1}, "", ""))
	if err != nil || w != nil || tk == nil {
		t.Fatalf("deferred with nothing in flight: %v %v %v", tk, w, err)
	}
}

type policyFunc func(*policy.Request, []policy.ReplicaView) (policy.Decision, error)

func (policyFunc) Name() string { return "func" }
func (f policyFunc) Pick(req *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
	return f(req, rs)
}
