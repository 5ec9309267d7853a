package router

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// The queue moves when the fleet grows: a replica coming back in rotation
// (its health check passes, SetHealthy) or added (SetReplicas) takes the
// requests waiting at once, not at the next first token, end or scrape,
// which an idle fleet never sends.
func TestFlowReleasedWhenReplicaBackOrAdded(t *testing.T) {
	cases := []struct {
		name string
		n    int // replicas at the start
		down bool
		grow func(fr *flowRig)
	}{
		{"SetHealthy", 2, true, func(fr *flowRig) { fr.rt.SetHealthy(1, true) }},
		{"health check passes", 2, true, func(fr *flowRig) { fr.rt.Replica(1).SetHealthOK(true, fr.now) }},
		{"SetReplicas adds", 1, false, func(fr *flowRig) {
			if _, err := fr.rt.SetReplicas(specs("r0", "r1")); err != nil {
				fr.t.Fatal(err)
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fr := newFlowRig(t, c.n, tightFlow())
			if c.down {
				fr.rt.Replica(1).SetHealthOK(false, fr.now)
			}
			mustSubmit(t, fr, "a1", "A", 0, 100) // r0, saturated now
			w := mustSubmit(t, fr, "a2", "A", 0, 100)
			if w == nil || fr.rt.Queued() != 1 {
				t.Fatalf("a2 should wait for room: released %q", fr.order())
			}
			c.grow(fr)
			if tk := fr.tickets["a2"]; tk == nil || tk.Replica != 1 || fr.rt.Queued() != 0 {
				t.Fatalf("r1 joined with room, a2 still waits: released %q, %d waiting", fr.order(), fr.rt.Queued())
			}
		})
	}
}

// In the gateway a replica added is a candidate once its models are
// listed (its first health check passes: Replica.SetServed), while a
// listed one may take the request: the listing moves the queue too.
// Added and listed, r1 waited for the next scrape.
func TestFlowReleasedWhenAddedReplicaListed(t *testing.T) {
	fr := newFlowRig(t, 1, tightFlow())
	served := NewServed([]Model{{ID: "m", Root: "m"}}, nil)
	fr.rt.Replica(0).SetServed(served)
	mustSubmit(t, fr, "a1", "A", 0, 100) // r0, saturated now
	mustSubmit(t, fr, "a2", "A", 0, 100)
	if _, err := fr.rt.SetReplicas(specs("r0", "r1")); err != nil {
		t.Fatal(err)
	}
	if fr.rt.Queued() != 1 {
		t.Fatalf("r1, not listed yet, took a2 while r0 serves the model: released %q", fr.order())
	}
	fr.rt.Replica(1).SetServed(served)
	if tk := fr.tickets["a2"]; tk == nil || tk.Replica != 1 || fr.rt.Queued() != 0 {
		t.Fatalf("r1 listed with room, a2 still waits: released %q, %d waiting", fr.order(), fr.rt.Queued())
	}
}

// A request held for replicas that are then removed is never left waiting
// on them: it goes to another replica that may take it, or, when none may
// (a retry that excluded the rest), leaves the queue with
// policy.ErrNoReplica at once, not at its TTL.
func TestFlowHeldForRemovedReplica(t *testing.T) {
	for _, replace := range []bool{false, true} {
		fr := newFlowRig(t, 2, tightFlow())
		mustSubmit(t, fr, "a1", "A", 0, 100) // r0
		mustSubmit(t, fr, "a2", "A", 0, 100) // r1: both saturated
		req := fr.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: "retry " + strings.Repeat("abcd", 100), Prompts: 1, MaxTokens: 10}, "", "")
		tk, x, err := fr.rt.Submit(req, 0) // a retry that failed on r0: r1 alone
		if err != nil || tk != nil || x == nil {
			t.Fatalf("the retry should wait for r1: %v %v %v", tk, x, err)
		}
		list := specs("r0")
		if replace {
			list = specs("r0", "r2")
		}
		if _, err := fr.rt.SetReplicas(list); err != nil {
			t.Fatal(err)
		}
		select {
		case <-x.Done():
		default:
			t.Fatalf("replace %v: the retry still waits for r1, removed", replace)
		}
		tk, err = x.Result()
		switch {
		case replace && (err != nil || tk.Replica != 2):
			t.Fatalf("the retry should go to r2, added: %v %v", tk, err)
		case !replace && !errors.Is(err, policy.ErrNoReplica):
			t.Fatalf("the retry, with no replica left to take it: %v %v; want ErrNoReplica", tk, err)
		}
		if fr.rt.Queued() != 0 {
			t.Fatalf("%d still waiting", fr.rt.Queued())
		}
	}
}

