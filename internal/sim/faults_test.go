package sim

import (
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

const smallBody = `{"model":"sim-llama-8b","prompt":"fault injection","max_tokens":3,"ignore_eos":true}`

// streamBody is long enough (5000 steps) that the cut always comes first.
const streamBody = `{"model":"sim-llama-8b","prompt":"fault injection","max_tokens":5000,"ignore_eos":true,"stream":true}`

func errorType(t *testing.T, r testutil.Response) string {
	t.Helper()
	var e struct {
		Error struct {
			Type string `json:"type"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(r.Body), &e); err != nil {
		t.Fatalf("not an OpenAI error body: %s", r.Body)
	}
	return e.Error.Type
}

func TestFaultErrorRateAndReplicas(t *testing.T) {
	cfg := fast()
	cfg.Replicas = 2
	cfg.Faults.ErrorRate = 1
	cfg.FaultReplicas = []int{1}
	f := startFleet(t, cfg)
	c := testClient(t)
	if r := testutil.Post(t, c, f.URLs()[0]+"/v1/completions", smallBody); r.Status != 200 {
		t.Errorf("replica 0 (no faults): %d", r.Status)
	}
	r := testutil.Post(t, c, f.URLs()[1]+"/v1/completions", smallBody)
	if r.Status != 500 || errorType(t, r) != "server_error" {
		t.Errorf("replica 1: %d %s", r.Status, r.Body)
	}
	if r := get(t, c, f.URLs()[1]+"/health"); r.Status != 200 {
		t.Errorf("an error rate does not fail /health: %d", r.Status)
	}
}

// The rate is a seeded draw: about the rate, and the same sequence again
// with the same seed.
func TestFaultErrorRateSeeded(t *testing.T) {
	run := func() []bool {
		cfg := fast()
		cfg.Faults.ErrorRate = 0.25
		f := startFleet(t, cfg)
		c := testClient(t)
		var out []bool
		for range 120 {
			out = append(out, testutil.Post(t, c, f.URLs()[0]+"/v1/completions", smallBody).Status == 500)
		}
		return out
	}
	a, b := run(), run()
	n := 0
	for i := range a {
		if a[i] {
			n++
		}
		if a[i] != b[i] {
			t.Fatalf("request %d differs between runs with one seed", i)
		}
	}
	if n < 15 || n > 45 {
		t.Errorf("%d errors of 120 at rate 0.25", n)
	}
}

func TestFaultFailAfter(t *testing.T) {
	cfg := fast()
	cfg.Faults.FailAfter = 2
	f := startFleet(t, cfg)
	c := testClient(t)
	url := f.URLs()[0]
	for i, want := range []int{200, 200, 503, 503} {
		if r := testutil.Post(t, c, url+"/v1/chat/completions",
			`{"model":"sim-llama-8b","messages":[{"role":"user","content":"x"}],"max_tokens":1}`); r.Status != want {
			t.Errorf("request %d: %d, want %d", i, r.Status, want)
		}
	}
	if r := get(t, c, url+"/health"); r.Status != 503 {
		t.Errorf("/health after failing: %d", r.Status)
	}
}

// A stalled request gets no byte until the stall (on the replica's clock)
// has passed.
func TestFaultStall(t *testing.T) {
	clk := newFakeClock()
	cfg := Config{Clock: clk, Seed: 1, Faults: Faults{StallRate: 1, Stall: 10 * time.Second}}
	f := startFleet(t, cfg)
	c := testClient(t)
	done := make(chan testutil.Response, 1)
	go func() { done <- testutil.Post(t, c, f.URLs()[0]+"/v1/completions", smallBody) }()
	if got := waitTimer(t, clk); got != 10*time.Second {
		t.Fatalf("stall timer %v", got)
	}
	clk.Advance(10*time.Second - time.Millisecond)
	select {
	case r := <-done:
		t.Fatalf("answered %d before the stall ended", r.Status)
	default:
	}
	clk.Advance(time.Millisecond)
	decodeCompletion(t, finish(t, clk, done))
}

// finish runs the engine's steps on the fake clock (advancing to each
// armed timer) until the answer arrives.
func finish(t *testing.T, clk *clock.Fake, done <-chan testutil.Response) testutil.Response {
	t.Helper()
	var r testutil.Response
	testutil.Eventually(t, 10*time.Second, "the answer", func() bool {
		select {
		case r = <-done:
			return true
		default:
		}
		if p := clk.Pending(); len(p) > 0 {
			clk.Advance(p[0])
		}
		return false
	})
	return r
}

func TestFaultDie(t *testing.T) {
	cfg := fast()
	cfg.Faults.DieRate = 1
	f := startFleet(t, cfg)
	c := testClient(t)
	url := f.URLs()[0]

	// Streamed: the first chunk arrives, then the connection is cut.
	r, err := c.Post(url+"/v1/completions", "application/json", strings.NewReader(streamBody))
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(r.Body)
	r.Body.Close()
	if err == nil || !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("stream read error %v, want unexpected EOF", err)
	}
	if !strings.HasPrefix(string(body), "data: {") || strings.Contains(string(body), "[DONE]") ||
		strings.Contains(string(body), `"finish_reason":"length"`) {
		t.Errorf("stream body %q", body)
	}
	testutil.Eventually(t, 10*time.Second, "the abort", func() bool {
		n, _ := metricValue(scrape(t, c, url), MetricRequestSuccess, map[string]string{"finished_reason": "abort"})
		return n == 1
	})

	// Non-streamed: no response at all.
	if r, err := c.Post(url+"/v1/completions", "application/json", strings.NewReader(smallBody)); err == nil {
		r.Body.Close()
		t.Errorf("non-streamed request answered %d", r.StatusCode)
	}
}

// The replica closes its listener and connections for a window, then
// listens on the same port again.
func TestFaultRefuse(t *testing.T) {
	clk := newFakeClock()
	cfg := Config{Clock: clk, Seed: 1, Faults: Faults{RefuseAfter: time.Second, RefuseFor: 2 * time.Second}}
	f := startFleet(t, cfg)
	c := testClient(t)
	url := f.URLs()[0]
	addr := strings.TrimPrefix(url, "http://")
	if r := get(t, c, url+"/health"); r.Status != 200 {
		t.Fatalf("/health %d", r.Status)
	}
	if got := waitTimer(t, clk); got != time.Second {
		t.Fatalf("refuse timer %v", got)
	}
	clk.Advance(time.Second)
	testutil.Eventually(t, 10*time.Second, "connections refused", func() bool { return refused(addr) })
	// The client's kept-alive connection is cut too: goDown closes the
	// listener, then the open connections, so a request on the kept-alive
	// one may slip between the two; it fails once they are cut (were they
	// never cut, it would be served for ever and this would time out).
	testutil.Eventually(t, 10*time.Second, "the kept-alive connection cut", func() bool {
		r, err := c.Get(url + "/health")
		if err == nil {
			r.Body.Close()
		}
		return err != nil
	})
	if got := waitTimer(t, clk); got != 2*time.Second {
		t.Fatalf("reopen timer %v", got)
	}
	clk.Advance(2 * time.Second)
	waitHealthy(t, c, url)
}

// waitHealthy waits until the replica's /health answers 200.
func waitHealthy(t *testing.T, c *http.Client, url string) {
	t.Helper()
	testutil.Eventually(t, 10*time.Second, "the replica back", func() bool {
		r, err := c.Get(url + "/health")
		if err != nil {
			return false
		}
		r.Body.Close()
		return r.StatusCode == http.StatusOK
	})
}

// refused reports whether a TCP connection to the replica is refused.
func refused(addr string) bool {
	conn, err := net.Dial("tcp", addr)
	if err == nil {
		conn.Close()
		return false
	}
	return true
}

// A query of death crashes the replica it reaches: no answer to it, open
// connections cut (an in-flight stream too), new ones refused, until
// CrashFor has passed on the replica's clock; replicas without the fault
// answer it as any request.
func TestFaultCrash(t *testing.T) {
	clk := newFakeClock()
	const mark = "<<kill-the-replica>>"
	cfg := Config{Clock: clk, Seed: 1, Replicas: 2, FaultReplicas: []int{0},
		Faults: Faults{CrashOn: mark, CrashFor: 5 * time.Second}}
	f := startFleet(t, cfg)
	c := testClient(t)
	url := f.URLs()[0]
	addr := strings.TrimPrefix(url, "http://")
	poison := `{"model":"sim-llama-8b","messages":[{"role":"system","content":"be brief"},` +
		`{"role":"user","content":"please ` + mark + ` now"}],"max_tokens":2}`
	// A replica without the fault answers the query of death as any request.
	done := make(chan testutil.Response, 1)
	go func() { done <- testutil.Post(t, c, f.URLs()[1]+"/v1/chat/completions", poison) }()
	if got := decodeCompletion(t, finish(t, clk, done)); got.Usage.CompletionTokens < 1 {
		t.Errorf("replica 1: %+v", got.Usage)
	}

	if r := get(t, c, url+"/health"); r.Status != 200 { // a kept-alive connection
		t.Fatalf("/health %d", r.Status)
	}
	stream, err := c.Post(url+"/v1/completions", "application/json", strings.NewReader(streamBody))
	if err != nil || stream.StatusCode != 200 {
		t.Fatalf("stream: %v", err)
	}
	defer stream.Body.Close()

	if r, err := c.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(poison)); err == nil {
		r.Body.Close()
		t.Fatalf("the query of death was answered %d", r.StatusCode)
	}
	if !refused(addr) {
		t.Fatal("connections accepted after the crash")
	}
	if _, err := io.ReadAll(stream.Body); err == nil {
		t.Error("the in-flight stream was not cut")
	}
	if _, err := c.Get(url + "/health"); err == nil {
		t.Error("a kept-alive connection survived the crash")
	}

	testutil.Eventually(t, 10*time.Second, "the restart timer", func() bool {
		return slices.Contains(clk.Pending(), 5*time.Second)
	})
	clk.Advance(5*time.Second - time.Millisecond)
	if !refused(addr) {
		t.Fatal("back before CrashFor")
	}
	clk.Advance(time.Millisecond)
	waitHealthy(t, c, url)
	// And it crashes again on the next one.
	if r, err := c.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(poison)); err == nil {
		r.Body.Close()
		t.Fatalf("the second query of death was answered %d", r.StatusCode)
	}
	if !refused(addr) {
		t.Fatal("connections accepted after the second crash")
	}
}

// The mark is looked for in every prompt of a batch and in the rendered
// chat; token-id prompts have no text.
func TestCrashMark(t *testing.T) {
	r := fuzzReplica(t)
	r.faults = Faults{CrashOn: "QOD", CrashFor: time.Second}
	tests := []struct {
		kind  prompt.Kind
		body  string
		crash bool
	}{
		{prompt.Completion, `{"model":"sim-llama-8b","prompt":"fine"}`, false},
		{prompt.Completion, `{"model":"sim-llama-8b","prompt":"a QOD b"}`, true},
		{prompt.Completion, `{"model":"sim-llama-8b","prompt":["fine","a QOD"]}`, true},
		{prompt.Completion, `{"model":"sim-llama-8b","prompt":[1,2,3]}`, false},
		{prompt.Chat, `{"model":"sim-llama-8b","messages":[{"role":"user","content":[{"type":"text","text":"QOD"}]}]}`, true},
		{prompt.Chat, `{"model":"sim-llama-8b","messages":[{"role":"user","content":"qod"}]}`, false},
	}
	for _, tc := range tests {
		j, err := r.parseJob(tc.kind, []byte(tc.body))
		if err != nil || j.crash != tc.crash {
			t.Errorf("%s: crash %v, %v; want %v", tc.body, j != nil && j.crash, err, tc.crash)
		}
	}
}
