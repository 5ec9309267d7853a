// Package clock is kvgate's one home for time: the wall clock (Real) and a
// manual one (Fake) behind the same small interface, with timers, tickers and
// AfterFunc as well as Now. The gateway, the fleet and the sim take a Clock,
// so breakers, backoffs, scrape ages and timeouts are tested exactly by
// advancing a Fake instead of waiting on real 20 ms loops.
//
// The interface follows package time's semantics (Go ≥ 1.23): Reset and Stop
// leave no stale value in a timer's channel.
package clock

import "time"

// Clock tells the time and makes timers.
type Clock interface {
	Now() time.Time
	Since(t time.Time) time.Duration
	// NewTimer fires once, d from now (at once when d ≤ 0).
	NewTimer(d time.Duration) Timer
	// NewTicker fires every d (d must be positive).
	NewTicker(d time.Duration) Ticker
	// AfterFunc calls f once, d from now. The Real clock calls it in its own
	// goroutine; the Fake calls it from Advance, outside its lock.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a one-shot timer.
type Timer interface {
	// C is the channel the timer fires on (nil for AfterFunc timers).
	C() <-chan time.Time
	// Reset re-arms the timer to fire d from now; it reports whether the
	// timer was armed.
	Reset(d time.Duration) bool
	// Stop disarms the timer; it reports whether the timer was armed.
	Stop() bool
}

// Ticker fires periodically.
type Ticker interface {
	C() <-chan time.Time
	Reset(d time.Duration)
	Stop()
}

// Real is the system clock.
func Real() Clock { return realClock{} }

// OrReal is c, or the system clock when c is nil: for optional Clock fields.
func OrReal(c Clock) Clock {
	if c == nil {
		return realClock{}
	}
	return c
}

type realClock struct{}

func (realClock) Now() time.Time                  { return time.Now() }
func (realClock) Since(t time.Time) time.Duration { return time.Since(t) }
func (realClock) NewTimer(d time.Duration) Timer  { return realTimer{time.NewTimer(d)} }
func (realClock) NewTicker(d time.Duration) Ticker {
	return realTicker{time.NewTicker(d)}
}
func (realClock) AfterFunc(d time.Duration, f func()) Timer { return realTimer{time.AfterFunc(d, f)} }

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time        { return t.t.C }
func (t realTimer) Reset(d time.Duration) bool { return t.t.Reset(d) }
func (t realTimer) Stop() bool                 { return t.t.Stop() }

type realTicker struct{ t *time.Ticker }

func (t realTicker) C() <-chan time.Time   { return t.t.C }
func (t realTicker) Reset(d time.Duration) { t.t.Reset(d) }
func (t realTicker) Stop()                 { t.t.Stop() }

// Sleep waits d on c, or until done is closed; it reports whether the whole
// wait elapsed.
func Sleep(c Clock, d time.Duration, done <-chan struct{}) bool {
	if d <= 0 {
		select {
		case <-done:
			return false
		default:
			return true
		}
	}
	t := c.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return false
	case <-t.C():
		return true
	}
}
