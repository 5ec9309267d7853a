package gateway

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/testutil"
)

// selfLoop, as a table: which replica URLs reach which listen address.
func TestSelfLoop(t *testing.T) {
	here := func() thisHost {
		return thisHost{name: "gw-host", addrs: []net.IP{net.ParseIP("10.1.2.3"), net.ParseIP("127.0.0.1")}}
	}
	for _, c := range []struct {
		listen, url string
		loop        bool
	}{
		{"127.0.0.1:8080", "http://127.0.0.1:8080", true},
		{"127.0.0.1:8080", "http://127.0.0.1:8080/v1/", true},
		{"127.0.0.1:8080", "http://localhost:8080", true},
		{"127.0.0.1:8080", "http://LOCALHOST:8080", true},
		{"127.0.0.1:8080", "http://0.0.0.0:8080", true},
		{"127.0.0.1:8080", "http://[::ffff:127.0.0.1]:8080", true},
		{"127.0.0.1:8080", "http://127.0.0.1:8081", false},
		{"127.0.0.1:8080", "http://127.0.0.2:8080", false}, // another loopback address: another socket
		{"127.0.0.1:8080", "http://[::1]:8080", false},
		{"127.0.0.1:8080", "https://127.0.0.1:8080", true},
		{"127.0.0.1:80", "http://localhost", true}, // the scheme's port
		{"127.0.0.1:443", "https://localhost", true},
		{"127.0.0.1:443", "http://localhost", false},
		{"localhost:8080", "http://127.0.0.1:8080", true},
		{"localhost:8080", "http://[::1]:8080", true},
		{"localhost:8080", "http://127.0.0.3:8080", false},
		{"[::1]:8080", "http://localhost:8080", true},
		{"[::1]:8080", "http://[::1]:8080", true},
		{":8080", "http://127.0.0.1:8080", true},
		{":8080", "http://127.0.0.2:8080", true}, // every address: the whole loopback range
		{":8080", "http://localhost:8080", true},
		{":8080", "http://[::]:8080", true},
		{"0.0.0.0:8080", "http://10.1.2.3:8080", true}, // an interface's address
		{"0.0.0.0:8080", "http://gw-host:8080", true},  // the hostname
		{"[::]:8080", "http://GW-HOST:8080", true},
		{"0.0.0.0:8080", "http://10.1.2.4:8080", false}, // another machine
		{"0.0.0.0:8080", "http://vllm-0.svc:8080", false},
		{"0.0.0.0:8080", "http://10.1.2.3:8000", false},
		{"10.1.2.3:8080", "http://10.1.2.3:8080", true},
		{"10.1.2.3:8080", "http://127.0.0.1:8080", false},
		{"vllm-gw:8080", "http://vllm-gw:8080", true},
		{"127.0.0.1:0", "http://127.0.0.1:0", false}, // a free port: never a fixed address
		{"127.0.0.1:http", "http://localhost", true},
		{"not an address", "http://127.0.0.1:8080", false},
	} {
		if got := selfLoop(c.listen, c.url, here); got != c.loop {
			t.Errorf("selfLoop(%q, %q) = %v, want %v", c.listen, c.url, got, c.loop)
		}
	}
}

