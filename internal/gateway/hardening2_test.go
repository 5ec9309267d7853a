package gateway

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
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

// Finding 9 (the gateway side; the rule itself is tested in fleet): the
// scrape age of each replica is a metric.
func TestScrapeAgeMetric(t *testing.T) {
	a := newStub(t, "", okStream(1))
	gw, clk := gwWithClock(t, baseConfig(a.srv.URL))
	eventually(t, "first scrape", func() bool {
		_, _, ok := gw.g.Router().ReplicaMetrics(0)
		return ok
	})
	before := counterValue(t, gw.g.reg, "kvgate_scrape_age_seconds", nil)
	a.srv.Close() // scrapes fail from now on
	clk.Advance(5 * time.Second)
	after := counterValue(t, gw.g.reg, "kvgate_scrape_age_seconds", nil)
	if after < before+5 || after > before+6 {
		t.Fatalf("scrape age %v → %v after 5 s without a good scrape", before, after)
	}
	if gw.g.Router().Views(gw.g.Router().Prepare(mustParse(t, `{"model":"m","prompt":"x"}`), "", ""))[0].HaveMetrics {
		t.Fatal("stale metrics still used")
	}
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

// Finding 11: remote tokenization is spread over the healthy replicas and
// bounded by tokenize_timeout, falling back to the approximate tokenizer.
func TestRemoteTokenizerSpreadAndFallback(t *testing.T) {
	var slowCalls, fastCalls atomic.Int64
	tokenizer := func(calls *atomic.Int64, delay chan struct{}) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			if delay != nil {
				select {
				case <-delay:
				case <-r.Context().Done():
					return
				}
			}
			_, _ = io.WriteString(w, `{"tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`)
		}
	}
	never := make(chan struct{})
	defer close(never)
	mk := func(h http.HandlerFunc) *stub {
		s := newStub(t, "", okStream(1))
		mux := http.NewServeMux()
		mux.Handle("/", s.srv.Config.Handler)
		mux.HandleFunc("/tokenize", h)
		s.srv.Config.Handler = mux
		return s
	}
	slow, fast := mk(tokenizer(&slowCalls, never)), mk(tokenizer(&fastCalls, nil))
	cfg := baseConfig(slow.srv.URL, fast.srv.URL)
	cfg.Tokenizer = "remote"
	cfg.TokenizeTimeout = Duration(50 * time.Millisecond)
	gw := startGateway(t, cfg)
	eventually(t, "models listed", func() bool { return len(gw.g.Fleet().Models()) > 0 })
	for i := range 6 {
		r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"distinct prompt `+strings.Repeat("z", i)+`"}`)
		if r.Status != 200 {
			t.Fatalf("%d %s", r.Status, r.Body)
		}
	}
	if slowCalls.Load() == 0 || fastCalls.Load() != 6 {
		t.Fatalf("tokenize calls: slow %d, fast %d; want spread, every request answered by the fast one", slowCalls.Load(), fastCalls.Load())
	}
	// Both replicas slow: the approximate tokenizer routes, within the bound.
	cfg2 := baseConfig(slow.srv.URL)
	cfg2.Tokenizer = "remote"
	cfg2.TokenizeTimeout = Duration(20 * time.Millisecond)
	gw2 := startGateway(t, cfg2)
	if r := testutil.Post(t, nil, gw2.srv.URL+"/v1/completions", `{"model":"m","prompt":"fallback"}`); r.Status != 200 {
		t.Fatalf("fallback: %d %s", r.Status, r.Body)
	}
	if n := counterValue(t, gw2.g.reg, "kvgate_remote_tokenize_total", map[string]string{"result": "fallback"}); n != 1 {
		t.Fatalf("%v fallbacks, want 1", n)
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

// Finding 13: X-Forwarded-For is appended to, not passed verbatim; the
// gateway's request id goes upstream and is the one the client sees.
func TestForwardedForAndRequestID(t *testing.T) {
	var seen atomic.Pointer[http.Header]
	a := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		h := r.Header.Clone()
		seen.Store(&h)
		w.Header().Set("X-Request-Id", "replica-own-id")
		okStream(1)(w, r)
	})
	gw, _ := gwWithClock(t, baseConfig(a.srv.URL))
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`,
		"X-Forwarded-For", "203.0.113.7", "X-Request-Id", "client-id-1")
	h := *seen.Load()
	if xff := h.Get("X-Forwarded-For"); xff != "203.0.113.7, 127.0.0.1" {
		t.Fatalf("X-Forwarded-For upstream %q", xff)
	}
	if h.Get("X-Request-Id") != "client-id-1" || r.Header.Get("X-Request-Id") != "client-id-1" {
		t.Fatalf("request id upstream %q, to the client %q", h.Get("X-Request-Id"), r.Header.Get("X-Request-Id"))
	}
	r = testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if id := r.Header.Get("X-Request-Id"); id == "" || id == "replica-own-id" || (*seen.Load()).Get("X-Request-Id") != id {
		t.Fatalf("generated request id %q, upstream %q", id, (*seen.Load()).Get("X-Request-Id"))
	}
}

