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
// flight, so the queue always has an event to wait for.

// Waiting is a request held in the router's queue.
type Waiting struct {
	req     *policy.Request
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
	rt.q.mu.Lock()
	defer rt.q.mu.Unlock()
	if len(rt.q.waiting) == 0 {
		t, err := rt.routeOrForce(req, exclude)
		if !errors.Is(err, policy.ErrDefer) {
			return t, nil, err
		}
	}
	w := &Waiting{req: req, exclude: slices.Clone(exclude), done: make(chan struct{})}
	rt.q.waiting = append(rt.q.waiting, w)
	return nil, w, nil
}

// Cancel takes w out of the queue (its client left or its wait ran out)
// and reports whether it was still waiting; false means it was routed, and
// the caller owns its ticket.
func (rt *Router) Cancel(w *Waiting) bool {
	rt.q.mu.Lock()
	defer rt.q.mu.Unlock()
	i := slices.Index(rt.q.waiting, w)
	if i < 0 {
		return false
	}
	rt.q.waiting = slices.Delete(rt.q.waiting, i, i+1)
	return true
}

// Queued is the number of requests waiting in the router.
func (rt *Router) Queued() int {
	rt.q.mu.Lock()
	defer rt.q.mu.Unlock()
	return len(rt.q.waiting)
}

// Release routes the queue's head while the policy lets it; the router
// calls it itself on a first token, an end or a scrape.
func (rt *Router) Release() {
	rt.q.mu.Lock()
	var out []*Waiting
	for len(rt.q.waiting) > 0 {
		w := rt.q.waiting[0]
		w.req.Now = rt.cfg.Now()
		t, err := rt.routeOrForce(w.req, w.exclude)
		if errors.Is(err, policy.ErrDefer) {
			break
		}
		rt.q.waiting = rt.q.waiting[1:]
		w.t, w.err = t, err
		out = append(out, w)
	}
	rt.q.mu.Unlock()
	for _, w := range out {
		close(w.done)
		if w.OnRouted != nil {
			w.OnRouted(w.t, w.err)
		}
	}
}

// routeOrForce is Route, except that a deferral while nothing is in flight
// (no event would ever release the queue) is overruled.
func (rt *Router) routeOrForce(req *policy.Request, exclude []int) (*Ticket, error) {
	t, err := rt.Route(req, exclude...)
	if !errors.Is(err, policy.ErrDefer) || rt.inFlight() > 0 {
		return t, err
	}
	req.NoDefer = true
	defer func() { req.NoDefer = false }()
	return rt.Route(req, exclude...)
}

// inFlight is the requests in flight to all replicas.
func (rt *Router) inFlight() int {
	n := 0
	for _, r := range rt.reps() {
		n += int(r.inFlight.Load())
	}
	return n
}
