package sim

import (
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// Timeline is a fleet's model time: the virtual time its engines run in,
// TimeScale times faster than the wall clock.
//
// Elastic (Config.Elastic > 0), it never runs more than that slack ahead
// of what the model still waits for (conservative synchronisation, as in
// parallel discrete-event simulation: no part of the model may pass a part
// it depends on):
//
//   - the end of a busy engine core's step: when a core falls behind — its
//     driver woken late, the host's CPU busy elsewhere — model time waits
//     for it instead of leaving it behind. Without this a late driver
//     stretches its steps by its lateness × the scale or, past MaxLag,
//     jumps ahead, which the requests it serves see as engine time: a few
//     ms of a busy host became 100 ms of TTFT at scale 20;
//   - holds (Hold, Release): a load generator in the same process (bench
//     --embedded) holds model time at its next arrival until it has sent
//     it, and at each request's send until the replica has it (the sim
//     releases it on arrival: HeaderHold), and the replica holds it at a
//     request's first token until the client has read it. The gateway's,
//     HTTP's and the client's real time then passes outside model time:
//     the engines see each request arrive at the model time the workload
//     says, however slow the host, and that real time is counted once,
//     apart, by the client. The replica also holds it at a stream's end
//     until the client has read it: a conversation's next turn follows
//     from there. A hold that lasts longer than holdFor of wall
//     time is dropped: a request waiting in the gateway's router queue
//     waits for the engines, which must then move on.
//
// A host too slow for the scale therefore slows model time down, but never
// distorts it. Not elastic, it is the plain scaled wall clock kvgate sim
// always had, and holds do nothing.
type Timeline struct {
	clk   clock.Clock
	scale float64
	slack time.Duration // Config.Elastic: how far model time may pass what it waits for; 0: not elastic

	mu    sync.Mutex
	base  time.Time     // the wall time at which model time was at;
	at    time.Duration // it runs at scale since
	last  time.Duration // the latest model time returned: never goes back
	ends  []time.Duration
	holds map[uint64]hold
	// held: the latest Now was held back; moved is closed when what held
	// it moves (a core's end moves on, a hold is released) and replaced.
	held  bool
	moved chan struct{}
}

// hold is model time held at at since the wall time since.
type hold struct {
	at    time.Duration
	since time.Time
}

// holdFor is how long (wall time) a hold lasts at most.
const holdFor = 250 * time.Millisecond

// HeaderHold carries, on a request to a replica, the key of the
// load generator's hold on its fleet's elastic Timeline (a decimal
// uint64, a multiple of 4): the replica releases key on the request's
// arrival, holds key+1 at its first token and key+3 at its end (the client
// releases them on reading them), and key+2 at a prefill step's answer
// (released at the decode step's arrival). Replicas without an elastic
// Timeline ignore it. Not an X-Kvgate-* name: the gateway strips those
// from what clients send (only it may set them), and this one must reach
// the replicas through it.
const HeaderHold = "X-Sim-Hold"

// HoldKey reads HeaderHold; false when absent or not a key.
func HoldKey(h http.Header) (uint64, bool) {
	v := h.Get(HeaderHold)
	if v == "" || len(v) > 20 {
		return 0, false
	}
	k, err := strconv.ParseUint(v, 10, 64)
	return k, err == nil && k%4 == 0
}

// NewTimeline is model time starting at 0 now, scale times faster than
// clk, elastic when slack > 0 (see Timeline).
func NewTimeline(clk clock.Clock, scale float64, slack time.Duration) *Timeline {
	clk = clock.OrReal(clk)
	return &Timeline{clk: clk, scale: scale, slack: max(slack, 0), base: clk.Now(), holds: map[uint64]hold{},
		moved: make(chan struct{})}
}

// Scale is the timeline's time scale.
func (tl *Timeline) Scale() float64 { return tl.scale }

// Elastic reports whether model time waits for what it depends on.
func (tl *Timeline) Elastic() bool { return tl.slack > 0 }

// Now is the current model time.
func (tl *Timeline) Now() time.Duration {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return tl.nowLocked(tl.clk.Now())
}

// nowLocked is model time at wall time w. Held back, it re-anchors at the
// hold, so that model time resumes from there once released rather than
// jumping ahead by the time it waited.
func (tl *Timeline) nowLocked(w time.Time) time.Duration {
	v := tl.at + time.Duration(float64(w.Sub(tl.base))*tl.scale)
	tl.held = false
	if lim, ok := tl.limitLocked(w); ok && v >= lim {
		tl.base, tl.at, tl.held = w, lim, true
		v = lim
	}
	tl.last = max(tl.last, v)
	return tl.last
}

// limitLocked is how far model time may go at wall time w: the earliest
// busy core's step end or hold + slack, never before the latest model time
// returned; false when nothing holds it back. Expired holds go.
func (tl *Timeline) limitLocked(w time.Time) (time.Duration, bool) {
	if tl.slack == 0 {
		return 0, false
	}
	end := never
	for _, e := range tl.ends {
		end = min(end, e)
	}
	for k, h := range tl.holds {
		if w.Sub(h.since) >= holdFor {
			delete(tl.holds, k)
			continue
		}
		end = min(end, h.at)
	}
	if end == never {
		return 0, false
	}
	return max(end+tl.slack, tl.last), true
}

// movedLocked tells the waiters of a held timeline that what held it moved.
func (tl *Timeline) movedLocked() {
	if tl.held {
		tl.held = false
		close(tl.moved)
		tl.moved = make(chan struct{})
	}
}

// join adds a core to the timeline, idle; it returns the core's slot for
// setEnd.
func (tl *Timeline) join() int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.ends = append(tl.ends, never)
	return len(tl.ends) - 1
}

