package sim

import "time"

// Clock is the wall clock a replica's driver and fault injection read. The
// engine never reads one: the driver converts wall time to virtual time and
// passes it in, so tests can drive a replica with a fake clock.
type Clock interface {
	Now() time.Time
	// NewTimer returns a stopped-or-running timer firing after d.
	NewTimer(d time.Duration) Timer
}

// Timer is the part of *time.Timer the sim uses.
type Timer interface {
	C() <-chan time.Time
	// Reset re-arms the timer to fire after d. With Go ≥ 1.23 timer
	// semantics no stale value is received after Reset or Stop.
	Reset(d time.Duration)
	Stop()
}

// RealClock is the system clock.
type RealClock struct{}

// Now is time.Now.
func (RealClock) Now() time.Time { return time.Now() }

// NewTimer wraps time.NewTimer.
func (RealClock) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time   { return t.t.C }
func (t realTimer) Reset(d time.Duration) { t.t.Reset(d) }
func (t realTimer) Stop()                 { t.t.Stop() }
