package bench

import (
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/sim"
)

// The model clock's timers fire when model time has reached their
// deadline (the time they carry says so), not before; Stop
// and Reset report whether they were armed and leave nothing stale; a
// ticker fires again a period on; AfterFunc runs its function. Model time
// runs 1000 times faster than the wall clock: the test waits for events
// only, bounded by a generous timeout.
func TestModelClock(t *testing.T) {
	tl := sim.NewTimeline(nil, 1000, 0)
	c := newModelClock(tl)
	defer c.close()
	within := func(ch <-chan time.Time, what string) time.Time {
		t.Helper()
		select {
		case v := <-ch:
			return v
		case <-time.After(30 * time.Second):
			t.Fatalf("%s did not fire", what)
		}
		return time.Time{}
	}
	start := tl.Now()
	late, early := c.NewTimer(3*time.Second), c.NewTimer(time.Second)
	stopped := c.NewTimer(2 * time.Second)
	if !stopped.Stop() || stopped.Stop() {
		t.Error("Stop of an armed timer, then again: want true, false")
	}
	if v := within(early.C(), "the 1 s timer"); v.Sub(c.origin) < start+time.Second {
		t.Errorf("the 1 s timer fired at model %v, before its deadline", v.Sub(c.origin)-start)
	}
	if v := within(late.C(), "the 3 s timer"); v.Sub(c.origin) < start+3*time.Second {
		t.Errorf("the 3 s timer fired at model %v", v.Sub(c.origin)-start)
	}
	if late.Reset(time.Second) {
		t.Error("Reset of a fired timer reports it armed")
	}
	within(late.C(), "the reset timer")
	select {
	case <-stopped.C():
		t.Error("a stopped timer fired")
	default:
	}

	tick := c.NewTicker(500 * time.Millisecond)
	a := within(tick.C(), "the ticker")
	b := within(tick.C(), "the ticker again")
	tick.Stop()
	if b.Sub(a) < 500*time.Millisecond {
		t.Errorf("ticks %v apart, want ≥ 500ms of model time", b.Sub(a))
	}
	ran := make(chan time.Time, 1)
	from := tl.Now()
	c.AfterFunc(time.Second, func() { ran <- c.Now() })
	if v := within(ran, "AfterFunc"); v.Sub(c.origin) < from+time.Second {
		t.Errorf("AfterFunc ran at model %v, before its deadline", v.Sub(c.origin)-from)
	}
}
