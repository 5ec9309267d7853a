package gateway

import (
	"context"
	"errors"
	"net"
	"net/http"
	"sync"
	"syscall"
	"time"
)

// Serve serves the gateway on ln until ctx ends, then drains: /ready answers
// 503 at once (the load balancer stops sending), keep-alives are turned off,
// and requests in flight — and any that still arrive — get drain_timeout
// to finish. Those still running then are cut: a stream ends with an SSE
// error event, others with a 503. Serve returns nil after a drain, the
// listener's error otherwise. Client connections are capped (max_connections).
func (g *Gateway) Serve(ctx context.Context, ln net.Listener) error {
	ln = newLimitListener(ln, g.maxConnections())
	srv := g.Server()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	g.StartDrain()
	srv.SetKeepAlivesEnabled(false)
	drained := g.waitIdle(g.cfg.DrainTimeout.D())
	if !drained {
		g.log.Warn("drain_timeout passed: cutting the requests still in flight", "in_flight", g.inFlight.Load())
	}
	g.cutNow()
	// Cut requests return at once; give their handlers a moment to write
	// their error event before the connections close.
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	if err := <-errc; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	g.log.Info("gateway stopped", "drained", drained)
	return nil
}

// StartDrain marks the gateway as draining: /ready answers 503.
func (g *Gateway) StartDrain() {
	if !g.draining.Swap(true) {
		g.log.Info("draining: /ready answers 503; in-flight requests may finish", "drain_timeout", g.cfg.DrainTimeout.D())
	}
}

// waitIdle waits until no request is in flight or d passes (wall time: a
// drain is the process's own lifetime, not a routing decision); it reports
// whether the gateway went idle.
func (g *Gateway) waitIdle(d time.Duration) bool {
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for g.inFlight.Load() > 0 {
		select {
		case <-deadline.C:
			return g.inFlight.Load() == 0
		case <-tick.C:
		}
	}
	return true
}

// maxConnections is the configured cap, or half the process's open-file
// limit: at the limit the other half stays free for upstream connections,
// scrapes and KV events, so requests already admitted can always reach a
// replica.
func (g *Gateway) maxConnections() int {
	if g.cfg.MaxConnections > 0 {
		return g.cfg.MaxConnections
	}
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err == nil && rl.Cur > 128 && rl.Cur < 1<<30 {
		return int(rl.Cur / 2)
	}
	return 4096
}

// limitListener accepts at most n connections at once (as
// golang.org/x/net/netutil's LimitListener): past the cap, Accept waits
// for a connection to close, and new clients wait in the kernel's backlog
// instead of taking the process's last file descriptors.
type limitListener struct {
	net.Listener
	sem  chan struct{}
	done chan struct{}
	once sync.Once
}

func newLimitListener(l net.Listener, n int) *limitListener {
	return &limitListener{Listener: l, sem: make(chan struct{}, n), done: make(chan struct{})}
}

func (l *limitListener) Accept() (net.Conn, error) {
	select {
	case l.sem <- struct{}{}:
	case <-l.done:
		return nil, net.ErrClosed
	}
	c, err := l.Listener.Accept()
	if err != nil {
		<-l.sem
		return nil, err
	}
	return &limitConn{Conn: c, release: func() { <-l.sem }}, nil
}

func (l *limitListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return l.Listener.Close()
}

type limitConn struct {
	net.Conn
	once    sync.Once
	release func()
}

// CloseWrite half-closes the connection when the underlying one can, as
// net/http does before closing after an error answer (so a client still
// sending its body reads the answer rather than a reset).
func (c *limitConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

func (c *limitConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
