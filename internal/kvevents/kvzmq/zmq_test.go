package kvzmq

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/testutil"
)

// waitTimeout bounds every wait in these tests; they finish in milliseconds
// when things work.
const waitTimeout = 10 * time.Second

// sink collects what a subscriber delivers and wakes waiters on each call.
type sink struct {
	mu     sync.Mutex
	msgs   []kvevents.Message
	gaps   [][2]uint64
	errs   []error
	notify chan struct{}
}

func newSink() *sink { return &sink{notify: make(chan struct{}, 1)} }

func (s *sink) poke() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

func (s *sink) handle(m kvevents.Message) {
	s.mu.Lock()
	s.msgs = append(s.msgs, m)
	s.mu.Unlock()
	s.poke()
}

func (s *sink) gap(expected, got uint64) {
	s.mu.Lock()
	s.gaps = append(s.gaps, [2]uint64{expected, got})
	s.mu.Unlock()
	s.poke()
}

func (s *sink) onErr(err error) {
	s.mu.Lock()
	s.errs = append(s.errs, err)
	s.mu.Unlock()
	s.poke()
}

func (s *sink) snapshot() (msgs []kvevents.Message, gaps [][2]uint64, errs []error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]kvevents.Message(nil), s.msgs...), append([][2]uint64(nil), s.gaps...), append([]error(nil), s.errs...)
}

// waitUntil re-checks cond after every delivery, failing after waitTimeout.
func (s *sink) waitUntil(t *testing.T, what string, cond func(msgs []kvevents.Message, gaps [][2]uint64, errs []error) bool) {
	t.Helper()
	timer := time.NewTimer(waitTimeout)
	defer timer.Stop()
	for {
		if cond(s.snapshot()) {
			return
		}
		select {
		case <-s.notify:
		case <-timer.C:
			msgs, gaps, errs := s.snapshot()
			t.Fatalf("timed out waiting for %s: %d messages, gaps %v, errors %v", what, len(msgs), gaps, errs)
		}
	}
}

const warmupTS = -1

// warmUp publishes marker batches until the subscriber has received one. A
// ZMQ subscriber misses whatever is published before its subscription
// reaches the publisher (the "slow joiner"), so tests cannot publish once
// and wait. Bounded in count and in time.
func warmUp(t *testing.T, publish func(kvevents.Batch) error, s *sink) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for i := 0; i < 2000 && time.Now().Before(deadline); i++ {
		if err := publish(kvevents.Batch{Timestamp: warmupTS, Events: []kvevents.Event{&kvevents.AllBlocksCleared{}}}); err != nil {
			t.Fatal(err)
		}
		wait := time.NewTimer(5 * time.Millisecond)
		select {
		case <-s.notify:
		case <-wait.C:
		}
		wait.Stop()
		if msgs, _, _ := s.snapshot(); len(msgs) > 0 {
			return
		}
	}
	t.Fatal("no warm-up message reached the subscriber")
}

// nextSeq is the sequence number the publisher will assign next.
func (p *zmqPublisher) nextSeq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.seq
}

// drain waits until the subscriber has everything p published so far.
func drain(t *testing.T, p *zmqPublisher, s *sink) {
	t.Helper()
	last := p.nextSeq() - 1
	s.waitUntil(t, fmt.Sprintf("seq %d", last), func(msgs []kvevents.Message, _ [][2]uint64, _ []error) bool {
		return len(msgs) > 0 && msgs[len(msgs)-1].Seq == last
	})
}

// subscribedPeers counts peers whose subscription the publisher has
// received, whatever its prefix.
func (p *zmqPublisher) subscribedPeers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for pp := range p.peers {
		pp.mu.Lock()
		if len(pp.subs) > 0 {
			n++
		}
		pp.mu.Unlock()
	}
	return n
}

// sendRaw queues arbitrary frames under the next sequence number.
func (p *zmqPublisher) sendRaw(frames ...[]byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seq++
	msg := zmq4.NewMsgFrom(frames...)
	for pp := range p.peers {
		if pp.subscribed(p.topic) {
			pp.out <- msg
		}
	}
}

