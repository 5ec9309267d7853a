package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeReplica is a minimal vLLM-shaped replica: it answers completions
// (streamed or not) with `n` tokens and usage, and counts requests.
type fakeReplica struct {
	srv      *httptest.Server
	requests atomic.Int64
	status   atomic.Int64 // when non-zero, completions answer this status
	breakAt  atomic.Int64 // when non-zero, streams break after this many chunks
	waiting  atomic.Int64 // vllm:num_requests_waiting its /metrics reports
	mu       sync.Mutex
	bodies   [][]byte
	headers  []http.Header
}

func newFakeReplica(t *testing.T) *fakeReplica {
	f := &fakeReplica{}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} %d\n"+
			"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} %d\n"+
			"# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n"+
			"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\"} 1\n", f.waiting.Load(), 0)
	})
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model"}]}`)
	})
	handler := func(w http.ResponseWriter, r *http.Request) {
		f.requests.Add(1)
		body, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.bodies = append(f.bodies, body)
		f.headers = append(f.headers, r.Header.Clone())
		f.mu.Unlock()
		for _, kv := range strings.Split(r.Header.Get("X-Test-Replica-Sets"), ";") { // "Name=value;...": headers to answer with
			if k, v, ok := strings.Cut(kv, "="); ok {
				w.Header().Set(k, v)
			}
		}
		if s := f.status.Load(); s != 0 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(int(s))
			fmt.Fprintf(w, `{"error":{"message":"status %d","type":"x","code":"y"}}`, s)
			return
		}
		var req struct {
			Stream bool `json:"stream"`
		}
		_ = json.Unmarshal(body, &req)
		usage := `{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":8}}`
		if !req.Stream {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"a b c","finish_reason":"length"}],"usage":%s}`, usage)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		for i := range 3 {
			if b := f.breakAt.Load(); b != 0 && int64(i) == b {
				panic(http.ErrAbortHandler) // cut the connection mid-stream
			}
			fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"t%d\",\"finish_reason\":null}]}\n\n", i)
			fl.Flush()
		}
		fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[],\"usage\":%s}\n\n", usage)
		fmt.Fprint(w, "data: [DONE]\n\n")
	}
	mux.HandleFunc("/v1/completions", handler)
	mux.HandleFunc("/v1/chat/completions", handler)
	f.srv = httptest.NewServer(mux)
	t.Cleanup(f.srv.Close)
	return f
}

type testGW struct {
	g      *Gateway
	srv    *httptest.Server
	cancel context.CancelFunc
	done   chan struct{}
}

func startGateway(t *testing.T, cfg Config) *testGW {
	t.Helper()
	return startGatewayWith(t, cfg, Options{})
}

// startGatewayWith starts a gateway with o (a logger, a fake clock) on an
// httptest server, stopped at the test's end.
func startGatewayWith(t *testing.T, cfg Config, o Options) *testGW {
	t.Helper()
	g, err := New(cfg, o)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	tg := &testGW{g: g, srv: httptest.NewServer(g.Handler()), cancel: cancel, done: make(chan struct{})}
	go func() { defer close(tg.done); g.Run(ctx) }()
	t.Cleanup(func() {
		tg.srv.Close()
		cancel()
		<-tg.done
	})
	return tg
}

// allListed waits until every replica of gw has been listed (its models
// read): until then only the listed ones are candidates, so a test of
// where a sequence of requests goes must not start before.
func allListed(t *testing.T, gw *testGW) {
	t.Helper()
	rt := gw.g.Router()
	eventually(t, "every replica listed", func() bool {
		for i := range rt.Replicas() {
			if rt.Replica(i).Served() == nil {
				return false
			}
		}
		return true
	})
}

func baseConfig(urls ...string) Config {
	cfg := Defaults()
	for _, u := range urls {
		cfg.Replicas = append(cfg.Replicas, ReplicaConfig{URL: u})
	}
	cfg.ScrapeInterval = Duration(20 * time.Millisecond)
	cfg.HealthInterval = Duration(20 * time.Millisecond)
	cfg.RetryBackoff = Duration(time.Millisecond)
	return cfg
}

// post sends a JSON body through testutil.Post and returns the status and
// header as a response, with the body read.
func post(t *testing.T, url, body string, hdr ...string) (*http.Response, string) {
	t.Helper()
	r := testutil.Post(t, nil, url, body, hdr...)
	return &http.Response{StatusCode: r.Status, Header: r.Header}, r.Body
}

// eventually polls cond until it holds or 5 s pass.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, what, cond)
}

func TestProxyNonStreamAndStream(t *testing.T) {
	a, b := newFakeReplica(t), newFakeReplica(t)
	gw := startGateway(t, baseConfig(a.srv.URL, b.srv.URL))
	resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"hello world","max_tokens":3}`)
	if resp.StatusCode != 200 || !strings.Contains(body, `"cached_tokens":8`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if r := resp.Header.Get("X-Kvgate-Replica"); r != a.srv.URL && r != b.srv.URL {
		t.Fatalf("X-Kvgate-Replica %q", r)
	}
	resp, body = post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"hello world","stream":true}`)
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" ||
		!strings.Contains(body, "t0") || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	resp, _ = post(t, gw.srv.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != 200 || resp.Header.Get("X-Kvgate-Replica") == "" {
		t.Fatalf("chat %d", resp.StatusCode)
	}
	waitIdle(t, gw)
}

// waitIdle waits for every replica's in-flight count to return to zero: a
// client may have read its whole answer a moment before the handler ends.
func waitIdle(t *testing.T, gw *testGW) {
	t.Helper()
	rt := gw.g.Router()
	eventually(t, "in-flight counts back to zero", func() bool {
		for i := range rt.Replicas() {
			if rt.InFlight(i) != 0 {
				return false
			}
		}
		return true
	})
}

func TestStreamFlushesEachEvent(t *testing.T) {
	release := make(chan struct{})
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("/v1/completions", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, "data: {\"choices\":[{\"text\":\"first\"}]}\n\n")
		w.(http.Flusher).Flush()
		<-release
		io.WriteString(w, "data: [DONE]\n\n")
	})
	up := httptest.NewServer(mux)
	defer up.Close()
	gw := startGateway(t, baseConfig(up.URL))
	req, _ := http.NewRequest(http.MethodPost, gw.srv.URL+"/v1/completions", strings.NewReader(`{"model":"m","prompt":"x","stream":true}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	line, err := br.ReadString('\n') // arrives while the upstream still holds the stream open
	close(release)
	if err != nil || !strings.Contains(line, "first") {
		t.Fatalf("%q %v", line, err)
	}
	_, _ = io.ReadAll(br)
}

