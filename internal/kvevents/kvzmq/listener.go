package kvzmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvgate/kvgate/internal/kvevents"
)

// Listener defaults.
const (
	defaultMaxConnections = 1024
	// DefaultMaxConnectionsPerAddress: an engine opens one connection per
	// listening port (one per data-parallel rank, each on its own port),
	// and a host rarely runs more than 8 engines; 16 leaves room for a
	// restart's overlap.
	DefaultMaxConnectionsPerAddress = 16
	// DefaultIdleTimeout: vLLM's publisher sends a batch for every engine
	// step that stores or evicts a block, and no ZMTP heartbeat (it sets no
	// ZMQ_HEARTBEAT_IVL). An idle engine's connection is closed after this
	// long and libzmq reconnects it at once (ZMQ_RECONNECT_IVL, 100 ms),
	// losing nothing since it had nothing to send; a dead or hostile peer
	// frees its slot.
	DefaultIdleTimeout = 5 * time.Minute
)

// ListenOptions tunes a Listener; the zero value gives the defaults.
type ListenOptions struct {
	// OnError, when set, receives dropped messages (*MessageError) and the
	// end of every connection (*ConnError, which wraps ErrConnection: a
	// refusal at accept, a failed handshake, a frame over MaxFrameBytes, an
	// idle timeout, a publisher that went away). It runs on the accepting
	// or the connection's goroutine, so calls may run concurrently.
	OnError func(error)
	// OnConnect, when set, runs on the connection's goroutine after a
	// publisher's handshake, before its first message.
	OnConnect func(remote net.Addr)
	// HandshakeTimeout bounds the ZMTP handshake of an accepted connection
	// (whose frames are capped at 64 KiB). Default 5 s.
	HandshakeTimeout time.Duration
	// MaxConnections bounds the connections open at once, handshaking or
	// not. When they are all taken, a newcomer takes the slot of the
	// longest-idle connection of the source address holding the most, if
	// that address holds more than the newcomer's; otherwise it is closed
	// at once. So idle peers from a few addresses never lock a publisher
	// out. Default 1024.
	MaxConnections int
	// MaxConnectionsPerAddress bounds the connections from one source
	// address; further ones are closed at once. Default
	// DefaultMaxConnectionsPerAddress.
	MaxConnectionsPerAddress int
	// MaxFrameBytes caps one frame of a message (and the message, plus 64
	// KiB for its topic and sequence frames): a publisher that announces a
	// larger one is disconnected before anything is allocated for it.
	// Default DefaultMaxFrameBytes.
	MaxFrameBytes int
	// IdleTimeout closes a connection that sent nothing whole (no message,
	// no ZMTP command) for this long. Default DefaultIdleTimeout.
	IdleTimeout time.Duration
	// AcceptFrom, when set, decides at accept whether a source address
	// may connect at all (the address is invalid for a non-TCP peer);
	// refused connections are closed before the handshake. It runs on the
	// accepting goroutine: it must not block.
	AcceptFrom func(remote netip.Addr) bool
	// Authorize, when set, decides for each message, before its payload is
	// decoded, whether the publisher at remote may publish under topic. A
	// refused message is dropped, counted in Stats().Unauthorized and
	// reported to OnError as a *MessageError wrapping Authorize's error.
	Authorize func(remote netip.Addr, topic string) error
}

// Reason says why a Listener's connection ended.
type Reason string

// The reasons a Listener refuses or closes a connection.
const (
	ReasonPeerAddress    Reason = "peer_address"    // AcceptFrom refused its source address
	ReasonPerAddress     Reason = "per_address"     // MaxConnectionsPerAddress from its address
	ReasonMaxConnections Reason = "max_connections" // MaxConnections, and none to evict
	ReasonEvicted        Reason = "evicted"         // its slot went to a newcomer (MaxConnections)
	ReasonHandshake      Reason = "handshake"       // no valid ZMTP handshake within HandshakeTimeout
	ReasonFrameSize      Reason = "frame_size"      // a frame over MaxFrameBytes
	ReasonIdle           Reason = "idle"            // nothing whole for IdleTimeout
	ReasonClosed         Reason = "closed"          // the publisher went away, or the connection failed
)

