package kvzmq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvgate/kvgate/internal/kvevents"
)

// replayEnd is the sequence number of the replay socket's end marker: -1 as
// a signed 64-bit integer (vLLM's END_SEQ).
const replayEnd = ^uint64(0)

const (
	// replayWriteTimeout bounds each reply write, so that a client that
	// stops reading cannot hold a connection (and a copy of the buffer's
	// index) for ever.
	replayWriteTimeout = 10 * time.Second
	// maxReplayBatches bounds the replies Replay reads, so that a server
	// that never sends the end marker cannot keep it looping.
	maxReplayBatches = 1 << 20
)

// ErrReplayTooLong: a replay server sent more replies than Replay reads.
var ErrReplayTooLong = errors.New("kvevents: replay did not end")

// replayEntry is one buffered batch.
type replayEntry struct {
	seq     uint64
	payload []byte
}

// replayRing keeps the latest batches, as vLLM's deque(maxlen=buffer_steps)
// does. It is guarded by the publisher's mutex.
type replayRing struct {
	buf  []replayEntry // grows to its capacity, then wraps
	next int           // where the next entry goes once the ring is full
}

func newReplayRing(size int) *replayRing { return &replayRing{buf: make([]replayEntry, 0, size)} }

func (r *replayRing) add(seq uint64, payload []byte) {
	if len(r.buf) < cap(r.buf) {
		r.buf = append(r.buf, replayEntry{seq, payload})
		return
	}
	r.buf[r.next] = replayEntry{seq, payload}
	r.next = (r.next + 1) % len(r.buf)
}

// since returns the entries with seq >= from, oldest first.
func (r *replayRing) since(from uint64) []replayEntry {
	var out []replayEntry
	for i := range r.buf {
		e := r.buf[(r.next+i)%len(r.buf)]
		if e.seq >= from {
			out = append(out, e)
		}
	}
	return out
}

func (p *zmqPublisher) acceptReplay(conn net.Conn) {
	if !p.track(conn, connReplay) {
		return
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.serveReplay(conn)
	}()
}

// serveReplay runs one replay connection as vLLM's ROUTER socket does: each
// request is answered on the connection that sent it (the ROUTER identity
// is the connection); a malformed request is ignored.
func (p *zmqPublisher) serveReplay(conn net.Conn) {
	defer func() {
		p.untrack(conn)
		_ = conn.Close()
	}()
	zc, err := openZMTP(conn, zmq4.Router, true, controlLimits) // it reads only requests
	if err != nil {
		return
	}
	_ = conn.SetDeadline(time.Time{}) // shutdown closes replay connections
	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			return
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		from, ok := parseReplayRequest(msg.Frames)
		if !ok {
			continue
		}
		if err := p.answerReplay(conn, zc, from); err != nil {
			return
		}
	}
}

// parseReplayRequest reads ["", start_seq]: what vLLM's ROUTER sees after
// the identity from a DEALER or a REQ. Like vLLM it reads start_seq as a
// big-endian integer of any length (here up to 8 bytes) and ignores the
// delimiter's content.
func parseReplayRequest(frames [][]byte) (from uint64, ok bool) {
	if len(frames) != 2 || len(frames[1]) > 8 {
		return 0, false
	}
	for _, b := range frames[1] {
		from = from<<8 | uint64(b)
	}
	return from, true
}

// answerReplay sends ["", seq, payload] for every buffered batch from seq
// from on, oldest first, then the end marker ["", END, ""].
func (p *zmqPublisher) answerReplay(conn net.Conn, zc *zmq4.Conn, from uint64) error {
	p.mu.Lock()
	entries := p.ring.since(from)
	p.mu.Unlock()
	defer func() { _ = conn.SetWriteDeadline(time.Time{}) }()
	for _, e := range entries {
		_ = conn.SetWriteDeadline(time.Now().Add(replayWriteTimeout))
		if err := zc.SendMsg(zmq4.NewMsgFrom([]byte{}, kvevents.SeqFrame(e.seq), e.payload)); err != nil {
			return err
		}
	}
	_ = conn.SetWriteDeadline(time.Now().Add(replayWriteTimeout))
	return zc.SendMsg(zmq4.NewMsgFrom([]byte{}, kvevents.SeqFrame(replayEnd), []byte{}))
}

// ReplayResult sums up a Replay.
type ReplayResult struct {
	Batches int // batches passed to fn
	Dropped int // replies skipped because their frames or payload did not decode
	// First and Last are the sequence numbers of the first and last batch
	// passed to fn; valid when Batches > 0.
	First, Last uint64
}