func startPublisher(t *testing.T, ctx context.Context, endpoint, topic string, f kvevents.Form) *zmqPublisher {
	t.Helper()
	p, err := newPublisher(ctx, endpoint, PublisherOptions{Topic: topic, Form: f})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func endpointOf(p *zmqPublisher) string { return "tcp://" + p.Addr().String() }

var fastRetry = SubscribeOptions{MinBackoff: time.Millisecond, MaxBackoff: 20 * time.Millisecond}

func startSubscriber(t *testing.T, ctx context.Context, endpoint, prefix string, s *sink) *Subscriber {
	t.Helper()
	opts := fastRetry
	opts.OnError = s.onErr
	sub, err := SubscribeWithOptions(ctx, endpoint, prefix, s.handle, s.gap, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}

// testBatch i is recognisable by its timestamp and its block hash.
func testBatch(i int) kvevents.Batch {
	return kvevents.Batch{
		Timestamp: float64(1000 + i),
		Events: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: []uint64{uint64(i), uint64(i) + 1<<40}, TokenIDs: []uint32{uint32(i), 1, 2, 3}, BlockSize: 2, Medium: "GPU"},
			&kvevents.BlockRemoved{BlockHashes: []uint64{uint64(i)}},
		},
		DataParallelRank: new(0),
	}
}

// sameBatch: a batch came through a transport intact when it encodes to the
// same bytes (Encode is deterministic; the codec's own tests compare field
// by field and decode every form).
func sameBatch(a, b kvevents.Batch) bool {
	ea, errA := kvevents.Encode(a, kvevents.FormMap)
	eb, errB := kvevents.Encode(b, kvevents.FormMap)
	return errA == nil && errB == nil && bytes.Equal(ea, eb)
}

// dump shows a batch in a failure message.
func dump(b kvevents.Batch) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "ts=%v", b.Timestamp)
	if b.DataParallelRank != nil {
		fmt.Fprintf(&sb, " dp=%d", *b.DataParallelRank)
	}
	for _, e := range b.Events {
		fmt.Fprintf(&sb, " %+v", e)
	}
	return sb.String()
}

func TestPubSubInOrder(t *testing.T) {
	const n = 300
	for _, f := range []kvevents.Form{kvevents.FormMap, kvevents.FormArray} {
		t.Run(f.String(), func(t *testing.T) {
			ctx := t.Context()
			topic := "kv@127.0.0.1:8000@sim-llama-8b"
			p := startPublisher(t, ctx, "tcp://127.0.0.1:0", topic, f)
			s := newSink()
			sub := startSubscriber(t, ctx, endpointOf(p), "kv@", s)
			warmUp(t, p.Publish, s)
			for i := range n {
				if err := p.Publish(testBatch(i)); err != nil {
					t.Fatal(err)
				}
			}
			drain(t, p, s)
			msgs, gaps, errs := s.snapshot()
			if len(gaps) != 0 || len(errs) != 0 {
				t.Fatalf("gaps %v, errors %v", gaps, errs)
			}
			// Warm-up markers first, then the n batches, seqs consecutive.
			first := len(msgs) - n
			if first < 1 {
				t.Fatalf("got %d messages, want at least %d", len(msgs), n+1)
			}
			for i, m := range msgs {
				if i > 0 && m.Seq != msgs[i-1].Seq+1 {
					t.Fatalf("message %d has seq %d after %d", i, m.Seq, msgs[i-1].Seq)
				}
				if m.Topic != topic {
					t.Fatalf("topic %q", m.Topic)
				}
				if i < first {
					if m.Batch.Timestamp != warmupTS {
						t.Fatalf("message %d is not a warm-up: %s", i, dump(m.Batch))
					}
					continue
				}
				if want := testBatch(i - first); !sameBatch(m.Batch, want) {
					t.Fatalf("message %d:\n got  %s\n want %s", i, dump(m.Batch), dump(want))
				}
			}
			if st := sub.Stats(); st.Messages != uint64(len(msgs)) || st.Gaps != 0 || st.Connects != 1 {
				t.Errorf("stats %+v with %d messages", st, len(msgs))
			}
		})
	}
}

func TestSubscriberReportsGap(t *testing.T) {
	ctx := t.Context()
	p := startPublisher(t, ctx, "tcp://127.0.0.1:0", "", kvevents.FormMap)
	s := newSink()
	sub := startSubscriber(t, ctx, endpointOf(p), "", s)
	warmUp(t, p.Publish, s)
	drain(t, p, s)
	last := p.nextSeq() - 1

	// The publisher's sequence jumps by 41, as when it dropped 41 batches.
	p.mu.Lock()
	p.seq += 41
	p.mu.Unlock()
	for i := range 2 {
		if err := p.Publish(testBatch(i)); err != nil {
			t.Fatal(err)
		}
	}
	drain(t, p, s)
	msgs, gaps, _ := s.snapshot()
	want := [][2]uint64{{last + 1, last + 42}}
	if fmt.Sprint(gaps) != fmt.Sprint(want) {
		t.Fatalf("gaps %v, want %v", gaps, want)
	}
	if got := msgs[len(msgs)-2].Seq; got != last+42 {
		t.Errorf("message after the gap has seq %d, want %d", got, last+42)
	}
	if st := sub.Stats(); st.Gaps != 1 {
		t.Errorf("stats %+v", st)
	}
}