// ConnError reports a connection of a Listener that ended, and why.
type ConnError struct {
	Remote net.Addr
	Reason Reason
	Err    error // what ended it; nil for a refusal at accept
}

func (e *ConnError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("kvevents: connection from %s refused: %s", e.Remote, e.Reason)
	}
	return fmt.Sprintf("kvevents: connection from %s closed (%s): %v", e.Remote, e.Reason, e.Err)
}

func (e *ConnError) Unwrap() []error {
	if e.Err == nil {
		return []error{ErrConnection}
	}
	return []error{ErrConnection, e.Err}
}

// ListenerStats counts what a Listener saw.
type ListenerStats struct {
	Messages     uint64 // batches passed to the handler
	Dropped      uint64 // messages that failed to decode
	Unauthorized uint64 // messages Authorize refused
	Connects     uint64 // publisher handshakes completed
	// Rejected counts connections closed at accept (AcceptFrom,
	// MaxConnectionsPerAddress, MaxConnections).
	Rejected         uint64
	Evicted          uint64 // connections whose slot went to a newcomer
	FailedHandshakes uint64
	Oversized        uint64 // connections closed for a frame over MaxFrameBytes
	Idle             uint64 // connections closed after IdleTimeout
	Active           int    // publishers connected now
}

// Listener is a bound ZMQ SUB socket that many publishers connect to
// (llm-d's topology: every engine's PUB socket connects to the router).
// Create it with Listen.
type Listener struct {
	ln      net.Listener
	handler func(kvevents.Message)
	opts    ListenOptions
	limits  frameLimits
	cancel  context.CancelFunc

	mu      sync.Mutex
	closed  bool
	conns   map[*lconn]struct{}
	perAddr map[netip.Addr]int

	done      chan struct{} // closed by shutdown
	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error

	messages, dropped, unauthorized, connects atomic.Uint64
	rejected, evicted, handshakes, oversized  atomic.Uint64
	idle                                      atomic.Uint64
	active                                    atomic.Int64
}

// lconn is one accepted connection.
type lconn struct {
	conn net.Conn
	addr netip.Addr
	// last (unix ns) is when it was accepted or last sent something
	// whole: the eviction takes the longest idle.
	last    atomic.Int64
	evicted atomic.Bool
}

func (c *lconn) touch() { c.last.Store(time.Now().UnixNano()) }

// Listen binds a SUB socket on endpoint (tcp://HOST:PORT, with * for all
// interfaces and port 0 for any, or ipc://PATH) and accepts publishers'
// connections: each is handshaken as a ZMTP SUB peer and subscribed to every
// topic, and each message it sends, [topic, seq, payload], is checked
// (ListenOptions.Authorize), decoded and passed to handler.
//
// handler runs on the connection's goroutine: calls for one connection come
// in order, calls for different connections may run concurrently. The
// Listener tracks no sequence numbers, since several publishers share the
// socket: the caller detects gaps per publisher, e.g. per (topic,
// data_parallel_rank). handler and the callbacks must not call Close (Close
// waits for them).
//
// What one peer may cost is bounded: its connections (per source address
// and in all), its handshake (time and size), its frames' size and its
// silence (ListenOptions).
//
// The Listener stops when ctx ends or Close is called.
func Listen(ctx context.Context, endpoint string, handler func(kvevents.Message), o ListenOptions) (*Listener, error) {
	if handler == nil {
		return nil, ErrNilHandler
	}
	o = o.withDefaults()
	ln, err := listenEndpoint(ctx, endpoint)
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	l := &Listener{
		ln:      ln,
		handler: handler,
		opts:    o,
		limits:  batchLimits(o.MaxFrameBytes),
		cancel:  cancel,
		conns:   make(map[*lconn]struct{}),
		perAddr: make(map[netip.Addr]int),
		done:    make(chan struct{}),
	}
	l.wg.Add(2)
	go func() {
		defer l.wg.Done()
		acceptLoop(ln, l.done, l.accept)
	}()
	go func() {
		defer l.wg.Done()
		<-runCtx.Done() // ctx ended, or shutdown cancelled it
		l.shutdown()
	}()
	return l, nil
}

