package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// Tests of the KV-event door (issue 22, findings 2, 3 and 8): who may
// publish on kv_events_listen, what a peer may cost, and how much a stream
// out of order may log and dial.

// freeListen is a tcp:// endpoint on a free loopback port.
func freeListen(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return "tcp://" + ln.Addr().String()
}

// rawPub is a ZMQ PUB connection made by hand to the gateway's listening
// socket from a chosen loopback address, so that a test controls every
// sequence number (a forger's 0 included).
type rawPub struct {
	conn net.Conn
	zc   *zmq4.Conn
}

// dialPub connects from local to listen and waits for the gateway's
// subscription; nil when the gateway refused the connection.
func dialPub(t *testing.T, local, listen string) *rawPub {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}, Timeout: 5 * time.Second}
	conn, err := d.Dial("tcp", strings.TrimPrefix(listen, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	zc, err := zmq4.Open(conn, null.Security(), zmq4.Pub, nil, false, nil)
	if err != nil {
		return nil
	}
	if _, err := zc.RecvMsg(); err != nil { // the subscription
		return nil
	}
	return &rawPub{conn: conn, zc: zc}
}

func (p *rawPub) send(t *testing.T, topic string, seq uint64, b kvevents.Batch) {
	t.Helper()
	frames, err := kvevents.EncodeFrames(topic, seq, b, kvevents.FormMap)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.zc.SendMsg(zmq4.NewMsgFrom(frames...)); err != nil {
		t.Fatal(err)
	}
}

// stored is one batch storing every text's blocks (16 tokens each).
func stored(texts ...string) kvevents.Batch {
	var b kvevents.Batch
	for k, text := range texts {
		b.Events = append(b.Events, storedEvent(text, 16, uint64(1000*(k+1)), false).Events...)
	}
	return b
}

// metricSum sums a series over the given label sets (nil: all).
func metricSum(t *testing.T, gw *testGW, name string, labels ...map[string]string) float64 {
	t.Helper()
	if len(labels) == 0 {
		return counterValue(t, gw.g.reg, name, nil)
	}
	total := 0.0
	for _, l := range labels {
		total += counterValue(t, gw.g.reg, name, l)
	}
	return total
}

// Finding 2: replicas A and B at 127.0.0.1, C at 127.0.0.2, each
// publishing from its own address. A publisher at 127.0.0.2 (C's address)
// forges A's topic with B's and C's prompts and a sequence-0 restart of A
// and B; one at 127.0.0.3 (no replica's) tries the same. Nothing moves:
// the index, the routing and every replica's sync are unchanged, and the
// forged batches are counted as drops with reason peer_address.
func TestKVListenForgedPublisherMovesNothing(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 2})
	flC := startSim(t, sim.Config{Replicas: 1, Host: "127.0.0.2"})
	urls := append(fl.URLs(), flC.URLs()...)
	listen := freeListen(t)
	cfg := simConfig("precise", urls...)
	cfg.Tokenizer = "remote"
	cfg.KVEventsListen = listen
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	topic := func(i int) string { return "kv@" + strings.TrimPrefix(urls[i], "http://") + "@" + sim.DefaultModel }
	texts := make([][]string, 3)
	for i, from := range []string{"127.0.0.1", "127.0.0.1", "127.0.0.2"} {
		texts[i] = []string{preciseText(fmt.Sprint("replica ", i, " first")), preciseText(fmt.Sprint("replica ", i, " second"))}
		p := dialPub(t, from, listen)
		if p == nil {
			t.Fatalf("replica %d's publisher refused from its own address %s", i, from)
		}
		p.send(t, topic(i), 0, stored(texts[i]...))
	}
	eventually(t, "every replica's prompts indexed, in sync", func() bool {
		for i := range texts {
			for _, text := range texts[i] {
				if matchOn(gw, sim.DefaultModel, text, i) != 8 {
					return false
				}
			}
		}
		return metricSum(t, gw, "kvgate_kv_events_synced") == 3
	})
	routes := func() map[string]string {
		out := map[string]string{}
		for i := range texts {
			for _, text := range texts[i] {
				out[text] = routedTo(t, gw, sim.DefaultModel, text)
			}
		}
		return out
	}
	before := routes()
	for i := range texts {
		for _, text := range texts[i] {
			if before[text] != urls[i] {
				t.Fatalf("before the attack, replica %d's prompt went to %s", i, before[text])
			}
		}
	}
	batches := metricSum(t, gw, "kvgate_kv_events_batches_total")
	sent := 0.0
	for _, forger := range []string{"127.0.0.2", "127.0.0.3"} {
		p := dialPub(t, forger, listen)
		if p == nil {
			continue // refused at the door
		}
		p.send(t, topic(0), 0, stored(append(texts[1], texts[2]...)...)) // A "restarted" holding B's and C's prompts
		p.send(t, topic(1), 0, kvevents.Batch{})                         // B "restarted" empty
		sent += 2
	}
	eventually(t, "the forged batches handled", func() bool {
		drops := 0.0
		for _, u := range urls {
			drops += counterValue(t, gw.g.reg, "kvgate_kv_events_dropped_total", map[string]string{"replica": u, "reason": "peer_address"})
		}
		return drops+metricSum(t, gw, "kvgate_kv_events_batches_total")-batches >= sent && sent > 0
	})
	after := routes()
	moved := 0
	for text, r := range before {
		if after[text] != r {
			moved++
		}
	}
	if moved != 0 {
		t.Errorf("%d of %d prompts moved after the forgery: before %v, after %v", moved, len(before), before, after)
	}
	if m := matchOn(gw, sim.DefaultModel, texts[1][0], 0); m != 0 {
		t.Errorf("replica A credited with %d blocks of replica B's prompt", m)
	}
	for i := range texts {
		for _, text := range texts[i] {
			if m := matchOn(gw, sim.DefaultModel, text, i); m != 8 {
				t.Errorf("replica %d's prompt now matches %d blocks there", i, m)
			}
		}
	}
	if n := metricSum(t, gw, "kvgate_kv_events_synced"); n != 3 {
		t.Errorf("%v replicas in sync after the forgery, want 3", n)
	}
	if n := counterValue(t, gw.g.reg, "kvgate_kv_events_dropped_total", map[string]string{"replica": urls[0], "reason": "peer_address"}); n != 1 {
		t.Errorf("%v batches for A dropped for their address, want 1", n)
	}
	if n := counterValue(t, gw.g.reg, "kvgate_kv_events_connections_closed_total", map[string]string{"reason": "peer_address"}); n != 1 {
		t.Errorf("%v connections refused for their address, want 1 (127.0.0.3)", n)
	}
}

