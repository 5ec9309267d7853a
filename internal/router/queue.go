package router

import (
	"errors"
	"slices"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

// The router's queue: late binding, and flow control's (flow.go). A policy
// may answer policy.ErrDefer (every replica's queue is too long to join
// now: Dynamo's router queue), or the flow controller may find the pool
// saturated; the request then waits in the router and is routed when a
// replica's prefill work shrinks (a first token, an end) or the router's
// view changes (a scrape; a replica added, removed, back in rotation or
// listed: SetReplicas, SetHealthy, Replica.SetServed). While requests
// wait, newcomers queue too (but for those held for their own replicas
// alone: errHeldAlone), in the queue's order (Less): by band and tenant
// share with flow control on; within them deadlines first, then turn
// priority, then by when a request's first token could come at the
// earliest under a policy that prices it (ttft: policy.QueueOrderer),
// else first come first served. A request is never deferred while nothing
// is in flight, so the queue always has an event to wait for.
// Each pool has its own queue (pools.go): a pool whose replicas are all
// busy holds back its own requests only.

// Waiting is a request held in the router's queue.
type Waiting struct {
	req     *policy.Request
	pl      *pool // whose queue it waits in
	exclude []int
	pol     policy.Policy // decides it instead of its pool's policy (nil: the pool's)
	// pd: a prefill/decode request (SubmitPD), routed to a pair with the
	// pair rule (routePair) into *pd; its ticket (t) is the decode step's.
	pd   *PD
	done chan struct{} // closed once routed (or failed)
	t    *Ticket
	err  error
	// OnRouted, when set before the queue moves (the replay, which routes
	// in its own event loop), is called with the ticket (or the error: a
	// shed request's *ShedError) as the request leaves the queue, on the
	// goroutine that released it.
	OnRouted func(*Ticket, error)

	// Its place in the queue (the queue's mutex): the band and tenant
	// queue it waits in (nil once it left), its index in that heap, its
	// order (seq: arrival), when it is due (its deadline, else its TTL's
	// end: EDF) and when it expires (zero: never, flow control off).
	bnd        *band
	tq         *tenantQ
	idx        int
	seq        uint64
	due        time.Time
	expires    time.Time
	enqueued   time.Time
	deadline   bool      // the request has a deadline: due is it
	newProgram bool      // the first turn of a program (turn priority: Less)
	ready      time.Time // enqueued plus prefillMs (Less)
	// prefillMs is its policy's prefill of its uncached prompt, where the
	// most of it is held, at enqueue (0: first come first served).
	prefillMs float64
	work      float64 // estimated GPU work: prompt + expected output
	// since is when a new program's current stint of waiting for room
	// began (programs_admit.go; zero: never held), heldFor its earlier
	// stints, and anyway that it waited AdmissionWait in all: it is placed
	// without room, still through the flow controller's gate (routeWith).
	since   time.Time
	heldFor time.Duration
	anyway  bool
	// alone: the flow controller last held it for its own candidates
	// alone, while another replica of its pool had room (errHeldAlone):
	// the requests behind it need not wait for it (release).
	alone bool
	// parking: a new program that left the queue without room, about to
	// be held for room again (release, then parkAgain); still waiting.
	parking bool
}

// Done is closed when the request has left the queue.
func (w *Waiting) Done() <-chan struct{} { return w.done }

// Result is the ticket (or error) the request left the queue with; valid
// once Done is closed. A pair's (SubmitPD) is its decode step's: PD has both.
func (w *Waiting) Result() (*Ticket, error) { return w.t, w.err }

// PD is the pair (or error) a prefill/decode request (SubmitPD) left the
// queue with; valid once Done is closed.
func (w *Waiting) PD() (PD, error) {
	if w.pd == nil || w.err != nil {
		return PD{}, w.err
	}
	return *w.pd, nil
}

// Enqueued is when the request started waiting.
func (w *Waiting) Enqueued() time.Time {
	q := w.pl.q
	q.mu.Lock() // a new program held for room joins the queue on another goroutine (releaseParked)
	defer q.mu.Unlock()
	return w.enqueued
}

// Expires is when the request's wait ends, shed (its deadline or its
// band's TTL, from when it first waited, held for room or queued; zero
// with flow control off: the caller bounds the wait).
func (w *Waiting) Expires() time.Time {
	q := w.pl.q
	q.mu.Lock() // as Enqueued
	defer q.mu.Unlock()
	return w.expires
}

// queue is one pool's queue: its bands, most urgent first, each holding
// the tenants with requests waiting in it.
type queue struct {
	mu    sync.Mutex
	n     int
	bands []*band // non-empty, by priority
	seq   uint64
	fl    *flow   // nil: flow control off
	solo  *tenant // the one tenant of a queue without flow control
	alone int     // of n, those held for their own candidates alone (Waiting.alone)
}

// band is one priority's requests.
type band struct {
	prio    int
	conf    Band
	n       int
	work    float64
	alone   float64    // of work, the requests' held alone (Waiting.alone)
	tenants []*tenantQ // with requests waiting, in the order they came
}

// tenantQ is one tenant's requests in one band: a heap by rank, due time
// and arrival.
type tenantQ struct {
	t     *tenant
	h     waitHeap
	work  float64
	alone float64 // of work, the requests' held alone (Waiting.alone)
}

type waitHeap []*Waiting

func (h waitHeap) Len() int { return len(h) }

// Less orders a tenant's waiting requests: by rank; then those with a
// deadline, earliest first; then turn priority: a program's next turn (or
// a request of no program) before a new program's first turn, so that the
// programs under way finish rather than all slowing down as more start
// (#27); then by when their first token could come at the earliest (their
// arrival plus their own prefill as their policy prices it: Waiting.ready;
// policy.QueueOrderer), a short prompt ahead of a long one that came a
// little before it, never of one that came longer before than the
// difference of their prefills (a bounded wait: no starvation); then by
// arrival. A policy that does not price it (the peers') is first come
// first served.
func (h waitHeap) Less(i, j int) bool { return waitBefore(h[i], h[j]) }

// waitBefore is waitHeap.Less of a and b.
func waitBefore(a, b *Waiting) bool {
	if a.req.Rank != b.req.Rank {
		return a.req.Rank < b.req.Rank
	}
	if a.deadline != b.deadline {
		return a.deadline
	}
	if a.deadline && !a.due.Equal(b.due) {
		return a.due.Before(b.due)
	}
	if a.newProgram != b.newProgram {
		return b.newProgram
	}
	if !a.ready.Equal(b.ready) {
		return a.ready.Before(b.ready)
	}
	return a.seq < b.seq
}
func (h waitHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].idx, h[j].idx = i, j
}
func (h *waitHeap) Push(x any) {
	w := x.(*Waiting)
	w.idx = len(*h)
	*h = append(*h, w)
}
func (h *waitHeap) Pop() any {
	old := *h
	w := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return w
}