func TestClientErrors(t *testing.T) {
	a := newFakeReplica(t)
	cfg := baseConfig(a.srv.URL)
	cfg.MaxBodyBytes = 1024
	gw := startGateway(t, cfg)
	eventually(t, "models listed", func() bool { return len(gw.g.Fleet().Models()) > 0 })
	tests := []struct {
		name, path, body string
		status           int
		code, param      string
	}{
		{"malformed", "/v1/completions", `{"model":`, 400, "", ""},
		{"no model", "/v1/completions", `{"prompt":"x"}`, 400, "", "model"},
		{"no prompt", "/v1/completions", `{"model":"m"}`, 400, "", "prompt"},
		{"no messages", "/v1/chat/completions", `{"model":"m"}`, 400, "", "messages"},
		{"oversized", "/v1/completions", `{"model":"m","prompt":"` + strings.Repeat("x", 2000) + `"}`, 413, "request_too_large", ""},
		{"unknown model", "/v1/completions", `{"model":"nope","prompt":"x"}`, 404, "model_not_found", ""},
		{"deep nesting", "/v1/completions", `{"model":"m","prompt":` + strings.Repeat("[", 200) + strings.Repeat("]", 200) + `}`, 400, "", ""},
		{"no endpoint", "/nothing", `{}`, 404, "not_found", ""}, // (any /v1/ path goes to the replicas: passthrough.go)
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := post(t, gw.srv.URL+tc.path, tc.body)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d want %d: %s", resp.StatusCode, tc.status, body)
			}
			var e errorBody
			if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("not an OpenAI error: %s", body)
			}
			if tc.code != "" && e.Error.Code != tc.code {
				t.Fatalf("code %q want %q", e.Error.Code, tc.code)
			}
			if tc.param != "" && (e.Error.Param == nil || *e.Error.Param != tc.param) {
				t.Fatalf("param %v want %q", e.Error.Param, tc.param)
			}
		})
	}
	if a.requests.Load() != 0 {
		t.Fatalf("a bad request reached the replica (%d)", a.requests.Load())
	}
	req, _ := http.NewRequest(http.MethodGet, gw.srv.URL+"/v1/completions", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 405 {
		t.Fatalf("GET: %d", resp.StatusCode)
	}
}