// listenGateway is a gateway listening for the KV events of one sim
// replica at 127.0.0.1, and its listening endpoint.
func listenGateway(t *testing.T) (*testGW, *sim.Fleet, string) {
	t.Helper()
	fl := startSim(t, sim.Config{Replicas: 1})
	listen := freeListen(t)
	cfg := simConfig("precise", fl.URLs()...)
	cfg.Tokenizer = "remote"
	cfg.KVEventsListen = listen
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	return gw, fl, listen
}

// Finding 3: 24 peers at the replica's address announcing 64 MiB frames
// are cut at the header, with nothing allocated for the frame.
func TestKVListenOversizedFramesCut(t *testing.T) {
	gw, _, listen := listenGateway(t)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var open []*rawPub
	for range 24 {
		if p := dialPub(t, "127.0.0.1", listen); p != nil {
			// A frame header announcing 64 MiB, more frames to follow, and 4 KiB of it.
			if _, err := p.conn.Write(append([]byte{0x03, 0, 0, 0, 0, 4, 0, 0, 0}, make([]byte, 4096)...)); err != nil {
				t.Fatal(err)
			}
			open = append(open, p)
		}
	}
	for _, p := range open {
		_ = p.conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		var ne net.Error
		if _, err := io.Copy(io.Discard, p.conn); errors.As(err, &ne) && ne.Timeout() { // EOF or a reset: closed
			t.Fatalf("a peer announcing a 64 MiB frame kept its connection: %v", err)
		}
	}
	runtime.ReadMemStats(&after)
	if grew := after.TotalAlloc - before.TotalAlloc; grew > 64<<20 {
		t.Errorf("%d MiB allocated while %d peers announced 64 MiB frames", grew>>20, len(open))
	}
	eventually(t, "every cut connection counted", func() bool {
		return counterValue(t, gw.g.reg, "kvgate_kv_events_connections_closed_total",
			map[string]string{"reason": "frame_size"}) == float64(len(open))
	})
}

// Finding 3: 1,100 idle peers from an address no replica has hold no
// slot; the replica's publisher, connecting after them, is heard.
func TestKVListenIdlePeersLockNobodyOut(t *testing.T) {
	gw, fl, listen := listenGateway(t)
	idle := 0
	for range 1100 {
		if dialPub(t, "127.0.0.2", listen) != nil {
			idle++
		}
	}
	text := preciseText("heard despite the idle peers")
	pub := dialPub(t, "127.0.0.1", listen)
	if pub == nil {
		t.Fatalf("the replica's publisher was refused (%d idle peers from 127.0.0.2 connected)", idle)
	}
	pub.send(t, "kv@"+strings.TrimPrefix(fl.URLs()[0], "http://")+"@"+sim.DefaultModel, 0, stored(text))
	eventually(t, "the publisher heard", func() bool { return matchOn(gw, sim.DefaultModel, text, 0) == 8 })
	if idle != 0 {
		t.Errorf("%d idle peers from an address no replica has were let in", idle)
	}
	if n := counterValue(t, gw.g.reg, "kvgate_kv_events_connections_closed_total", map[string]string{"reason": "peer_address"}); n != 1100 {
		t.Errorf("%v connections refused for their address, want 1100", n)
	}
}

