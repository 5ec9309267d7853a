package clock

import (
	"sort"
	"sync"
	"time"
)

// Fake is a manual clock: time moves only by Advance or Set, which fire every
// timer and ticker that falls due, in deadline order, each seeing Now equal
// to its own deadline. Tests synchronise with the code under test through
// WaitTimers (a goroutine has armed its timer) instead of sleeping.
type Fake struct {
	mu      sync.Mutex
	now     time.Time
	seq     uint64
	timers  map[*fakeTimer]struct{}
	changed chan struct{} // closed and replaced whenever the set of armed timers changes
}

// NewFake is a fake clock reading start (the zero time: a fixed date).
func NewFake(start time.Time) *Fake {
	if start.IsZero() {
		start = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	return &Fake{now: start, timers: map[*fakeTimer]struct{}{}, changed: make(chan struct{})}
}

var _ Clock = (*Fake)(nil)

type fakeTimer struct {
	c      *Fake
	ch     chan time.Time
	f      func()
	at     time.Time
	period time.Duration // > 0: a ticker
	seq    uint64        // arming order: ties fire first-armed first
}

// Now is the fake time.
func (c *Fake) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Since is Now().Sub(t).
func (c *Fake) Since(t time.Time) time.Duration { return c.Now().Sub(t) }

// NewTimer arms a timer d from now.
func (c *Fake) NewTimer(d time.Duration) Timer {
	t := &fakeTimer{c: c, ch: make(chan time.Time, 1)}
	t.Reset(d)
	return t
}

// AfterFunc arms f to be called d from now, by Advance.
func (c *Fake) AfterFunc(d time.Duration, f func()) Timer {
	t := &fakeTimer{c: c, f: f}
	t.Reset(d)
	return t
}

// NewTicker arms a ticker of period d.
func (c *Fake) NewTicker(d time.Duration) Ticker {
	if d <= 0 {
		panic("clock: non-positive ticker period")
	}
	t := &fakeTimer{c: c, ch: make(chan time.Time, 1), period: d}
	t.Reset(d)
	return fakeTicker{t}
}

type fakeTicker struct{ t *fakeTimer }

func (k fakeTicker) C() <-chan time.Time { return k.t.ch }
func (k fakeTicker) Reset(d time.Duration) {
	k.t.c.mu.Lock()
	k.t.period = d
	k.t.c.mu.Unlock()
	k.t.Reset(d)
}
func (k fakeTicker) Stop() { k.t.Stop() }

func (t *fakeTimer) C() <-chan time.Time { return t.ch }

func (t *fakeTimer) Reset(d time.Duration) bool {
	c := t.c
	c.mu.Lock()
	_, armed := c.timers[t]
	t.drain()
	t.at = c.now.Add(d)
	c.seq++
	t.seq = c.seq
	c.timers[t] = struct{}{}
	c.notifyLocked()
	due := d <= 0
	c.mu.Unlock()
	if due {
		c.Advance(0)
	}
	return armed
}

func (t *fakeTimer) Stop() bool {
	c := t.c
	c.mu.Lock()
	defer c.mu.Unlock()
	_, armed := c.timers[t]
	delete(c.timers, t)
	t.drain()
	c.notifyLocked()
	return armed
}

func (t *fakeTimer) drain() {
	if t.ch == nil {
		return
	}
	select {
	case <-t.ch:
	default:
	}
}

func (c *Fake) notifyLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

// Advance moves time forward by d, firing what falls due on the way.
func (c *Fake) Advance(d time.Duration) {
	c.mu.Lock()
	to := c.now.Add(d)
	c.mu.Unlock()
	c.Set(to)
}

// Set moves time forward to t (never back), firing what falls due on the way.
func (c *Fake) Set(to time.Time) {
	for {
		c.mu.Lock()
		t := c.nextDueLocked(to)
		if t == nil {
			if to.After(c.now) {
				c.now = to
			}
			c.mu.Unlock()
			return
		}
		if t.at.After(c.now) {
			c.now = t.at
		}
		at := c.now
		f := t.f
		if t.period > 0 {
			t.at = t.at.Add(t.period)
			c.seq++
			t.seq = c.seq
		} else {
			delete(c.timers, t)
		}
		if t.ch != nil {
			select {
			case t.ch <- at: // like time.Ticker, a tick nobody read is dropped
			default:
			}
		}
		c.notifyLocked()
		c.mu.Unlock()
		if f != nil {
			f()
		}
	}
}

func (c *Fake) nextDueLocked(to time.Time) *fakeTimer {
	var best *fakeTimer
	for t := range c.timers {
		if t.at.After(to) {
			continue
		}
		if best == nil || t.at.Before(best.at) || (t.at.Equal(best.at) && t.seq < best.seq) {
			best = t
		}
	}
	return best
}

// Timers is the number of armed timers and tickers.
func (c *Fake) Timers() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.timers)
}

// Pending are the armed timers' deadlines as offsets from now, soonest first.
func (c *Fake) Pending() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]time.Duration, 0, len(c.timers))
	for t := range c.timers {
		out = append(out, t.at.Sub(c.now))
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// WaitTimers blocks until at least n timers are armed or the deadline (real
// time) passes; it reports whether n were reached. Tests use it to know that
// the code under test is parked on its timer before they Advance.
func (c *Fake) WaitTimers(n int, within time.Duration) bool {
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	for {
		c.mu.Lock()
		ok, ch := len(c.timers) >= n, c.changed
		c.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-ch:
		case <-deadline.C:
			return false
		}
	}
}