// A replica URL that is the gateway's own listen address is refused at
// start; one brought by a replicas file or discovery is dropped (logged),
// the others kept.
func TestSelfLoopReplicaRefused(t *testing.T) {
	a := newFakeReplica(t)
	for _, self := range []string{"http://127.0.0.1:18181", "http://localhost:18181/"} {
		cfg := baseConfig(a.srv.URL, self)
		cfg.Listen = "127.0.0.1:18181"
		if _, err := New(cfg, Options{}); err == nil || !strings.Contains(err.Error(), "loop") {
			t.Fatalf("replica %s with listen %s: %v", self, cfg.Listen, err)
		}
		if err := cfg.Validate(); err == nil {
			t.Fatalf("Validate took replica %s with listen %s", self, cfg.Listen)
		}
	}
	// A replicas file read at start: the self entry dropped, logged.
	file := filepath.Join(t.TempDir(), "replicas.yaml")
	if err := os.WriteFile(file, []byte("- url: "+a.srv.URL+"\n- url: http://localhost:18181\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := baseConfig()
	cfg.Listen, cfg.ReplicasFile = "[::]:18181", file
	var logs testutil.SyncBuffer
	g, err := New(cfg, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	if n := g.rt.Replicas(); n != 1 || g.rt.URL(0) != a.srv.URL {
		t.Fatalf("the replicas file's self entry was not dropped: %d replicas", n)
	}
	if l := logs.String(); strings.Count(l, "requests would loop") != 1 {
		t.Fatalf("the self entry is not logged once: %s", l)
	}
	// A list from discovery while the gateway runs: the same.
	cfg = baseConfig(a.srv.URL)
	cfg.Listen = "0.0.0.0:18181"
	logs = testutil.SyncBuffer{}
	gw := startGatewayWith(t, cfg, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	b := newFakeReplica(t)
	if err := ctlOf(gw.g).Apply("", []ReplicaConfig{{URL: "http://127.0.0.1:18181"}, {URL: a.srv.URL}, {URL: b.srv.URL}}, "dns"); err != nil {
		t.Fatal(err)
	}
	var urls []string
	for i := range gw.g.rt.Replicas() {
		if !gw.g.rt.Replica(i).Removed() {
			urls = append(urls, gw.g.rt.URL(i))
		}
	}
	if len(urls) != 2 || urls[0] != a.srv.URL || urls[1] != b.srv.URL {
		t.Fatalf("after discovery: %v", urls)
	}
	if l := logs.String(); strings.Count(l, "requests would loop") != 1 {
		t.Fatalf("the self entry is not logged once: %s", l)
	}
}

// Each hop appends its Via entry to the client's; a request that carries
// this gateway's own entry gets 508 before routing, and never reaches a
// replica.
func TestViaHopAndLoop(t *testing.T) {
	a := newFakeReplica(t)
	gw := startGateway(t, baseConfig(a.srv.URL))
	resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "Via", "1.0 edge, 1.1 lb (Envoy)")
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	a.mu.Lock()
	via := a.headers[0].Values("Via")
	a.mu.Unlock()
	if strings.Join(via, ", ") != "1.0 edge, 1.1 lb (Envoy), 1.1 "+gw.g.via || !strings.HasPrefix(gw.g.via, "kvgate-") {
		t.Fatalf("the replica saw Via %q (gateway %s)", via, gw.g.via)
	}
	for _, v := range []string{"1.1 " + gw.g.via, "1.0 edge, 1.1 " + gw.g.via + " (kvgate)", "HTTP/1.1 x,1.1 " + gw.g.via} {
		resp, body = post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "Via", v)
		if resp.StatusCode != http.StatusLoopDetected || errorCode(body) != "loop_detected" {
			t.Fatalf("Via %q: %d %s", v, resp.StatusCode, body)
		}
	}
	if n := a.requests.Load(); n != 1 {
		t.Fatalf("%d requests reached the replica, want 1", n)
	}
	waitIdle(t, gw)
}

// Two gateways whose replicas are each other: a request ends in 508 after
// one round (not in thousands of connections), and the 508 counts against
// no replica (eject_after 1: one failure counted would eject).
func TestTwoGatewayLoopEndsIn508(t *testing.T) {
	lnA, lnB := listenLoopback(t), listenLoopback(t)
	urlA, urlB := "http://"+lnA.Addr().String(), "http://"+lnB.Addr().String()
	start := func(ln net.Listener, listen, replica string) *Gateway {
		cfg := baseConfig()
		cfg.Replicas = []ReplicaConfig{{URL: replica, DataParallelSize: 1}} // not counted at start: the other is not up yet
		cfg.Listen, cfg.EjectAfter = listen, 1
		// Bounds for the loop kvgate had: it ran until these ended it.
		cfg.MaxConnections, cfg.RequestTimeout = 64, Duration(30*time.Second)
		g, err := New(cfg, Options{})
		if err != nil {
			t.Fatal(err)
		}
		srv := &httptest.Server{Listener: ln, Config: &http.Server{Handler: g.Handler()}}
		srv.Start()
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); g.Run(ctx) }()
		t.Cleanup(func() { srv.Close(); cancel(); <-done })
		return g
	}
	gA := start(lnA, lnA.Addr().String(), urlB)
	gB := start(lnB, lnB.Addr().String(), urlA)
	eventually(t, "each gateway sees the other healthy", func() bool {
		return gA.rt.Replica(0).Healthy() && gB.rt.Replica(0).Healthy()
	})
	// Requests naming no model: each gateway lists the other's (empty)
	// models, so a request naming one would get 404 at the first hop.
	for _, c := range []struct{ path, body string }{
		{"/tokenize", `{"prompt":"hello"}`},
		{"/detokenize", `{"tokens":[1,2]}`},
		{"/v1/score", `{"text_1":"a","text_2":"b"}`},
	} {
		resp, body := post(t, urlA+c.path, c.body)
		if resp.StatusCode != http.StatusLoopDetected || errorCode(body) != "loop_detected" {
			t.Fatalf("%s through the loop: %d %s", c.path, resp.StatusCode, body)
		}
	}
	for _, g := range []*Gateway{gA, gB} {
		if g.fleet.Ejected(0) || !g.rt.Replica(0).Healthy() {
			t.Fatalf("a 508 counted against the other gateway (%s)", g.rt.URL(0))
		}
	}
	eventually(t, "nothing in flight", func() bool { return gA.rt.InFlight(0) == 0 && gB.rt.InFlight(0) == 0 })
}

func listenLoopback(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	return ln
}