func newQueue(cfg *FlowConfig) *queue {
	q := &queue{solo: &tenant{weight: 1}}
	if cfg != nil && cfg.Enabled {
		q.fl = newFlow(cfg)
	}
	return q
}

// Submit routes req like Route, unless the policy defers it, the flow
// controller holds it (its pool saturated) or requests are already
// waiting: then it joins the queue and Submit returns its Waiting (nil
// ticket, nil error). With flow control, a request the queue cannot take
// is refused with a *ShedError.
func (rt *Router) Submit(req *policy.Request, exclude ...int) (*Ticket, *Waiting, error) {
	return rt.SubmitWith(nil, req, exclude...)
}

// SubmitWith is Submit deciding with pol instead of the pool's policy (nil:
// that policy), as RouteWith is Route: a request pinned to one replica or
// routed by load still waits its turn in its pool's queue, by band,
// tenant share and deadline, so that naming a stored response does not
// jump the flow controller.
func (rt *Router) SubmitWith(pol policy.Policy, req *policy.Request, exclude ...int) (*Ticket, *Waiting, error) {
	return rt.submit(pol, req, exclude, nil)
}

// SubmitPD is RoutePD through req's pool's queue, as Submit is Route: with
// flow control on, a prefill/decode request is held while the replicas
// that would compute its prompt are saturated (pickPairGated), released in
// the queue's order, shed with the same reasons, its deadline checked
// against the pair's estimate and its work charged to its tenant. A
// Waiting's pair is Waiting.PD once it left. With flow control off the
// pair is routed at once (RoutePD: no policy defers a pair). The decode
// step of a request already prefilled (RouteDecode) is never held: its KV
// is held on the prefill replica meanwhile.
func (rt *Router) SubmitPD(req *policy.Request, exclude ...int) (PD, *Waiting, error) {
	if pl := rt.poolOfRequest(req); pl == nil || pl.q.fl == nil {
		pd, err := rt.RoutePD(req, exclude...)
		return pd, nil, err
	}
	var pd PD
	_, w, err := rt.submit(nil, req, exclude, &pd)
	return pd, w, err
}

