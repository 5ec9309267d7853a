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
	case <-time.After(30 * time.Second): // a bound on a hang, not a wait
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
