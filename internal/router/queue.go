package router

import (
	"errors"
	"slices"
	"sync"

	"github.com/kvgate/kvgate/internal/policy"
)

// The router's queue: late binding. A policy may answer policy.ErrDefer
// (every replica's queue is too long to join now: Dynamo's router queue);
// the request then waits in the router, first come first served, and is
// routed when a replica's prefill work shrinks (a first token, an end) or
// the router's view changes (a scrape). While requests wait, newcomers
// queue behind them. A request is never deferred while nothing is in
// flight, so the queue always has an event to wait for. Each pool has its
// own queue (pools.go): a pool whose replicas are all busy holds back its
// own requests only.

// Waiting is a request held in the router's queue.
type Waiting struct {
	req     *policy.Request
	pl      *pool // whose queue it waits in
	exclude []int
	done    chan struct{} // closed once routed (or failed)
	t       *Ticket
	err     error
	// OnRouted, when set before the queue moves (the replay, which routes
	// in its own event loop), is called with the ticket as the request
	// leaves the queue, on the goroutine that released it.
	OnRouted func(*Ticket, error)
}

// Done is closed when the request has left the queue.
func (w *Waiting) Done() <-chan struct{} { return w.done }

// Result is the ticket (or error) the request left the queue with; valid
// once Done is closed.
func (w *Waiting) Result() (*Ticket, error) { return w.t, w.err }

// queue is the router's FIFO of waiting requests.
type queue struct {
	mu      sync.Mutex
	waiting []*Waiting
}

// Submit routes req like Route, unless the policy defers it or requests
// are already waiting: then it joins the queue and Submit returns its
// Waiting (nil ticket, nil error).
func (rt *Router) Submit(req *policy.Request, exclude ...int) (*Ticket, *Waiting, error) {
	pl := rt.poolOfRequest(req)
	if pl == nil {
		return nil, nil, ErrModelNotServed
	}
	pl.q.mu.Lock()
	defer pl.q.mu.Unlock()
	if len(pl.q.waiting) == 0 {
		t, err := rt.routeOrForce(pl, req, exclude)
		if !errors.Is(err, policy.ErrDefer) {
			return t, nil, err
		}
	}
	w := &Waiting{req: req, pl: pl, exclude: slices.Clone(exclude), done: make(chan struct{})}
	pl.q.waiting = append(pl.q.waiting, w)
	return nil, w, nil
}

// Cancel takes w out of the queue (its client left or its wait ran out)
// and reports whether it was still waiting; false means it was routed, and
// the caller owns its ticket.
func (rt *Router) Cancel(w *Waiting) bool {
	q := w.pl.q
	q.mu.Lock()
	defer q.mu.Unlock()
	i := slices.Index(q.waiting, w)
	if i < 0 {
		return false
	}
	q.waiting = slices.Delete(q.waiting, i, i+1)
	return true
}

// Queued is the number of requests waiting in the router (every pool's).
func (rt *Router) Queued() int {
	n := 0
	for _, pl := range rt.pools {
		n += pl.q.len()
	}
	return n
}

func (q *queue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.waiting)
}

// Release routes each pool's queue's head while its policy lets it; the
// router calls it itself on a first token, an end or a scrape.
func (rt *Router) Release() {
	for _, pl := range rt.pools {
		rt.release(pl)
	}
}

// release routes pl's queue's head while pl's policy lets it.
func (rt *Router) release(pl *pool) {
	pl.q.mu.Lock()
	var out []*Waiting
	for len(pl.q.waiting) > 0 {
		w := pl.q.waiting[0]
		w.req.Now = rt.cfg.Now()
		t, err := rt.routeOrForce(pl, w.req, w.exclude)
		if errors.Is(err, policy.ErrDefer) {
			break
		}
		pl.q.waiting = pl.q.waiting[1:]
		w.t, w.err = t, err
		out = append(out, w)
	}
	pl.q.mu.Unlock()
	for _, w := range out {
		close(w.done)
		if w.OnRouted != nil {
			w.OnRouted(w.t, w.err)
		}
	}
}

// routeOrForce is Route, except that a deferral while nothing is in flight
// in req's pool pl (no event would ever release its queue) is overruled.
func (rt *Router) routeOrForce(pl *pool, req *policy.Request, exclude []int) (*Ticket, error) {
	t, err := rt.Route(req, exclude...)
	if !errors.Is(err, policy.ErrDefer) || rt.inFlight(pl) > 0 {
		return t, err
	}
	req.NoDefer = true
	defer func() { req.NoDefer = false }()
	return rt.Route(req, exclude...)
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
