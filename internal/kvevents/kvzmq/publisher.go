package kvzmq

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

	"github.com/kvgate/kvgate/internal/kvevents"
)

// Publisher sends batches to subscribers. Sequence numbers are assigned per
// publisher in Publish order: 0, 1, 2, ... (from PublisherOptions.FirstSeq).
type Publisher interface {
	Publish(b kvevents.Batch) error
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

// PublisherOptions configures NewPublisher. The zero value binds the
// endpoint with vLLM's defaults: topic "", kvevents.FormMap, no replay socket.
type PublisherOptions struct {
	Topic string
	Form  kvevents.Form
	// Connect dials the endpoint, and redials with capped backoff (50 ms to 2 s)
	// whenever the connection fails or drops while the publisher lives,
	// instead of binding it: llm-d's topology, where every engine connects
	// to one bound SUB socket (see Listen). Batches published while not
	// connected are dropped, as a ZMQ PUB socket drops them.
	Connect bool
	// LocalAddr, in connect mode, is the address to dial from (as libzmq's
	// "tcp://SOURCE;HOST:PORT" does): a listener that checks a publisher's
	// source address sees this one. nil: the system's choice.
	LocalAddr net.Addr
	// ReplayEndpoint, when set, is bound as vLLM's replay socket (a ZMQ
	// ROUTER): a client sends a start sequence number and gets the buffered
	// batches from there on (see Replay).
	ReplayEndpoint string
	// Buffer is how many of the latest batches the replay socket keeps.
	// Default 10_000 (vLLM's buffer_steps).
	Buffer int
	// FirstSeq is the sequence number of the first batch. vLLM counts from
	// 0 (the default); llm-d's vLLM simulator counts from 1.
	FirstSeq uint64
	// HWM bounds the messages queued per subscriber. Default 10_000.
	HWM int
}

// defaultBuffer is vLLM's buffer_steps default.
const defaultBuffer = 10_000

// zmqPublisher is a ZMQ PUB socket built on zmq4's ZMTP 3.0 connection layer
// (greeting, NULL-security handshake, framing), with vLLM's optional replay
// socket beside it.
//
// It does not use zmq4's PUB socket type because that socket cannot be shut
// down cleanly: zmq4 v0.17's NewPub starts a writer goroutine
// (pubMWriter.run) that Close never stops, and its readers can block for ever
// on an internal channel. Here every goroutine has an owner and Close waits
// for all of them. Semantics are ZMQ PUB's: subscribers send ZMTP 3.0
// subscription messages (0x01 + prefix, 0x00 + prefix to cancel), a message
// goes to every peer subscribed to a prefix of its topic, and a peer whose
// queue is full (HWM) misses messages rather than blocking the publisher.
// The peers are the connections the bound socket accepts or, in connect
// mode, the one connection the publisher dials.
type zmqPublisher struct {
	topic []byte
	form  kvevents.Form
	hwm   int

	ln      net.Listener // the bound PUB socket; nil in connect mode
	network string       // connect mode: what to dial, and from where
	addr    string
	local   net.Addr
	rln     net.Listener // the replay socket; nil without one
	cancel  context.CancelFunc

	mu      sync.Mutex
	seq     uint64
	closed  bool
	ring    *replayRing           // nil without a replay socket
	conns   map[net.Conn]connKind // every live connection, handshaking or not
	peers   map[*pubPeer]struct{} // subscriber connections that completed the handshake
	dropped atomic.Uint64         // messages not queued because a peer was at its HWM

	done     chan struct{} // closed by shutdown
	wg       sync.WaitGroup
	shutOnce sync.Once
	closeErr error
}

// connKind tells shutdown how to stop a connection.
type connKind int

const (
	connPeer   connKind = iota // unblock its reads; its writer flushes, then closes it
	connReplay                 // close it outright
)

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
// for its goroutines either way. It is NewPublisher with only Topic and Form
// set.
func NewZMQPublisher(ctx context.Context, endpoint, topic string, f kvevents.Form) (Publisher, error) {
	return NewPublisher(ctx, endpoint, PublisherOptions{Topic: topic, Form: f})
}

// NewPublisher starts a PUB socket on endpoint: bound (tcp://HOST:PORT, with
// * for all interfaces, or ipc://PATH), or dialed when o.Connect is set
// (tcp://HOST:PORT or ipc://PATH); BindsEndpoint tells which vLLM would do.
// With o.ReplayEndpoint it also binds a replay socket. It stops when ctx
// ends or Close is called; Close waits for its goroutines either way.
//
// The returned value also has Addr() net.Addr (the bound address, nil in
// connect mode), ReplayAddr() net.Addr (nil without a replay socket) and
// Dropped() uint64.
func NewPublisher(ctx context.Context, endpoint string, o PublisherOptions) (Publisher, error) {
	p, err := newPublisher(ctx, endpoint, o)
	if err != nil {
		return nil, err
	}
	return p, nil
}

func newPublisher(ctx context.Context, endpoint string, o PublisherOptions) (*zmqPublisher, error) {
	if o.Form != kvevents.FormMap && o.Form != kvevents.FormArray {
		return nil, fmt.Errorf("%w: %s", kvevents.ErrUnknownForm, o.Form)
	}
	if o.HWM <= 0 {
		o.HWM = defaultHWM
	}
	if o.Buffer <= 0 {
		o.Buffer = defaultBuffer
	}
	network, addr, err := parseEndpoint(endpoint, !o.Connect)
	if err != nil {
		return nil, err
	}
	p := &zmqPublisher{
		topic:   []byte(o.Topic),
		form:    o.Form,
		hwm:     o.HWM,
		network: network,
		addr:    addr,
		local:   o.LocalAddr,
		seq:     o.FirstSeq,
		conns:   make(map[net.Conn]connKind),
		peers:   make(map[*pubPeer]struct{}),
		done:    make(chan struct{}),
	}
	if err := p.bind(ctx, endpoint, o); err != nil {
		return nil, err
	}
	p.start(ctx)
	return p, nil
}

// bind binds the PUB socket (unless in connect mode) and the replay socket.
func (p *zmqPublisher) bind(ctx context.Context, endpoint string, o PublisherOptions) error {
	var lc net.ListenConfig
	if !o.Connect {
		ln, err := lc.Listen(ctx, p.network, p.addr)
		if err != nil {
			return fmt.Errorf("kvevents: bind %s: %w", endpoint, err)
		}
		p.ln = ln
	}
	if o.ReplayEndpoint == "" {
		return nil
	}
	rln, err := listenEndpoint(ctx, o.ReplayEndpoint)
	if err != nil {
		if p.ln != nil {
			_ = p.ln.Close()
		}
		return err
	}
	p.rln = rln
	p.ring = newReplayRing(o.Buffer)
	return nil
}

// listenEndpoint binds a ZMQ endpoint.
func listenEndpoint(ctx context.Context, endpoint string) (net.Listener, error) {
	network, addr, err := parseEndpoint(endpoint, true)
	if err != nil {
		return nil, err
	}
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, network, addr)
	if err != nil {
		return nil, fmt.Errorf("kvevents: bind %s: %w", endpoint, err)
	}
	return ln, nil
}

