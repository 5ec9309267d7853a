package router

import (
	"sync"
	"time"
)

// BreakerConfig tunes a replica's circuit breaker.
type BreakerConfig struct {
	EjectAfter int           // consecutive failures that open it (default 3)
	Cooldown   time.Duration // first open period (default 10 s), doubling per opening in a row up to 32×
}

// Breaker is a replica's circuit breaker (passive health, as Envoy's
// outlier detection): closed while requests succeed; open for a cooldown
// after EjectAfter consecutive failures, or at once when a half-open trial
// fails, the cooldown doubling with each opening in a row (at most 32×);
// after the cooldown half-open, letting one trial request through at a
// time, and closed again by the trial's success. Only failures of the
// replica count: a client going away or a 4xx is Neutral. Times are passed
// in, so tests drive it with a fake clock.
type Breaker struct {
	mu           sync.Mutex
	cfg          BreakerConfig
	consecFail   int
	ejectedUntil time.Time
	opens        int  // consecutive openings without a success in between
	trial        bool // half-open: a trial request is in flight
}

// Configure sets the breaker's thresholds.
func (b *Breaker) Configure(c BreakerConfig) {
	if c.EjectAfter <= 0 {
		c.EjectAfter = 3
	}
	if c.Cooldown <= 0 {
		c.Cooldown = 10 * time.Second
	}
	b.mu.Lock()
	b.cfg = c
	b.mu.Unlock()
}

// Allow asks to send a request: always while closed; while half-open only
// one trial at a time; never while open. Every allowed request is then
// reported with exactly one of Success, Failure or Neutral.
func (b *Breaker) Allow(now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.opens == 0 {
		return true
	}
	if now.Before(b.ejectedUntil) || b.trial {
		return false
	}
	b.trial = true
	return true
}

// Success closes the breaker and restarts the failure count.
func (b *Breaker) Success() {
	b.mu.Lock()
	b.consecFail, b.opens, b.trial = 0, 0, false
	b.mu.Unlock()
}

// Neutral ends a request that says nothing of the replica's health: it only
// frees a half-open breaker's trial.
func (b *Breaker) Neutral() {
	b.mu.Lock()
	b.trial = false
	b.mu.Unlock()
}

// Failure records a failure of the replica at now; it returns the cooldown
// when this failure opened the breaker (0 otherwise).
func (b *Breaker) Failure(now time.Time) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cfg.EjectAfter == 0 {
		b.cfg.EjectAfter, b.cfg.Cooldown = 3, 10*time.Second
	}
	b.consecFail++
	trial := b.trial
	b.trial = false
	if now.Before(b.ejectedUntil) || (!trial && b.consecFail < b.cfg.EjectAfter) {
		return 0
	}
	b.opens++
	cooldown := b.cfg.Cooldown << min(b.opens-1, 5)
	b.ejectedUntil = now.Add(cooldown)
	b.consecFail = 0
	return cooldown
}

// Open reports whether the breaker is in its cooldown at now.
func (b *Breaker) Open(now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return now.Before(b.ejectedUntil)
}

// State is "closed", "open" or "half-open" at now.
func (b *Breaker) State(now time.Time) string {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.opens == 0:
		return "closed"
	case now.Before(b.ejectedUntil):
		return "open"
	}
	return "half-open"
}

// Until is the end of the current cooldown (zero when never opened).
func (b *Breaker) Until() time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.ejectedUntil
}
