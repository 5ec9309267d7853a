package router

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

func specs(urls ...string) []Spec {
	out := make([]Spec, len(urls))
	for i, u := range urls {
		out[i] = Spec{URL: u}
	}
	return out
}

// routeN routes n requests for text and returns the replicas chosen, each
// ticket left open.
func routeN(t *testing.T, rt *Router, text string, n int) ([]int, []*Ticket) {
	t.Helper()
	var got []int
	var tks []*Ticket
	for range n {
		tk, err := rt.Route(rt.Prepare(parse(t, text), "", ""))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, tk.Replica)
		tks = append(tks, tk)
	}
	return got, tks
}

func TestSetReplicasAddsColdAndKeepsTheOthers(t *testing.T) {
	rt := newRouter(t, "ttft", 2)
	long := strings.Repeat("a shared system prompt ", 40)
	_, tks := routeN(t, rt, long, 1)
	held := tks[0].Replica
	before := rt.Index().ReplicaLen(held)
	if before == 0 {
		t.Fatal("the index learnt nothing")
	}
	ch, err := rt.SetReplicas(specs("http://ra", "http://rb", "http://rc"))
	if err != nil {
		t.Fatal(err)
	}
	if len(ch.Added) != 1 || ch.Added[0] != 2 || len(ch.Removed)+len(ch.Revived)+len(ch.Updated) != 0 {
		t.Fatalf("change %+v, want slot 2 added", ch)
	}
	if rt.Replicas() != 3 || rt.Name(2) != "http://rc" || rt.Index().ReplicaLen(2) != 0 {
		t.Fatalf("replicas %d, name %q, new index %d: want 3, http://rc, cold", rt.Replicas(), rt.Name(2), rt.Index().ReplicaLen(2))
	}
	if rt.Index().ReplicaLen(held) != before {
		t.Fatalf("the other replica's index changed: %d → %d", before, rt.Index().ReplicaLen(held))
	}
	views := rt.Views(rt.Prepare(parse(t, long), "", ""))
	if len(views) != 3 || views[held].Match == 0 || views[2].Match != 0 || !views[2].Healthy {
		t.Fatalf("views after the add: %+v", views)
	}
	// The new replica takes work: least_load sends there while it is emptiest.
	ll, _ := policy.New("least_load", policy.Options{Seed: 1})
	rt.SetPolicy(ll)
	got, _ := routeN(t, rt, "x", 3)
	if !containsInt(got, 2) {
		t.Fatalf("routed to %v: the added replica never chosen", got)
	}
}