// Finding 8: 5,000 batches out of order (1, 0, 3, 2, ...) over two minutes
// of a fake clock: every gap and restart counted, but at most one line a
// minute per replica and cause, and the replay endpoint dialled at most a
// burst a minute (one in flight, one a second).
func TestKVOutOfOrderBatchesRateLimited(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var dials atomic.Int64
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			dials.Add(1)
			_ = conn.Close() // the replay fails at once
		}
	}()
	defer ln.Close()
	cfg := baseConfig("http://127.0.0.1:1")
	cfg.Replicas[0].KVEvents = "tcp://127.0.0.1:2" // not followed: the test hands batches over itself
	cfg.Replicas[0].KVEventsReplay = "tcp://" + ln.Addr().String()
	cfg.Tokenizer = "remote"
	clk := clock.NewFake(time.Unix(1_000_000, 0))
	var logs syncLog
	g, err := New(cfg, Options{Clock: clk, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	const n = 5000
	for k := range n / 2 {
		if k == n/4 {
			clk.Advance(time.Minute)
		}
		for _, seq := range []uint64{uint64(2*k + 1), uint64(2 * k)} {
			ctlOf(g).onKVMessage(ctx, 0, kvevents.Message{Topic: "kv@127.0.0.1:1@m", Seq: seq})
		}
	}
	gaps := counterValue(t, g.reg, "kvgate_kv_events_gaps_total", nil)
	if gaps < n/2-1 {
		t.Errorf("%v gaps counted, want every one (%d)", gaps, n/2-1)
	}
	if d := dials.Load(); d > 2*kvReplayBurst {
		t.Errorf("the replay endpoint dialled %d times for %d batches out of order, want at most %d", d, n, 2*kvReplayBurst)
	}
	out := logs.String()
	for _, line := range []string{"sequence gap", "publisher restarted"} {
		if c := strings.Count(out, line); c < 1 || c > 2 {
			t.Errorf("%q logged %d times over two minutes, want 1 or 2", line, c)
		}
	}
	if lines := strings.Count(out, "\n"); lines > 12 {
		t.Errorf("%d log lines for %d batches out of order:\n%s", lines, n, out)
	}
	if !strings.Contains(out, "suppressed=") {
		t.Errorf("the second minute's lines do not count the ones suppressed:\n%s", out)
	}
}

// kv_events_trust takes one entry or a list, and every setting of the
// KV-event socket is checked.
func TestKVEventsConfigValidated(t *testing.T) {
	base := "replicas: [{url: http://127.0.0.1:1}]\ntokenizer: remote\nkv_events_listen: tcp://127.0.0.1:5557\n"
	tests := []struct {
		name, yaml string
		trust      []string
		err        string
	}{
		{"default", "", []string{"replica_address"}, ""},
		{"one string", "kv_events_trust: any\n", []string{"any"}, ""},
		{"a list", "kv_events_trust: [replica_address, 10.0.0.0/8]\n", []string{"replica_address", "10.0.0.0/8"}, ""},
		{"empty list", "kv_events_trust: []\n", nil, "kv_events_trust"},
		{"a bare address", "kv_events_trust: 10.0.0.1\n", nil, "/32"},
		{"any and more", "kv_events_trust: [any, 10.0.0.0/8]\n", nil, "alone"},
		{"not a list", "kv_events_trust: {a: 1}\n", nil, "kv_events_trust"},
		{"tiny frames", "kv_events_max_frame_bytes: 1024\n", nil, "kv_events_max_frame_bytes"},
		{"huge frames", "kv_events_max_frame_bytes: 4294967296\n", nil, "kv_events_max_frame_bytes"},
		{"per address over all", "kv_events_max_connections: 8\nkv_events_max_connections_per_address: 9\n", nil, "per address"},
		{"no connections", "kv_events_max_connections: 0\n", nil, "kv_events_max_connections"},
		{"idle too short", "kv_events_idle_timeout: 10ms\n", nil, "kv_events_idle_timeout"},
		{"handshake too long", "kv_events_handshake_timeout: 2m\n", nil, "kv_events_handshake_timeout"},
		{"all set", "kv_events_max_frame_bytes: 8388608\nkv_events_max_connections: 64\nkv_events_max_connections_per_address: 4\n" +
			"kv_events_idle_timeout: 10m\nkv_events_handshake_timeout: 2s\n", []string{"replica_address"}, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := ParseConfig([]byte(base + tc.yaml))
			if err == nil {
				err = cfg.Validate()
			}
			switch {
			case tc.err == "" && err != nil:
				t.Fatal(err)
			case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
				t.Fatalf("err %v, want one naming %q", err, tc.err)
			case tc.err == "" && strings.Join(cfg.KVEventsTrust, ",") != strings.Join(tc.trust, ","):
				t.Fatalf("trust %v, want %v", cfg.KVEventsTrust, tc.trust)
			}
		})
	}
}