// Finding 14: keys match exactly, as vLLM's do.
func TestKeysAreCaseSensitive(t *testing.T) {
	a := newStub(t, "", okStream(1))
	gw, _ := gwWithClock(t, baseConfig(a.srv.URL))
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"MODEL":"m","prompt":"x"}`)
	if r.Status != 400 || !strings.Contains(r.Body, `"param":"model"`) || a.calls.Load() != 0 {
		t.Fatalf("MODEL: %d %s", r.Status, r.Body)
	}
}

// Finding 15: /v1/models keeps the replicas' fields and needs a key when
// keys are configured.
func TestModelsEndpoint(t *testing.T) {
	a := newStub(t, `{"object":"list","data":[{"id":"m","root":"/models/m","parent":null,"max_model_len":4096},`+
		`{"id":"lora","root":"/adapters/l","parent":"m","max_model_len":4096}]}`, okStream(1))
	cfg := baseConfig(a.srv.URL)
	cfg.APIKeys = []string{"k"}
	gw, _ := gwWithClock(t, cfg)
	get := func(key string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, gw.srv.URL+"/v1/models", nil)
		if key != "" {
			req.Header.Set("Authorization", "Bearer "+key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, _ := get(""); code != 401 {
		t.Fatalf("without a key: %d", code)
	}
	code, body := get("k")
	var list struct {
		Data []struct {
			ID          string  `json:"id"`
			Root        string  `json:"root"`
			Parent      *string `json:"parent"`
			MaxModelLen int     `json:"max_model_len"`
		} `json:"data"`
	}
	if code != 200 || json.Unmarshal([]byte(body), &list) != nil || len(list.Data) != 2 {
		t.Fatalf("%d %s", code, body)
	}
	l := list.Data[0] // sorted by id
	if l.ID != "lora" || l.Root != "/adapters/l" || l.Parent == nil || *l.Parent != "m" || l.MaxModelLen != 4096 ||
		list.Data[1].Parent != nil {
		t.Fatalf("fields lost: %s", body)
	}
}

// The breaker cycle, exactly, on a fake clock: a replica whose /health
// passes but whose every answer is a 500 sees EjectAfter requests, then one
// trial per cooldown (10 s, 20 s, ...), each answered 500 to its client.
func TestBreakerCycleOnFakeClock(t *testing.T) {
	broken := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(500)
		_, _ = io.WriteString(w, `{"error":{"message":"engine dead","type":"InternalServerError","code":500}}`)
	})
	good := newStub(t, "", okStream(1))
	cfg := baseConfig(broken.srv.URL, good.srv.URL)
	cfg.Policy = "round_robin"
	cfg.EjectAfter = 3
	cfg.EjectCooldown = Duration(10 * time.Second)
	gw, clk := gwWithClock(t, cfg)
	send := func(n int) (fails int) {
		for range n {
			if r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`); r.Status == 500 {
				fails++
			}
			waitIdle(t, gw) // the attempt is settled (a client may read its answer a moment before)
		}
		return fails
	}
	fails := 0
	for i := 0; broken.calls.Load() < 3 && i < 20; i++ {
		fails += send(1)
	}
	if fails != 3 || gw.g.Fleet().State(0) != "open" {
		for _, v := range []string{"served", "failed", "client_gone", "rejected"} {
			t.Logf("%s: %v", v, counterValue(t, gw.g.reg, "kvgate_attempts_total", map[string]string{"verdict": v, "replica": broken.srv.URL}))
		}
		t.Fatalf("%d of %d requests to the broken replica failed; breaker %s", fails, broken.calls.Load(), gw.g.Fleet().State(0))
	}
	if send(10); broken.calls.Load() != 3 {
		t.Fatalf("an open breaker let %d requests through", broken.calls.Load()-3)
	}
	for i, cooldown := range []time.Duration{10 * time.Second, 20 * time.Second, 40 * time.Second} {
		clk.Advance(cooldown)
		// The health loop runs on the clock too: step it until its check,
		// after the cooldown, puts the replica back half-open.
		eventually(t, "back in rotation half-open", func() bool {
			clk.Advance(gw.g.cfg.HealthInterval.D())
			return gw.g.Router().Healthy(0)
		})
		send(4)
		if want := int64(4 + i); broken.calls.Load() != want {
			t.Fatalf("cooldown %d: %d requests reached the broken replica, want %d (one trial)", i, broken.calls.Load(), want)
		}
		if st := gw.g.Fleet().State(0); st != "open" {
			t.Fatalf("after a failed trial: %s", st)
		}
	}
}
