package router

import (
	"cmp"
	"container/heap"
	"slices"
	"time"
)

// The queue's structure (flow.go says the order): bands by priority, in
// each the tenants with requests waiting, in each a heap. Every method
// runs with the queue's mutex held.

// setExpiry gives w, from now, its band's TTL or its deadline, whichever
// comes first, unless it has one already: a new program held for room
// waits under the expiry it got when first held, through the queue and
// back (programs_admit.go), never a new TTL at each trip.
func (f *flow) setExpiry(w *Waiting, now time.Time) {
	if !w.expires.IsZero() {
		return
	}
	req := w.req
	w.expires = now.Add(f.cfg.band(req.Priority).TTL)
	if !req.Deadline.IsZero() && req.Deadline.Before(w.expires) {
		w.expires = req.Deadline
	}
	w.deadline = !req.Deadline.IsZero()
	w.due = w.expires
}

// admit puts w in the queue at now, or refuses it. With flow control its
// band bounds it: a sheddable band's request is refused (the pool is
// saturated: it would wait), a full band refuses it, a request whose
// estimated wait passes its expiry is shed now, and a full pool displaces
// the newest request of the least urgent band below it (returned, to be
// told once the mutex is released) or refuses it.
func (q *queue) admit(w *Waiting, now time.Time) ([]*Waiting, error) {
	q.seq++
	w.seq, w.enqueued = q.seq, now
	w.ready = now.Add(time.Duration(w.prefillMs * float64(time.Millisecond))) // bounded by policy.QueuePrefillMs
	// Turn priority (Less): a new program's first turn goes after the
	// programs' next turns, unless it was already held for room (parked):
	// it has waited its turn once.
	w.newProgram = w.req.Program.ID != 0 && !w.req.Program.Continues && w.since.IsZero()
	f := q.fl
	if f == nil {
		q.push(w, 0, Band{}, q.solo)
		return nil, nil
	}
	req := w.req
	conf := f.cfg.band(req.Priority)
	ten := f.tenant(req.Tenant)
	w.work = float64(max(req.Tokens, 0)) + ten.expectedOutput(req.MaxTokens)
	f.setExpiry(w, now)
	// At most its tenant's whole queue ahead (a sum per tenant): the
	// Retry-After of a refusal, and enough to admit it by its expiry.
	ahead := q.ahead(w, ten, false)
	switch b := q.findBand(req.Priority); {
	case conf.Sheddable:
		return nil, shed(ShedSaturated, f.wait(ahead))
	case b != nil && b.n >= conf.MaxQueued:
		return nil, shed(ShedQueueFull, f.wait(ahead))
	}
	if wait, past := q.pastExpiry(w, ten, ahead, now); past {
		return nil, shed(q.expiryReason(w), wait)
	}
	if q.n == 0 {
		// The drain rate is measured from when requests start waiting.
		f.winStart, f.winWork = now, 0
	}
	var evicted []*Waiting
	if q.n >= f.cfg.MaxQueued {
		v := q.victim(req.Priority)
		if v == nil {
			return nil, shed(ShedQueueFull, f.wait(ahead))
		}
		q.remove(v)
		v.err = shed(ShedDisplaced, f.wait(q.totalWork()))
		evicted = append(evicted, v)
	}
	q.push(w, req.Priority, conf, ten)
	return evicted, nil
}

// pastExpiry reports whether w would wait past its expiry, and how long:
// bound (ahead's, not exact) admits it, else the exact estimate decides
// (ownAhead, one pass over its tenant's queue, paid only here).
func (q *queue) pastExpiry(w *Waiting, ten *tenant, bound float64, now time.Time) (time.Duration, bool) {
	past := func(work float64) (time.Duration, bool) {
		wait := q.fl.wait(work)
		return wait, wait > 0 && now.Add(wait).After(w.expires)
	}
	if _, ok := past(bound); !ok {
		return 0, false
	}
	return past(q.ahead(w, ten, true))
}

// push adds w to its band's tenant queue (both made when missing).
func (q *queue) push(w *Waiting, prio int, conf Band, ten *tenant) {
	b := q.findBand(prio)
	if b == nil {
		b = &band{prio: prio, conf: conf}
		i, _ := slices.BinarySearchFunc(q.bands, prio, func(x *band, p int) int { return cmp.Compare(x.prio, p) })
		q.bands = slices.Insert(q.bands, i, b)
	}
	var tq *tenantQ
	for _, x := range b.tenants {
		if x.t == ten {
			tq = x
			break
		}
	}
	if tq == nil {
		tq = &tenantQ{t: ten}
		b.tenants = append(b.tenants, tq)
	}
	heap.Push(&tq.h, w)
	w.bnd, w.tq = b, tq
	tq.work += w.work
	b.work += w.work
	b.n++
	q.n++
	if w.alone {
		q.countAlone(w, 1)
	}
	ten.queued++
	if q.fl != nil {
		q.fl.activate(ten)
	}
}

