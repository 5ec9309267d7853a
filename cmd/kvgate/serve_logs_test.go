package main

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/testutil"
)

// servedGateway is `kvgate serve` run in this process until stop.
type servedGateway struct {
	addr        string
	out, errOut *testutil.SyncBuffer
	stop        func() int // cancels the run and returns its exit status
}

// startServe runs kvgate serve with args (and --listen on a free port) and
// waits for its startup line.
func startServe(t *testing.T, args ...string) *servedGateway {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	g := &servedGateway{out: &testutil.SyncBuffer{}, errOut: &testutil.SyncBuffer{}}
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, append([]string{"serve", "--listen", "127.0.0.1:0"}, args...), strings.NewReader(""), g.out, g.errOut)
	}()
	stopped := false
	g.stop = func() int {
		if stopped {
			return 0
		}
		stopped = true
		cancel()
		return <-code
	}
	t.Cleanup(func() { g.stop() })
	testutil.Eventually(t, 10*time.Second, "the gateway to start", func() bool {
		return strings.Contains(g.out.String(), "serving http://") || strings.Contains(g.errOut.String(), "kvgate serve:")
	})
	line := g.out.String()
	i := strings.Index(line, "http://")
	if i < 0 {
		t.Fatalf("no startup line: %s%s", line, g.errOut.String())
	}
	g.addr = strings.Fields(line[i:])[0]
	return g
}

// healthyReplica answers /health (and 404 to the rest).
func healthyReplica(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// Without an admin token, one line at start says the admin endpoints are
// off and which flag turns them on; with one, nothing is said.
func TestServeSaysAdminOff(t *testing.T) {
	t.Setenv("KVGATE_ADMIN_TOKEN", "")
	rep := healthyReplica(t)
	g := startServe(t, "--replicas", rep)
	if g.stop() != 0 || strings.Count(g.errOut.String(), "admin endpoints off") != 1 ||
		!strings.Contains(g.errOut.String(), "--admin-token TOKEN") {
		t.Fatalf("no token: %s", g.errOut.String())
	}
	g = startServe(t, "--replicas", rep, "--admin-token", "s3cret")
	if g.stop() != 0 || strings.Contains(g.errOut.String(), "admin endpoints off") {
		t.Fatalf("with a token: %s", g.errOut.String())
	}
}

// Logs read as a person writes: durations as in the config ("30s", not
// 30000000000 nanoseconds), and one replica is "1 replica".
func TestServeLogsReadable(t *testing.T) {
	g := startServe(t, "--replicas", healthyReplica(t), "--drain-timeout", "30s")
	if !strings.Contains(g.out.String(), "→ 1 replica, policy ttft") {
		t.Errorf("startup line: %s", g.out.String())
	}
	if code := g.stop(); code != 0 {
		t.Fatalf("exit %d: %s", code, g.errOut.String())
	}
	logs := g.errOut.String()
	if !strings.Contains(logs, `"drain_timeout":"30s"`) || strings.Contains(logs, "30000000000") {
		t.Errorf("the drain line's duration: %s", logs)
	}
	var buf strings.Builder
	newLogger(&buf, slog.LevelInfo).Info("x", "d", 1500*time.Millisecond, slog.Group("g", "cooldown", 10*time.Second))
	if !strings.Contains(buf.String(), `"d":"1.5s","g":{"cooldown":"10s"}`) {
		t.Errorf("durations: %s", buf.String())
	}
}
