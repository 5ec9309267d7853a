package sim

import (
	"bufio"
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"
)

// startStream opens a streamed request and returns its body after the
// first chunk arrived.
func startStream(t *testing.T, url, body string) io.ReadCloser {
	t.Helper()
	c := testClient(t)
	r, err := c.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(r.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("first line %q: %v", line, err)
	}
	return struct {
		io.Reader
		io.Closer
	}{br, r.Body}
}

func TestShutdownGraceful(t *testing.T) {
	f, err := Start(context.Background(), Config{Replicas: 2, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	url := f.URLs()[0]
	body := startStream(t, url, `{"model":"sim-llama-8b","prompt":"x","max_tokens":20,"ignore_eos":true,"stream":true}`)
	defer body.Close()
	done := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		done <- f.Shutdown(ctx)
	}()
	rest, err := io.ReadAll(body)
	if err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("in-flight stream not completed: %v, %q", err, rest)
	}
	if err := <-done; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if conn, err := net.Dial("tcp", strings.TrimPrefix(url, "http://")); err == nil {
		conn.Close()
		t.Error("still listening after Shutdown")
	}
	if err := f.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestCloseCutsInFlight(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	f, err := Start(ctx, Config{Replicas: 1, Seed: 1, KVEvents: true})
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	body := startStream(t, f.URLs()[0],
		`{"model":"sim-llama-8b","prompt":"x","max_tokens":100000,"ignore_eos":true,"stream":true}`)
	defer body.Close()
	// Cancelling Start's context closes the fleet at once.
	cancel()
	if _, err := io.ReadAll(body); err == nil {
		t.Error("stream completed after Close")
	}
	if err := f.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
}
