package router

import (
	"fmt"
	"slices"
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

// Replicas added and removed one by one, 5,000 times, with the clock
// moving two minutes each time (finding 11): the removed ones are
// forgotten once drained and past forget_after (default 5 min), so the
// slot table and the index stay bounded by the replicas known at once
// instead of growing by every replica ever seen (base: 5,001 slots).
func TestChurnKeepsSlotsAndIndexBounded(t *testing.T) {
	for _, pol := range []string{"ttft", "sglang", "preble", "dynamo", "llmd", "lru_affinity", "least_load"} {
		t.Run(pol, func(t *testing.T) {
			p, _ := policy.New(pol, policy.Options{Seed: 1})
			now := time.Unix(0, 0)
			rt, err := New(Config{Replicas: []string{"http://base"}, Policy: p, Now: func() time.Time { return now }, Dynamic: true})
			if err != nil {
				t.Fatal(err)
			}
			maxSlots, maxEntries, blocks := 0, 0, 0
			for k := range 5000 {
				name := fmt.Sprintf("http://r%d", k)
				ch, err := rt.SetReplicas(specs("http://base", name))
				if err != nil || len(ch.Added) != 1 {
					t.Fatalf("add %d: %+v %v", k, ch, err)
				}
				// A request each, so that the replica has index rows and policy state.
				req := rt.Prepare(parse(t, fmt.Sprintf("conversation %d ", k)+strings.Repeat("w", 300)), "", "")
				blocks = max(blocks, len(req.Blocks))
				tk, err := rt.Route(req, 0)
				if err != nil {
					t.Fatal(err)
				}
				tk.FirstToken(now)
				tk.Done(now, Outcome{CachedTokens: -1, OutputTokens: 16})
				if _, err := rt.SetReplicas(specs("http://base")); err != nil {
					t.Fatal(err)
				}
				now = now.Add(2 * time.Minute)
				maxSlots, maxEntries = max(maxSlots, rt.Replicas()), max(maxEntries, rt.Index().Len())
			}
			// Active base, the one just added and the ones removed within 5 min.
			if maxSlots > 5 {
				t.Fatalf("%d slots after 5,000 replicas added and removed: want at most 5", maxSlots)
			}
			// Each request's blocks are learnt on its replica: a few replicas' worth, not 5,000.
			if blocks == 0 || maxEntries > 5*blocks || rt.Index().Blocks() > 5*blocks {
				t.Fatalf("index entries up to %d, blocks %d: the forgotten replicas' rows were kept", maxEntries, rt.Index().Blocks())
			}
		})
	}
}

// forgetSpy is least_load that records the slots it was told to forget.
type forgetSpy struct {
	policy.Policy
	mu     sync.Mutex
	forgot []int
}

func (s *forgetSpy) Forget(slot int) { s.mu.Lock(); s.forgot = append(s.forgot, slot); s.mu.Unlock() }

// A removed replica is forgotten only once drained and removed for
// ForgetAfter; its slot then goes to the next replica added, cold (the
// policy forgot the slot first); one listed again within ForgetAfter is
// revived in its slot with its state.
func TestForgetAfterDrainAndTTLThenReuse(t *testing.T) {
	ll, _ := policy.New("least_load", policy.Options{Seed: 1})
	spy := &forgetSpy{Policy: ll}
	now := time.Unix(0, 0)
	rt, err := New(Config{Replicas: []string{"http://ra", "http://rb", "http://rc"}, Policy: spy,
		Now: func() time.Time { return now }, ForgetAfter: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	long := strings.Repeat("held by rb ", 50)
	tk, err := rt.Route(rt.Prepare(parse(t, long), "", ""), 0, 2) // rb, held open
	if err != nil || tk.Replica != 1 {
		t.Fatalf("routed to %v, %v", tk, err)
	}
	tk.Accept()
	rt.SetMetrics(1, Metrics{Waiting: 3}, now)
	if _, err := rt.SetReplicas(specs("http://ra", "http://rc")); err != nil {
		t.Fatal(err)
	}
	now = now.Add(10 * time.Minute)
	if got := rt.Forget(); len(got) != 0 || rt.Vacant() != 0 {
		t.Fatalf("forgot %+v with a request in flight", got)
	}
	tk.Done(now, Outcome{CachedTokens: -1})
	got := rt.Forget()
	if len(got) != 1 || got[0] != (Forgotten{Slot: 1, Name: "http://rb", URL: "http://rb"}) || rt.Vacant() != 1 {
		t.Fatalf("forgot %+v, %d vacant: want rb's slot 1", got, rt.Vacant())
	}
	if _, ok := rt.Lookup("http://rb"); ok || !rt.Replica(1).Vacant() || rt.Index().ReplicaLen(1) != 0 || rt.Replicas() != 3 {
		t.Fatalf("slot 1 after the forget: vacant %v, index %d", rt.Replica(1).Vacant(), rt.Index().ReplicaLen(1))
	}
	if !slices.Equal(spy.forgot, []int{1}) {
		t.Fatalf("the policy forgot slots %v, want [1]", spy.forgot)
	}
	if _, err := rt.Route(rt.Prepare(parse(t, "y"), "", ""), 0, 2); err == nil {
		t.Fatal("a vacant slot was a candidate")
	}
	// rc removed; listed again within a minute: revived in its slot.
	rt.SetMetrics(2, Metrics{Waiting: 7}, now)
	if _, err := rt.SetReplicas(specs("http://ra")); err != nil {
		t.Fatal(err)
	}
	now = now.Add(59 * time.Second)
	ch, err := rt.SetReplicas(specs("http://ra", "http://rc", "http://rd"))
	if err != nil || !slices.Equal(ch.Revived, []int{2}) || !slices.Equal(ch.Added, []int{1}) || len(ch.Forgotten) != 0 {
		t.Fatalf("change %+v, %v: want rc revived in 2, rd added in 1", ch, err)
	}
	if m, _, ok := rt.ReplicaMetrics(2); !ok || m.Waiting != 7 {
		t.Fatal("the revived replica lost its state")
	}
	if _, _, ok := rt.ReplicaMetrics(1); ok || rt.Name(1) != "http://rd" || rt.InFlight(1) != 0 || rt.Replica(1).Vacant() {
		t.Fatal("the replica in the reused slot is not cold")
	}
	if rt.Replicas() != 3 || rt.Vacant() != 0 {
		t.Fatalf("%d slots, %d vacant: the freed slot was not reused", rt.Replicas(), rt.Vacant())
	}
}