// start runs the publisher's goroutines: the accept loop or the connect
// loop, the replay socket's accept loop, and the watcher of ctx.
func (p *zmqPublisher) start(ctx context.Context) {
	runCtx, cancel := context.WithCancel(ctx)
	p.cancel = cancel
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		<-runCtx.Done() // ctx ended, or shutdown cancelled it
		p.shutdown()
	}()
	p.wg.Add(1)
	if p.ln != nil {
		go func() {
			defer p.wg.Done()
			acceptLoop(p.ln, p.done, p.acceptPeer)
		}()
	} else {
		go p.connectLoop(runCtx)
	}
	if p.rln != nil {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			acceptLoop(p.rln, p.done, p.acceptReplay)
		}()
	}
}

// Addr is the bound address (useful after binding port 0); nil in connect
// mode.
func (p *zmqPublisher) Addr() net.Addr {
	if p.ln == nil {
		return nil
	}
	return p.ln.Addr()
}

// ReplayAddr is the replay socket's bound address; nil without one.
func (p *zmqPublisher) ReplayAddr() net.Addr {
	if p.rln == nil {
		return nil
	}
	return p.rln.Addr()
}

// Dropped counts messages a subscriber missed because its queue was full.
func (p *zmqPublisher) Dropped() uint64 { return p.dropped.Load() }

// track registers a new connection so that shutdown can stop it, and starts
// its handshake deadline; false (and the connection closed) when the
// publisher is closed. Under p.mu, so that shutdown's deadline wins.
func (p *zmqPublisher) track(conn net.Conn, kind connKind) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		_ = conn.Close()
		return false
	}
	_ = conn.SetDeadline(time.Now().Add(handshakeTimeout))
	p.conns[conn] = kind
	return true
}

