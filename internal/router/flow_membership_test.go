package router

import (
	"errors"
	"strings"
	"testing"

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
