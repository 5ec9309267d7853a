package router

import (
	"fmt"
	"slices"
)

// Membership: replicas join and leave while the router routes (a
// replicas file, DNS, Kubernetes). The router's slots are append-only: a
// new replica takes a new slot, so it starts cold (its index row, its
// policy state and its counters are new) without touching the others',
// and a slot number held anywhere (a ticket, a policy's per-slot state,
// the index, a peer gateway's decision mapped by name) keeps naming the
// same replica. A removed replica keeps its slot: it is never a candidate
// again, its requests in flight finish (drain), and when its name comes
// back (a flapping DNS answer, a pod that was briefly not ready) it is
// revived with everything the router knew of it. The cost of a slot that
// never comes back is one unhealthy view per decision.

// members is one snapshot of the membership.
type members struct {
	replicas []*Replica
	byName   map[string]int
}

func (m *members) add(r *Replica) {
	m.byName[r.name] = len(m.replicas)
	m.replicas = append(m.replicas, r)
}

// reps is the current snapshot's replicas (do not modify).
func (rt *Router) reps() []*Replica { return rt.mem.Load().replicas }

// Name is the target's name: its URL, or URL#k for rank k of a
// data-parallel server.
func (sp Spec) Name() string {
	if sp.Ranked {
		return fmt.Sprintf("%s#%d", sp.URL, sp.Rank)
	}
	return sp.URL
}

func (rt *Router) newReplica(slot int, sp Spec) *Replica {
	r := &Replica{index: slot, name: sp.Name(), healthOK: true}
	r.spec.Store(&sp)
	r.healthy.Store(true)
	r.Breaker.Configure(rt.cfg.Breaker)
	return r
}

// sp is the replica's current spec.
func (r *Replica) sp() *Spec { return r.spec.Load() }

// Removed reports whether a discovery source removed the replica (it may
// still be draining).
func (r *Replica) Removed() bool { return r.removed.Load() }

// Draining reports whether the replica was removed and still has requests
// in flight.
func (r *Replica) Draining() bool { return r.removed.Load() && r.inFlight.Load() > 0 }

// Change is what SetReplicas did, by slot.
type Change struct {
	Added   []int // new slots: cold replicas
	Revived []int // removed replicas listed again, with their state
	Removed []int // no new requests; in flight ones drain
	// Drained are the removed replicas that had nothing in flight: done
	// at once (OnDrained is not called for them).
	Drained []int
	Updated []int // listed with another key, role or KV-event endpoint
}

// Empty reports whether nothing changed.
func (c Change) Empty() bool {
	return len(c.Added)+len(c.Revived)+len(c.Removed)+len(c.Updated) == 0
}

// SetReplicas makes specs the router's replicas (targets, by Spec.Name):
// new names are added cold, names gone are removed (draining), removed
// names listed again are revived, and a listed name whose spec changed
// takes the new one (its state kept). Routing goes on meanwhile: it reads
// the snapshot published here. A spec listed twice is an error, and
// nothing changes.
func (rt *Router) SetReplicas(specs []Spec) (Change, error) {
	want := make(map[string]Spec, len(specs))
	for _, sp := range specs {
		if _, dup := want[sp.Name()]; dup {
			return Change{}, fmt.Errorf("router: replica %s listed twice", sp.Name())
		}
		if err := rt.checkPool(sp); err != nil {
			return Change{}, err
		}
		want[sp.Name()] = sp
	}
	rt.memMu.Lock()
	defer rt.memMu.Unlock()
	old := rt.mem.Load()
	var ch Change
	for i, r := range old.replicas {
		sp, listed := want[r.name]
		switch {
		case !listed && !r.removed.Load():
			ch.Removed = append(ch.Removed, i)
		case listed && r.removed.Load():
			ch.Revived = append(ch.Revived, i)
		}
		if listed && *r.sp() != sp {
			ch.Updated = append(ch.Updated, i)
			r.spec.Store(&sp)
		}
	}
	next := &members{replicas: slices.Clone(old.replicas), byName: old.byName}
	for _, sp := range specs {
		if _, known := old.byName[sp.Name()]; known {
			continue
		}
		if len(ch.Added) == 0 {
			next.byName = make(map[string]int, len(old.byName)+1)
			for k, v := range old.byName {
				next.byName[k] = v
			}
		}
		ch.Added = append(ch.Added, len(next.replicas))
		next.add(rt.newReplica(len(next.replicas), sp))
	}
	if len(ch.Added) > 0 {
		// The indexes grow before the snapshot that names the new slots.
		rt.approx.SetReplicas(len(next.replicas))
		if rt.precise != nil {
			rt.precise.Index().SetReplicas(len(next.replicas))
		}
		rt.mem.Store(next)
	}
	for _, i := range ch.Revived {
		old.replicas[i].draining.Store(false)
		old.replicas[i].removed.Store(false)
	}
	for _, i := range ch.Removed {
		r := old.replicas[i]
		r.draining.Store(true)
		r.removed.Store(true)
		if r.inFlight.Load() == 0 && r.draining.CompareAndSwap(true, false) {
			ch.Drained = append(ch.Drained, i)
		}
	}
	// A queue waiting on replicas that left (or for ones that came) moves.
	rt.releaseIfQueued()
	return ch, nil
}

// drained reports (once per removal) that a removed replica's last
// request in flight ended.
func (rt *Router) drained(r *Replica) {
	if r.draining.CompareAndSwap(true, false) && rt.cfg.OnDrained != nil {
		rt.cfg.OnDrained(r.index)
	}
}

// SetBreaker configures every replica's circuit breaker, and those of
// the replicas added from now on (a configuration reload).
func (rt *Router) SetBreaker(c BreakerConfig) {
	rt.memMu.Lock()
	defer rt.memMu.Unlock()
	rt.cfg.Breaker = c
	for _, r := range rt.reps() {
		r.Breaker.Configure(c)
	}
}

// Active is the number of replicas not removed.
func (rt *Router) Active() int {
	n := 0
	for _, r := range rt.reps() {
		if !r.removed.Load() {
			n++
		}
	}
	return n
}