// findBand is priority p's band (nil: none waiting).
func (q *queue) findBand(p int) *band {
	i, ok := slices.BinarySearchFunc(q.bands, p, func(x *band, p int) int { return cmp.Compare(x.prio, p) })
	if !ok {
		return nil
	}
	return q.bands[i]
}

// head is the next request: of the most urgent band, the tenant with the
// least counter (ties by name), its first by rank, due time and arrival;
// requests set aside (setAside) are passed over. nil: none.
func (q *queue) head() *Waiting {
	for _, b := range q.bands {
		var best *tenantQ
		for _, tq := range b.tenants {
			if len(tq.h) > 0 && (best == nil || tq.t.vtime < best.t.vtime || tq.t.vtime == best.t.vtime && tq.t.name < best.t.name) {
				best = tq
			}
		}
		if best != nil {
			return best.h[0]
		}
	}
	return nil
}

// setAlone marks w held for its own candidates alone, or not.
func (q *queue) setAlone(w *Waiting, alone bool) {
	switch {
	case alone && !w.alone:
		q.countAlone(w, 1)
	case !alone && w.alone:
		q.countAlone(w, -1)
	}
	w.alone = alone
}

// countAlone counts w, held alone and waiting in q, in (sign 1) or out
// (-1) of the requests and work held alone.
func (q *queue) countAlone(w *Waiting, sign int) {
	q.alone += sign
	if w.tq != nil {
		w.tq.alone += float64(sign) * w.work
		w.bnd.alone += float64(sign) * w.work
	}
}

// setAside takes w out of its tenant's heap for the rest of one release,
// still counted as waiting (its tenant, band and queue), so that head
// passes over it; restore puts the requests set aside back.
func (q *queue) setAside(w *Waiting) { heap.Remove(&w.tq.h, w.idx) }

func (q *queue) restore(aside []*Waiting) {
	for _, w := range aside {
		heap.Push(&w.tq.h, w)
		if !slices.Contains(w.bnd.tenants, w.tq) { // its tenant's last other request left meanwhile
			w.bnd.tenants = append(w.bnd.tenants, w.tq)
		}
	}
}

// remove takes w out of the queue (it leaves: routed, shed or cancelled).
func (q *queue) remove(w *Waiting) {
	b, tq := w.bnd, w.tq
	heap.Remove(&tq.h, w.idx)
	if w.alone {
		q.countAlone(w, -1)
	}
	w.bnd, w.tq = nil, nil
	tq.work -= w.work
	b.work -= w.work
	b.n--
	q.n--
	tq.t.queued--
	if q.fl != nil {
		q.fl.deactivate(tq.t)
	}
	if len(tq.h) == 0 {
		b.tenants = slices.DeleteFunc(b.tenants, func(x *tenantQ) bool { return x == tq })
	}
	if b.n == 0 {
		q.bands = slices.DeleteFunc(q.bands, func(x *band) bool { return x == b })
	}
	if q.n == 0 && q.fl != nil {
		// The drain rate is measured while requests wait: an idle queue
		// must not dilute the next window.
		q.fl.winStart, q.fl.winWork = time.Time{}, 0
	}
}

// expiryReason is why w's wait ends at its expiry: its deadline, or its
// band's TTL.
func (q *queue) expiryReason(w *Waiting) string {
	if d := w.req.Deadline; !d.IsZero() && w.expires.Equal(d) {
		return ShedDeadline
	}
	return ShedTTL
}

// expiredErr is the error of w shed at its expiry.
func (q *queue) expiredErr(w *Waiting) error {
	var wait time.Duration
	if q.fl != nil {
		wait = q.fl.wait(q.totalWork())
	}
	return shed(q.expiryReason(w), wait)
}

