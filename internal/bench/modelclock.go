package bench

import (
	"container/heap"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/sim"
)

// modelClock is the embedded gateway's clock: the fleet's model time
// (sim.Timeline), so that what the gateway measures against time — a first
// token's TTFT, which the ttft policy learns its correction from, a
// scrape's age, a prefill's expected end — and what it waits for — its
// timeouts, scrape and health intervals, backoffs — are in the engines'
// time, as at time scale 1. On the wall clock the gateway saw every TTFT
// divided by the scale: at scale 20 ttft's correction sat at its 1/4 bound
// and it routed otherwise than at scale 1 (its engine TTFT 33-36 ms against
// 30 ms). The elastic timeline's holds keep model time still while a
// request or its first token is in transit, so the gateway's own work takes
// no model time: bench counts it apart, in real time.
//
// Timers fire when model time reaches their deadline: one goroutine waits
// for the earliest (Timeline.Wait), until close. A timer waiting on model
// time held by a request in transit waits for the hold, which lasts
// holdFor of wall time at most.
type modelClock struct {
	tl     *sim.Timeline
	origin time.Time // the time.Time of model time 0

	mu     sync.Mutex
	timers timerHeap
	wake   chan struct{} // cap 1: the earliest deadline changed
	done   chan struct{}
	wg     sync.WaitGroup
}

func newModelClock(tl *sim.Timeline) *modelClock {
	c := &modelClock{tl: tl, origin: time.Now(), wake: make(chan struct{}, 1), done: make(chan struct{})}
	c.wg.Go(c.run)
	return c
}

// close stops the clock's goroutine; its timers fire no more.
func (c *modelClock) close() {
	close(c.done)
	c.wg.Wait()
}

func (c *modelClock) Now() time.Time                  { return c.origin.Add(c.tl.Now()) }
func (c *modelClock) Since(t time.Time) time.Duration { return c.Now().Sub(t) }

func (c *modelClock) NewTimer(d time.Duration) clock.Timer {
	t := &modelTimer{c: c, ch: make(chan time.Time, 1), idx: -1}
	t.Reset(d)
	return t
}

func (c *modelClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	t := &modelTimer{c: c, f: f, idx: -1}
	t.Reset(d)
	return t
}

func (c *modelClock) NewTicker(d time.Duration) clock.Ticker {
	t := &modelTimer{c: c, ch: make(chan time.Time, 1), idx: -1}
	t.reset(d, d)
	return modelTicker{t}
}

// run fires the timers whose deadline model time has reached.
func (c *modelClock) run() {
	wall := time.NewTimer(time.Hour)
	wall.Stop()
	for {
		c.mu.Lock()
		if len(c.timers) == 0 {
			c.mu.Unlock()
			select {
			case <-c.wake:
				continue
			case <-c.done:
				return
			}
		}
		next := c.timers[0].deadline
		c.mu.Unlock()
		reached, d, moved := c.tl.Wait(next)
		if reached {
			c.fire()
			continue
		}
		var fire <-chan time.Time
		if d > 0 {
			wall.Reset(d)
			fire = wall.C
		}
		select {
		case <-fire:
		case <-moved:
		case <-c.wake:
		case <-c.done:
			wall.Stop()
			return
		}
		wall.Stop()
	}
}

// fire fires every timer due now; a ticker is armed again a period on.
func (c *modelClock) fire() {
	now := c.tl.Now()
	var funcs []func()
	c.mu.Lock()
	for len(c.timers) > 0 && c.timers[0].deadline <= now {
		t := heap.Pop(&c.timers).(*modelTimer)
		if t.f != nil {
			funcs = append(funcs, t.f)
		} else {
			select {
			case t.ch <- c.origin.Add(now):
			default: // a ticker not read since: it drops the tick, as time.Ticker does
			}
		}
		if t.period > 0 {
			t.deadline = now + t.period
			heap.Push(&c.timers, t)
		}
	}
	c.mu.Unlock()
	for _, f := range funcs {
		go f() // as time.AfterFunc, in its own goroutine
	}
}

// modelTimer is a timer (ch) or AfterFunc (f) on the model clock; a ticker
// when period > 0.
type modelTimer struct {
	c        *modelClock
	ch       chan time.Time
	f        func()
	deadline time.Duration
	period   time.Duration
	idx      int // in the clock's heap; -1 when not armed
}

func (t *modelTimer) C() <-chan time.Time { return t.ch }

func (t *modelTimer) Reset(d time.Duration) bool { return t.reset(d, 0) }

// reset arms the timer d (model time) from now, with period for a ticker;
// as package time's timers (Go ≥ 1.23) it leaves no stale value in C.
func (t *modelTimer) reset(d, period time.Duration) bool {
	now := t.c.tl.Now()
	c := t.c
	c.mu.Lock()
	armed := t.disarmLocked()
	t.deadline, t.period = now+max(d, 0), period
	heap.Push(&c.timers, t)
	earliest := t.idx == 0
	c.mu.Unlock()
	if earliest {
		select {
		case c.wake <- struct{}{}:
		default:
		}
	}
	return armed
}

func (t *modelTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	return t.disarmLocked()
}

// disarmLocked takes the timer out of the heap and drains its channel; it
// reports whether it was armed.
func (t *modelTimer) disarmLocked() bool {
	armed := t.idx >= 0
	if armed {
		heap.Remove(&t.c.timers, t.idx)
	}
	if t.ch != nil {
		select {
		case <-t.ch:
		default:
		}
	}
	return armed
}

type modelTicker struct{ t *modelTimer }

func (k modelTicker) C() <-chan time.Time   { return k.t.ch }
func (k modelTicker) Reset(d time.Duration) { k.t.reset(d, d) }
func (k modelTicker) Stop()                 { k.t.Stop() }

// timerHeap orders armed timers by deadline.
type timerHeap []*modelTimer

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].deadline < h[j].deadline }
func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].idx, h[j].idx = i, j
}
func (h *timerHeap) Push(x any) {
	t := x.(*modelTimer)
	t.idx = len(*h)
	*h = append(*h, t)
}
func (h *timerHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	t.idx = -1
	*h = old[:len(old)-1]
	return t
}