// nameResolver answers A lookups from a table.
type nameResolver map[string]string

func (r nameResolver) LookupIPAddr(_ context.Context, host string) ([]net.IPAddr, error) {
	if ip, ok := r[host]; ok {
		return []net.IPAddr{{IP: net.ParseIP(ip)}}, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

func (r nameResolver) LookupSRV(context.Context, string, string, string) (string, []*net.SRV, error) {
	return "", nil, errors.New("not used")
}

// Who may connect, and for which replica a publisher may publish, under
// each kv_events_trust: replicas listed by address or by a name resolved
// through the gateway's resolver. (Nothing is dialled: the replicas'
// data-parallel sizes are given.)
func TestKVPublisherTrust(t *testing.T) {
	const a, b = "kv@127.0.0.11:8000@m", "kv@engine-b.test:8000@m" // b resolves to 127.0.0.12
	type check struct {
		from, topic      string
		connect, publish bool
	}
	tests := []struct {
		trust  []string
		checks []check
	}{
		{[]string{"replica_address"}, []check{
			{"127.0.0.11", a, true, true}, {"127.0.0.11", b, true, false}, {"127.0.0.12", b, true, true},
			{"127.0.0.12", a, true, false}, {"127.0.0.13", a, false, false}, {"127.0.0.11", "kv@10.9.9.9:1@m", true, true}}},
		{[]string{"127.0.0.8/30"}, []check{
			{"127.0.0.9", a, true, true}, {"127.0.0.9", b, true, true}, {"127.0.0.12", b, false, false}, {"127.0.0.11", b, true, true}}},
		{[]string{"replica_address", "192.168.0.0/16"}, []check{
			{"192.168.7.7", a, true, true}, {"127.0.0.12", b, true, true}, {"127.0.0.12", a, true, false}, {"127.0.0.19", b, false, false}}},
		{[]string{"any"}, []check{{"203.0.113.9", a, true, true}, {"127.0.0.12", a, true, true}}},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.trust, ","), func(t *testing.T) {
			cfg := baseConfig("http://127.0.0.11:8000", "http://engine-b.test:8000")
			for i := range cfg.Replicas {
				cfg.Replicas[i].DataParallelSize = 1
			}
			cfg.Tokenizer = "remote"
			cfg.KVEventsListen = "tcp://127.0.0.1:5557" // not bound: the test asks the checks directly
			cfg.KVEventsTrust = tc.trust
			g, err := New(cfg, Options{Resolver: nameResolver{"engine-b.test": "127.0.0.12"}})
			if err != nil {
				t.Fatal(err)
			}
			stop := ctlOf(g).followKVAddrs(t.Context())
			defer stop()
			testutil.Eventually(t, 10*time.Second, "the name resolved", func() bool {
				return ctlOf(g).kv.book.Load().Has(netip.MustParseAddr("127.0.0.12"))
			})
			trust, err := kvzmq.ParseTrust(tc.trust)
			if err != nil {
				t.Fatal(err)
			}
			refused := 0
			for _, c := range tc.checks {
				from := netip.MustParseAddr(c.from)
				if got := ctlOf(g).kvMayConnect(trust, from); got != c.connect {
					t.Errorf("%s may connect: %v, want %v", c.from, got, c.connect)
				}
				err := ctlOf(g).kvAuthorize(trust, 0, from, c.topic)
				if (err == nil) != c.publish || (err != nil && !errors.Is(err, errPeerAddress)) {
					t.Errorf("%s publishing %s: %v, want allowed %v", c.from, c.topic, err, c.publish)
				}
				if err != nil {
					refused++
				}
			}
			if n := counterValue(t, g.reg, "kvgate_kv_events_dropped_total", map[string]string{"reason": "peer_address"}); n != float64(refused) {
				t.Errorf("%v drops counted for %d refused", n, refused)
			}
		})
	}
}
