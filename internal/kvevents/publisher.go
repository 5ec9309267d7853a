package kvevents

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// Publisher sends batches to subscribers. Sequence numbers are assigned per
// publisher: 0, 1, 2, ... in Publish order.
type Publisher interface {
	Publish(b Batch) error
	Close() error
}

const (
	// defaultHWM bounds the messages queued per subscriber, as ZMQ's send
	// high-water mark does: past it a slow subscriber loses messages (and
	// sees the gap in the sequence) instead of stalling the replica.
	defaultHWM = 10_000
	// handshakeTimeout bounds the ZMTP greeting and READY exchange.
	handshakeTimeout = 5 * time.Second
	// flushTimeout bounds how long Close lets queued messages drain.
	flushTimeout = time.Second
)

// zmqPublisher is a ZMQ PUB socket built on zmq4's ZMTP 3.0 connection layer
// (greeting, NULL-security handshake, framing).
//
// It does not use zmq4's PUB socket type because that socket cannot be shut
// down cleanly: zmq4 v0.17's NewPub starts a writer goroutine
// (pubMWriter.run) that Close never stops, and its readers can block for ever
// on an internal channel. Here every goroutine has an owner and Close waits
// for all of them. Semantics are ZMQ PUB's: subscribers send ZMTP 3.0
// subscription messages (0x01 + prefix, 0x00 + prefix to cancel), a message
// goes to every peer subscribed to a prefix of its topic, and a peer whose
// queue is full (HWM) misses messages rather than blocking the publisher.
type zmqPublisher struct {
	topic []byte
	form  Form
	hwm   int
	ln    net.Listener

	mu      sync.Mutex
	seq     uint64
	closed  bool
	conns   map[net.Conn]struct{} // every accepted connection, handshaking or not
	peers   map[*pubPeer]struct{} // connections that completed the handshake
	dropped atomic.Uint64         // messages not queued because a peer was at its HWM

	done     chan struct{} // closed by shutdown
	wg       sync.WaitGroup
	shutOnce sync.Once
	closeErr error
}

var _ Publisher = (*zmqPublisher)(nil)

// pubPeer is one connected subscriber: a reader goroutine takes its
// subscriptions, a writer goroutine drains its queue.
type pubPeer struct {
	conn net.Conn
	zc   *zmq4.Conn
	out  chan zmq4.Msg

	mu   sync.Mutex
	subs map[string]int // prefix -> count (ZMQ counts duplicate subscriptions)

	outOnce sync.Once
}

func (pp *pubPeer) closeOut() { pp.outOnce.Do(func() { close(pp.out) }) }

func (pp *pubPeer) subscribed(topic []byte) bool {
	pp.mu.Lock()
	defer pp.mu.Unlock()
	for prefix := range pp.subs {
		if bytes.HasPrefix(topic, []byte(prefix)) {
			return true
		}
	}
	return false
}

// NewZMQPublisher binds a PUB socket on endpoint (tcp://HOST:PORT, with * for
// all interfaces, or ipc://PATH) and publishes every batch under topic with
// events in form f. It stops when ctx ends or Close is called; Close waits
// for its goroutines either way.
func NewZMQPublisher(ctx context.Context, endpoint, topic string, f Form) (Publisher, error) {
	return newZMQPublisher(ctx, endpoint, topic, f, defaultHWM)
}

func newZMQPublisher(ctx context.Context, endpoint, topic string, f Form, hwm int) (*zmqPublisher, error) {
	if f != FormMap && f != FormArray {
		return nil, fmt.Errorf("%w: %s", ErrUnknownForm, f)
	}
	network, addr, err := parseEndpoint(endpoint, true)
	if err != nil {
		return nil, err
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, network, addr)
	if err != nil {
		return nil, fmt.Errorf("kvevents: bind %s: %w", endpoint, err)
	}
	p := &zmqPublisher{
		topic: []byte(topic),
		form:  f,
		hwm:   hwm,
		ln:    ln,
		conns: make(map[net.Conn]struct{}),
		peers: make(map[*pubPeer]struct{}),
		done:  make(chan struct{}),
	}
	p.wg.Add(2)
	go p.accept()
	go func() {
		defer p.wg.Done()
		select {
		case <-ctx.Done():
			p.shutdown()
		case <-p.done:
		}
	}()
	return p, nil
}

// Addr is the bound address (useful after binding port 0).
func (p *zmqPublisher) Addr() net.Addr { return p.ln.Addr() }

// Dropped counts messages a subscriber missed because its queue was full.
func (p *zmqPublisher) Dropped() uint64 { return p.dropped.Load() }

