package sim

import (
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// Timeline is a fleet's model time: the virtual time its engines run in,
// TimeScale times faster than the wall clock.
//
// Elastic (Config.Elastic > 0), it never runs more than that far ahead of
// the end of a busy engine core's step: when a core falls behind — its
// driver woken late, the host's CPU busy elsewhere — model time waits for
// it instead of leaving it behind (conservative synchronisation, as in
// parallel discrete-event simulation: no part of the model may pass a part
// it depends on). A core that cannot keep up at the time scale therefore
// slows model time down, but never distorts it: its steps take what the
// cost model says, requests arrive at the model time of their arrival, and
// a load generator that paces itself by the same Timeline (bench
// --embedded) sends what the workload says in model time however slow the
// host. Without it a late driver either stretches its steps by its lateness
// × the scale, or (past MaxLag) jumps ahead, which the requests it serves
// see as engine time: a few ms of a busy host became 100 ms of TTFT at scale
// 20.
//
// Not elastic, it is the plain scaled wall clock kvgate sim always had.
type Timeline struct {
	clk   clock.Clock
	scale float64
	slack time.Duration // Config.Elastic: model time allowed past a busy core's step end; 0: not elastic

	mu   sync.Mutex
	base time.Time     // model time at is base; it runs at scale since
	at   time.Duration //
	last time.Duration // the latest model time returned: never goes back
	ends []time.Duration
	// held: the latest Now was held back by a core; moved is closed when
	// the hold moves (a core's end moves on) and is then replaced.
	held  bool
	moved chan struct{}
}

// NewTimeline is model time starting at 0 now, scale times faster than
// clk, elastic when slack > 0 (see Timeline).
func NewTimeline(clk clock.Clock, scale float64, slack time.Duration) *Timeline {
	clk = clock.OrReal(clk)
	return &Timeline{clk: clk, scale: scale, slack: max(slack, 0), base: clk.Now(), moved: make(chan struct{})}
}

// Scale is the timeline's time scale.
func (tl *Timeline) Scale() float64 { return tl.scale }

// Now is the current model time.
func (tl *Timeline) Now() time.Duration {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return tl.nowLocked(tl.clk.Now())
}

// nowLocked is model time at wall time w. Held back by a core, it
// re-anchors at the hold, so that model time resumes from there once the
// core moves on rather than jumping ahead by the time it waited.
func (tl *Timeline) nowLocked(w time.Time) time.Duration {
	v := tl.at + time.Duration(float64(w.Sub(tl.base))*tl.scale)
	tl.held = false
	if lim, ok := tl.limitLocked(); ok && v >= lim {
		tl.base, tl.at, tl.held = w, lim, true
		v = lim
	}
	tl.last = max(tl.last, v)
	return tl.last
}

// limitLocked is how far model time may go: the earliest busy core's step
// end + slack, never before the latest model time returned; false when
// nothing holds it back.
func (tl *Timeline) limitLocked() (time.Duration, bool) {
	if tl.slack == 0 {
		return 0, false
	}
	end := never
	for _, e := range tl.ends {
		end = min(end, e)
	}
	if end == never {
		return 0, false
	}
	return max(end+tl.slack, tl.last), true
}

// join adds a core to an elastic timeline, idle; it returns the core's
// slot for setEnd.
func (tl *Timeline) join() int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.ends = append(tl.ends, never)
	return len(tl.ends) - 1
}

// setEnd records how far core slot has simulated: the end of its step, its
// wake-up time while it has work and no step yet, or never when idle.
// Model time held back may move on: its waiters are woken.
func (tl *Timeline) setEnd(slot int, end time.Duration) {
	if tl.slack == 0 {
		return
	}
	tl.mu.Lock()
	defer tl.mu.Unlock()
	before := tl.ends[slot]
	tl.ends[slot] = end
	if tl.held && end > before {
		tl.held = false
		close(tl.moved)
		tl.moved = make(chan struct{})
	}
}

// Wait says how to wait for model time v: reached; else a wall duration
// after which to ask again (at the current pace; model time may be held
// back meanwhile), or, while model time is held back short of v, moved: a
// channel closed when the hold moves.
func (tl *Timeline) Wait(v time.Duration) (reached bool, d time.Duration, moved <-chan struct{}) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	w := tl.clk.Now()
	now := tl.nowLocked(w)
	switch {
	case now >= v:
		return true, 0, nil
	case tl.held:
		return false, 0, tl.moved
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
// time reaches v; false when done closes first. The timer is stopped again
// when it returns.
func (tl *Timeline) Until(t clock.Timer, v time.Duration, done <-chan struct{}) bool {
	for {
		reached, d, moved := tl.Wait(v)
		if reached {
			return true
		}
		var fire <-chan time.Time
		if moved == nil {
			t.Reset(d)
			fire = t.C()
		}
		select {
		case <-fire:
		case <-moved:
		case <-done:
			t.Stop()
			return false
		}
	}
}

// WallOf is the wall time of model time v at the current pace (an
// estimate once model time is held back: ask Wait).
func (tl *Timeline) WallOf(v time.Duration) time.Time {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.nowLocked(tl.clk.Now())
	return tl.base.Add(time.Duration(float64(v-tl.at) / tl.scale))
}