func (o ListenOptions) withDefaults() ListenOptions {
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = handshakeTimeout
	}
	if o.MaxConnections <= 0 {
		o.MaxConnections = defaultMaxConnections
	}
	if o.MaxConnectionsPerAddress <= 0 {
		o.MaxConnectionsPerAddress = DefaultMaxConnectionsPerAddress
	}
	if o.MaxFrameBytes <= 0 {
		o.MaxFrameBytes = DefaultMaxFrameBytes
	}
	if o.IdleTimeout <= 0 {
		o.IdleTimeout = DefaultIdleTimeout
	}
	return o
}

// Addr is the bound address (useful after binding port 0).
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// Stats returns the counters so far; safe from any goroutine.
func (l *Listener) Stats() ListenerStats {
	return ListenerStats{
		Messages:         l.messages.Load(),
		Dropped:          l.dropped.Load(),
		Unauthorized:     l.unauthorized.Load(),
		Connects:         l.connects.Load(),
		Rejected:         l.rejected.Load(),
		Evicted:          l.evicted.Load(),
		FailedHandshakes: l.handshakes.Load(),
		Oversized:        l.oversized.Load(),
		Idle:             l.idle.Load(),
		Active:           int(l.active.Load()),
	}
}

// Close stops accepting, closes every connection and waits for all
// goroutines (and so for handler calls in progress). It is idempotent.
func (l *Listener) Close() error {
	l.shutdown()
	l.wg.Wait()
	return l.closeErr
}

func (l *Listener) shutdown() {
	l.closeOnce.Do(func() {
		l.mu.Lock()
		l.closed = true
		close(l.done)
		l.cancel()
		for c := range l.conns {
			_ = c.conn.Close()
		}
		l.mu.Unlock()
		if err := l.ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			l.closeErr = err
		}
	})
}

func (l *Listener) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

func (l *Listener) reportErr(err error) {
	if l.opts.OnError != nil {
		l.opts.OnError(err)
	}
}

// remoteIP is a peer's source address (invalid for a non-TCP peer).
func remoteIP(a net.Addr) netip.Addr {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.AddrPort().Addr().Unmap().WithZone("")
	}
	return netip.Addr{}
}

// accept starts serving conn, or closes it when the Listener is closed,
// the source address is refused or at its cap, or every slot is taken and
// none can be evicted.
func (l *Listener) accept(conn net.Conn) {
	c := &lconn{conn: conn, addr: remoteIP(conn.RemoteAddr())}
	if l.opts.AcceptFrom != nil && !l.opts.AcceptFrom(c.addr) {
		l.refuse(conn, ReasonPeerAddress)
		return
	}
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		_ = conn.Close()
		return
	}
	if l.perAddr[c.addr] >= l.opts.MaxConnectionsPerAddress {
		l.mu.Unlock()
		l.refuse(conn, ReasonPerAddress)
		return
	}
	if len(l.conns) >= l.opts.MaxConnections {
		victim := l.victimFor(c.addr)
		if victim == nil {
			l.mu.Unlock()
			l.refuse(conn, ReasonMaxConnections)
			return
		}
		victim.evicted.Store(true)
		l.untrackLocked(victim)
		_ = victim.conn.Close() // its goroutine reports it
	}
	_ = conn.SetDeadline(time.Now().Add(l.opts.HandshakeTimeout))
	c.touch()
	l.conns[c] = struct{}{}
	l.perAddr[c.addr]++
	l.wg.Add(1)
	l.mu.Unlock()
	go l.serve(c)
}

// refuse closes a connection at accept and reports why.
func (l *Listener) refuse(conn net.Conn, why Reason) {
	remote := conn.RemoteAddr()
	_ = conn.Close()
	l.rejected.Add(1)
	l.reportErr(&ConnError{Remote: remote, Reason: why})
}

