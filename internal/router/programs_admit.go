package router

import (
	"errors"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

// KV admission by program. A replica's KV cache holds only so many live
// programs' contexts: placing a new program where the contexts of the
// programs homed there already fill it evicts those of the paused ones
// (LRU: a paused program's blocks are the oldest free ones), and each of
// them prefills its whole context again at its next turn. So a new
// program (its first turn) goes only to a replica where the live
// programs' contexts and its own fit in ProgramConfig.KVShare of the
// cache; where none has room it waits in the router, for a program to end
// or idle past its TTL, ProgramConfig.AdmissionWait at most, and is then
// placed anyway; only once programs are long (AdmissionMinContext). Continuing programs never wait here: their context is
// already placed. Only for policies that place programs
// (policy.PlacesPrograms).

// errNoRoom: a new program fits no candidate beside the live programs: it
// waits (Submit parks it).
var errNoRoom = errors.New("router: no replica has room for a new program")

// admit restricts views (Healthy false) to the candidates with room for
// req, a new program, or answers errNoRoom when none has. A request that
// must be routed now (NoDefer), or whose program fits no replica even
// empty, is placed by the policy alone.
func (rt *Router) admit(pl *pool, req *policy.Request, views []policy.ReplicaView) error {
	if !rt.progs.cfg.KVAdmission || req.Program.ID == 0 || req.Program.Continues {
		return nil
	}
	if m := rt.progs.cfg.AdmissionMinContext; m > 0 && math.Float64frombits(pl.idleCtx.Load()) < float64(m) {
		return nil // programs here (req's pool) are short: a hold would only delay them
	}
	share := rt.progs.cfg.KVShare
	fit, ever := 0, false
	room := make([]bool, len(views))
	for i := range views {
		v := &views[i]
		if !v.Healthy {
			continue
		}
		// What the program adds there: its context beyond the prefix the
		// replica already holds (a shared system prompt is held once).
		held := min(max(v.Match, 0)*rt.cfg.BlockSize, req.Tokens)
		need := float64(req.Tokens - held + max(req.MaxTokens, 0))
		limit := float64(max(v.NumBlocks, 0)) * float64(rt.cfg.BlockSize) * share
		if need > limit {
			continue
		}
		ever = true
		if room[i] = float64(max(v.ProgramTokens, 0))+need <= limit; room[i] {
			fit++
		}
	}
	switch {
	case fit > 0:
		for i := range views {
			if !room[i] {
				views[i].Healthy = false
			}
		}
		return nil
	case !ever || req.NoDefer:
		return nil
	}
	return errNoRoom
}

// parked are the new programs waiting for room, in arrival order. Lock
// order: parked.mu before a pool's queue's mu, never the other way.
type parked struct {
	mu sync.Mutex
	ws []*Waiting
	n  atomic.Int64 // len(ws), read without the lock
}

func (p *parked) len() int { return int(p.n.Load()) }

// add parks w, held for room from at. Its AdmissionWait counts the time
// it has been held for room in all (heldFor, its earlier stints): a trip
// through its pool's queue (the pool saturated, or its policy deferring it,
// when room was tried again) neither starts the wait over, which let a
// program bouncing between the two under load be held without end, nor
// counts towards it: the queue is a wait for the pool, which every request
// makes, not for room.
func (p *parked) add(w *Waiting, at time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.addLocked(w, at)
}

// addLocked is add with p.mu held.
func (p *parked) addLocked(w *Waiting, at time.Time) {
	w.since = at
	p.ws = append(p.ws, w)
	p.n.Store(int64(len(p.ws)))
}

// cancelLocked takes w out, reporting whether it was parked (p.mu held).
func (p *parked) cancelLocked(w *Waiting) bool {
	i := slices.Index(p.ws, w)
	if i < 0 {
		return false
	}
	p.ws = slices.Delete(p.ws, i, i+1)
	p.n.Store(int64(len(p.ws)))
	return true
}

// park makes a waiting request of req (new program with no room).
func (rt *Router) park(pl *pool, pol policy.Policy, req *policy.Request, exclude []int) *Waiting {
	w := &Waiting{req: req, pl: pl, pol: pol, exclude: slices.Clone(exclude), done: make(chan struct{}), prefillMs: rt.prefillMs(pl, pol, req)}
	if fl := pl.q.fl; fl != nil {
		// Held for room, it waits under flow control's expiry as in the
		// queue: its caller sheds it then (Expire), rather than routing
		// it past the gate at its own timeout.
		fl.setExpiry(w, req.Now)
	}
	rt.progs.park.add(w, req.Now)
	return w
}

// releaseParked tries the parked programs again, in order: those with room
// now (or waiting AdmissionWait already) are routed, or join their pool's
// queue when the policy defers them; the others keep waiting.
func (rt *Router) releaseParked() {
	p := &rt.progs.park
	p.mu.Lock()
	var out, keep, evicted []*Waiting
	for _, w := range p.ws {
		w.req.Now = rt.cfg.Now()
		held := w.heldFor + w.req.Now.Sub(w.since)
		if held >= rt.progs.cfg.AdmissionWait {
			w.anyway = true // waited long enough: placed without room, in its turn
		}
		q := w.pl.q
		q.mu.Lock()
		t, err := rt.routeQueued(w.pl, w.pol, w.req, w.exclude, w.anyway, w.pd)
		switch {
		case errors.Is(err, errNoRoom):
			keep = append(keep, w)
		case errors.Is(err, policy.ErrDefer):
			w.heldFor = held // for room so far; the queue's wait is not counted
			w.alone = errors.Is(err, errHeldAlone)
			ev, qerr := q.admit(w, w.req.Now)
			evicted = append(evicted, ev...)
			if qerr != nil { // the queue cannot take it: refused as Submit would
				w.err = qerr
				out = append(out, w)
			}
		default:
			w.t, w.err = t, err
			out = append(out, w)
		}
		q.mu.Unlock()
	}
	p.ws = keep
	p.n.Store(int64(len(keep)))
	p.mu.Unlock()
	leave(evicted)
	leave(out)
}