// setEnd records how far core slot has simulated: the end of its step, its
// wake-up time while it has work and no step yet, an event it waits for,
// or never when idle.
func (tl *Timeline) setEnd(slot int, end time.Duration) {
	if tl.slack == 0 {
		return
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	before := tl.ends[slot]
	tl.ends[slot] = end
	if end > before {
		tl.movedLocked()
	}
}

// Hold holds model time at at (+ the slack) until Release(key), or for
// holdFor of wall time at most; a key held again moves its hold. Nothing
// when not elastic.
func (tl *Timeline) Hold(key uint64, at time.Duration) {
	if tl.slack == 0 {
		return
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	before, had := tl.holds[key]
	tl.holds[key] = hold{at: at, since: tl.clk.Now()}
	if had && at > before.at {
		tl.movedLocked()
	}
}

// Release ends the hold of key, if any.
func (tl *Timeline) Release(key uint64) {
	if tl.slack == 0 {
		return
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	if _, ok := tl.holds[key]; ok {
		delete(tl.holds, key)
		tl.movedLocked()
	}
}

// Wait says how to wait for model time v: reached; else, while model time
// is held back short of v, moved (closed when what holds it moves) and,
// when a hold may expire first, d; else d, a wall duration after which to
// ask again (at the current pace; model time may be held back meanwhile).
func (tl *Timeline) Wait(v time.Duration) (reached bool, d time.Duration, moved <-chan struct{}) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	w := tl.clk.Now()
	now := tl.nowLocked(w)
	switch {
	case now >= v:
		return true, 0, nil
	case tl.held:
		d = 0
		for _, h := range tl.holds {
			if left := holdFor - w.Sub(h.since); d == 0 || left < d {
				d = max(left, time.Nanosecond)
			}
		}
		return false, d, tl.moved
	}
	// The wall time of v at the current pace, as wallOf always computed it,
	// so that a timer set for it ends the wait even if the conversion back
	// rounds a nanosecond short.
	d = tl.base.Add(time.Duration(float64(v-tl.at) / tl.scale)).Sub(w)
	if d <= 0 {
		return true, 0, nil
	}
	return false, d, nil
}

// Until waits on t (a stopped timer of the timeline's clock) until model
// time reaches v; false when done closes first. The timer is stopped when
// it returns.
func (tl *Timeline) Until(t clock.Timer, v time.Duration, done <-chan struct{}) bool {
	for {
		reached, d, moved := tl.Wait(v)
		if reached {
			return true
		}
		var fire <-chan time.Time
		if d > 0 {
			t.Reset(d)
			fire = t.C()
		}
		select {
		case <-fire:
		case <-moved:
			if fire != nil {
				t.Stop()
			}
		case <-done:
			t.Stop()
			return false
		}
	}
}