// Replay asks a vLLM replay endpoint (tcp://HOST:PORT or ipc://PATH; the
// publisher's replay_endpoint) for its buffered batches from sequence number
// from on and calls fn for each, in order, until the end marker. It dials,
// handshakes as a ZMQ DEALER, sends ["", from as 8 bytes big-endian] and
// reads the replies, in either form vLLM has used: ["", seq, payload], or
// ["", topic, seq, payload] with the end marker ["", "", END, ""]; the end
// marker is the seq 0xFFFFFFFFFFFFFFFF (-1). A reply that does not decode is
// skipped and counted in Dropped. A message of the 3-frame form has Topic
// "".
//
// The buffer holds only the latest batches (vLLM: buffer_steps, 10_000 by
// default): when First > from, the batches in between are gone. ctx bounds
// the whole exchange; after 1<<20 replies without the end marker Replay
// gives up with ErrReplayTooLong. The result counts what was delivered even
// when an error ends the exchange.
func Replay(ctx context.Context, endpoint string, from uint64, fn func(kvevents.Message)) (ReplayResult, error) {
	return ReplayWithOptions(ctx, endpoint, from, fn, ReplayOptions{})
}

// ReplayOptions tunes a Replay; the zero value gives the defaults.
type ReplayOptions struct {
	// MaxFrameBytes caps one frame of a reply (a batch); a server that
	// announces a larger one ends the exchange with an error wrapping
	// ErrFrameSize. Default DefaultMaxFrameBytes.
	MaxFrameBytes int
	// maxBatches bounds the replies read (tests lower it); default
	// maxReplayBatches.
	maxBatches int
}

// ReplayWithOptions is Replay with tuning; see ReplayOptions.
func ReplayWithOptions(ctx context.Context, endpoint string, from uint64, fn func(kvevents.Message), o ReplayOptions) (ReplayResult, error) {
	if o.maxBatches <= 0 {
		o.maxBatches = maxReplayBatches
	}
	if fn == nil {
		return ReplayResult{}, ErrNilHandler
	}
	network, addr, err := parseEndpoint(endpoint, false)
	if err != nil {
		return ReplayResult{}, err
	}
	fail := func(err error) error {
		if ctx.Err() != nil {
			return fmt.Errorf("kvevents: replay from %s: %w", endpoint, context.Cause(ctx))
		}
		return fmt.Errorf("%w: replay from %s: %w", ErrConnection, endpoint, err)
	}
	d := net.Dialer{Timeout: handshakeTimeout}
	conn, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return ReplayResult{}, fail(err)
	}
	// Closing the connection is what ends a read when ctx ends.
	stop := closeOnDone(ctx, conn)
	defer func() {
		stop()
		_ = conn.Close()
	}()
	_ = conn.SetDeadline(time.Now().Add(handshakeTimeout))
	zc, err := openZMTP(conn, zmq4.Dealer, false, batchLimits(o.MaxFrameBytes))
	if err != nil {
		return ReplayResult{}, fail(err)
	}
	_ = conn.SetDeadline(time.Time{})
	if err := zc.SendMsg(zmq4.NewMsgFrom([]byte{}, kvevents.SeqFrame(from))); err != nil {
		return ReplayResult{}, fail(err)
	}
	res, err := readReplay(zc, fn, o.maxBatches)
	if err != nil && !errors.Is(err, ErrReplayTooLong) {
		err = fail(err)
	}
	return res, err
}

// readReplay reads replies until the end marker, at most limit+1 messages.
func readReplay(zc *zmq4.Conn, fn func(kvevents.Message), limit int) (ReplayResult, error) {
	var res ReplayResult
	for range limit + 1 {
		msg, err := zc.RecvMsg()
		if err != nil {
			return res, err
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		topic, seq, payload, err := splitReplay(msg.Frames)
		if err != nil {
			res.Dropped++
			continue
		}
		if seq == replayEnd {
			return res, nil
		}
		b, err := kvevents.Decode(payload)
		if err != nil {
			res.Dropped++
			continue
		}
		if res.Batches == 0 {
			res.First = seq
		}
		res.Batches++
		res.Last = seq
		fn(kvevents.Message{Topic: topic, Seq: seq, Batch: b})
	}
	return res, fmt.Errorf("%w: %d replies without the end marker", ErrReplayTooLong, limit+1)
}

// splitReplay parses a reply as a DEALER receives it: ["", seq, payload] or
// ["", topic, seq, payload].
func splitReplay(frames [][]byte) (topic string, seq uint64, payload []byte, err error) {
	switch len(frames) {
	case 3:
		frames = frames[1:]
	case 4:
		topic, frames = string(frames[1]), frames[2:]
	default:
		return "", 0, nil, fmt.Errorf("%w: replay reply of %d frames", kvevents.ErrFrames, len(frames))
	}
	if len(frames[0]) != 8 {
		return "", 0, nil, fmt.Errorf("%w: sequence frame of %d bytes, want 8", kvevents.ErrFrames, len(frames[0]))
	}
	return topic, binary.BigEndian.Uint64(frames[0]), frames[1], nil
}
