package gateway

// Faults on the request path, from clients and replicas as real ones fail:
// overflowing fields, hang-ups, silent and stalled replicas, an adapter on
// one replica, slow readers, a query of death, bounded buffering, rejected
// prompts. Timeouts are driven by a fake clock.

import (
	"bufio"
	"context"
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

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/testutil"
)

// stub is a vLLM-shaped replica whose completions endpoint a test writes.
type stub struct {
	srv       *httptest.Server
	calls     atomic.Int64
	tokenizes atomic.Int64
	models    string
}

const defaultModels = `{"object":"list","data":[{"id":"m","object":"model","root":"/models/m","parent":null,"max_model_len":4096}]}`

func newStub(t *testing.T, models string, complete http.HandlerFunc) *stub {
	t.Helper()
	s := &stub{models: models}
	if s.models == "" {
		s.models = defaultModels
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.1\n")
	})
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, s.models) })
	handler := func(w http.ResponseWriter, r *http.Request) { s.calls.Add(1); complete(w, r) }
	mux.HandleFunc("/v1/completions", handler)
	mux.HandleFunc("/v1/chat/completions", handler)
	s.srv = httptest.NewServer(mux)
	t.Cleanup(s.srv.Close)
	return s
}

// okStream answers a stream of n token events and [DONE].
func okStream(n int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !strings.Contains(string(body), `"stream":true`) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"choices":[{"index":0,"text":"ok"}],"usage":{"prompt_tokens":4,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range n {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"text\":\"t%d\"}]}\n\n", i)
			w.(http.Flusher).Flush()
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	}
}

// gwWithClock starts a gateway on a fake clock; the fleet's first probes
// have run when it returns (models listed).
func gwWithClock(t *testing.T, cfg Config) (*testGW, *clock.Fake) {
	t.Helper()
	clk := clock.NewFake(time.Time{})
	tg := startGatewayWith(t, cfg, Options{Clock: clk})
	eventually(t, "models listed", func() bool { return len(tg.g.Fleet().Models()) > 0 })
	return tg, clk
}

func counterValue(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	total := 0.0
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if matches(m, labels) {
				total += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	return total
}

func matches(m *dto.Metric, labels map[string]string) bool {
	for k, v := range labels {
		found := false
		for _, l := range m.GetLabel() {
			if l.GetName() == k && l.GetValue() == v {
				found = true
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// Finding 1: max_tokens of 2^63−1 is a clear 400 and harms nobody else.
func TestOverflowRequestIsRejectedAndHarmsNoOne(t *testing.T) {
	a := newStub(t, "", okStream(2))
	gw, _ := gwWithClock(t, baseConfig(a.srv.URL))
	var wg sync.WaitGroup
	var bad atomic.Int64
	for i := range 30 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := fmt.Sprintf(`{"model":"m","prompt":"hello %d","max_tokens":8,"stream":true}`, i)
			if i%3 == 0 {
				body = `{"model":"m","prompt":"x","max_tokens":9223372036854775807}`
			}
			r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", body)
			if (i%3 == 0 && (r.Status != 400 || !strings.Contains(r.Body, `"param":"max_tokens"`))) ||
				(i%3 != 0 && (r.Status != 200 || !strings.Contains(r.Body, "[DONE]"))) {
				bad.Add(1)
				t.Errorf("request %d: %d %s", i, r.Status, r.Body)
			}
		}()
	}
	wg.Wait()
	if a.calls.Load() != 20 {
		t.Fatalf("replica saw %d requests, want the 20 ordinary ones", a.calls.Load())
	}
	// Above the model's context (4096, from /v1/models): a 400 before routing.
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x","max_completion_tokens":5000}`)
	if r.Status != 400 || !strings.Contains(r.Body, "context of 4096") {
		t.Fatalf("max_tokens above the context: %d %s", r.Status, r.Body)
	}
}

// Finding 2: clients pressing "stop" mid-stream never count against the
// replica; neither does the gateway's own request_timeout ending a stream.
func TestClientHangupsDoNotEjectReplicas(t *testing.T) {
	hold := make(chan struct{})
	t.Cleanup(func() { close(hold) })
	a := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"t\"}]}\n\n")
		w.(http.Flusher).Flush()
		select { // a long generation
		case <-hold:
		case <-r.Context().Done():
		}
	})
	cfg := baseConfig(a.srv.URL)
	cfg.EjectAfter = 3
	cfg.StreamIdleTimeout = 0 // the long generations here are silent: only request_timeout ends them
	gw, clk := gwWithClock(t, cfg)
	for range 9 {
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw.srv.URL+"/v1/completions",
			strings.NewReader(`{"model":"m","prompt":"x","stream":true}`))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		line, _ := bufio.NewReader(resp.Body).ReadString('\n')
		if !strings.Contains(line, "data:") {
			t.Fatalf("first chunk %q", line)
		}
		cancel() // the user pressed stop
		resp.Body.Close()
	}
	waitIdle(t, gw)
	// The gateway's own request_timeout ends three long streams.
	for range 3 {
		resp, br := startStream(t, gw.srv.URL, `{"model":"m","prompt":"y","stream":true}`)
		clk.Advance(gw.g.conf().RequestTimeout.D())
		rest, _ := io.ReadAll(br)
		resp.Body.Close()
		if !strings.Contains(string(rest), "request_timeout") {
			t.Fatalf("a stream cut by request_timeout must end with an error event: %q", rest)
		}
	}
	waitIdle(t, gw)
	if st := gw.g.Fleet().State(0); st != "closed" || !gw.g.Router().Healthy(0) {
		t.Fatalf("client hang-ups changed the replica's breaker: %s", st)
	}
	if n := counterValue(t, gw.g.reg, "kvgate_attempts_total", map[string]string{"verdict": "client_gone"}); n != 9 {
		t.Fatalf("%v client_gone verdicts, want 9", n)
	}
	if n := counterValue(t, gw.g.reg, "kvgate_ejections_total", nil); n != 0 {
		t.Fatalf("%v ejections", n)
	}
}