func (p *zmqPublisher) accept() {
	defer p.wg.Done()
	delay := 5 * time.Millisecond
	for {
		conn, err := p.ln.Accept()
		if err != nil {
			select {
			case <-p.done:
				return
			default:
			}
			// A transient failure (out of file descriptors, ...): back off as
			// net/http's server does rather than spin.
			t := time.NewTimer(delay)
			select {
			case <-p.done:
				t.Stop()
				return
			case <-t.C:
			}
			delay = min(2*delay, time.Second)
			continue
		}
		delay = 5 * time.Millisecond
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = conn.Close()
			continue
		}
		p.conns[conn] = struct{}{}
		p.wg.Add(1)
		p.mu.Unlock()
		go p.serve(conn)
	}
}

// serve runs one subscriber connection: handshake, then read its
// subscriptions until it goes away. Its writer runs beside it.
func (p *zmqPublisher) serve(conn net.Conn) {
	defer p.wg.Done()
	// Until the peer is registered serve owns the connection; after that the
	// writer does, so that Close can flush what is queued.
	ownsConn := true
	defer func() {
		p.mu.Lock()
		delete(p.conns, conn)
		p.mu.Unlock()
		if ownsConn {
			_ = conn.Close()
		}
	}()

	_ = conn.SetDeadline(time.Now().Add(handshakeTimeout))
	zc, err := zmq4.Open(conn, null.Security(), zmq4.Pub, nil, true, nil)
	if err != nil {
		return
	}
	_ = conn.SetDeadline(time.Time{})

	pp := &pubPeer{conn: conn, zc: zc, out: make(chan zmq4.Msg, p.hwm), subs: make(map[string]int)}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.peers[pp] = struct{}{}
	p.wg.Add(1)
	p.mu.Unlock()
	ownsConn = false
	go p.write(pp)

	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			break
		}
		if msg.Type == zmq4.CmdMsg || len(msg.Frames) != 1 || len(msg.Frames[0]) == 0 {
			continue // commands are answered by zmq4; PUB ignores other input
		}
		f := msg.Frames[0]
		prefix := string(f[1:])
		pp.mu.Lock()
		switch f[0] {
		case 1:
			pp.subs[prefix]++
		case 0:
			if pp.subs[prefix] <= 1 {
				delete(pp.subs, prefix)
			} else {
				pp.subs[prefix]--
			}
		}
		pp.mu.Unlock()
	}
	p.mu.Lock()
	delete(p.peers, pp)
	pp.closeOut() // under p.mu: Publish never sends on a closed channel
	p.mu.Unlock()
}

// write drains one peer's queue onto its connection. After a write error it
// closes the connection (which ends serve) and discards until the queue is
// closed.
func (p *zmqPublisher) write(pp *pubPeer) {
	defer p.wg.Done()
	failed := false
	for msg := range pp.out {
		if failed {
			continue
		}
		if err := pp.zc.SendMsg(msg); err != nil {
			failed = true
			_ = pp.conn.Close()
		}
	}
	// The queue is closed: by serve (peer gone) or by Close after flushing.
	_ = pp.conn.Close()
}

// Publish encodes b, assigns it the next sequence number and queues it for
// every subscribed peer. It does not wait for the network.
func (p *zmqPublisher) Publish(b Batch) error {
	payload, err := Encode(b, p.form)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return ErrClosed
	}
	seq := p.seq
	p.seq++
	p.sendLocked(seq, payload)
	return nil
}

// sendLocked queues one message; p.mu is held.
func (p *zmqPublisher) sendLocked(seq uint64, payload []byte) {
	msg := zmq4.NewMsgFrom(p.topic, seqFrame(seq), payload)
	for pp := range p.peers {
		if !pp.subscribed(p.topic) {
			continue
		}
		select {
		case pp.out <- msg:
		default:
			p.dropped.Add(1)
		}
	}
}

// subscribers counts peers subscribed to the publisher's topic.
func (p *zmqPublisher) subscribers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for pp := range p.peers {
		if pp.subscribed(p.topic) {
			n++
		}
	}
	return n
}

// Close stops accepting, lets each peer's queued messages drain for up to
// flushTimeout, closes every connection and waits for all goroutines. It is
// idempotent.
func (p *zmqPublisher) Close() error {
	p.shutdown()
	p.wg.Wait()
	return p.closeErr
}

// shutdown starts closing without waiting: Close, or the end of the
// publisher's context, calls it.
func (p *zmqPublisher) shutdown() {
	p.shutOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		close(p.done)
		deadline := time.Now().Add(flushTimeout)
		for pp := range p.peers {
			_ = pp.conn.SetWriteDeadline(deadline)
			pp.closeOut() // the writer flushes what is queued, then closes the conn
		}
		for conn := range p.conns {
			// Unblock handshakes and subscription reads; writes keep their
			// deadline.
			_ = conn.SetReadDeadline(time.Now())
		}
		p.mu.Unlock()
		if err := p.ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) {
			p.closeErr = err
		}
	})
}
