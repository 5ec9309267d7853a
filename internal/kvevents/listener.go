package kvevents

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
)

// defaultMaxConnections bounds a Listener's connections by default.
const defaultMaxConnections = 1024

// ListenOptions tunes a Listener; the zero value gives the defaults.
type ListenOptions struct {
	// OnError, when set, receives dropped messages (*MessageError) and
	// connection failures (wrapping ErrConnection: a failed handshake, a
	// publisher that went away, a connection refused over MaxConnections).
	// It runs on the connection's goroutine, so calls for different
	// connections may run concurrently.
	OnError func(error)
	// OnConnect, when set, runs on the connection's goroutine after a
	// publisher's handshake, before its first message.
	OnConnect func(remote net.Addr)
	// HandshakeTimeout bounds the ZMTP handshake of an accepted connection.
	// Default 5 s.
	HandshakeTimeout time.Duration
	// MaxConnections bounds the connections open at once, handshaking or
	// not; further ones are closed at once. Default 1024.
	MaxConnections int
}

// ListenerStats counts what a Listener saw.
type ListenerStats struct {
	Messages uint64 // batches passed to the handler
	Dropped  uint64 // messages that failed to decode
	Connects uint64 // publisher handshakes completed
	Rejected uint64 // connections closed at once because MaxConnections were open
	Active   int    // publishers connected now
}

// Listener is a bound ZMQ SUB socket that many publishers connect to
// (llm-d's topology: every engine's PUB socket connects to the router).
// Create it with Listen.
type Listener struct {
	ln      net.Listener
	handler func(Message)
	opts    ListenOptions
	cancel  context.CancelFunc

	mu     sync.Mutex
	closed bool
	conns  map[net.Conn]struct{}

	done      chan struct{} // closed by shutdown
	wg        sync.WaitGroup
	closeOnce sync.Once
	closeErr  error

	messages, dropped, connects, rejected atomic.Uint64
	active                                atomic.Int64
}

// Listen binds a SUB socket on endpoint (tcp://HOST:PORT, with * for all
// interfaces and port 0 for any, or ipc://PATH) and accepts publishers'
// connections: each is handshaken as a ZMTP SUB peer and subscribed to every
// topic, and each message it sends, [topic, seq, payload], is decoded and
// passed to handler.
//
// handler runs on the connection's goroutine: calls for one connection come
// in order, calls for different connections may run concurrently. The
// Listener tracks no sequence numbers, since several publishers share the
// socket: the caller detects gaps per publisher, e.g. per (topic,
// data_parallel_rank). handler and the callbacks must not call Close (Close
// waits for them).
//
// The Listener stops when ctx ends or Close is called.
func Listen(ctx context.Context, endpoint string, handler func(Message), o ListenOptions) (*Listener, error) {
	if handler == nil {
		return nil, ErrNilHandler
	}
	if o.HandshakeTimeout <= 0 {
		o.HandshakeTimeout = handshakeTimeout
	}
	if o.MaxConnections <= 0 {
		o.MaxConnections = defaultMaxConnections
	}
	ln, err := listenEndpoint(ctx, endpoint)
	if err != nil {
		return nil, err
	}
	runCtx, cancel := context.WithCancel(ctx)
	l := &Listener{
		ln:      ln,
		handler: handler,
		opts:    o,
		cancel:  cancel,
		conns:   make(map[net.Conn]struct{}),
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

// Addr is the bound address (useful after binding port 0).
func (l *Listener) Addr() net.Addr { return l.ln.Addr() }

// Stats returns the counters so far; safe from any goroutine.
func (l *Listener) Stats() ListenerStats {
	return ListenerStats{
		Messages: l.messages.Load(),
		Dropped:  l.dropped.Load(),
		Connects: l.connects.Load(),
		Rejected: l.rejected.Load(),
		Active:   int(l.active.Load()),
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
		for conn := range l.conns {
			_ = conn.Close()
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

// accept starts serving conn, or closes it when the Listener is closed or
// full.
func (l *Listener) accept(conn net.Conn) {
	l.mu.Lock()
	switch {
	case l.closed:
		l.mu.Unlock()
		_ = conn.Close()
		return
	case len(l.conns) >= l.opts.MaxConnections:
		l.mu.Unlock()
		remote := conn.RemoteAddr()
		_ = conn.Close()
		l.rejected.Add(1)
		l.reportErr(fmt.Errorf("%w from %s: refused, %d connections open", ErrConnection, remote, l.opts.MaxConnections))
		return
	}
	_ = conn.SetDeadline(time.Now().Add(l.opts.HandshakeTimeout))
	l.conns[conn] = struct{}{}
	l.wg.Add(1)
	l.mu.Unlock()
	go l.serve(conn)
}

// serve runs one publisher's connection until it fails or the Listener
// closes.
func (l *Listener) serve(conn net.Conn) {
	defer l.wg.Done()
	remote := conn.RemoteAddr()
	err := l.session(conn)
	l.mu.Lock()
	delete(l.conns, conn)
	l.mu.Unlock()
	_ = conn.Close()
	if !l.isClosed() {
		l.reportErr(fmt.Errorf("%w from %s: %w", ErrConnection, remote, err))
	}
}

// session handshakes, subscribes to every topic and delivers messages until
// the connection fails.
func (l *Listener) session(conn net.Conn) error {
	zc, err := openZMTP(conn, zmq4.Sub, true)
	if err != nil {
		return err
	}
	_ = conn.SetDeadline(time.Time{}) // shutdown closes the connection
	// ZMTP 3.0 subscription to every topic: a one-frame message 0x01.
	if err := zc.SendMsg(zmq4.NewMsg([]byte{1})); err != nil {
		return err
	}
	l.connects.Add(1)
	l.active.Add(1)
	defer l.active.Add(-1)
	if l.opts.OnConnect != nil {
		l.opts.OnConnect(conn.RemoteAddr())
	}
	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			return err
		}
		if msg.Type == zmq4.CmdMsg {
			continue // PING and the like, answered by zmq4
		}
		m, err := DecodeFrames(msg.Frames)
		if err != nil {
			l.dropped.Add(1)
			l.reportErr(&MessageError{Topic: m.Topic, Seq: m.Seq, Err: err})
			continue
		}
		l.messages.Add(1)
		l.handler(m)
	}
}
