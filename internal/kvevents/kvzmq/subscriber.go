package kvzmq

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvgate/kvgate/internal/kvevents"
)

var (
	// ErrNilHandler: Subscribe without a handler.
	ErrNilHandler = errors.New("kvevents: nil handler")
	// ErrConnection wraps the failures of one connection attempt or session
	// (dial, handshake, disconnect); the subscriber reconnects after each.
	ErrConnection = errors.New("kvevents: connection")
)

// MessageError reports a received message that was dropped because its
// frames or payload could not be decoded. Its batch is lost, like a gap.
type MessageError struct {
	Topic string
	Seq   uint64 // valid when the frames were well-formed
	Err   error  // kvevents.ErrFrames, or a *kvevents.DecodeError
}

func (e *MessageError) Error() string {
	return fmt.Sprintf("kvevents: message topic=%q seq=%d dropped: %v", e.Topic, e.Seq, e.Err)
}

func (e *MessageError) Unwrap() error { return e.Err }

// SubscribeOptions tunes a subscriber; the zero value gives the defaults.
type SubscribeOptions struct {
	// OnError, when set, receives dropped messages (*MessageError) and
	// connection failures (wrapping ErrConnection). It runs on the
	// subscriber's goroutine, like the handler.
	OnError func(error)
	// OnConnect, when set, runs on the subscriber's goroutine after each
	// connection is established, before its first message. A reconnection
	// may follow a publisher restart whose new sequence happens to continue
	// the old one, which no gap would reveal; a caller that must not miss a
	// restart resynchronises here.
	OnConnect func()
	// MinBackoff and MaxBackoff bound the wait between connection attempts,
	// which doubles after each failure (capped exponential backoff) and
	// starts again from MinBackoff once a connection is established.
	// Defaults: 50 ms and 2 s.
	MinBackoff, MaxBackoff time.Duration
	// HandshakeTimeout bounds dialing plus the ZMTP handshake. Default 5 s.
	HandshakeTimeout time.Duration
	// MaxFrameBytes caps one frame of a batch; a publisher that announces
	// a larger one is disconnected (and redialled). Default
	// DefaultMaxFrameBytes.
	MaxFrameBytes int
}

// SubscriberStats counts what a subscriber saw.
type SubscriberStats struct {
	Messages uint64 // batches passed to the handler
	Gaps     uint64 // sequence discontinuities reported to onGap
	Dropped  uint64 // messages that failed to decode
	Connects uint64 // connections established (the first one included)
}

// Subscriber receives batches from one publisher. Create it with Subscribe.
type Subscriber struct {
	endpoint, network, addr string
	prefix                  string
	handler                 func(kvevents.Message)
	onGap                   func(expected, got uint64)
	opts                    SubscribeOptions

	cancel    context.CancelFunc
	done      chan struct{}
	closeOnce sync.Once

	messages, gaps, dropped, connects atomic.Uint64
}

// Subscribe connects to endpoint (tcp://HOST:PORT or ipc://PATH),
// subscribes to topicPrefix ("" for every topic) and calls handler for each
// message, in order, from one goroutine. It returns at once; the connection
// is made in the background and remade, with capped exponential backoff,
// whenever it fails or drops, until ctx ends or Close is called.
//
// Sequence numbers are tracked across reconnections: when a message's Seq is
// not the previous one plus one (messages lost while disconnected or dropped
// at the publisher's high-water mark, or a restarted publisher counting from
// 0 again), onGap(previous+1, Seq) is called before the handler sees that
// message, so the caller can resynchronise. The very first message sets the
// baseline and is not a gap. onGap may be nil.
//
// handler and onGap must not call Close (Close waits for them).
func Subscribe(ctx context.Context, endpoint, topicPrefix string, handler func(kvevents.Message), onGap func(expected, got uint64)) (*Subscriber, error) {
	return SubscribeWithOptions(ctx, endpoint, topicPrefix, handler, onGap, SubscribeOptions{})
}

// SubscribeWithOptions is Subscribe with tuning; see SubscribeOptions.
func SubscribeWithOptions(ctx context.Context, endpoint, topicPrefix string, handler func(kvevents.Message), onGap func(expected, got uint64), opts SubscribeOptions) (*Subscriber, error) {
	if handler == nil {
		return nil, ErrNilHandler
	}
	network, addr, err := parseEndpoint(endpoint, false)
	if err != nil {
		return nil, err
	}
	if opts.MinBackoff <= 0 {
		opts.MinBackoff = 50 * time.Millisecond
	}
	if opts.MaxBackoff <= 0 {
		opts.MaxBackoff = 2 * time.Second
	}
	opts.MaxBackoff = max(opts.MaxBackoff, opts.MinBackoff)
	if opts.HandshakeTimeout <= 0 {
		opts.HandshakeTimeout = handshakeTimeout
	}
	runCtx, cancel := context.WithCancel(ctx)
	s := &Subscriber{
		endpoint: endpoint,
		network:  network,
		addr:     addr,
		prefix:   topicPrefix,
		handler:  handler,
		onGap:    onGap,
		opts:     opts,
		cancel:   cancel,
		done:     make(chan struct{}),
	}
	go s.run(runCtx)
	return s, nil
}

