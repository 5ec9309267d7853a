package gateway

import (
	"context"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// limiter bounds the requests the gateway proxies at once. Past the limit a
// request waits in a bounded queue: a full queue answers 429 with
// Retry-After at once (shed load before it costs anything), a wait longer
// than the queue timeout answers 503. Admitted requests then see replicas
// that are busy but not drowning, so their latency stays bounded however
// much traffic arrives.
type limiter struct {
	slots   chan struct{}
	waiting atomic.Int64
	maxWait int64
	timeout time.Duration
}

var (
	errOverloaded = &apiError{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "overloaded",
		Message: "the gateway is at its concurrency limit and its queue is full; retry later"}
	errQueueTimeout = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "queue_timeout",
		Message: "the request waited in the gateway's queue longer than its queue timeout"}
)

func newLimiter(concurrency, queue int, timeout time.Duration) *limiter {
	if concurrency <= 0 {
		return nil
	}
	return &limiter{slots: make(chan struct{}, concurrency), maxWait: int64(queue), timeout: timeout}
}

// acquire takes a slot, or returns the error to answer with.
func (l *limiter) acquire(ctx context.Context, clk clock.Clock) error {
	if l == nil {
		return nil
	}
	select {
	case l.slots <- struct{}{}:
		return nil
	default:
	}
	if l.waiting.Add(1) > l.maxWait {
		l.waiting.Add(-1)
		return errOverloaded
	}
	defer l.waiting.Add(-1)
	var timeout <-chan time.Time
	if l.timeout > 0 {
		t := clk.NewTimer(l.timeout)
		defer t.Stop()
		timeout = t.C()
	}
	select {
	case l.slots <- struct{}{}:
		return nil
	case <-timeout:
		return errQueueTimeout
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

func (l *limiter) release() {
	if l != nil {
		<-l.slots
	}
}

// queued is the number of requests waiting for a slot.
func (l *limiter) queued() int64 {
	if l == nil {
		return 0
	}
	return l.waiting.Load()
}

// inUse is the number of admitted requests.
func (l *limiter) inUse() int {
	if l == nil {
		return 0
	}
	return len(l.slots)
}
