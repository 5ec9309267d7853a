package gateway

import (
	"cmp"
	"container/list"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Request bodies cost what has arrived. A body is read in the reads the
// client's bytes come in, and each read's bytes are charged to the body
// memory budget (max_body_memory) before they are kept: a client that
// declares 8 MiB and sends 100 bytes holds 100 bytes, not 8 MiB, so slow
// uploads cannot reserve the budget away from requests whose bodies are
// here. Three bounds keep one client from starving the others:
//
//   - max_body_bytes per body (413);
//   - a read deadline that grows with the bytes received, as Apache's
//     mod_reqtimeout does with MinRate (nginx's client_body_timeout and
//     Envoy's request timeouts are the same idea, per read or per request):
//     body_rate_grace, plus a second per min_body_rate bytes, never past
//     body_read_timeout. A per-read idle timeout would let a client keep a
//     body open forever with one byte per timeout; an average rate from the
//     start bounds the whole body, and the grace lets a client that pauses
//     at the start (TLS, a slow first packet) through. A body cut is 408;
//   - a per-client share of the budget (max_body_memory_share): the bytes
//     one client address holds at once, so one address (an IPv4 address,
//     an IPv6 /64: what one host can use) cannot fill the budget. Behind a
//     proxy the address is the proxy's: every client shares one share.
//
// A read whose bytes do not fit waits up to queue_timeout for room (other
// bodies end); then the body fails, 503 when the gateway's budget is full,
// 429 when the client's own share is, and gives back all it held.

var (
	// errBodyTimeout: the body arrived slower than min_body_rate, or not
	// within body_read_timeout.
	errBodyTimeout = &apiError{Status: http.StatusRequestTimeout, Type: "invalid_request_error", Code: "body_timeout"}
	// errClientBodyMemory: this client address holds its share of the body
	// memory (max_body_memory_share).
	errClientBodyMemory = &apiError{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "client_body_memory",
		Message: "this client address holds its share of the gateway's request-body memory (max_body_memory_share); retry later"}
)

// readChunk bounds one read of a body, so that one charge to the budget is
// small: a waiting read never needs much room to go on.
const readChunk = 64 << 10

// validateBodies checks the keys of request bodies' bounds.
func (c *Config) validateBodies() []error {
	var errs []error
	if c.MinBodyRate < 0 || c.MinBodyRate > 1<<30 || (c.MinBodyRate > 0 && c.BodyRateGrace <= 0) {
		errs = append(errs, keyErr("min_body_rate", "must be in [0, 1 GiB/s] (0: off), and body_rate_grace positive when it is on"))
	}
	if !(c.MaxBodyMemoryShare > 0 && c.MaxBodyMemoryShare <= 1) {
		errs = append(errs, keyErr("max_body_memory_share", "%v: want a fraction in (0, 1]", c.MaxBodyMemoryShare))
	}
	return errs
}

// bodyBudget is max_body_memory: the bytes of request bodies held at once,
// in all and per client address. Reads that do not fit wait in a queue,
// granted in order as bytes are given back, each as soon as it fits: a
// read waiting for its own client's share holds up nobody else's.
type bodyBudget struct {
	total, perClient int64
	held             atomic.Int64 // bytes held (the kvgate_request_body_bytes gauge)

	mu      sync.Mutex
	clients map[netip.Addr]int64 // bytes held per client address (no zero entries)
	waiters list.List            // of *bodyWaiter
}

// bodyWaiter is a read waiting for room; ready is closed once its bytes
// are charged.
type bodyWaiter struct {
	client netip.Addr
	n      int64
	ready  chan struct{}
	el     *list.Element
}

// newBodyBudget is cfg's budget. One client may always hold a body of
// max_body_bytes, whatever its share.
func newBodyBudget(cfg Config) *bodyBudget {
	per := max(int64(float64(cfg.MaxBodyMemory)*cfg.MaxBodyMemoryShare), cfg.MaxBodyBytes)
	return &bodyBudget{total: cfg.MaxBodyMemory, perClient: per, clients: map[netip.Addr]int64{}}
}

// fits says what, if anything, keeps n more bytes of client out (mu held):
// the budget as a whole (503), else the client's share (429).
func (b *bodyBudget) fits(client netip.Addr, n int64) error {
	switch {
	case b.held.Load()+n > b.total:
		return errBodyMemory
	case b.clients[client]+n > b.perClient:
		return errClientBodyMemory
	}
	return nil
}

// charge adds n bytes to client (mu held).
func (b *bodyBudget) charge(client netip.Addr, n int64) {
	b.clients[client] += n
	b.held.Add(n)
}

// take charges n bytes of client at once when they fit, else queues a
// waiter.
func (b *bodyBudget) take(client netip.Addr, n int64) *bodyWaiter {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.fits(client, n) == nil {
		b.charge(client, n)
		return nil
	}
	w := &bodyWaiter{client: client, n: n, ready: make(chan struct{})}
	w.el = b.waiters.PushBack(w)
	return w
}

// give returns n bytes of client, and grants the waiters that now fit,
// in order.
func (b *bodyBudget) give(client netip.Addr, n int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if left := b.clients[client] - n; left > 0 {
		b.clients[client] = left
	} else {
		delete(b.clients, client)
	}
	b.held.Add(-n)
	for e := b.waiters.Front(); e != nil; {
		w, next := e.Value.(*bodyWaiter), e.Next()
		if b.fits(w.client, w.n) == nil {
			b.charge(w.client, w.n)
			b.waiters.Remove(w.el)
			w.el = nil
			close(w.ready)
		}
		e = next
		if b.held.Load() >= b.total {
			break // nothing more fits
		}
	}
}

// cancel withdraws w: nil when it was granted meanwhile (its bytes are
// then charged, and the caller holds them), else what keeps it out.
func (b *bodyBudget) cancel(w *bodyWaiter) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if w.el == nil {
		return nil
	}
	b.waiters.Remove(w.el)
	w.el = nil
	return b.fits(w.client, w.n) // not nil: give grants every waiter that fits
}