// startStream sends a streamed request and reads its first event.
func startStream(t *testing.T, base, body string) (*http.Response, *bufio.Reader) {
	t.Helper()
	resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	if line, _ := br.ReadString('\n'); !strings.HasPrefix(line, "data:") {
		t.Fatalf("first line %q", line)
	}
	return resp, br
}

// Finding 3: a streamed request whose replica sends nothing is cut by the
// first-byte timeout (504, counted, never retried); a long non-streamed
// answer is never cut by it; a stalled stream ends at the idle timeout.
func TestFirstByteAndIdleTimeouts(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	handler := func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		switch {
		case strings.Contains(string(body), "stall-before"):
			<-r.Context().Done()
		case strings.Contains(string(body), "stall-after"):
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"t\"}]}\n\n")
			w.(http.Flusher).Flush()
			<-r.Context().Done()
		default: // a long non-streamed generation
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"choices":[{"index":0,"text":"long"}],"usage":{"prompt_tokens":1,"completion_tokens":900}}`)
		}
	}
	a, b := newStub(t, "", handler), newStub(t, "", handler)
	calls := func() int64 { return a.calls.Load() + b.calls.Load() }
	cfg := baseConfig(a.srv.URL, b.srv.URL)
	cfg.Retries = 2
	d := Defaults()
	if d.FirstByteTimeout <= 0 || d.StreamIdleTimeout <= 0 || d.WriteTimeout <= 0 || d.DrainTimeout <= 0 {
		t.Fatal("the defaults must bound first byte, stream idleness, client writes and drains")
	}
	gw, clk := gwWithClock(t, cfg)
	inFlight := func() int { return gw.g.Router().InFlight(0) + gw.g.Router().InFlight(1) }
	ask := func(body string, upstreamCalls int64) chan testutil.Response {
		t.Helper()
		c := make(chan testutil.Response, 1)
		go func() { c <- testutil.Post(t, nil, gw.srv.URL+"/v1/completions", body) }()
		eventually(t, "the request at its replica", func() bool { return calls() == upstreamCalls })
		return c
	}
	r0 := ask(`{"model":"m","prompt":"stall-before","stream":true}`, 1)
	clk.Advance(d.FirstByteTimeout.D())
	if r := <-r0; r.Status != 504 || calls() != 1 {
		t.Fatalf("first-byte timeout: %d %s; %d upstream calls (must not be retried)", r.Status, r.Body, calls())
	}
	long := ask(`{"model":"m","prompt":"long answer"}`, 2)
	clk.Advance(3 * d.FirstByteTimeout.D())
	once.Do(func() { close(release) })
	if r := <-long; r.Status != 200 || !strings.Contains(r.Body, "long") {
		t.Fatalf("a long non-streamed answer was cut: %d %s", r.Status, r.Body)
	}
	resp, br := startStream(t, gw.srv.URL, `{"model":"m","prompt":"stall-after","stream":true}`)
	defer resp.Body.Close()
	rest := make(chan []byte, 1)
	go func() { b, _ := io.ReadAll(br); rest <- b }()
	// The idle timer is armed once the first event is relayed, which the
	// client may see first: advance until the stream ends (bounded).
	var got []byte
	testutil.Eventually(t, 10*time.Second, "the stalled stream cut", func() bool {
		clk.Advance(d.StreamIdleTimeout.D())
		select {
		case got = <-rest:
			return true
		case <-time.After(10 * time.Millisecond):
			return false
		}
	})
	if !strings.Contains(string(got), "upstream_stream_idle") {
		t.Fatalf("stalled stream: %q", got)
	}
	eventually(t, "idle", func() bool { return inFlight() == 0 })
	if n := counterValue(t, gw.g.reg, "kvgate_attempts_total", map[string]string{"verdict": "failed"}); n != 2 {
		t.Fatalf("%v failed verdicts, want 2 (first byte, idle)", n)
	}
}

// Finding 4: an adapter served by 1 of 3 replicas always goes there.
func TestAdapterOnOneReplica(t *testing.T) {
	plain := func() *stub { return newStub(t, "", okStream(1)) }
	withLoRA := newStub(t, `{"object":"list","data":[{"id":"m","root":"m","parent":null,"max_model_len":4096},`+
		`{"id":"sql-lora","root":"/adapters/sql","parent":"m","max_model_len":4096}]}`, okStream(1))
	a, b := plain(), plain()
	gw, _ := gwWithClock(t, baseConfig(a.srv.URL, withLoRA.srv.URL, b.srv.URL))
	eventually(t, "all listed", func() bool { return len(gw.g.Fleet().Models()) == 2 })
	for i := range 12 {
		r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":"sql-lora","prompt":"q%d"}`, i))
		if r.Status != 200 || r.Header.Get("X-Kvgate-Replica") != withLoRA.srv.URL {
			t.Fatalf("request %d: %d via %s", i, r.Status, r.Header.Get("X-Kvgate-Replica"))
		}
	}
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"other","prompt":"q"}`)
	if r.Status != 404 || strings.Contains(r.Body, "sql-lora") || strings.Contains(r.Body, "127.0.0.1") {
		t.Fatalf("unknown model: %d %s (must not list models or addresses)", r.Status, r.Body)
	}
}

// Finding 5: a client that stops reading loses its request at the write
// timeout, and its concurrency slot is freed.
func TestSlowReaderFreesItsSlot(t *testing.T) {
	chunk := "data: {\"choices\":[{\"index\":0,\"text\":\"" + strings.Repeat("x", 60<<10) + "\"}]}\n\n"
	a := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !strings.Contains(string(body), "flood") {
			okStream(1)(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for range 2000 { // up to 120 MiB: far more than socket buffers hold
			if _, err := io.WriteString(w, chunk); err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	})
	cfg := baseConfig(a.srv.URL)
	cfg.MaxConcurrency, cfg.MaxQueue = 2, 0
	cfg.WriteTimeout = Duration(200 * time.Millisecond)
	gw := startGateway(t, cfg)
	for range 2 {
		c, err := net.Dial("tcp", strings.TrimPrefix(gw.srv.URL, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		body := `{"model":"m","prompt":"flood","stream":true}`
		fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		// and never read
	}
	eventually(t, "both slow readers admitted", func() bool { return gw.g.live.lim.Load().inUse() == 2 })
	eventually(t, "the slow readers' slots freed by the write timeout", func() bool { return gw.g.live.lim.Load().inUse() == 0 })
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if r.Status != 200 {
		t.Fatalf("after two slow readers: %d %s", r.Status, r.Body)
	}
	waitIdle(t, gw)
	if st := gw.g.Fleet().State(0); st != "closed" {
		t.Fatalf("slow readers counted against the replica: %s", st)
	}
}

// Finding 6: a request sent whole and then answered by a dropped connection
// is never retried: an input that crashes a replica reaches one replica.
func TestQueryOfDeathReachesOneReplica(t *testing.T) {
	var hits atomic.Int64
	crash := func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		hits.Add(1)
		panic(http.ErrAbortHandler) // the replica's process dies on this input
	}
	reps := []*stub{newStub(t, "", crash), newStub(t, "", crash), newStub(t, "", crash)}
	cfg := baseConfig(reps[0].srv.URL, reps[1].srv.URL, reps[2].srv.URL)
	gw, _ := gwWithClock(t, cfg)
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"poison"}`)
	if r.Status != 502 || hits.Load() != 1 {
		t.Fatalf("query of death: %d %s, reached %d replicas", r.Status, r.Body, hits.Load())
	}
	if strings.Contains(r.Body, "127.0.0.1") {
		t.Fatalf("the error names an internal address: %s", r.Body)
	}
}

