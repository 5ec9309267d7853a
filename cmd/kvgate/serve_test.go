package main

import (
	"context"
	"errors"
	"flag"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
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
	out, errOut := &testutil.SyncBuffer{}, &testutil.SyncBuffer{}
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
	case <-time.After(testutil.Bound(30 * time.Second)): // a bound on a hang, not a wait
		t.Fatal("serve did not stop")
	}
}

// serveConfig parses serve's flags as run does and returns the configuration.
func serveConfig(t *testing.T, args ...string) (gateway.Config, error) {
	t.Helper()
	var f serveFlags
	cfg, _, err := f.config(parsedFlags(t, "serve", f.register, args))
	return cfg, err
}

// parsedFlags parses args into the flags register adds, as main does, and
// returns the names of those given.
func parsedFlags(t *testing.T, verb string, register func(*flag.FlagSet), args []string) map[string]bool {
	t.Helper()
	fs := flag.NewFlagSet(verb, flag.ContinueOnError)
	register(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	return set
}

// --prefill-replicas makes the --replicas decode replicas; --non-cached-tokens
// sets the threshold (0: never skip); prefill replicas alone are a usage error.
func TestServePrefillFlags(t *testing.T) {
	cfg, err := serveConfig(t, "--replicas", "http://d1,http://d2", "--prefill-replicas", "http://p1", "--non-cached-tokens", "0")
	if err != nil || len(cfg.Replicas) != 3 || cfg.NonCachedTokens != 0 || cfg.Validate() != nil {
		t.Fatalf("%v %+v", err, cfg)
	}
	for i, want := range []string{"decode", "decode", "prefill"} {
		if cfg.Replicas[i].Role != want {
			t.Fatalf("replica %d role %q, want %s", i, cfg.Replicas[i].Role, want)
		}
	}
	if got := fleetSummary(cfg); got != "1 prefill + 2 decode replicas" {
		t.Fatalf("summary %q", got)
	}
	if cfg, _ := serveConfig(t, "--replicas", "http://a"); cfg.NonCachedTokens != 16 || fleetSummary(cfg) != "1 replica" {
		t.Fatalf("defaults: %d %q", cfg.NonCachedTokens, fleetSummary(cfg))
	}
	if _, err := serveConfig(t, "--prefill-replicas", "http://p1"); !errors.Is(err, errUsage) {
		t.Fatalf("--prefill-replicas alone: %v", err)
	}
}

// kvgate serve in front of kvgate sim's prefill and decode replicas: the
// answer is the decode replica's, with the KV its prefill replica computed.
func TestServePrefillDecode(t *testing.T) {
	fl, err := sim.Start(context.Background(), sim.Config{Replicas: 2, TimeScale: 50,
		Roles: []engine.Role{engine.RolePrefill, engine.RoleDecode}})
	if err != nil {
		t.Fatal(err)
	}
	defer fl.Close()
	ctx, cancel := context.WithCancel(context.Background())
	out, errOut := &testutil.SyncBuffer{}, &testutil.SyncBuffer{}
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, []string{"serve", "--replicas", fl.URLs()[1], "--prefill-replicas", fl.URLs()[0],
			"--listen", "127.0.0.1:0", "--log-level", "error"}, strings.NewReader(""), out, errOut)
	}()
	defer func() { cancel(); <-code }()
	testutil.Eventually(t, 10*time.Second, "the gateway to start", func() bool { return strings.Contains(out.String(), "serving http://") })
	line := out.String()
	if !strings.Contains(line, "→ 1 prefill + 1 decode replicas") {
		t.Fatalf("startup line: %q", line)
	}
	addr := strings.Fields(line[strings.Index(line, "http://"):])[0]
	body := `{"model":"` + sim.DefaultModel + `","max_tokens":3,"prompt":"` + strings.Repeat("a prompt for two steps. ", 10) + `"}`
	// /ready waits for both replicas' first health checks: a request
	// before the prefill replica's has passed goes to the decode replica
	// alone, without X-Kvgate-Prefill.
	testutil.Eventually(t, 10*time.Second, "the gateway ready", func() bool {
		resp, err := http.Get(addr + "/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	var r testutil.Response
	testutil.Eventually(t, 10*time.Second, "the replicas listed", func() bool {
		r = testutil.Post(t, nil, addr+"/v1/completions", body)
		return r.Status == http.StatusOK
	})
	if r.Header.Get("X-Kvgate-Replica") != fl.URLs()[1] || r.Header.Get("X-Kvgate-Prefill") != fl.URLs()[0] ||
		r.Header.Get(sim.HeaderKVPull) != "pulled" {
		t.Fatalf("headers %v", r.Header)
	}
}