// clientKey is the client address a body is charged to: the peer's IPv4
// address, or its IPv6 /64 (one host's usual allocation). Behind a proxy
// it is the proxy's.
func clientKey(r *http.Request) netip.Addr {
	ap, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil {
		return netip.Addr{} // not an IP peer (a Unix socket): one shared key
	}
	a := ap.Addr().Unmap()
	if a.Is6() {
		p, _ := a.Prefix(64)
		a = p.Addr()
	}
	return a
}

// bodyHold is what one body holds of the budget.
type bodyHold struct {
	b      *bodyBudget
	client netip.Addr
	n      int64
}

// release gives back all the body holds.
func (h *bodyHold) release() {
	if h.n > 0 {
		h.b.give(h.client, h.n)
		h.n = 0
	}
}

// chargeBody charges n more bytes to h: at once when they fit, else after a
// wait of up to queue_timeout (on the gateway's clock) for room. It
// returns the wall time waited: the body's read deadline does not count
// it against the client.
func (g *Gateway) chargeBody(ctx context.Context, h *bodyHold, n int64) (time.Duration, error) {
	w := h.b.take(h.client, n)
	if w == nil {
		h.n += n
		return 0, nil
	}
	start := time.Now()
	t := g.clock.NewTimer(g.conf().QueueTimeout.D())
	defer t.Stop()
	var gone error
	select {
	case <-w.ready:
		h.n += n
		return time.Since(start), nil
	case <-t.C():
	case <-ctx.Done():
		gone = context.Cause(ctx)
	}
	why := h.b.cancel(w)
	if why == nil {
		h.n += n // granted as the wait ended: held, given back with the rest
	}
	return time.Since(start), cmp.Or(gone, why)
}

// bodyDeadline is the read deadline of one request body: it grows with
// the bytes received (mod_reqtimeout's MinRate). It is wall time, as a
// socket's deadline is.
type bodyDeadline struct {
	rc           http.ResponseController
	start        time.Time
	grace, limit time.Duration
	rate, got    int64
}

func (g *Gateway) newBodyDeadline(w http.ResponseWriter) *bodyDeadline {
	return &bodyDeadline{rc: *http.NewResponseController(w), start: time.Now(), grace: g.cfg.BodyRateGrace.D(),
		limit: g.cfg.BodyReadTimeout.D(), rate: g.cfg.MinBodyRate}
}

// allowed is how long the body may take, with got bytes received.
func (d *bodyDeadline) allowed() (time.Duration, bool) {
	if d.rate <= 0 {
		return d.limit, false
	}
	secs := d.got / d.rate
	if secs > int64(d.limit/time.Second) {
		return d.limit, false // (and no overflow below)
	}
	byRate := d.grace + time.Duration(secs)*time.Second + time.Duration(d.got%d.rate)*time.Second/time.Duration(d.rate)
	if byRate >= d.limit {
		return d.limit, false
	}
	return byRate, true
}

// arm sets the socket's read deadline for got bytes received.
func (d *bodyDeadline) arm() {
	a, _ := d.allowed()
	_ = d.rc.SetReadDeadline(d.start.Add(a))
}

// received notes n more bytes; waited is time the gateway made the body
// wait (for memory), which is not the client's.
func (d *bodyDeadline) received(n int64, waited time.Duration) {
	d.got += n
	d.start = d.start.Add(waited)
	d.arm()
}