func containsInt(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func TestSetReplicasRemoveDrainsAndRevives(t *testing.T) {
	var drained []int
	var mu sync.Mutex
	p, _ := policy.New("least_load", policy.Options{Seed: 1})
	now := time.Unix(0, 0)
	rt, err := New(Config{Replicas: []string{"http://ra", "http://rb"}, Policy: p, Now: func() time.Time { return now },
		OnDrained: func(i int) { mu.Lock(); drained = append(drained, i); mu.Unlock() }})
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("held by rb ", 50)
	tk, err := rt.Route(rt.Prepare(parse(t, long), "", ""), 0) // rb, held open: a stream
	if err != nil || tk.Replica != 1 {
		t.Fatalf("routed to %v, %v", tk, err)
	}
	held := rt.Index().ReplicaLen(1)
	ch, err := rt.SetReplicas(specs("http://ra"))
	if err != nil || len(ch.Removed) != 1 || ch.Removed[0] != 1 {
		t.Fatalf("change %+v, %v: want slot 1 removed", ch, err)
	}
	if !rt.Replica(1).Removed() || !rt.Replica(1).Draining() || rt.Active() != 1 {
		t.Fatal("the removed replica is not draining")
	}
	got, tks := routeN(t, rt, long, 5)
	for _, r := range got {
		if r != 0 {
			t.Fatalf("routed to %v after rb was removed", got)
		}
	}
	if _, err := rt.Route(rt.Prepare(parse(t, "y"), "", ""), 0); err == nil {
		t.Fatal("the removed replica was a candidate")
	}
	mu.Lock()
	if len(drained) != 0 {
		t.Fatalf("drained %v while a request is in flight", drained)
	}
	mu.Unlock()
	tk.Done(now, Outcome{CachedTokens: -1})
	for _, x := range tks {
		x.Done(now, Outcome{CachedTokens: -1})
	}
	mu.Lock()
	if len(drained) != 1 || drained[0] != 1 {
		t.Fatalf("drained %v, want [1] once", drained)
	}
	mu.Unlock()
	if rt.Replica(1).Draining() {
		t.Fatal("still draining with nothing in flight")
	}
	// Listed again: revived with its index.
	ch, _ = rt.SetReplicas(specs("http://ra", "http://rb"))
	if len(ch.Revived) != 1 || ch.Revived[0] != 1 || len(ch.Added) != 0 || rt.Replicas() != 2 {
		t.Fatalf("change %+v with %d slots: want slot 1 revived, no new slot", ch, rt.Replicas())
	}
	if rt.Replica(1).Removed() || rt.Index().ReplicaLen(1) != held {
		t.Fatalf("revived replica: removed %v, index %d (was %d)", rt.Replica(1).Removed(), rt.Index().ReplicaLen(1), held)
	}
	if _, err := rt.Route(rt.Prepare(parse(t, "y"), "", ""), 0); err != nil {
		t.Fatalf("the revived replica is no candidate: %v", err)
	}
}

func TestSetReplicasRemovedIdleDrainsAtOnceAndUpdates(t *testing.T) {
	var drained atomic.Int64
	p, _ := policy.New("round_robin", policy.Options{Seed: 1})
	rt, err := New(Config{Specs: specs("http://ra", "http://rb"), Policy: p, OnDrained: func(int) { drained.Add(1) }})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rt.SetReplicas(specs("http://ra", "http://ra")); err == nil || rt.Active() != 2 {
		t.Fatal("a replica listed twice was taken")
	}
	ch, err := rt.SetReplicas([]Spec{{URL: "http://ra", Role: policy.RoleDecode}})
	if err != nil || len(ch.Drained) != 1 || ch.Drained[0] != 1 || len(ch.Updated) != 1 {
		t.Fatalf("change %+v, %v: want rb removed and drained at once, ra updated", ch, err)
	}
	if drained.Load() != 0 {
		t.Fatalf("OnDrained called %d times for a replica drained at once", drained.Load())
	}
	if rt.Replica(0).Role() != policy.RoleDecode {
		t.Fatal("the updated spec's role was not taken")
	}
	if !rt.Disaggregated() {
		t.Fatal("a decode replica makes the fleet disaggregated")
	}
	if rt.Serves("m") != true {
		t.Fatal("the remaining replica serves (not listed yet)")
	}
	rt.Replica(0).SetServed(NewServed([]Model{{ID: "m"}}, nil))
	rt.Replica(1).SetServed(NewServed([]Model{{ID: "other"}}, nil))
	if rt.Serves("other") {
		t.Fatal("a removed replica's model counts as served")
	}
}

// TestSetReplicasWhileRouting routes from several goroutines while the
// membership changes (run with -race): every ticket's counters go back to
// zero on the replica it counted on.
func TestSetReplicasWhileRouting(t *testing.T) {
	rt := newRouter(t, "ttft", 2)
	lists := [][]Spec{specs("http://ra", "http://rb", "http://rc"), specs("http://rc"), specs("http://ra", "http://rd"), specs("http://ra", "http://rb")}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() {
			for i := 0; i < 2000; i++ {
				select {
				case <-stop:
					return
				default:
				}
				tk, err := rt.Route(rt.Prepare(parse(t, strings.Repeat("w", 40*(i%7+w))), "", ""))
				if err != nil {
					continue // a moment with every listed replica just added is fine; errors are not counted
				}
				tk.Accept()
				tk.FirstToken(time.Unix(1, 0))
				tk.Done(time.Unix(2, 0), Outcome{CachedTokens: -1})
			}
		})
	}
	for i := range 200 {
		if _, err := rt.SetReplicas(lists[i%len(lists)]); err != nil {
			t.Error(err)
		}
	}
	close(stop)
	wg.Wait()
	if rt.Replicas() != 4 {
		t.Fatalf("%d slots, want 4 (ra, rb, rc, rd: append-only)", rt.Replicas())
	}
	for i, r := range rt.reps() {
		if r.inFlight.Load() != 0 || r.pendingCount.Load() != 0 || r.inFlightTokens.Load() != 0 {
			t.Fatalf("replica %d counters not zero", i)
		}
	}
}
