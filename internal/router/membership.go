package router

import (
	"fmt"
	"maps"
	"slices"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

// Membership: replicas join and leave while the router routes (a
// replicas file, DNS, Kubernetes). A new replica takes a new slot (or a
// free one, below), so it starts cold (its index row, its policy state and
// its counters are new) without touching the others', and a slot number
// held anywhere (a ticket, a policy's per-slot state, the index, a peer
// gateway's decision mapped by name) keeps naming the same replica while
// the replica is known. A removed replica keeps its slot for ForgetAfter:
// it is never a candidate again, its requests in flight finish (drain),
// and when its name comes back within that time (a flapping DNS answer, a
// pod that was briefly not ready) it is revived with everything the
// router knew of it.
//
// Then it is forgotten (Forget, and every SetReplicas): once drained and
// removed for ForgetAfter, its slot becomes vacant and its state is freed
// (its rows of both indexes, each policy's state for the slot through
// policy.Forgetter, its counters, scrapes and breaker with its Replica);
// the gateway frees its own (metric series, fleet and KV-event state) from
// the Forgotten list. The next replica added takes the lowest vacant slot,
// cold. So the slot table, and the views every decision builds over it,
// are bounded by the most replicas known at once (active, or removed
// within ForgetAfter), not by every replica ever seen: 5,000 replicas
// added and removed one by one, two minutes apart, leave 4 slots, not
// 5,001 (and a decision over them takes 4 µs, not 1.1 ms).
//
// Slots are reused rather than numbered anew because every decision builds
// one view per slot (ReplicaView.Index is the slot, Decision.Replica
// indexes the views): a slot space that only grows would make each
// decision pay for every replica ever seen. Reuse is safe because nothing
// refers to a forgotten slot: its replica had nothing in flight (no
// ticket), its name left the name map (peer decisions and KV-event topics
// resolve names), and policies dropped its state before the slot is
// given again (the router serialises both under memMu). One window is
// left: a request that read the snapshot before the removal and commits
// more than ForgetAfter later (a goroutine descheduled for minutes) counts
// on the forgotten Replica and may teach the index and its policy one
// request about the slot's next replica.

// DefaultForgetAfter is Config.ForgetAfter's default: long enough for a
// rolling restart's pod to come back with its state, short enough that a
// fleet churning all day keeps few dead slots.
const DefaultForgetAfter = 5 * time.Minute

// Forgotten is a replica the router forgot: its former slot, now vacant
// (the next replica added takes it), and its name and URL, whose state
// elsewhere (metrics, logs, probes) the caller frees.
type Forgotten struct {
	Slot      int
	Name, URL string
}

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
	r := &Replica{index: slot, name: sp.Name(), healthOK: true, serial: rt.serials.Add(1), back: rt.releaseIfQueued}
	r.spec.Store(&sp)
	r.healthy.Store(true)
	r.Breaker.Configure(rt.cfg.Breaker)
	return r
}

// vacantReplica is a free slot's placeholder: removed, unhealthy, no name,
// no state; never a candidate, skipped wherever removed replicas are.
func (rt *Router) vacantReplica(slot int) *Replica {
	r := &Replica{index: slot, vacant: true}
	r.spec.Store(&Spec{})
	r.removed.Store(true)
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
	// Forgotten are the replicas forgotten before the change (removed for
	// ForgetAfter and drained): their slots may be among Added.
	Forgotten []Forgotten
}

// Empty reports whether nothing changed.
func (c Change) Empty() bool {
	return len(c.Added)+len(c.Revived)+len(c.Removed)+len(c.Updated) == 0
}

