package kvzmq

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/testutil"
)

func startListener(t *testing.T, ctx context.Context, endpoint string, s *sink, o ListenOptions) *Listener {
	t.Helper()
	if o.OnError == nil {
		o.OnError = s.onErr
	}
	l, err := Listen(ctx, endpoint, s.handle, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	return l
}

func listenerEndpoint(l *Listener) string { return "tcp://" + l.Addr().String() }

// startConnecting starts a publisher that dials endpoint.
func startConnecting(t *testing.T, ctx context.Context, endpoint string, o PublisherOptions) *zmqPublisher {
	t.Helper()
	o.Connect = true
	p, err := newPublisher(ctx, endpoint, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// waitSubscribed waits until the listener's subscription has reached p: a
// batch published before that is dropped, as ZMQ PUB drops it.
func waitSubscribed(t *testing.T, p *zmqPublisher) {
	t.Helper()
	testutil.Eventually(t, waitTimeout, "the listener's subscription", func() bool { return p.subscribers() == 1 })
}

func publishN(t *testing.T, p *zmqPublisher, from, n int) {
	t.Helper()
	for i := from; i < from+n; i++ {
		if err := p.Publish(testBatch(i)); err != nil {
			t.Fatal(err)
		}
	}
}

func TestConnectingPublisherToListener(t *testing.T) {
	ctx := t.Context()
	s := newSink()
	remotes := make(chan net.Addr, 1)
	l := startListener(t, ctx, "tcp://127.0.0.1:0", s, ListenOptions{OnConnect: func(a net.Addr) { remotes <- a }})
	const topic, n = "kv@127.0.0.1:8000@m", 50
	p := startConnecting(t, ctx, listenerEndpoint(l), PublisherOptions{Topic: topic, Form: kvevents.FormArray})
	if p.Addr() != nil {
		t.Errorf("connect-mode Addr() = %v, want nil", p.Addr())
	}
	waitSubscribed(t, p)
	publishN(t, p, 0, n)
	drain(t, p, s)
	msgs, _, errs := s.snapshot()
	if len(msgs) != n || len(errs) != 0 {
		t.Fatalf("%d messages, errors %v", len(msgs), errs)
	}
	for i, m := range msgs {
		if m.Seq != uint64(i) || m.Topic != topic || !sameBatch(m.Batch, testBatch(i)) {
			t.Fatalf("message %d: topic %q seq %d %s", i, m.Topic, m.Seq, dump(m.Batch))
		}
	}
	if a := <-remotes; a == nil || a.Network() != "tcp" {
		t.Errorf("OnConnect got %v", a)
	}
	if st := l.Stats(); st != (ListenerStats{Messages: n, Connects: 1, Active: 1}) {
		t.Errorf("stats %+v", st)
	}
}

func TestListenerTwoPublishers(t *testing.T) {
	ctx := t.Context()
	s := newSink()
	l := startListener(t, ctx, "tcp://127.0.0.1:0", s, ListenOptions{})
	pa := startConnecting(t, ctx, listenerEndpoint(l), PublisherOptions{Topic: "kv@a"})
	pb := startConnecting(t, ctx, listenerEndpoint(l), PublisherOptions{Topic: "kv@b", FirstSeq: 100})
	waitSubscribed(t, pa)
	waitSubscribed(t, pb)
	const n = 20
	for i := range n {
		publishN(t, pa, i, 1)
		publishN(t, pb, i, 1)
	}
	s.waitUntil(t, "both publishers' batches", func(msgs []kvevents.Message, _ [][2]uint64, _ []error) bool { return len(msgs) >= 2*n })
	msgs, _, errs := s.snapshot()
	if len(msgs) != 2*n || len(errs) != 0 {
		t.Fatalf("%d messages, errors %v", len(msgs), errs)
	}
	// In order per publisher (per connection); the two interleave freely.
	next := map[string]uint64{"kv@a": 0, "kv@b": 100}
	for _, m := range msgs {
		want, ok := next[m.Topic]
		if !ok || m.Seq != want || !sameBatch(m.Batch, testBatch(int(m.Seq%100))) {
			t.Fatalf("topic %q seq %d, want seq %d", m.Topic, m.Seq, want)
		}
		next[m.Topic]++
	}
	if st := l.Stats(); st != (ListenerStats{Messages: 2 * n, Connects: 2, Active: 2}) {
		t.Errorf("stats %+v", st)
	}
	if err := pa.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, waitTimeout, "one publisher left", func() bool { return l.Stats().Active == 1 })
	s.waitUntil(t, "the disconnect reported", func(_ []kvevents.Message, _ [][2]uint64, errs []error) bool { return len(errs) == 1 })
	if _, _, errs := s.snapshot(); !errors.Is(errs[0], ErrConnection) {
		t.Errorf("error %v", errs[0])
	}
}

func TestConnectingPublisherReconnectsAfterListenerRestart(t *testing.T) {
	ctx := t.Context()
	s1 := newSink()
	l1 := startListener(t, ctx, "tcp://127.0.0.1:0", s1, ListenOptions{})
	ep := listenerEndpoint(l1)
	p := startConnecting(t, ctx, ep, PublisherOptions{Topic: "kv"})
	waitSubscribed(t, p)
	publishN(t, p, 0, 3)
	drain(t, p, s1)
	if err := l1.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, waitTimeout, "the publisher to lose its peer", func() bool { return p.subscribers() == 0 })
	publishN(t, p, 3, 2) // no peer: dropped

	s2 := newSink()
	l2 := startListener(t, ctx, ep, s2, ListenOptions{})
	waitSubscribed(t, p)
	publishN(t, p, 5, 1)
	drain(t, p, s2)
	msgs, _, errs := s2.snapshot()
	if len(msgs) != 1 || msgs[0].Seq != 5 || !sameBatch(msgs[0].Batch, testBatch(5)) || len(errs) != 0 {
		t.Fatalf("after the restart: %d messages (first seq %d), errors %v", len(msgs), msgs[0].Seq, errs)
	}
	if st := l2.Stats(); st.Connects != 1 || st.Messages != 1 {
		t.Errorf("stats %+v", st)
	}
}

func TestPublisherFirstSeq(t *testing.T) {
	ctx := t.Context()
	s := newSink()
	l := startListener(t, ctx, "tcp://127.0.0.1:0", s, ListenOptions{})
	p := startConnecting(t, ctx, listenerEndpoint(l), PublisherOptions{FirstSeq: 1})
	waitSubscribed(t, p)
	publishN(t, p, 0, 3)
	drain(t, p, s)
	msgs, _, _ := s.snapshot()
	var seqs []uint64
	for _, m := range msgs {
		seqs = append(seqs, m.Seq)
	}
	if len(seqs) != 3 || seqs[0] != 1 || seqs[1] != 2 || seqs[2] != 3 {
		t.Fatalf("seqs %v, want [1 2 3]", seqs)
	}
}

// readUntilClosed reads conn until the peer closes it; it fails on a
// timeout, i.e. when the peer keeps the connection open.
func readUntilClosed(t *testing.T, conn net.Conn) {
	t.Helper()
	_ = conn.SetReadDeadline(time.Now().Add(waitTimeout))
	_, err := io.Copy(io.Discard, conn)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatal("the listener kept the connection open")
	}
}