func TestRetryBeforeFirstByte(t *testing.T) {
	good := newFakeReplica(t)
	// A replica that refuses connections: a listener closed at once.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close()
	busy := newFakeReplica(t)
	busy.status.Store(503)
	cfg := baseConfig(dead, busy.srv.URL, good.srv.URL)
	cfg.Policy = "round_robin"
	cfg.HealthInterval = Duration(time.Hour) // keep the dead one in rotation: only the retry saves us
	cfg.EjectAfter = 1000
	gw := startGateway(t, cfg)
	for i := range 9 {
		resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
		if resp.StatusCode != 200 || resp.Header.Get("X-Kvgate-Replica") != good.srv.URL {
			t.Fatalf("request %d: %d %s via %s", i, resp.StatusCode, body, resp.Header.Get("X-Kvgate-Replica"))
		}
	}
	if good.requests.Load() != 9 {
		t.Fatalf("good replica got %d", good.requests.Load())
	}
	// Every replica refusing: the client gets the last refusal, not a hang.
	good.status.Store(503)
	resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 503 {
		t.Fatalf("all refusing: %d %s", resp.StatusCode, body)
	}
	waitIdle(t, gw)
}

func TestNoRetryAfterFirstByte(t *testing.T) {
	a, b := newFakeReplica(t), newFakeReplica(t)
	a.breakAt.Store(1)
	b.breakAt.Store(1)
	gw := startGateway(t, baseConfig(a.srv.URL, b.srv.URL))
	resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
	if resp.StatusCode != 200 || !strings.Contains(body, "t0") || !strings.Contains(body, "upstream_stream_error") {
		t.Fatalf("%d %q", resp.StatusCode, body)
	}
	if n := a.requests.Load() + b.requests.Load(); n != 1 {
		t.Fatalf("a broken stream was sent %d times", n)
	}
}

func TestAdminEndpoints(t *testing.T) {
	a := newFakeReplica(t)
	gw := startGateway(t, baseConfig(a.srv.URL))
	resp, _ := post(t, gw.srv.URL+"/debug/route", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 404 {
		t.Fatalf("no token configured: %d", resp.StatusCode)
	}
	cfg := baseConfig(a.srv.URL)
	cfg.AdminToken = "s3cret"
	gw = startGateway(t, cfg)
	resp, _ = post(t, gw.srv.URL+"/debug/route", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 401 {
		t.Fatalf("no bearer: %d", resp.StatusCode)
	}
	resp, _ = post(t, gw.srv.URL+"/debug/route", `{"model":"m","prompt":"x"}`, "Authorization", "Bearer wrong")
	if resp.StatusCode != 401 {
		t.Fatalf("wrong bearer: %d", resp.StatusCode)
	}
	before := a.requests.Load()
	resp, body := post(t, gw.srv.URL+"/debug/route", `{"model":"m","messages":[{"role":"user","content":"hello"}]}`, "Authorization", "Bearer s3cret")
	if resp.StatusCode != 200 || !strings.Contains(body, `"replica_url": "`+a.srv.URL) || !strings.Contains(body, `"kind": "chat"`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if a.requests.Load() != before {
		t.Fatal("a dry run sent the request")
	}
}

func TestAPIKeysAndHopHeaders(t *testing.T) {
	a := newFakeReplica(t)
	cfg := baseConfig(a.srv.URL)
	cfg.APIKeys = []string{"k1"}
	cfg.Replicas[0].APIKey = "upstream-key"
	gw := startGateway(t, cfg)
	resp, _ := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if resp.StatusCode != 401 {
		t.Fatalf("no key: %d", resp.StatusCode)
	}
	resp, _ = post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "Authorization", "Bearer k1",
		"Connection", "X-Secret-Hop", "X-Secret-Hop", "1", "Proxy-Authorization", "p")
	if resp.StatusCode != 200 {
		t.Fatalf("key: %d", resp.StatusCode)
	}
	a.mu.Lock()
	h := a.headers[len(a.headers)-1]
	a.mu.Unlock()
	if h.Get("Authorization") != "Bearer upstream-key" || h.Get("X-Secret-Hop") != "" || h.Get("Proxy-Authorization") != "" {
		t.Fatalf("upstream headers %v", h)
	}
}

// ctlOf is g's control plane, for tests that look inside it.
func ctlOf(g *Gateway) *control { return g.ctl.(*control) }