// victimFor picks the connection a newcomer from addr may take the slot
// of when every slot is taken: among the addresses holding the most
// connections, if they hold more than addr does, the longest idle of
// their connections (an idle peer rather than a publisher at work). A
// scan of every connection, only when the Listener is full. l.mu is held.
func (l *Listener) victimFor(addr netip.Addr) *lconn {
	most := 0
	for _, n := range l.perAddr {
		most = max(most, n)
	}
	if most <= l.perAddr[addr] {
		return nil
	}
	var victim *lconn
	for c := range l.conns {
		if l.perAddr[c.addr] == most && (victim == nil || c.last.Load() < victim.last.Load()) {
			victim = c
		}
	}
	return victim
}

// untrackLocked forgets c (idempotent). l.mu is held.
func (l *Listener) untrackLocked(c *lconn) {
	if _, ok := l.conns[c]; !ok {
		return
	}
	delete(l.conns, c)
	if l.perAddr[c.addr]--; l.perAddr[c.addr] <= 0 {
		delete(l.perAddr, c.addr)
	}
}

// serve runs one publisher's connection until it fails or the Listener
// closes, then reports why it ended.
func (l *Listener) serve(c *lconn) {
	defer l.wg.Done()
	handshaken, err := l.session(c)
	l.mu.Lock()
	l.untrackLocked(c)
	l.mu.Unlock()
	_ = c.conn.Close()
	if l.isClosed() {
		return
	}
	why := ReasonClosed
	switch {
	case c.evicted.Load():
		why = ReasonEvicted
		l.evicted.Add(1)
	case !handshaken:
		why = ReasonHandshake
		l.handshakes.Add(1)
	case errors.Is(err, ErrFrameSize):
		why = ReasonFrameSize
		l.oversized.Add(1)
	case errors.Is(err, os.ErrDeadlineExceeded):
		why = ReasonIdle
		l.idle.Add(1)
	}
	l.reportErr(&ConnError{Remote: c.conn.RemoteAddr(), Reason: why, Err: err})
}

// session handshakes, subscribes to every topic and delivers messages until
// the connection fails; handshaken reports whether the handshake passed.
func (l *Listener) session(c *lconn) (handshaken bool, err error) {
	conn := c.conn
	zc, err := openZMTP(conn, zmq4.Sub, true, l.limits)
	if err != nil {
		return false, err
	}
	// ZMTP 3.0 subscription to every topic: a one-frame message 0x01,
	// still within the handshake's deadline.
	if err := zc.SendMsg(zmq4.NewMsg([]byte{1})); err != nil {
		return false, err
	}
	_ = conn.SetDeadline(time.Time{}) // each read sets its own; shutdown closes the connection
	c.touch()
	l.connects.Add(1)
	l.active.Add(1)
	defer l.active.Add(-1)
	if l.opts.OnConnect != nil {
		l.opts.OnConnect(conn.RemoteAddr())
	}
	for {
		_ = conn.SetReadDeadline(time.Now().Add(l.opts.IdleTimeout))
		msg, err := zc.RecvMsg()
		if err != nil {
			return true, err
		}
		c.touch()
		if msg.Type == zmq4.CmdMsg {
			continue // PING and the like, answered by zmq4
		}
		l.deliver(c.addr, msg.Frames)
	}
}

// deliver checks, decodes and hands over one message.
func (l *Listener) deliver(from netip.Addr, frames [][]byte) {
	topic, seq, payload, err := kvevents.SplitFrames(frames)
	if err != nil {
		l.dropped.Add(1)
		l.reportErr(&MessageError{Err: err})
		return
	}
	if l.opts.Authorize != nil {
		if err := l.opts.Authorize(from, topic); err != nil {
			l.unauthorized.Add(1)
			l.reportErr(&MessageError{Topic: topic, Seq: seq, Err: err})
			return
		}
	}
	b, err := kvevents.Decode(payload)
	if err != nil {
		l.dropped.Add(1)
		l.reportErr(&MessageError{Topic: topic, Seq: seq, Err: err})
		return
	}
	l.messages.Add(1)
	l.handler(kvevents.Message{Topic: topic, Seq: seq, Batch: b})
}