// submit is SubmitWith, or for a pair (pd not nil) SubmitPD routing into *pd.
func (rt *Router) submit(pol policy.Policy, req *policy.Request, exclude []int, pd *PD) (*Ticket, *Waiting, error) {
	pl := rt.poolOfRequest(req)
	if pl == nil {
		return nil, nil, ErrModelNotServed
	}
	q := pl.q
	q.mu.Lock()
	var err error
	if q.n == q.alone { // nothing waits that this request could pass
		var t *Ticket
		t, err = rt.routeQueued(pl, pol, req, exclude, false, pd)
		if errors.Is(err, errNoRoom) {
			q.mu.Unlock() // lock order: parked before the queue
			return nil, rt.park(pl, pol, req, exclude), nil
		}
		if !errors.Is(err, policy.ErrDefer) {
			q.mu.Unlock()
			return t, nil, err
		}
	}
	rt.lookupProgram(req) // whether it continues a program (turn priority), when no decision looked yet
	w := &Waiting{req: req, pl: pl, pol: pol, exclude: slices.Clone(exclude), done: make(chan struct{}), prefillMs: rt.prefillMs(pl, pol, req),
		alone: errors.Is(err, errHeldAlone)}
	if pd != nil {
		w.pd = new(PD)
	}
	evicted, err := q.admit(w, rt.cfg.Now())
	q.mu.Unlock()
	leave(evicted)
	if err != nil {
		return nil, nil, err
	}
	return nil, w, nil
}

// Cancel takes w out of the queue (its client left or its wait ran out)
// and reports whether it was still waiting; false means it was routed, and
// the caller owns its ticket.
func (rt *Router) Cancel(w *Waiting) bool {
	p, q := &rt.progs.park, w.pl.q
	p.mu.Lock() // lock order: parked before the queue
	defer p.mu.Unlock()
	q.mu.Lock()
	defer q.mu.Unlock()
	return rt.takeOut(w)
}

// Expire sheds w if it is still waiting (its Expires came: the caller's
// timer) and returns why; nil means it already left the queue (Result).
// A new program held for room again after a trip through the queue
// (programs_admit.go) still waits, under the expiry the queue gave it.
func (rt *Router) Expire(w *Waiting) error {
	p, q := &rt.progs.park, w.pl.q
	p.mu.Lock()
	defer p.mu.Unlock()
	q.mu.Lock()
	defer q.mu.Unlock()
	if !rt.takeOut(w) {
		return nil
	}
	return q.expiredErr(w)
}

