package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/testutil"
)

// SIGTERM (ctx ends) drains the gateway and `kvgate serve` exits 0.
func TestServeExitsZeroAfterDrain(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			_, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`)
		}
	}))
	defer up.Close()
	ctx, cancel := context.WithCancel(context.Background())
	out, errOut := &syncBuffer{}, &syncBuffer{}
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, []string{"serve", "--replicas", up.URL, "--listen", "127.0.0.1:0", "--drain-timeout", "200ms",
			"--first-byte-timeout", "5s", "--log-level", "error"}, strings.NewReader(""), out, errOut)
	}()
	testutil.Eventually(t, 10*time.Second, "the gateway to start", func() bool { return strings.Contains(out.String(), "serving http://") })
	cancel()
	select {
	case c := <-code:
		if c != 0 {
			t.Fatalf("exit %d after a drain: %s", c, errOut.String())
		}
	case <-time.After(30 * time.Second): // a bound on a hang, not a wait
		t.Fatal("serve did not stop")
	}
}