func TestListenerMaxConnections(t *testing.T) {
	ctx := t.Context()
	s := newSink()
	l := startListener(t, ctx, "tcp://127.0.0.1:0", s, ListenOptions{MaxConnections: 1})
	p := startConnecting(t, ctx, listenerEndpoint(l), PublisherOptions{})
	waitSubscribed(t, p)

	// Full: a second connection is closed before any greeting is sent.
	conn, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(waitTimeout))
	if n, err := conn.Read(make([]byte, 64)); n != 0 || !errors.Is(err, io.EOF) {
		t.Fatalf("over the limit: read %d bytes, %v; want EOF", n, err)
	}
	s.waitUntil(t, "the refusal reported", func(_ []kvevents.Message, _ [][2]uint64, errs []error) bool { return len(errs) == 1 })
	if st := l.Stats(); st.Rejected != 1 || st.Active != 1 {
		t.Errorf("stats %+v", st)
	}

	// The publisher's connection still works.
	publishN(t, p, 0, 2)
	drain(t, p, s)
}

// dialZMTP connects to addr and handshakes as a socket of type typ.
func dialZMTP(t *testing.T, addr string, typ zmq4.SocketType) (net.Conn, *zmq4.Conn, error) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(waitTimeout))
	zc, err := zmq4.Open(conn, null.Security(), typ, nil, false, nil)
	return conn, zc, err
}

