package kvzmq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"
)

// Limits on what one peer may send. zmq4 allocates a frame's declared size
// before reading its body and gathers the frames of a message without bound,
// so without them one header claiming 2^40 bytes, or an endless run of
// frames flagged MORE, would exhaust the process's memory.
//
// DefaultMaxFrameBytes is the default cap on one frame of a KV-event batch
// (and on the message, plus messageSlack for the topic and sequence
// frames). vLLM publishes one batch per engine step, whose stored blocks
// carry at most the step's tokens (max_num_batched_tokens, 8192 by default
// with chunked prefill): about 9 bytes per token id plus a hash per block,
// under 100 KiB by default and under 4 MiB up to ~400k tokens per step.
const (
	DefaultMaxFrameBytes = 4 << 20
	messageSlack         = 64 << 10
	maxMessageParts      = 16 // our protocols use at most 4 frames per message
	// controlFrameBytes caps every frame of the ZMTP handshake (a READY
	// command carries the socket type and an identity of at most 255
	// bytes) and what the publisher reads (subscriptions, replay requests).
	controlFrameBytes = 64 << 10
)

// frameLimits bound what a frameGuard lets through.
type frameLimits struct {
	frame, message uint64
	parts          int
}

// batchLimits are the limits for reading batches of at most maxFrame bytes
// (DefaultMaxFrameBytes when maxFrame ≤ 0).
func batchLimits(maxFrame int) frameLimits {
	if maxFrame <= 0 {
		maxFrame = DefaultMaxFrameBytes
	}
	return frameLimits{frame: uint64(maxFrame), message: uint64(maxFrame) + messageSlack, parts: maxMessageParts}
}

// controlLimits are the limits of the handshake and of control messages.
var controlLimits = frameLimits{frame: controlFrameBytes, message: controlFrameBytes, parts: 4}

// Connection backoff (vLLM relies on libzmq's reconnect, which retries with
// a similar capped interval).
const (
	minBackoff = 50 * time.Millisecond
	maxBackoff = 2 * time.Second
)

var (
	// ErrPeer: a peer broke the ZMTP framing limits or the handshake.
	ErrPeer = errors.New("kvevents: misbehaving peer")
	// ErrFrameSize: a peer announced a frame (or a message) over the
	// limits; it comes with ErrPeer.
	ErrFrameSize = errors.New("frame over the size limit")
)

// ZMTP frame flags (RFC 23).
const (
	flagMore    = 0x01
	flagLong    = 0x02
	greetingLen = 64
)

// frameGuard passes a ZMTP 3 byte stream through unchanged while following
// its framing, and fails the read that would hand zmq4 a frame header beyond
// the limits above, before zmq4 can allocate for it.
type frameGuard struct {
	net.Conn
	lim      frameLimits
	greeting int     // greeting bytes still to pass
	hdr      [9]byte // the current frame header, as far as read
	hdrN     int
	body     uint64 // body bytes of the current frame still to pass
	msgBytes uint64 // bytes in the frames of the current message so far
	msgParts int
	err      error
}

func newFrameGuard(c net.Conn, lim frameLimits) *frameGuard {
	return &frameGuard{Conn: c, lim: lim, greeting: greetingLen}
}

func (g *frameGuard) Read(p []byte) (int, error) {
	if g.err != nil {
		return 0, g.err
	}
	n, err := g.Conn.Read(p)
	if serr := g.scan(p[:n]); serr != nil {
		g.err = serr
		return 0, serr
	}
	return n, err
}

// scan follows the framing over the next bytes of the stream.
func (g *frameGuard) scan(b []byte) error {
	for len(b) > 0 {
		switch {
		case g.greeting > 0:
			k := min(g.greeting, len(b))
			g.greeting -= k
			b = b[k:]
		case g.body > 0:
			k := min(g.body, uint64(len(b)))
			g.body -= k
			b = b[k:]
		default:
			g.hdr[g.hdrN] = b[0]
			g.hdrN++
			b = b[1:]
			if err := g.header(); err != nil {
				return err
			}
		}
	}
	return nil
}

// header checks the frame header once it is complete.
func (g *frameGuard) header() error {
	flags := g.hdr[0]
	need := 2
	if flags&flagLong != 0 {
		need = 9
	}
	if g.hdrN < need {
		return nil
	}
	g.hdrN = 0
	size := uint64(g.hdr[1])
	if need == 9 {
		size = binary.BigEndian.Uint64(g.hdr[1:9])
	}
	g.msgParts++
	if size > g.lim.frame || size > g.lim.message-g.msgBytes || g.msgParts > g.lim.parts {
		return fmt.Errorf("%w: %w: frame of %d bytes, part %d of a message of %d bytes so far (limits %d, %d, %d)",
			ErrPeer, ErrFrameSize, size, g.msgParts, g.msgBytes, g.lim.frame, g.lim.message, g.lim.parts)
	}
	g.msgBytes += size
	if flags&flagMore == 0 {
		g.msgBytes, g.msgParts = 0, 0
	}
	g.body = size
	return nil
}

// openZMTP runs the ZMTP 3.0 greeting and NULL-security handshake on conn as
// a socket of type t, behind a frameGuard: the handshake's frames within
// controlLimits, the messages after it within lim. zmq4 panics on a peer
// that announces an unknown socket type or malformed metadata; here that is
// an error, so that no peer can crash the process.
func openZMTP(conn net.Conn, t zmq4.SocketType, server bool, lim frameLimits) (zc *zmq4.Conn, err error) {
	defer func() {
		if r := recover(); r != nil {
			zc, err = nil, fmt.Errorf("%w: ZMTP handshake: %v", ErrPeer, r)
		}
	}()
	g := newFrameGuard(conn, controlLimits)
	zc, err = zmq4.Open(g, null.Security(), t, nil, server, nil)
	// zmq4 reads only in Open and RecvMsg, exactly the bytes it needs: no
	// read of a message can have begun before this.
	g.lim = lim
	return zc, err
}

// acceptLoop hands every connection ln accepts to handle (which takes it
// over and must not block for long) until done is closed. A transient
// failure (out of file descriptors, ...) backs off as net/http's server
// does rather than spinning.
func acceptLoop(ln net.Listener, done <-chan struct{}, handle func(net.Conn)) {
	delay := 5 * time.Millisecond
	for {
		conn, err := ln.Accept()
		if err == nil {
			delay = 5 * time.Millisecond
			handle(conn)
			continue
		}
		select {
		case <-done:
			return
		default:
		}
		if !sleep(done, delay) {
			return
		}
		delay = min(2*delay, time.Second)
	}
}

// sleep waits d; false when done is closed first.
func sleep(done <-chan struct{}, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return false
	case <-t.C:
		return true
	}
}

// closeOnDone closes conn when ctx ends. The returned stop ends the watch
// and waits for its goroutine.
func closeOnDone(ctx context.Context, conn net.Conn) (stop func()) {
	stopped, exited := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		select {
		case <-ctx.Done():
			_ = conn.Close()
		case <-stopped:
		}
	}()
	return func() {
		close(stopped)
		<-exited
	}
}
