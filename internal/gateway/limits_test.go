package gateway

// The gateway's own limits: the connection cap and the body budget, and
// the drain at shutdown.

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

func mustParse(t *testing.T, body string) *prompt.Parsed {
	t.Helper()
	p, err := prompt.Parse(prompt.Completion, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// serveOnLoopback runs a gateway's Serve on a loopback port; cancel starts
// its drain, and served yields Serve's result.
func serveOnLoopback(t *testing.T, cfg Config) (*Gateway, net.Listener, context.CancelFunc, chan error) {
	t.Helper()
	g, err := New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- g.Serve(ctx, ln) }()
	return g, ln, cancel, served
}

// Finding 10: connections are capped (past the cap clients wait in the
// backlog, nobody is refused), and request bodies held at once are
// bounded by max_body_memory.
func TestConnectionCapAndBodyMemory(t *testing.T) {
	a := newStub(t, "", okStream(1))
	cfg := baseConfig(a.srv.URL)
	cfg.MaxConnections = 2
	cfg.MaxBodyBytes = 1 << 20
	cfg.MaxBodyMemory = 1 << 20
	cfg.MaxBodyMemoryShare = 1 // the budget as a whole, from one address
	cfg.QueueTimeout = Duration(200 * time.Millisecond)
	g, ln, cancel, served := serveOnLoopback(t, cfg)
	defer func() { cancel(); <-served }()
	base := "http://" + ln.Addr().String()
	// Two idle connections take the cap.
	var idle []net.Conn
	for range 2 {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		idle = append(idle, c)
	}
	got := make(chan int, 1)
	go func() {
		c := &http.Client{Transport: &http.Transport{}}
		defer c.CloseIdleConnections()
		req, _ := http.NewRequest(http.MethodGet, base+"/health", nil)
		resp, err := c.Do(req)
		if err != nil {
			got <- -1
			return
		}
		resp.Body.Close()
		got <- resp.StatusCode
	}()
	select {
	case <-got:
		t.Fatal("a third connection was served past the cap of 2")
	case <-time.After(100 * time.Millisecond): // a bound on a non-event, not a wait for one
	}
	idle[0].Close()
	if code := <-got; code != 200 {
		t.Fatalf("after a connection closed: %d", code)
	}
	idle[1].Close()
	// One body of the whole budget has arrived but for its last byte (its
	// client still sending); another waits queue_timeout for room, then
	// gets 503.
	slow, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer slow.Close()
	_, _ = io.WriteString(slow, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1048576\r\n\r\n{")
	_, _ = io.WriteString(slow, strings.Repeat(" ", 1<<20-2))
	eventually(t, "the budget taken", func() bool { return g.bodies.held.Load() == 1<<20-1 })
	r := testutil.Post(t, nil, base+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if r.Status != 503 || !strings.Contains(r.Body, "max_body_memory") {
		t.Fatalf("over the body budget: %d %s", r.Status, r.Body)
	}
}

// Finding 12: on shutdown /ready answers 503 at once, a request in flight
// gets drain_timeout, then is cut with an SSE error event; Serve returns nil.
func TestDrainOnShutdown(t *testing.T) {
	hold := make(chan struct{})
	defer close(hold)
	a := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"t\"}]}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-hold:
		case <-r.Context().Done():
		}
	})
	cfg := baseConfig(a.srv.URL)
	cfg.DrainTimeout = Duration(300 * time.Millisecond)
	_, ln, cancel, served := serveOnLoopback(t, cfg)
	base := "http://" + ln.Addr().String()
	resp, br := startStream(t, base, `{"model":"m","prompt":"long","stream":true}`)
	defer resp.Body.Close()
	cancel() // SIGTERM
	eventually(t, "/ready 503", func() bool {
		r, err := http.Get(base + "/ready")
		if err != nil {
			return false
		}
		r.Body.Close()
		return r.StatusCode == 503
	})
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), "gateway_shutdown") {
		t.Fatalf("a cut stream must end with an error event: %q", rest)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve after a drain: %v", err)
	}
}
