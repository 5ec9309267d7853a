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
// replica count: a client going away or a 4xx is Neutral. Each admitted
// request carries a Pass from Allow and reports with it, so that only the
// trial's own outcome closes or reopens a half-open breaker, and a request
// admitted before the breaker opened cannot close it or count again. Times
// are passed in, so tests drive it with a fake clock.
type Breaker struct {
	mu           sync.Mutex
	cfg          BreakerConfig
	consecFail   int
	ejectedUntil time.Time
	opens        int    // consecutive openings without a success in between
	epoch        uint64 // openings so far: a Pass from an older epoch is stale
	trial        bool   // half-open: a trial request is in flight
}

// Pass is what Allow gave one request: whether it is the half-open trial,
// and the breaker's epoch when it was admitted.
type Pass struct {
	Trial bool
	epoch uint64
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
// one trial at a time; never while open. Every admitted request is then
// reported with its Pass through exactly one of Success, Failure or Neutral.
func (b *Breaker) Allow(now time.Time) (bool, Pass) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.opens == 0 {
		return true, Pass{epoch: b.epoch}
	}
	if now.Before(b.ejectedUntil) || b.trial {
		return false, Pass{}
	}
	b.trial = true
	return true, Pass{Trial: true, epoch: b.epoch}
}

// current reports whether a non-trial pass was admitted in the present
// closed period (not before an opening since).
func (b *Breaker) current(p Pass) bool { return !p.Trial && p.epoch == b.epoch && b.opens == 0 }

// Success records a good exchange: the trial's closes the breaker; one
// admitted while closed restarts the failure count.
func (b *Breaker) Success(p Pass) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case p.Trial && b.trial && p.epoch == b.epoch:
		b.consecFail, b.opens, b.trial = 0, 0, false
	case b.current(p):
		b.consecFail = 0
	}
}

// Neutral ends an exchange that says nothing of the replica's health: the
// trial's frees the trial slot.
func (b *Breaker) Neutral(p Pass) {
	b.mu.Lock()
	if p.Trial && p.epoch == b.epoch {
		b.trial = false
	}
	b.mu.Unlock()
}

// Failure records a failure of the replica at now; it returns the cooldown
// when this failure opened the breaker (0 otherwise). A failed trial reopens
// it at once; EjectAfter consecutive failures of requests admitted while
// closed open it; a stale pass counts for nothing.
func (b *Breaker) Failure(now time.Time, p Pass) time.Duration {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cfg.EjectAfter == 0 {
		b.cfg.EjectAfter, b.cfg.Cooldown = 3, 10*time.Second
	}
	switch {
	case p.Trial && b.trial && p.epoch == b.epoch:
		b.trial = false
	case b.current(p):
		if b.consecFail++; b.consecFail < b.cfg.EjectAfter {
			return 0
		}
	default:
		return 0
	}
	b.opens++
	b.epoch++
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

// Health is what a request's outcome says of its replica's health, for
// its breaker (Outcome.Health).
type Health int8

const (
	// HealthNeutral says nothing: a client's fault (a 4xx), the client
	// gone, the gateway's own limit, a 429, or a request never sent. A
	// half-open breaker's trial slot is freed.
	HealthNeutral Health = iota
	// HealthOK: the replica served it. A trial's success closes the breaker.
	HealthOK
	// HealthFailed: the replica failed it (refused before any work, or
	// failed after the request was written). Counts towards opening the
	// breaker; a trial's failure reopens it.
	HealthFailed
)

// Ejection is a replica taken out of rotation by its breaker's opening.
type Ejection struct {
	Slot     int
	Name     string
	Cooldown time.Duration
}

// Allow asks the replica's breaker to send the ticket's request: always
// while closed; while half-open only as the one trial; never while open.
// The ticket keeps the breaker's pass, and Done reports the outcome's
// health with it, exactly once; a ticket not allowed (or never asked)
// reports nothing. Asking again answers the same.
func (t *Ticket) Allow() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.asked && !t.done {
		t.asked = true
		t.allowed, t.pass = t.r.Breaker.Allow(t.rt.cfg.Now())
	}
	return t.allowed
}

// report gives the breaker the ticket's health at its end (Done, once).
// A failure that opens the breaker takes the replica out of rotation at
// once and is heard by Config.OnEject.
func (t *Ticket) report(at time.Time, h Health) {
	t.mu.Lock()
	allowed, pass := t.allowed, t.pass
	t.mu.Unlock()
	if !allowed {
		return
	}
	b := &t.r.Breaker
	switch h {
	case HealthOK:
		b.Success(pass)
	case HealthFailed:
		if cooldown := b.Failure(at, pass); cooldown > 0 {
			t.r.UpdateHealthy(at)
			if f := t.rt.cfg.OnEject; f != nil {
				f(Ejection{Slot: t.Replica, Name: t.r.name, Cooldown: cooldown})
			}
		}
	default:
		b.Neutral(pass)
	}
}