// takeOut takes w out wherever it waits: held for room, in its pool's
// queue, or between the two (parking: release moves it from the one to
// the other in two steps, as the locks' order wants) and reports whether
// it was still waiting. Both locks are held, parked's and w's queue's, so
// that w leaves exactly once: by this, or routed or shed (Done).
func (rt *Router) takeOut(w *Waiting) bool {
	q := w.pl.q
	switch {
	case rt.progs.park.cancelLocked(w):
		return true
	case w.tq != nil:
		q.remove(w)
		return true
	case w.parking:
		w.parking = false // release's second step passes over it
		return true
	}
	return false
}

// Queued is the number of requests waiting in the router (every pool's).
func (rt *Router) Queued() int {
	n := rt.progs.park.len()
	for _, pl := range rt.pools {
		n += pl.q.len()
	}
	return n
}

func (q *queue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.n
}

// eachLocked calls f with every request waiting in q, in no order; q.mu
// is held by the caller.
func (q *queue) eachLocked(f func(*Waiting)) {
	for _, b := range q.bands {
		for _, tq := range b.tenants {
			for _, w := range tq.h {
				f(w)
			}
		}
	}
}

// Release routes each pool's queue's head while its policy lets it; the
// router calls it itself on a first token, an end, a scrape and a change
// of membership or health.
func (rt *Router) Release() {
	for _, pl := range rt.pools {
		rt.release(pl)
	}
}

// release routes pl's queue's head while the pool takes it: a head past
// its expiry is shed instead, a new program with no room leaves the
// queue to wait for room apart (programs_admit.go), and a head the flow
// controller holds for its own candidates alone (errHeldAlone: a retry
// excluding a replica, a model only some replicas list) is passed over
// while another replica has room for the requests behind it.
func (rt *Router) release(pl *pool) {
	q := pl.q
	q.mu.Lock()
	var out, noRoom []*Waiting
	var po passOver
	now := rt.cfg.Now()
	for q.n > len(po.aside) {
		w := q.head()
		if !w.expires.IsZero() && !now.Before(w.expires) {
			q.remove(w)
			w.err = q.expiredErr(w)
			out = append(out, w)
			continue
		}
		if po.same(q, w) {
			continue
		}
		w.req.Now = now
		t, err := rt.routeQueued(pl, w.pol, w.req, w.exclude, w.anyway, w.pd)
		if errors.Is(err, policy.ErrDefer) {
			if po.held(q, w, err) {
				continue
			}
			break
		}
		q.remove(w)
		if errors.Is(err, errNoRoom) {
			w.parking = true
			noRoom = append(noRoom, w)
			continue
		}
		if q.fl != nil && err == nil {
			q.fl.drained(now, w.work)
		}
		w.t, w.err = t, err
		out = append(out, w)
	}
	q.restore(po.aside)
	q.mu.Unlock()
	if len(noRoom) > 0 {
		if rt.beforePark != nil {
			rt.beforePark()
		}
		rt.parkAgain(q, noRoom, now)
	}
	leave(out)
}

// parkAgain holds for room the new programs that left q without it (the
// second step of release, under both locks in their order), but those a
// Cancel or Expire took out meanwhile (takeOut).
func (rt *Router) parkAgain(q *queue, ws []*Waiting, now time.Time) {
	p := &rt.progs.park
	p.mu.Lock()
	defer p.mu.Unlock()
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, w := range ws {
		if w.parking {
			w.parking = false
			p.addLocked(w, now)
		}
	}
}

// passOver is one release pass's requests held for their own candidates
// alone (errHeldAlone), set aside so that those behind them may go: tried
// are those a decision found held, aside those and the requests held for
// the same reason (same, without a decision).
type passOver struct{ tried, aside []*Waiting }

// Bounds of one pass: the decisions that find a request held alone (a
// decision is about 8 µs at 16 replicas, BenchmarkDecisionFlow), and the
// requests set aside in all.
const (
	maxPassedOver = 16
	maxSetAside   = 1024
)