// Finding 7: a replica's endless line is cut at the line bound, and a large
// non-streamed body is relayed whole (not truncated under a 200), with its
// usage read from the tail.
func TestBoundedBuffering(t *testing.T) {
	big := `{"choices":[{"index":0,"text":"` + strings.Repeat("y", 3<<20) +
		`"}],"usage":{"prompt_tokens":5,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":3}}}`
	var wrote atomic.Int64
	a := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !strings.Contains(string(body), `"stream":true`) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, big)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: ")
		line := []byte(strings.Repeat("z", 64<<10))
		for range 6400 { // 400 MiB without a newline, unless the gateway hangs up
			if _, err := w.Write(line); err != nil {
				return
			}
			wrote.Add(int64(len(line)))
		}
	})
	cfg := baseConfig(a.srv.URL)
	cfg.MaxStreamLineBytes = 256 << 10
	gw, _ := gwWithClock(t, cfg)
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x","stream":true}`)
	if !strings.Contains(r.Body, "upstream_stream_error") || len(r.Body) > 4096 {
		t.Fatalf("endless line: %d bytes relayed: %.200q", len(r.Body), r.Body)
	}
	eventually(t, "the replica stops writing", func() bool { return gw.g.Router().InFlight(0) == 0 })
	if w := wrote.Load(); w > 64<<20 {
		t.Fatalf("the gateway read %d MiB of an endless line", w>>20)
	}
	r = testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if r.Status != 200 || r.Body != big {
		t.Fatalf("large body: %d, %d bytes of %d", r.Status, len(r.Body), len(big))
	}
}