func TestSubscriberReconnectsAfterPublisherRestart(t *testing.T) {
	ctx := t.Context()
	p1 := startPublisher(t, ctx, "tcp://127.0.0.1:0", "kv", kvevents.FormArray)
	ep := endpointOf(p1)
	s := newSink()
	var connects atomic.Int32
	opts := fastRetry
	opts.OnError = s.onErr
	opts.OnConnect = func() { connects.Add(1) }
	sub, err := SubscribeWithOptions(ctx, ep, "kv", s.handle, s.gap, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	warmUp(t, p1.Publish, s)
	for i := range 5 {
		if err := p1.Publish(testBatch(i)); err != nil {
			t.Fatal(err)
		}
	}
	drain(t, p1, s)
	last := p1.nextSeq() - 1
	if err := p1.Close(); err != nil {
		t.Fatal(err)
	}

	// A restarted replica binds the same port and counts from 0 again.
	p2 := startPublisher(t, ctx, ep, "kv", kvevents.FormMap)
	testutil.Eventually(t, waitTimeout, "the subscriber to reconnect", func() bool { return p2.subscribedPeers() == 1 })
	if err := p2.Publish(testBatch(100)); err != nil {
		t.Fatal(err)
	}
	drain(t, p2, s)
	msgs, gaps, errs := s.snapshot()
	if want := [][2]uint64{{last + 1, 0}}; fmt.Sprint(gaps) != fmt.Sprint(want) {
		t.Fatalf("gaps %v, want %v", gaps, want)
	}
	if m := msgs[len(msgs)-1]; m.Seq != 0 || !sameBatch(m.Batch, testBatch(100)) {
		t.Fatalf("last message seq %d %s", m.Seq, dump(m.Batch))
	}
	if !errors.Is(errs[0], ErrConnection) {
		t.Errorf("first reported error %v, want the lost connection", errs[0])
	}
	if st := sub.Stats(); st.Connects != 2 || st.Gaps != 1 || connects.Load() != 2 {
		t.Errorf("stats %+v, OnConnect ran %d times", st, connects.Load())
	}
}

func TestSubscriberRetriesUntilPublisherAppears(t *testing.T) {
	ctx := t.Context()
	// Reserve a port, then free it: nothing listens there for now.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	_ = ln.Close()

	s := newSink()
	sub := startSubscriber(t, ctx, "tcp://"+addr, "", s)
	s.waitUntil(t, "three refused connections", func(_ []kvevents.Message, _ [][2]uint64, errs []error) bool {
		return len(errs) >= 3
	})
	_, _, errs := s.snapshot()
	for _, err := range errs {
		if !errors.Is(err, ErrConnection) {
			t.Fatalf("error %v does not wrap ErrConnection", err)
		}
	}
	p := startPublisher(t, ctx, "tcp://"+addr, "", kvevents.FormMap)
	warmUp(t, p.Publish, s)
	if st := sub.Stats(); st.Connects != 1 || st.Gaps != 0 {
		t.Errorf("stats %+v", st)
	}
}

func TestTopicPrefixFiltering(t *testing.T) {
	ctx := t.Context()
	p := startPublisher(t, ctx, "tcp://127.0.0.1:0", "kv@127.0.0.1:8000@m", kvevents.FormMap)
	match, other, all := newSink(), newSink(), newSink()
	startSubscriber(t, ctx, endpointOf(p), "kv@127.0.0.1:8000", match)
	otherSub := startSubscriber(t, ctx, endpointOf(p), "kv@127.0.0.1:8001", other)
	startSubscriber(t, ctx, endpointOf(p), "", all)
	testutil.Eventually(t, waitTimeout, "three subscriptions", func() bool { return p.subscribedPeers() == 3 })
	const n = 10
	for i := range n {
		if err := p.Publish(testBatch(i)); err != nil {
			t.Fatal(err)
		}
	}
	drain(t, p, match)
	drain(t, p, all)
	for name, s := range map[string]*sink{"matching": match, "empty prefix": all} {
		if msgs, _, _ := s.snapshot(); len(msgs) != n {
			t.Errorf("%s subscriber got %d messages, want %d", name, len(msgs), n)
		}
	}
	if msgs, _, _ := other.snapshot(); len(msgs) != 0 || otherSub.Stats().Messages != 0 {
		t.Errorf("non-matching subscriber got %d messages", len(msgs))
	}
}

func TestSubscriberDropsUndecodableMessages(t *testing.T) {
	ctx := t.Context()
	p := startPublisher(t, ctx, "tcp://127.0.0.1:0", "t", kvevents.FormMap)
	s := newSink()
	sub := startSubscriber(t, ctx, endpointOf(p), "t", s)
	warmUp(t, p.Publish, s)
	drain(t, p, s)
	badSeq := p.nextSeq()
	p.sendRaw([]byte("t"), kvevents.SeqFrame(badSeq), []byte{0x92, 0xc1}) // not msgpack
	p.sendRaw([]byte("t"), []byte{1, 2, 3})                               // two frames, short seq
	if err := p.Publish(testBatch(7)); err != nil {
		t.Fatal(err)
	}
	drain(t, p, s)
	msgs, gaps, errs := s.snapshot()
	if !sameBatch(msgs[len(msgs)-1].Batch, testBatch(7)) {
		t.Fatalf("last message %s", dump(msgs[len(msgs)-1].Batch))
	}
	// The bad payload kept its place in the sequence; the frameless message
	// has no seq, so the good one after it shows as a gap of one.
	if want := [][2]uint64{{badSeq + 1, badSeq + 2}}; fmt.Sprint(gaps) != fmt.Sprint(want) {
		t.Errorf("gaps %v, want %v", gaps, want)
	}
	if len(errs) != 2 {
		t.Fatalf("errors %v, want 2", errs)
	}
	var me *MessageError
	if !errors.As(errs[0], &me) || me.Seq != badSeq || !errors.Is(errs[0], kvevents.ErrMalformed) {
		t.Errorf("first error %v", errs[0])
	}
	if !errors.Is(errs[1], kvevents.ErrFrames) {
		t.Errorf("second error %v", errs[1])
	}
	if st := sub.Stats(); st.Dropped != 2 {
		t.Errorf("stats %+v", st)
	}
}

func TestPublisherHighWaterMark(t *testing.T) {
	p, err := newPublisher(t.Context(), "tcp://127.0.0.1:0", PublisherOptions{HWM: 2})
	if err != nil {
		t.Fatal(err)
	}
	// A peer whose writer is stalled: nothing drains its queue.
	conn, other := net.Pipe()
	defer other.Close()
	defer conn.Close()
	peer := &pubPeer{conn: conn, out: make(chan zmq4.Msg, p.hwm), subs: map[string]int{"": 1}}
	p.mu.Lock()
	p.peers[peer] = struct{}{}
	p.mu.Unlock()
	for i := range 5 {
		if err := p.Publish(testBatch(i)); err != nil {
			t.Fatal(err)
		}
	}
	if got := len(peer.out); got != 2 {
		t.Errorf("queued %d, want 2", got)
	}
	if got := p.Dropped(); got != 3 {
		t.Errorf("dropped %d, want 3", got)
	}
	// Publish never blocked; the queued ones are the oldest.
	first := <-peer.out
	if m, err := kvevents.DecodeFrames(first.Frames); err != nil || m.Seq != 0 {
		t.Errorf("first queued message seq %d, %v", m.Seq, err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestPublisherClose(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	p, err := NewZMQPublisher(ctx, "tcp://127.0.0.1:0", "", kvevents.FormMap)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(testBatch(0)); err != nil {
		t.Fatal(err)
	}
	if err := p.Publish(kvevents.Batch{Events: []kvevents.Event{nil}}); !errors.Is(err, kvevents.ErrInvalidBatch) {
		t.Errorf("Publish(bad batch) = %v", err)
	}
	// Ending the context closes the publisher.
	cancel()
	testutil.Eventually(t, waitTimeout, "publisher closed by its context", func() bool {
		return errors.Is(p.Publish(testBatch(1)), ErrClosed)
	})
	if err := p.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if err := p.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestPublisherBindErrors(t *testing.T) {
	p := startPublisher(t, t.Context(), "tcp://127.0.0.1:0", "", kvevents.FormMap)
	tests := []struct {
		name, endpoint string
		form           kvevents.Form
		want           error
	}{
		{"port-in-use", endpointOf(p), kvevents.FormMap, nil},
		{"no-scheme", "127.0.0.1:5557", kvevents.FormMap, ErrEndpoint},
		{"bad-form", "tcp://127.0.0.1:0", kvevents.Form(9), kvevents.ErrUnknownForm},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q, err := NewZMQPublisher(t.Context(), tc.endpoint, "", tc.form)
			if err == nil {
				_ = q.Close()
				t.Fatal("NewZMQPublisher succeeded")
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("error %v, want %v", err, tc.want)
			}
		})
	}
}

func TestSubscribeArgumentErrors(t *testing.T) {
	h := func(kvevents.Message) {}
	tests := []struct {
		name, endpoint string
		handler        func(kvevents.Message)
		want           error
	}{
		{"nil-handler", "tcp://127.0.0.1:5557", nil, ErrNilHandler},
		{"star-host", "tcp://*:5557", h, ErrEndpoint},
		{"no-port", "tcp://127.0.0.1", h, ErrEndpoint},
		{"inproc", "inproc://x", h, ErrEndpoint},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Subscribe(t.Context(), tc.endpoint, "", tc.handler, nil)
			if err == nil {
				_ = s.Close()
				t.Fatal("Subscribe succeeded")
			}
			if !errors.Is(err, tc.want) {
				t.Errorf("error %v, want %v", err, tc.want)
			}
		})
	}
}

func TestSubscriberStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	p := startPublisher(t, t.Context(), "tcp://127.0.0.1:0", "", kvevents.FormMap)
	s := newSink()
	sub, err := Subscribe(ctx, endpointOf(p), "", s.handle, s.gap)
	if err != nil {
		t.Fatal(err)
	}
	warmUp(t, p.Publish, s)
	cancel()
	select {
	case <-sub.done:
	case <-time.After(waitTimeout):
		t.Fatal("subscriber goroutine still running after its context ended")
	}
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestParseEndpoint(t *testing.T) {
	tests := []struct {
		ep            string
		bind          bool
		network, addr string
		ok            bool
	}{
		{"tcp://127.0.0.1:5557", false, "tcp", "127.0.0.1:5557", true},
		{"tcp://*:5557", true, "tcp", ":5557", true},
		{"tcp://*:5557", false, "", "", false},
		{"tcp://[::1]:5557", false, "tcp", "[::1]:5557", true},
		{"tcp://localhost:", false, "", "", false},
		{"ipc:///tmp/kv.sock", true, "unix", "/tmp/kv.sock", true},
		{"udp://127.0.0.1:1", false, "", "", false},
		{"tcp://", false, "", "", false},
	}
	for _, tc := range tests {
		network, addr, err := parseEndpoint(tc.ep, tc.bind)
		if (err == nil) != tc.ok || network != tc.network || addr != tc.addr {
			t.Errorf("parseEndpoint(%q, %v) = %q, %q, %v", tc.ep, tc.bind, network, addr, err)
		}
		if err != nil && !errors.Is(err, ErrEndpoint) {
			t.Errorf("parseEndpoint(%q): error %v does not wrap ErrEndpoint", tc.ep, err)
		}
	}
}

func TestFrames(t *testing.T) {
	frames, err := kvevents.EncodeFrames("kv@a@m", 0x0102030405060708, testBatch(3), kvevents.FormArray)
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprintf("%x", frames[1]); got != "0102030405060708" {
		t.Errorf("seq frame %s, want big-endian", got)
	}
	m, err := kvevents.DecodeFrames(frames)
	if err != nil || m.Topic != "kv@a@m" || m.Seq != 0x0102030405060708 || !sameBatch(m.Batch, testBatch(3)) {
		t.Fatalf("DecodeFrames = %+v, %v", m, err)
	}
	bad := []struct {
		name   string
		frames [][]byte
		want   error
	}{
		{"two-frames", frames[:2], kvevents.ErrFrames},
		{"short-seq", [][]byte{frames[0], {1, 2}, frames[2]}, kvevents.ErrFrames},
		{"bad-payload", [][]byte{frames[0], frames[1], {0xc1}}, kvevents.ErrMalformed},
	}
	for _, tc := range bad {
		if _, err := kvevents.DecodeFrames(tc.frames); !errors.Is(err, tc.want) {
			t.Errorf("%s: error %v, want %v", tc.name, err, tc.want)
		}
	}
}