// end ends the body's deadline. A body read whole lifts it, so that a
// client's disconnect is still noticed during a stream (net/http's
// background read). A body that failed keeps it: before the answer
// net/http discards the unread rest of the body (up to 256 KiB, so that a
// client still sending reads its answer rather than a reset), and that
// discard must not wait past the body's deadline on a client that
// stopped sending.
func (d *bodyDeadline) end(ok bool) {
	if ok {
		_ = d.rc.SetReadDeadline(time.Time{})
	}
}

// timeout is the 408 for a body whose deadline passed.
func (d *bodyDeadline) timeout() error {
	if _, byRate := d.allowed(); byRate {
		return errBodyTimeout.with(fmt.Sprintf("the request body arrived slower than %d bytes/s (min_body_rate, after %v)",
			d.rate, d.grace))
	}
	return errBodyTimeout.with(fmt.Sprintf("the request body did not arrive within %v (body_read_timeout)", d.limit))
}

// readBody reads a JSON request body whole, within max_body_bytes, the
// body memory budget (charged as the bytes arrive) and the body's read
// deadline. The returned release gives its memory back.
func (g *Gateway) readBody(w http.ResponseWriter, r *http.Request) ([]byte, func(), error) {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(ct, "application/json") {
		return nil, nil, errContentType
	}
	return g.readBodyAs(w, r)
}

// readBodyAs is readBody whatever the body's content type says.
func (g *Gateway) readBodyAs(w http.ResponseWriter, r *http.Request) ([]byte, func(), error) {
	if r.ContentLength > g.cfg.MaxBodyBytes {
		return nil, nil, errTooLarge.with(fmt.Sprintf("request body larger than %d bytes", g.cfg.MaxBodyBytes))
	}
	h := &bodyHold{b: g.bodies, client: clientKey(r)}
	dl := g.newBodyDeadline(w)
	dl.arm()
	body, err := g.readCharged(r, http.MaxBytesReader(w, r.Body, g.cfg.MaxBodyBytes), h, dl, g.cfg.MaxBodyBytes)
	dl.end(err == nil)
	if err != nil {
		h.release()
		return nil, nil, err
	}
	return body, h.release, nil
}

// readCharged reads r to its end, charging each read's bytes to h and to
// the deadline. The buffer grows as the bytes come (from 4 KiB, doubling),
// never from the declared length, and not past size (the Content-Length,
// or limit): what a body allocates is at most twice what it was charged,
// plus 4 KiB.
func (g *Gateway) readCharged(req *http.Request, r io.Reader, h *bodyHold, dl *bodyDeadline, limit int64) ([]byte, error) {
	size := limit
	if req.ContentLength >= 0 {
		size = min(req.ContentLength, limit)
	}
	var buf []byte
	for {
		if len(buf) == cap(buf) {
			if int64(len(buf)) >= size {
				return buf, g.readEnd(req, r, dl)
			}
			buf = growTo(buf, size)
		}
		n, err := r.Read(buf[len(buf):min(cap(buf), len(buf)+readChunk)])
		if n > 0 {
			waited, gerr := g.chargeBody(req.Context(), h, int64(n))
			if gerr != nil {
				return nil, gerr
			}
			buf = buf[:len(buf)+n]
			dl.received(int64(n), waited)
		}
		if errors.Is(err, io.EOF) {
			return buf, nil
		}
		if err != nil {
			return nil, bodyError(dl, err)
		}
	}
}

// readEnd reads past the bytes a body was expected to have: its end, or
// max_body_bytes overrun.
func (g *Gateway) readEnd(req *http.Request, r io.Reader, dl *bodyDeadline) error {
	var probe [1]byte
	n, err := r.Read(probe[:])
	switch {
	case errors.Is(err, io.EOF) && n == 0:
		return nil
	case err != nil:
		return bodyError(dl, err)
	}
	// net/http never reads past a Content-Length, and an unknown length
	// reads up to max_body_bytes: a byte here is past the limit.
	return errTooLarge.with(fmt.Sprintf("request body larger than %d bytes", min(req.ContentLength, g.cfg.MaxBodyBytes)))
}

// growTo is buf with more capacity: doubling from 4 KiB, at most size
// (more than cap(buf)).
func growTo(buf []byte, size int64) []byte {
	out := make([]byte, len(buf), min(int64(max(2*cap(buf), 4<<10)), size))
	copy(out, buf)
	return out
}

// bodyError is the client's error for a body read that failed on its
// side: too large (413), too slow (408: dl says which bound, nil for a
// streamed upload's body_read_timeout), or broken (400).
func bodyError(dl *bodyDeadline, err error) error {
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe):
		return errTooLarge.with(fmt.Sprintf("request body larger than %d bytes", mbe.Limit))
	case errors.Is(err, os.ErrDeadlineExceeded) && dl != nil:
		return dl.timeout()
	case errors.Is(err, os.ErrDeadlineExceeded):
		return errBodyTimeout.with("the request body did not arrive within body_read_timeout")
	}
	return &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: "reading the request body: " + err.Error()}
}