func TestListenerSurvivesMisbehavingPeers(t *testing.T) {
	ctx := t.Context()
	s := newSink()
	l := startListener(t, ctx, "tcp://127.0.0.1:0", s, ListenOptions{})
	addr := l.Addr().String()

	// An unknown socket type makes zmq4's handshake panic.
	if _, _, err := dialZMTP(t, addr, zmq4.SocketType("BOGUS")); err == nil {
		t.Fatal("handshake as BOGUS succeeded")
	}
	s.waitUntil(t, "the bad handshake reported", func(_ []kvevents.Message, _ [][2]uint64, errs []error) bool { return len(errs) == 1 })

	// A frame header claiming a terabyte: closed before zmq4 allocates.
	conn, _, err := dialZMTP(t, addr, zmq4.Pub)
	if err != nil {
		t.Fatal(err)
	}
	var hdr [9]byte
	hdr[0] = flagLong | flagMore
	binary.BigEndian.PutUint64(hdr[1:], 1<<40)
	if _, err := conn.Write(hdr[:]); err != nil {
		t.Fatal(err)
	}
	readUntilClosed(t, conn)
	s.waitUntil(t, "the huge frame reported", func(_ []kvevents.Message, _ [][2]uint64, errs []error) bool { return len(errs) == 2 })

	_, _, errs := s.snapshot()
	for _, err := range errs {
		if !errors.Is(err, ErrConnection) || !errors.Is(err, ErrPeer) {
			t.Errorf("error %v, want ErrConnection and ErrPeer", err)
		}
	}
	// And it still serves publishers.
	p := startConnecting(t, ctx, listenerEndpoint(l), PublisherOptions{})
	waitSubscribed(t, p)
	publishN(t, p, 0, 1)
	drain(t, p, s)
}

func TestListenerDropsUndecodableMessages(t *testing.T) {
	ctx := t.Context()
	s := newSink()
	l := startListener(t, ctx, "tcp://127.0.0.1:0", s, ListenOptions{})
	p := startConnecting(t, ctx, listenerEndpoint(l), PublisherOptions{Topic: "t"})
	waitSubscribed(t, p)
	p.sendRaw([]byte("t"), kvevents.SeqFrame(0), []byte{0xc1}) // not msgpack
	p.sendRaw([]byte("t"), []byte{1})                          // two frames
	publishN(t, p, 2, 1)
	drain(t, p, s)
	msgs, _, errs := s.snapshot()
	if len(msgs) != 1 || len(errs) != 2 {
		t.Fatalf("%d messages, errors %v", len(msgs), errs)
	}
	var me *MessageError
	if !errors.As(errs[0], &me) || me.Topic != "t" || !errors.Is(errs[0], kvevents.ErrMalformed) || !errors.Is(errs[1], kvevents.ErrFrames) {
		t.Errorf("errors %v", errs)
	}
	if st := l.Stats(); st.Dropped != 2 || st.Messages != 1 {
		t.Errorf("stats %+v", st)
	}
}

func TestListenerStopsWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	s := newSink()
	l, err := Listen(ctx, "tcp://127.0.0.1:0", s.handle, ListenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	p := startConnecting(t, t.Context(), listenerEndpoint(l), PublisherOptions{})
	waitSubscribed(t, p)
	cancel()
	testutil.Eventually(t, waitTimeout, "the publisher to lose its peer", func() bool { return p.subscribers() == 0 })
	testutil.Eventually(t, waitTimeout, "the socket to be unbound", func() bool {
		conn, err := net.Dial("tcp", l.Addr().String())
		if err == nil {
			_ = conn.Close()
		}
		return err != nil
	})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			if err := l.Close(); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
}

func TestListenArgumentErrors(t *testing.T) {
	h := func(kvevents.Message) {}
	if _, err := Listen(t.Context(), "tcp://127.0.0.1:0", nil, ListenOptions{}); !errors.Is(err, ErrNilHandler) {
		t.Errorf("nil handler: %v", err)
	}
	if _, err := Listen(t.Context(), "udp://127.0.0.1:0", h, ListenOptions{}); !errors.Is(err, ErrEndpoint) {
		t.Errorf("udp: %v", err)
	}
	if _, err := NewPublisher(t.Context(), "tcp://*:5557", PublisherOptions{Connect: true}); !errors.Is(err, ErrEndpoint) {
		t.Errorf("connect to *: %v", err)
	}
}

func TestBindsEndpoint(t *testing.T) {
	tests := map[string]bool{
		"tcp://*:5557":              true,
		"tcp://0.0.0.0:5557":        true,
		"tcp://[::]:5557":           true,
		"ipc:///tmp/kv":             true,
		"inproc://kv":               true,
		"tcp://127.0.0.1:5557":      false,
		"tcp://router.svc:5557":     false,
		"tcp://[2001:db8::1]:5557":  true, // "::" is in the address: vLLM binds it too
		"tcp://10.0.0.1:5557":       false,
		"tcp://kv-router.ns.svc:80": false,
	}
	for ep, want := range tests {
		if got := BindsEndpoint(ep); got != want {
			t.Errorf("BindsEndpoint(%q) = %v, want %v", ep, got, want)
		}
	}
}
