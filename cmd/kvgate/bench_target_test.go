package main

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// bench --target where no request succeeds exits non-zero saying why,
// and writes no table of zeros: a dead port (the refused connection
// named), and a gateway's URL given with /v1 (an OpenAI client's habit).
func TestBenchTargetNothingServed(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + l.Addr().String()
	l.Close()
	gw := httptest.NewServer(http.NotFoundHandler())
	defer gw.Close()
	for _, tc := range []struct{ target, want string }{
		{dead, "no request succeeded: 4 of 4 failed (connect ×4); Get \"" + dead + "/metrics\": dial tcp " + dead[len("http://"):] +
			": connect: connection refused"},
		{gw.URL + "/v1", "no request succeeded: 4 of 4 failed (http_404 ×4); give --target the gateway's base URL, without /v1"},
	} {
		path := filepath.Join(t.TempDir(), "r.json")
		code, stdout, stderr := runCmd(t, "", "bench", "--target", tc.target, "--workload", "random", "--requests", "4",
			"--workload-param", "input_len=16", "--workload-param", "output_len=1", "--json", path)
		if code != 1 || !strings.Contains(stderr, "kvgate bench: "+tc.want) || strings.Contains(stdout, "ttft p50") {
			t.Errorf("%s: exit %d, stdout %q, stderr %s; want 1 and %q", tc.target, code, stdout, stderr, tc.want)
		}
		if _, err := os.Stat(path); err == nil {
			t.Errorf("%s: a result was written", tc.target)
		}
	}
}

// bench --target names its run after the policy the gateway routed it
// with (read from its kvgate_requests_total), not "target".
func TestBenchTargetNamesThePolicy(t *testing.T) {
	fl, err := sim.Start(context.Background(), sim.Config{Replicas: 2, TimeScale: 50})
	if err != nil {
		t.Fatal(err)
	}
	defer fl.Close()
	g := startServe(t, "--replicas", strings.Join(fl.URLs(), ","), "--policy", "sglang", "--log-level", "error")
	testutil.Eventually(t, 10*time.Second, "the gateway ready", func() bool {
		resp, err := http.Get(g.addr + "/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	path := filepath.Join(t.TempDir(), "r.json")
	code, stdout, stderr := runCmd(t, "", "bench", "--target", g.addr, "--workload", "random", "--requests", "4",
		"--workload-param", "input_len=16", "--workload-param", "output_len=2", "--time-scale", "50", "--json", path)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if r := readResult(t, path).Runs[0]; r.Policy != "sglang" || r.Errors != 0 {
		t.Errorf("run %q with %d errors, want sglang", r.Policy, r.Errors)
	}
	if !strings.Contains(stdout, "\nsglang ") {
		t.Errorf("the table does not name sglang:\n%s", stdout)
	}
}