// ahead is the work w waits for: every more urgent band's, and in its own
// band its tenant's and, of every other tenant, at most its weighted share
// of the same (generalized processor sharing: the others are served in
// proportion to their weights while w's tenant drains), plus w's own.
// Of its own tenant's, only the requests ordered before it (waitHeap.Less:
// a request with a deadline, a program's next turn or a short prompt goes
// before others that came earlier): counted whole, the tenant's queue shed
// a deadline request that would have gone first. The work of the requests
// held for their own candidates alone (errHeldAlone: a retry excluding a
// replica, an adapter on some replicas) is not ahead of a request that is
// not: they wait for their replicas
// while it goes to another with room (release passes over them). A
// request held alone itself counts it all, as it may wait behind them on
// its replicas (which replicas each waits for is not kept: an estimate
// too long sheds it early, one too short only at its expiry). With exact
// false it counts its tenant's whole queue in its band: a bound above the
// exact figure (every term grows with the tenant's), in time linear in
// the bands and tenants, where the exact one passes over the tenant's
// queue (up to its band's MaxQueued: ~75 µs at 5,000 under the queue's
// mutex, BenchmarkFlowAdmitFullBand).
func (q *queue) ahead(w *Waiting, ten *tenant, exact bool) float64 {
	work := func(total, alone float64) float64 {
		if w.alone {
			return total
		}
		return max(total-alone, 0)
	}
	sum := w.work
	for _, b := range q.bands {
		if b.prio < w.req.Priority {
			sum += work(b.work, b.alone)
			continue
		}
		if b.prio > w.req.Priority {
			break
		}
		own := 0.0
		for _, tq := range b.tenants {
			switch {
			case tq.t != ten:
			case exact:
				own = ownAhead(tq, w)
			default:
				own = work(tq.work, tq.alone)
			}
		}
		sum += own
		mine := w.work + own
		for _, tq := range b.tenants {
			if tq.t != ten {
				sum += min(work(tq.work, tq.alone), mine*tq.t.weight/ten.weight)
			}
		}
	}
	return sum
}

// ownAhead is the work of the requests of tq, w's own tenant's queue in
// its band, ordered before w; those held alone only when w is (ahead).
// One pass over the tenant's queue, bounded by the band's MaxQueued.
func ownAhead(tq *tenantQ, w *Waiting) float64 {
	s := 0.0
	for _, x := range tq.h {
		if (w.alone || !x.alone) && waitBefore(x, w) {
			s += x.work
		}
	}
	return s
}

// totalWork is the work waiting in every band.
func (q *queue) totalWork() float64 {
	s := 0.0
	for _, b := range q.bands {
		s += b.work
	}
	return s
}

// victim is the request a request of priority p displaces from a full
// pool: the newest of the least urgent band, when it is less urgent than
// p (nil: none).
func (q *queue) victim(p int) *Waiting {
	if len(q.bands) == 0 || q.bands[len(q.bands)-1].prio <= p {
		return nil
	}
	var newest *Waiting
	for _, tq := range q.bands[len(q.bands)-1].tenants {
		for _, w := range tq.h {
			if newest == nil || w.seq > newest.seq {
				newest = w
			}
		}
	}
	return newest
}

// QueueDepth is the requests waiting in one pool's band for one tenant.
type QueueDepth struct {
	Pool     string
	Band     int
	Tenant   string
	Requests int
}

// QueueDepths are the requests waiting, by pool, band and tenant (none
// when nothing waits).
func (rt *Router) QueueDepths() []QueueDepth {
	var out []QueueDepth
	for _, pl := range rt.pools {
		q := pl.q
		q.mu.Lock()
		for _, b := range q.bands {
			for _, tq := range b.tenants {
				out = append(out, QueueDepth{Pool: pl.name, Band: b.prio, Tenant: tq.t.name, Requests: len(tq.h)})
			}
		}
		q.mu.Unlock()
	}
	return out
}

// TenantFlow is one tenant's flow-control state in one pool.
type TenantFlow struct {
	Pool, Tenant string
	Weight       float64
	// Served is the tenant's VTC counter times its weight: the GPU work
	// (tokens) it was served, less the idle time's lifts.
	Served float64
	// Queued are its requests waiting; Active those waiting or in flight.
	Queued, Active int
}

// FlowTenants is every pool's tenants' state, by pool and name (none with
// flow control off).
func (rt *Router) FlowTenants() []TenantFlow {
	var out []TenantFlow
	for _, pl := range rt.pools {
		q := pl.q
		if q.fl == nil {
			continue
		}
		q.mu.Lock()
		for _, t := range q.fl.tenants {
			out = append(out, TenantFlow{Pool: pl.name, Tenant: t.name, Weight: t.weight, Served: t.vtime * t.weight,
				Queued: t.queued, Active: t.active})
		}
		q.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b TenantFlow) int {
		return cmp.Or(cmp.Compare(a.Pool, b.Pool), cmp.Compare(a.Tenant, b.Tenant))
	})
	return out
}
