package main

import (
	"bytes"
	"context"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/testutil"
)

// `kvgate serve` with OTEL_TRACES_EXPORTER=otlp exports its spans to the
// OTLP/HTTP collector OTEL_EXPORTER_OTLP_ENDPOINT names; a request's spans,
// still batched when SIGTERM comes (the batch waits 5 s), are flushed on
// exit, after the drain, under the client's trace id.
func TestServeTracingFlushesOnExit(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/models":
			_, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`)
		case "/v1/completions":
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"c","choices":[{"index":0,"text":"ok"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}`)
		}
	}))
	defer up.Close()
	var mu sync.Mutex
	var exported [][]byte
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.URL.Path == "/v1/traces" {
			mu.Lock()
			exported = append(exported, b)
			mu.Unlock()
		}
	}))
	defer collector.Close()
	t.Setenv("OTEL_TRACES_EXPORTER", "otlp")
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.URL)
	ctx, cancel := context.WithCancel(context.Background())
	out, errOut := &testutil.SyncBuffer{}, &testutil.SyncBuffer{}
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, []string{"serve", "--replicas", up.URL, "--listen", "127.0.0.1:0", "--drain-timeout", "200ms",
			"--log-level", "error"}, strings.NewReader(""), out, errOut)
	}()
	addr := regexp.MustCompile(`serving (http://[0-9.:]+)`)
	testutil.Eventually(t, 10*time.Second, "the gateway to start", func() bool { return addr.MatchString(out.String()) })
	gw := addr.FindStringSubmatch(out.String())[1]
	const traceID = "0af7651916cd43dd8448eb211c80319c"
	resp := testutil.Post(t, nil, gw+"/v1/completions", `{"model":"m","prompt":"hi"}`,
		"traceparent", "00-"+traceID+"-b7ad6b7169203331-01")
	if resp.Status != 200 {
		t.Fatalf("%d %s", resp.Status, resp.Body)
	}
	cancel()
	select {
	case c := <-code:
		if c != 0 {
			t.Fatalf("exit %d: %s", c, errOut.String())
		}
	case <-time.After(testutil.Bound(30 * time.Second)): // a bound on a hang, not a wait
		t.Fatal("serve did not stop")
	}
	id, _ := hex.DecodeString(traceID)
	mu.Lock()
	defer mu.Unlock()
	for _, b := range exported {
		if bytes.Contains(b, id) {
			return
		}
	}
	t.Fatalf("%d exports, none with the request's trace id", len(exported))
}

// tracingEnabled: the configuration, or OTEL_TRACES_EXPORTER; the SDK's
// off switches win.
func TestTracingEnabled(t *testing.T) {
	env := func(kv ...string) func(string) string {
		return func(k string) string {
			for i := 0; i+1 < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1]
				}
			}
			return ""
		}
	}
	on, off := gateway.Config{Tracing: true}, gateway.Config{}
	for _, c := range []struct {
		cfg  gateway.Config
		env  func(string) string
		want bool
	}{
		{off, env(), false},
		{on, env(), true},
		{off, env("OTEL_TRACES_EXPORTER", "otlp"), true},
		{off, env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"), false},
		{on, env("OTEL_SDK_DISABLED", "true"), false},
		{on, env("OTEL_TRACES_EXPORTER", "none"), false},
	} {
		if got := tracingEnabled(c.cfg, c.env); got != c.want {
			t.Fatalf("tracing %v with %v: %v", c.cfg.Tracing, c.env("OTEL_TRACES_EXPORTER"), got)
		}
	}
}

// startTracing exports over OTLP/HTTP to the collector the variables name,
// and its shutdown flushes the batched spans; a protocol it does not speak
// is refused.
func TestStartTracingExportsAndFlushes(t *testing.T) {
	got := make(chan string, 16)
	collector := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		got <- r.URL.Path
	}))
	defer collector.Close()
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.URL)
	t.Setenv("OTEL_SERVICE_NAME", "kvgate-test")
	tp, shutdown, err := startTracing(context.Background(), gateway.Config{Tracing: true})
	if err != nil || tp == nil {
		t.Fatalf("%v %v", tp, err)
	}
	_, span := tp.Tracer("t").Start(context.Background(), "one")
	span.End()
	if err := shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-got:
		if p != "/v1/traces" {
			t.Fatalf("exported to %s", p)
		}
	default:
		t.Fatal("shutdown did not flush the batched span to the collector")
	}
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	if _, _, err := startTracing(context.Background(), gateway.Config{Tracing: true}); err == nil {
		t.Fatal("grpc accepted")
	}
	tp, shutdown, err = startTracing(context.Background(), gateway.Config{})
	if tp != nil || err != nil || shutdown(context.Background()) != nil {
		t.Fatal("tracing off still built a provider")
	}
}