// The estimate of a request's wait counts the work ahead of it on the
// replicas it may use, not that of requests held for their own replicas
// alone (an adapter on r0 only, while r0 is saturated): those wait for r0
// whatever the queue does, and the request behind them goes to r1 as soon
// as it has room. Their work counted, a request of a band with a 5 s TTL
// was shed at once for the ~20 s of a more urgent band's adapter prompts
// held for r0.
func TestFlowEstimateLeavesOutHeldAlone(t *testing.T) {
	fc := FlowConfig{Saturation: SaturationRule{QueueMs: 1}, Bands: []Band{{Priority: 1, TTL: 5 * time.Second}}}
	fr := newFlowRig(t, 2, fc)
	fr.rt.Replica(0).SetServed(NewServed([]Model{{ID: "m", Root: "m"}, {ID: "lora", Parent: "m"}}, nil))
	fr.rt.Replica(1).SetServed(NewServed([]Model{{ID: "m", Root: "m"}}, nil))
	// The drain rate: a request of ~1,010 tokens' work leaves per second.
	for i := 1; i <= 6; i++ {
		mustSubmit(t, fr, fmt.Sprintf("a%d", i), "A", 0, 1000)
	}
	for i := 1; i <= 4; i++ {
		fr.now = fr.now.Add(time.Second)
		fr.first(fmt.Sprintf("a%d", i))
	}
	if fl := fr.rt.pools[0].q.fl; fr.rt.Queued() != 0 || fl.rate < 900 || fl.rate > 1100 {
		t.Fatalf("setup: %d waiting, drain rate %g; want none waiting, ~1,010/s", fr.rt.Queued(), fl.rate)
	}
	// a5 on r0, a6 on r1: both saturated. Two adapter requests of 10,000
	// tokens wait for r0, held alone once r1 has room (a6's first token).
	lora := func(name string, prio int) error {
		text := name + " " + strings.Repeat("abcd", 10000)
		req := fr.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "lora", Text: text, Prompts: 1, MaxTokens: 10}, "", "")
		req.Tenant, req.Priority = "L", prio
		tk, w, err := fr.rt.Submit(req)
		if err == nil && (tk != nil || w == nil) {
			t.Fatalf("%s should wait for r0: %v %v", name, tk, w)
		}
		return err
	}
	for _, n := range []string{"lora1", "lora2"} {
		if err := lora(n, 0); err != nil {
			t.Fatal(err)
		}
	}
	fr.first("a6")
	// Held for r0 alone, another adapter request still counts the work
	// held there ahead of it.
	if err := lora("lora3", 1); reason(err) != ShedTTL {
		t.Fatalf("lora3, ~20 s of work ahead of it on r0 and a 5 s TTL: %v; want shed (ttl)", err)
	}
	mustSubmit(t, fr, "b1", "B", 1, 100) // r1, saturated again
	if tk := fr.tickets["b1"]; tk == nil || tk.Replica != 1 {
		t.Fatalf("b1 should go to r1: released %q", fr.order())
	}
	if _, err := fr.submit("b2", "B", 1, 100); err != nil {
		t.Fatalf("b2, ~0.1 s of work ahead of it on r1, was refused for the adapter's work held for r0: %v", err)
	}
	fr.first("b1")
	if tk := fr.tickets["b2"]; tk == nil || tk.Replica != 1 {
		t.Fatalf("b2 should go to r1 once it has room: released %q", fr.order())
	}
}