func (p *zmqPublisher) untrack(conn net.Conn) {
	p.mu.Lock()
	delete(p.conns, conn)
	p.mu.Unlock()
}

func (p *zmqPublisher) acceptPeer(conn net.Conn) {
	if !p.track(conn, connPeer) {
		return
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.session(conn, true)
	}()
}

// connectLoop dials the endpoint and runs each connection until it drops,
// then redials, with capped exponential backoff, until ctx ends.
func (p *zmqPublisher) connectLoop(ctx context.Context) {
	defer p.wg.Done()
	backoff := minBackoff
	for {
		if p.connectOnce(ctx) {
			backoff = minBackoff
		}
		if !sleep(ctx.Done(), backoff) {
			return
		}
		backoff = min(2*backoff, maxBackoff)
	}
}

// connectOnce makes one connection and serves it until it drops; true when
// its handshake succeeded.
func (p *zmqPublisher) connectOnce(ctx context.Context) bool {
	d := net.Dialer{Timeout: handshakeTimeout, LocalAddr: p.local}
	conn, err := d.DialContext(ctx, p.network, p.addr)
	if err != nil || !p.track(conn, connPeer) {
		return false
	}
	return p.session(conn, false)
}

// session runs one subscriber connection: handshake (as the ZMTP server
// when the connection was accepted), then read its subscriptions until it
// goes away. Its writer runs beside it. connected reports whether the
// handshake succeeded.
func (p *zmqPublisher) session(conn net.Conn, server bool) (connected bool) {
	// Until the peer is registered session owns the connection; after that
	// the writer does, so that Close can flush what is queued.
	ownsConn := true
	defer func() {
		p.untrack(conn)
		if ownsConn {
			_ = conn.Close()
		}
	}()
	zc, err := openZMTP(conn, zmq4.Pub, server, controlLimits) // it reads only subscriptions
	if err != nil {
		return false
	}
	pp := &pubPeer{conn: conn, zc: zc, out: make(chan zmq4.Msg, p.hwm), subs: make(map[string]int)}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return true
	}
	_ = conn.SetDeadline(time.Time{}) // under p.mu: shutdown's read deadline wins
	p.peers[pp] = struct{}{}
	p.wg.Add(1)
	p.mu.Unlock()
	ownsConn = false
	go p.write(pp)

	p.readSubscriptions(pp)
	p.mu.Lock()
	delete(p.peers, pp)
	pp.closeOut() // under p.mu: Publish never sends on a closed channel
	p.mu.Unlock()
	return true
}

// readSubscriptions applies a peer's subscription messages until its
// connection fails.
func (p *zmqPublisher) readSubscriptions(pp *pubPeer) {
	for {
		msg, err := pp.zc.RecvMsg()
		if err != nil {
			return
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

// Publish encodes b, assigns it the next sequence number, keeps it for the
// replay socket (if any) and queues it for every subscribed peer. It does
// not wait for the network; with no peer connected the batch is dropped.
func (p *zmqPublisher) Publish(b kvevents.Batch) error {
	payload, err := kvevents.Encode(b, p.form)
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
	if p.ring != nil {
		p.ring.add(seq, payload)
	}
	p.sendLocked(seq, payload)
	return nil
}

// sendLocked queues one message; p.mu is held.
func (p *zmqPublisher) sendLocked(seq uint64, payload []byte) {
	msg := zmq4.NewMsgFrom(p.topic, kvevents.SeqFrame(seq), payload)
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
		p.cancel() // stops a dial in progress
		deadline := time.Now().Add(flushTimeout)
		for pp := range p.peers {
			_ = pp.conn.SetWriteDeadline(deadline)
			pp.closeOut() // the writer flushes what is queued, then closes the conn
		}
		for conn, kind := range p.conns {
			if kind == connReplay {
				_ = conn.Close()
				continue
			}
			// Unblock handshakes and subscription reads; writes keep their
			// deadline.
			_ = conn.SetReadDeadline(time.Now())
		}
		p.mu.Unlock()
		for _, ln := range []net.Listener{p.ln, p.rln} {
			if ln == nil {
				continue
			}
			if err := ln.Close(); err != nil && !errors.Is(err, net.ErrClosed) && p.closeErr == nil {
				p.closeErr = err
			}
		}
	})
}