// SetReplicas makes specs the router's replicas (targets, by Spec.Name):
// new names are added cold (in the lowest vacant slot, else a new one),
// names gone are removed (draining), removed names listed again are
// revived, and a listed name whose spec changed takes the new one (its
// state kept). The replicas due to be forgotten are forgotten first
// (Change.Forgotten). Routing goes on meanwhile: it reads the snapshot
// published here. A spec listed twice is an error, and nothing changes.
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
	now := rt.cfg.Now()
	ch := Change{Forgotten: rt.forgetLocked(now)}
	old := rt.mem.Load()
	for i, r := range old.replicas {
		sp, listed := want[r.name]
		switch {
		case r.vacant:
			continue
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
	rt.addLocked(old, specs, &ch)
	for _, i := range ch.Revived {
		old.replicas[i].draining.Store(false)
		old.replicas[i].removed.Store(false)
	}
	for _, i := range ch.Removed {
		r := old.replicas[i]
		r.removedAt = now
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

// addLocked adds the specs whose names old does not know, each in the
// lowest vacant slot or a new one, and publishes the snapshot naming them
// (memMu held).
func (rt *Router) addLocked(old *members, specs []Spec, ch *Change) {
	var next *members
	for _, sp := range specs {
		if _, known := old.byName[sp.Name()]; known {
			continue
		}
		if next == nil {
			next = &members{replicas: slices.Clone(old.replicas), byName: maps.Clone(old.byName)}
		}
		slot := len(next.replicas)
		if len(rt.free) > 0 {
			slot, rt.free = rt.free[0], rt.free[1:]
			next.replicas[slot] = rt.newReplica(slot, sp)
			next.byName[sp.Name()] = slot
		} else {
			next.add(rt.newReplica(slot, sp))
		}
		ch.Added = append(ch.Added, slot)
	}
	if next == nil {
		return
	}
	// The indexes grow before the snapshot that names the new slots.
	rt.approx.SetReplicas(len(next.replicas))
	if rt.precise != nil {
		rt.precise.Index().SetReplicas(len(next.replicas))
	}
	for _, ix := range rt.hostIndexes() {
		ix.SetReplicas(len(next.replicas))
	}
	rt.mem.Store(next)
}

// Forget forgets the replicas removed at least ForgetAfter ago that have
// nothing in flight (see Membership above) and returns them; the caller
// frees what it keeps of them. SetReplicas does it too: Forget is for a
// fleet that stopped changing.
func (rt *Router) Forget() []Forgotten {
	rt.memMu.Lock()
	defer rt.memMu.Unlock()
	return rt.forgetLocked(rt.cfg.Now())
}

// forgetLocked forgets the replicas due at now (memMu held): a new
// snapshot with their slots vacant and their names gone, then their rows
// of the indexes and their policies' state dropped.
func (rt *Router) forgetLocked(now time.Time) []Forgotten {
	old := rt.mem.Load()
	var gone []Forgotten
	for i, r := range old.replicas {
		if !r.vacant && r.removed.Load() && r.inFlight.Load() == 0 && now.Sub(r.removedAt) >= rt.cfg.ForgetAfter {
			gone = append(gone, Forgotten{Slot: i, Name: r.name, URL: r.URL()})
		}
	}
	if len(gone) == 0 {
		return nil
	}
	next := &members{replicas: slices.Clone(old.replicas), byName: maps.Clone(old.byName)}
	for _, f := range gone {
		delete(next.byName, f.Name)
		next.replicas[f.Slot] = rt.vacantReplica(f.Slot)
		rt.free = append(rt.free, f.Slot)
	}
	slices.Sort(rt.free)
	rt.mem.Store(next)
	for _, f := range gone {
		_ = rt.approx.Forget(f.Slot)
		if rt.approxHost != nil {
			_ = rt.approxHost.Forget(f.Slot)
		}
		if rt.precise != nil {
			_ = rt.precise.Forget(f.Slot) // both tiers
		}
		rt.forgetPolicies(f.Slot)
	}
	return gone
}

// forgetPolicies drops slot's state in every policy routing (the default
// one and each pool's) that keeps state per slot.
func (rt *Router) forgetPolicies(slot int) {
	holders := []*atomic.Pointer[policies]{&rt.pol}
	for _, pl := range rt.pools {
		if !slices.Contains(holders, pl.pol) { // the default pool's is rt.pol
			holders = append(holders, pl.pol)
		}
	}
	for _, h := range holders {
		if f, ok := h.Load().pol.(policy.Forgetter); ok {
			f.Forget(slot)
		}
	}
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

// Vacant is the number of free slots (forgotten replicas'), which the next
// replicas added take.
func (rt *Router) Vacant() int {
	rt.memMu.Lock()
	defer rt.memMu.Unlock()
	return len(rt.free)
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