// A request is credited to its replica once it is sent, before the
// replica answers (as the peers' routers credit what they route: a burst
// routed before the first answer sees it), and kept only if the replica
// takes it: a refusal forgets it.
func TestSentPromptsAreCreditedUntilRefused(t *testing.T) {
	hold := make(chan struct{})
	a := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		<-hold
		if strings.Contains(string(body), "refuse") {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, `{"error":{"message":"full","type":"ServiceUnavailableError","code":503}}`)
			return
		}
		r.Body = io.NopCloser(strings.NewReader(string(body)))
		okStream(1)(w, r)
	})
	var release sync.Once
	t.Cleanup(func() { release.Do(func() { close(hold) }) }) // a test stopped early frees the stub
	cfg := baseConfig(a.srv.URL)
	cfg.Retries = 0 // the refusal reaches the client at once, no backoff on the fake clock
	gw, _ := gwWithClock(t, cfg)
	rt := gw.g.Router()
	send := func(prompt string) <-chan int {
		done := make(chan int, 1)
		go func() { // no t.Fatal off the test's goroutine: a failed call is status -1
			resp, err := http.Post(gw.srv.URL+"/v1/completions", "application/json",
				strings.NewReader(`{"model":"m","prompt":"`+prompt+`","stream":true}`))
			if err != nil {
				done <- -1
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			done <- resp.StatusCode
		}()
		return done
	}
	taken := send("taken " + strings.Repeat("t ", 400))
	eventually(t, "the sent request credited before its answer", func() bool { return rt.Index().Len() > 0 })
	hold <- struct{}{}
	if st := <-taken; st != 200 {
		t.Fatalf("taken: %d", st)
	}
	waitIdle(t, gw)
	held := rt.Index().Len()
	refused := send("refuse " + strings.Repeat("r ", 400))
	eventually(t, "the second request credited before its answer", func() bool { return rt.Index().Len() > held })
	release.Do(func() { close(hold) })
	if st := <-refused; st != http.StatusServiceUnavailable {
		t.Fatalf("refused: %d", st)
	}
	waitIdle(t, gw)
	if n := rt.Index().Len(); n != held {
		t.Fatalf("after the refusal the index holds %d entries, want the %d of the request taken", n, held)
	}
}

// Finding 8: prompts the replicas reject leave nothing in the index.
func TestRejectedPromptsAreNotLearned(t *testing.T) {
	a := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if strings.Contains(string(body), "oversized") {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(400)
			_, _ = io.WriteString(w, `{"error":{"message":"too long","type":"BadRequestError","code":400}}`)
			return
		}
		okStream(1)(w, r)
	})
	gw, _ := gwWithClock(t, baseConfig(a.srv.URL))
	for range 3 {
		r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions",
			`{"model":"m","prompt":"oversized `+strings.Repeat("w ", 4000)+`","stream":true}`)
		if r.Status != 400 {
			t.Fatalf("%d %s", r.Status, r.Body)
		}
		r = testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"oversized non-streamed `+strings.Repeat("v ", 4000)+`"}`)
		if r.Status != 400 {
			t.Fatalf("%d %s", r.Status, r.Body)
		}
	}
	waitIdle(t, gw)
	if n := gw.g.Router().Index().Len(); n != 0 {
		t.Fatalf("the index holds %d entries of rejected prompts", n)
	}
	if st := gw.g.Fleet().State(0); st != "closed" {
		t.Fatalf("the client's 400s counted against the replica: %s", st)
	}
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"`+strings.Repeat("ok ", 200)+`","stream":true}`)
	waitIdle(t, gw)
	if r.Status != 200 || gw.g.Router().Index().Len() == 0 {
		t.Fatalf("an accepted prompt was not learned: %d, %d entries", r.Status, gw.g.Router().Index().Len())
	}
}