// held sets w aside when err says it is held for its own candidates alone
// (and records why); false: the pass stops at w.
func (p *passOver) held(q *queue, w *Waiting, err error) bool {
	q.setAlone(w, errors.Is(err, errHeldAlone))
	if !w.alone || len(p.tried) == maxPassedOver || len(p.aside) == maxSetAside {
		return false
	}
	q.setAside(w)
	p.tried, p.aside = append(p.tried, w), append(p.aside, w)
	return true
}

// same sets w aside, without a decision, when a request tried in this pass
// was held alone with the same candidates: the same model and exclusions
// under the pool's policy (the gate reads only the candidates' loads).
func (p *passOver) same(q *queue, w *Waiting) bool {
	if w.pol != nil || w.req.NoDefer || len(p.aside) == maxSetAside {
		return false
	}
	for _, x := range p.tried {
		if x.pol == nil && (x.pd == nil) == (w.pd == nil) && x.req.Model == w.req.Model && slices.Equal(x.exclude, w.exclude) {
			q.setAlone(w, true)
			q.setAside(w)
			p.aside = append(p.aside, w)
			return true
		}
	}
	return false
}

// leave tells the requests that left the queue.
func leave(out []*Waiting) {
	for _, w := range out {
		close(w.done)
		if w.OnRouted != nil {
			w.OnRouted(w.t, w.err)
		}
	}
}

// routeQueued is RouteWith (pol nil: the pool's policy), or for a pair (pd
// not nil) RoutePD into *pd, through pl's flow controller (gated by
// saturation, the decision checked against the deadline, the work
// charged), except that a deferral while nothing is in flight in pl (no
// event would ever release its queue) is overruled. anyway places a new
// program without room (it waited AdmissionWait). pl's queue's mutex is
// held.
func (rt *Router) routeQueued(pl *pool, pol policy.Policy, req *policy.Request, exclude []int, anyway bool, pd *PD) (*Ticket, error) {
	t, err := rt.routeOnce(pl, pol, req, exclude, anyway, pd)
	if !errors.Is(err, policy.ErrDefer) || rt.inFlight(pl) > 0 {
		return t, err
	}
	req.NoDefer = true
	defer func() { req.NoDefer = false }()
	return rt.routeOnce(pl, pol, req, exclude, anyway, pd)
}

// routeOnce is one decision of routeQueued.
func (rt *Router) routeOnce(pl *pool, pol policy.Policy, req *policy.Request, exclude []int, anyway bool, pd *PD) (*Ticket, error) {
	if pd != nil {
		return rt.routePair(req, exclude, pl.q, pd)
	}
	return rt.routeWith(pol, req, exclude, pl.q, anyway)
}

// inFlight is the requests in flight to pl's replicas.
func (rt *Router) inFlight(pl *pool) int {
	n := 0
	for _, r := range rt.reps() {
		if pl.has(r) {
			n += int(r.inFlight.Load())
		}
	}
	return n
}

// prefillMs is what the queue adds to req's arrival to order it (Less):
// pol's QueuePrefillMs (pol nil: pl's policy) of req's prompt less the
// most of it any replica in rotation holds; 0 for a policy whose queue is first come
// first served.
func (rt *Router) prefillMs(pl *pool, pol policy.Policy, req *policy.Request) float64 {
	if pol == nil {
		pol = pl.pol.Load().pol
	}
	if _, ok := pol.(policy.QueueOrderer); !ok {
		return 0
	}
	vb := rt.getBuf()
	defer rt.putBuf(vb)
	views, _ := rt.views(req, vb)
	held := 0
	for i := range views {
		if views[i].Healthy { // a replica out of rotation serves it no hit
			held = max(held, views[i].Match)
		}
	}
	return policy.QueuePrefillMs(pol, rt.uncached(req, held))
}
