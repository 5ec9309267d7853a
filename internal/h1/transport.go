// Package h1 is a lean HTTP/1.1 client transport for plain http://
// replicas. net/http's Transport runs two goroutines per connection
// (persistConn's readLoop and writeLoop) and hands every request and
// response between them and the caller over channels: two goroutine
// wake-ups per request, plus its own request/response bookkeeping. This
// transport writes the request and reads the response on the caller's
// goroutine over a pooled keep-alive connection, as fasthttp does; the
// parsing itself stays net/http's (http.ReadResponse, its chunked and
// Content-Length framing), bounded by a header size limit.
//
// Anything it does not handle goes to a fallback RoundTripper (net/http's
// Transport): https, bodies of unknown length, larger than MaxBody or
// streamed (no GetBody), upgrades, trailers, user info in the URL.
package h1

import (
	"context"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// Options configure a Transport; zero values take the defaults.
type Options struct {
	// Fallback serves the requests the lean path does not (required).
	Fallback http.RoundTripper
	// Dial opens a connection (default: net.Dialer with ConnectTimeout
	// and 30 s TCP keep-alive).
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// ConnectTimeout bounds the default Dial (0: none but the context).
	ConnectTimeout time.Duration
	// MaxIdlePerHost bounds the idle connections kept per host
	// (default 1024).
	MaxIdlePerHost int
	// IdleTimeout closes a connection idle this long (default 4 s: below
	// uvicorn's 5 s keep-alive, so that a request is never written on a
	// connection the replica is closing).
	IdleTimeout time.Duration
	// MaxHeaderBytes bounds a response's header, 1xx responses included
	// (default 64 KiB): a replica's reply is outside input.
	MaxHeaderBytes int64
	// MaxBody is the largest request body sent by the lean path (default
	// 1 MiB); larger ones go to the fallback, which reads an early answer
	// while it still writes.
	MaxBody int64
	// Clock times idle connections (default: the wall clock).
	Clock clock.Clock
}

// Defaults.
const (
	DefaultMaxIdlePerHost = 1024
	DefaultIdleTimeout    = 4 * time.Second
	DefaultMaxHeaderBytes = 64 << 10
	DefaultMaxBody        = 1 << 20
)

// Transport is an http.RoundTripper: the lean path for plain HTTP/1.1,
// the fallback for the rest. Safe for concurrent use.
type Transport struct {
	o     Options
	pools sync.Map // host:port → *pool; read without a lock on every request
}

// New builds a Transport.
func New(o Options) *Transport {
	if o.Fallback == nil {
		panic("h1: Options.Fallback is required")
	}
	if o.MaxIdlePerHost <= 0 {
		o.MaxIdlePerHost = DefaultMaxIdlePerHost
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = DefaultIdleTimeout
	}
	if o.MaxHeaderBytes <= 0 {
		o.MaxHeaderBytes = DefaultMaxHeaderBytes
	}
	if o.MaxBody <= 0 {
		o.MaxBody = DefaultMaxBody
	}
	if o.Dial == nil {
		d := &net.Dialer{Timeout: o.ConnectTimeout, KeepAlive: 30 * time.Second}
		o.Dial = d.DialContext
	}
	o.Clock = clock.OrReal(o.Clock)
	return &Transport{o: o}
}

// Lean reports whether req takes the lean path.
func (t *Transport) Lean(req *http.Request) bool {
	u := req.URL
	if u == nil || u.Scheme != "http" || u.User != nil || u.Host == "" || req.Method == http.MethodConnect {
		return false
	}
	if len(req.TransferEncoding) > 0 || len(req.Trailer) > 0 || req.Header.Get("Upgrade") != "" {
		return false
	}
	switch {
	case req.Body == nil || req.Body == http.NoBody:
		return true
	case req.ContentLength > 0 && req.ContentLength <= t.o.MaxBody && req.GetBody != nil:
		return true
	}
	// Unknown length (a chunked upload), large, or streamed (no GetBody:
	// a client's upload still arriving, whose replica may answer early and
	// stop reading: net/http's Transport reads that answer while it writes).
	return false
}

// RoundTrip sends req and reads the response's header; its body is read
// from the connection as the caller reads it, and the connection goes
// back to the pool once the body is read to its end.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	if !t.Lean(req) {
		return t.o.Fallback.RoundTrip(req)
	}
	ctx := req.Context()
	if ctx.Err() != nil {
		closeBody(req)
		return nil, context.Cause(ctx)
	}
	p := t.pool(hostPort(req.URL.Host))
	for retried := false; ; retried = true {
		c, err := p.get(ctx)
		if err != nil {
			closeBody(req)
			if ctx.Err() != nil {
				err = context.Cause(ctx)
			}
			return nil, err
		}
		resp, err := c.roundTrip(ctx, req, t.o.MaxHeaderBytes)
		if err == nil {
			return resp, nil
		}
		if ctx.Err() != nil {
			err = context.Cause(ctx)
		}
		if retried || !c.reused || !retryable(req, err) || !rewind(req) {
			return nil, err // the body was closed when written
		}
		// A reused connection the replica had closed, found before any of
		// the request reached it (or before any answer, for an idempotent
		// request): safe to send again on a new one, as net/http does.
	}
}

// rewind makes req's body readable again for a retry.
func rewind(req *http.Request) bool {
	if req.Body == nil || req.Body == http.NoBody {
		return true
	}
	if req.GetBody == nil {
		return false
	}
	b, err := req.GetBody()
	if err != nil {
		return false
	}
	req.Body = b
	return true
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// hostPort adds HTTP's default port to a host without one.
func hostPort(host string) string {
	if _, port, err := net.SplitHostPort(host); err == nil && port != "" {
		return host
	}
	return net.JoinHostPort(trimBrackets(host), "80")
}

func trimBrackets(h string) string {
	if len(h) > 1 && h[0] == '[' && h[len(h)-1] == ']' {
		return h[1 : len(h)-1]
	}
	return h
}

// pool is the transport's pool of the host addr, made on first use.
func (t *Transport) pool(addr string) *pool {
	if p, ok := t.pools.Load(addr); ok {
		return p.(*pool)
	}
	p, _ := t.pools.LoadOrStore(addr, &pool{t: t, addr: addr})
	return p.(*pool)
}

// CloseIdleConnections closes every idle connection, the fallback's too.
func (t *Transport) CloseIdleConnections() {
	t.pools.Range(func(_, p any) bool {
		p.(*pool).closeIdle(func(*conn) bool { return true })
		return true
	})
	if ci, ok := t.o.Fallback.(interface{ CloseIdleConnections() }); ok {
		ci.CloseIdleConnections()
	}
}

// Idle is the number of idle connections to addr (host:port), for tests
// and metrics.
func (t *Transport) Idle(addr string) int {
	v, ok := t.pools.Load(addr)
	if !ok {
		return 0
	}
	p := v.(*pool)
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.idle)
}