// Stats returns the counters so far; safe from any goroutine.
func (s *Subscriber) Stats() SubscriberStats {
	return SubscriberStats{
		Messages: s.messages.Load(),
		Gaps:     s.gaps.Load(),
		Dropped:  s.dropped.Load(),
		Connects: s.connects.Load(),
	}
}

// Close stops the subscriber and waits for its goroutine (and so for a
// handler call in progress) to finish. It is idempotent.
func (s *Subscriber) Close() error {
	s.closeOnce.Do(func() {
		s.cancel()
		<-s.done
	})
	return nil
}

// seqTracker detects gaps in the sequence numbers of one publisher.
type seqTracker struct {
	last uint64
	have bool
}

// next records seq and reports whether it breaks the sequence, with the
// sequence number that was expected.
func (t *seqTracker) next(seq uint64) (expected uint64, gap bool) {
	expected = t.last + 1
	gap = t.have && seq != expected
	t.last, t.have = seq, true
	return expected, gap
}

func (s *Subscriber) run(ctx context.Context) {
	defer close(s.done)
	var seqs seqTracker
	backoff := s.opts.MinBackoff
	for {
		connected, err := s.session(ctx, &seqs)
		if ctx.Err() != nil {
			return
		}
		s.reportErr(fmt.Errorf("%w to %s: %v", ErrConnection, s.endpoint, err))
		if connected {
			backoff = s.opts.MinBackoff
		}
		t := time.NewTimer(backoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(2*backoff, s.opts.MaxBackoff)
	}
}

func (s *Subscriber) reportErr(err error) {
	if s.opts.OnError != nil {
		s.opts.OnError(err)
	}
}

// session makes one connection and reads from it until it fails. connected
// reports whether the handshake succeeded.
func (s *Subscriber) session(ctx context.Context, seqs *seqTracker) (connected bool, err error) {
	dialer := net.Dialer{Timeout: s.opts.HandshakeTimeout}
	conn, err := dialer.DialContext(ctx, s.network, s.addr)
	if err != nil {
		return false, err
	}
	// Closing the connection is what unblocks a read when ctx ends; the
	// watcher that does it is waited for before the session returns.
	sessionDone, watcherDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(watcherDone)
		select {
		case <-ctx.Done():
			_ = conn.Close()
		case <-sessionDone:
		}
	}()
	defer func() {
		close(sessionDone)
		<-watcherDone
		_ = conn.Close()
	}()

	_ = conn.SetDeadline(time.Now().Add(s.opts.HandshakeTimeout))
	zc, err := openZMTP(conn, zmq4.Sub, false, batchLimits(s.opts.MaxFrameBytes))
	if err != nil {
		return false, err
	}
	_ = conn.SetDeadline(time.Time{})
	// ZMTP 3.0 subscription: a one-frame message 0x01 + prefix.
	if err := zc.SendMsg(zmq4.NewMsg(append([]byte{1}, s.prefix...))); err != nil {
		return false, err
	}
	s.connects.Add(1)
	if s.opts.OnConnect != nil {
		s.opts.OnConnect()
	}

	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			return true, err
		}
		if msg.Type == zmq4.CmdMsg {
			continue // PING and the like, answered by zmq4
		}
		topic, seq, payload, err := kvevents.SplitFrames(msg.Frames)
		if err != nil {
			s.dropped.Add(1)
			s.reportErr(&MessageError{Err: err})
			continue
		}
		if !strings.HasPrefix(topic, s.prefix) {
			continue // the publisher filters; this guards against one that does not
		}
		if expected, gap := seqs.next(seq); gap {
			s.gaps.Add(1)
			if s.onGap != nil {
				s.onGap(expected, seq)
			}
		}
		b, err := kvevents.Decode(payload)
		if err != nil {
			s.dropped.Add(1)
			s.reportErr(&MessageError{Topic: topic, Seq: seq, Err: err})
			continue
		}
		s.messages.Add(1)
		s.handler(kvevents.Message{Topic: topic, Seq: seq, Batch: b})
	}
}
