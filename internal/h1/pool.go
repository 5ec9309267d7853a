package h1

import (
	"bufio"
	"context"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// pool is one host's idle keep-alive connections: a stack, the most
// recently used on top (a hot connection is reused, the cold ones age out
// at the bottom), at most MaxIdlePerHost. A timer, armed while any is idle,
// closes those idle longer than IdleTimeout: no goroutine per connection.
type pool struct {
	t     *Transport
	addr  string
	mu    sync.Mutex
	idle  []*conn
	sweep clock.Timer // nil: not armed
}

// get pops a live idle connection, or dials a new one.
func (p *pool) get(ctx context.Context) (*conn, error) {
	now := p.t.o.Clock.Now()
	for {
		p.mu.Lock()
		n := len(p.idle)
		if n == 0 {
			p.mu.Unlock()
			break
		}
		c := p.idle[n-1]
		p.idle[n-1] = nil
		p.idle = p.idle[:n-1]
		p.mu.Unlock()
		if now.Sub(c.idleAt) < p.t.o.IdleTimeout && c.alive() {
			c.reused = true
			return c, nil
		}
		_ = c.nc.Close()
	}
	nc, err := p.t.o.Dial(ctx, "tcp", p.addr)
	if err != nil {
		return nil, err
	}
	return newConn(p, nc), nil
}

// put returns a connection whose exchange ended cleanly; false when the
// pool is full (the caller closes it).
func (p *pool) put(c *conn) bool {
	c.idleAt = p.t.o.Clock.Now()
	c.reused = false
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.idle) >= p.t.o.MaxIdlePerHost {
		return false
	}
	p.idle = append(p.idle, c)
	if p.sweep == nil {
		p.sweep = p.t.o.Clock.AfterFunc(p.t.o.IdleTimeout, p.sweepIdle)
	}
	return true
}

// sweepIdle closes the connections idle past IdleTimeout, and re-arms
// while some remain. A pool left empty leaves the transport's map, which
// so holds only the hosts used lately (a discovery churning through
// addresses does not grow it); a request that still holds it may pool a
// connection in it, which its own timer closes.
func (p *pool) sweepIdle() {
	now := p.t.o.Clock.Now()
	p.closeIdle(func(c *conn) bool { return now.Sub(c.idleAt) >= p.t.o.IdleTimeout })
	p.mu.Lock()
	defer p.mu.Unlock()
	p.sweep = nil
	if len(p.idle) > 0 {
		p.sweep = p.t.o.Clock.AfterFunc(p.t.o.IdleTimeout, p.sweepIdle)
		return
	}
	p.t.pools.CompareAndDelete(p.addr, p)
}

// closeIdle closes the idle connections stale says to.
func (p *pool) closeIdle(stale func(*conn) bool) {
	p.mu.Lock()
	var closing []*conn
	keep := p.idle[:0]
	for _, c := range p.idle {
		if stale(c) {
			closing = append(closing, c)
		} else {
			keep = append(keep, c)
		}
	}
	clear(p.idle[len(keep):])
	p.idle = keep
	p.mu.Unlock()
	for _, c := range closing {
		_ = c.nc.Close()
	}
}

// conn is one connection to a replica, with its buffers. lim bounds what
// the reader takes from the connection while a response header is read.
type conn struct {
	p      *pool
	nc     net.Conn
	raw    syscall.RawConn // nil: not a socket (tests), alive trusts it
	lim    limitReader
	out    countWriter
	body   io.LimitedReader // writeRequest's reader of the request body
	fixed  fixedBody        // the body of a response fastResponse read
	br     *bufio.Reader
	bw     *bufio.Writer
	idleAt time.Time
	reused bool
	peek   func(fd uintptr) bool // alive's probe, made once
	peeked peekResult
	// peekBuf receives alive's peeked byte, never read: the peek only
	// tells whether one is there.
	peekBuf [1]byte
}

func newConn(p *pool, nc net.Conn) *conn {
	c := &conn{p: p, nc: nc}
	c.lim = limitReader{r: nc, n: unlimited}
	c.br = bufio.NewReaderSize(&c.lim, 4096)
	c.out.c = c
	c.bw = bufio.NewWriterSize(&c.out, 4096)
	if sc, ok := nc.(syscall.Conn); ok {
		if raw, err := sc.SyscallConn(); err == nil {
			c.raw = raw
			c.peek = c.peekFD
		}
	}
	return c
}

// limitReader reads from r until n bytes are read, then answers
// errHeaderTooLarge.
type limitReader struct {
	r net.Conn
	n int64
}

const unlimited = 1<<63 - 1

func (l *limitReader) Read(b []byte) (int, error) {
	if l.n <= 0 {
		return 0, errHeaderTooLarge
	}
	if int64(len(b)) > l.n {
		b = b[:l.n]
	}
	n, err := l.r.Read(b)
	l.n -= int64(n)
	return n, err
}

type peekResult struct {
	n   int
	err error
}

// alive tells whether an idle connection can carry a request: nothing to
// read, no end of stream (the replica closed it, e.g. its keep-alive ran
// out), found by a non-blocking peek at the socket. Data where none is
// due is a broken exchange: not alive either.
func (c *conn) alive() bool {
	if c.br.Buffered() > 0 {
		return false
	}
	if c.raw == nil {
		return true
	}
	if err := c.raw.Read(c.peek); err != nil {
		return false
	}
	return c.peeked.err == syscall.EAGAIN || c.peeked.err == syscall.EWOULDBLOCK
}

func (c *conn) peekFD(fd uintptr) bool {
	n, _, err := syscall.Recvfrom(int(fd), c.peekBuf[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	c.peeked = peekResult{n, err}
	return true // never wait for readiness
}

// abort ends a connection's exchange at once (its context ended): the
// read or write in progress fails.
func (c *conn) abort() { _ = c.nc.SetDeadline(aLongTimeAgo) }

var aLongTimeAgo = time.Unix(1, 0)
