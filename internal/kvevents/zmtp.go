package kvevents

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
// frames flagged MORE, would exhaust the process's memory. A vLLM batch is a
// few hundred kilobytes even for a long prompt's prefill.
const (
	maxFrameBytes   = 64 << 20
	maxMessageBytes = 64 << 20
	maxMessageParts = 16 // our protocols use at most 4 frames per message
)

// Connection backoff (vLLM relies on libzmq's reconnect, which retries with
// a similar capped interval).
const (
	minBackoff = 50 * time.Millisecond
	maxBackoff = 2 * time.Second
)

// ErrPeer: a peer broke the ZMTP framing limits or the handshake.
var ErrPeer = errors.New("kvevents: misbehaving peer")

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
	greeting int     // greeting bytes still to pass
	hdr      [9]byte // the current frame header, as far as read
	hdrN     int
	body     uint64 // body bytes of the current frame still to pass
	msgBytes uint64 // bytes in the frames of the current message so far
	msgParts int
	err      error
}

func newFrameGuard(c net.Conn) *frameGuard { return &frameGuard{Conn: c, greeting: greetingLen} }

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
	if size > maxFrameBytes || size > maxMessageBytes-g.msgBytes || g.msgParts > maxMessageParts {
		return fmt.Errorf("%w: frame of %d bytes, part %d of a message of %d bytes so far (limits %d, %d, %d)",
			ErrPeer, size, g.msgParts, g.msgBytes, maxFrameBytes, maxMessageBytes, maxMessageParts)
	}
	g.msgBytes += size
	if flags&flagMore == 0 {
		g.msgBytes, g.msgParts = 0, 0
	}
	g.body = size
	return nil
}

// openZMTP runs the ZMTP 3.0 greeting and NULL-security handshake on conn as
// a socket of type t, behind a frameGuard. zmq4 panics on a peer that
// announces an unknown socket type or malformed metadata; here that is an
// error, so that no peer can crash the process.
func openZMTP(conn net.Conn, t zmq4.SocketType, server bool) (zc *zmq4.Conn, err error) {
	defer func() {
		if r := recover(); r != nil {
			zc, err = nil, fmt.Errorf("%w: ZMTP handshake: %v", ErrPeer, r)
		}
	}()
	return zmq4.Open(newFrameGuard(conn), null.Security(), t, nil, server, nil)
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
