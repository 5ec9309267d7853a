package gateway

import (
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

// settle reads one table: for every verdict, what the replica's breaker
// hears (eject_after 1: one failure opens it), whether the prefix index
// keeps the request the replica took, and whether the attempt is counted.
// A client's 4xx, a client gone, the gateway's limit, a 429 and a loop
// (508: rejected) never count against the replica.
func TestSettleOutcomeOfEveryVerdict(t *testing.T) {
	type want struct {
		breaker string // after settling, with eject_after 1
		kept    bool   // the index holds the request's blocks for the replica
		counted bool   // kvgate_attempts_total{verdict}
	}
	cases := []struct {
		v       verdict
		started bool
		want    want
	}{
		{served, true, want{"closed", true, true}},
		{skipped, false, want{"closed", true, false}},
		{refused, false, want{"open", false, true}},
		{busy, false, want{"closed", true, true}},
		{failed, false, want{"open", false, true}},
		{failed, true, want{"open", true, true}}, // a stream broken midway: the replica took it
		{rejected, false, want{"closed", false, true}},
		{rejected, true, want{"closed", false, true}},
		{clientGone, true, want{"closed", true, true}},
		{gatewayLimit, false, want{"closed", true, true}},
	}
	seen := map[verdict]bool{}
	for _, c := range cases {
		seen[c.v] = true
		t.Run(c.v.String(), func(t *testing.T) {
			cfg := baseConfig("http://127.0.0.1:1")
			cfg.EjectAfter = 1
			g, err := New(cfg, Options{})
			if err != nil {
				t.Fatal(err)
			}
			req := g.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: strings.Repeat("a prompt. ", 40), Prompts: 1}, "", "")
			tk, err := g.rt.Route(req)
			if err != nil {
				t.Fatal(err)
			}
			x := &exchange{w: httptest.NewRecorder(), r: httptest.NewRequest(http.MethodPost, "/v1/completions", nil),
				base: slog.New(slog.DiscardHandler), start: g.clock.Now(), req: req}
			a := &attempt{tk: tk, cached: -1, v: c.v, started: c.started}
			if c.v != skipped && !g.allow(a) {
				t.Fatal("a closed breaker refused")
			}
			a.v = c.v
			tk.Accept() // the replica's first byte: learnt, unless settle forgets it
			g.settle(x, a)
			got := want{breaker: g.fleet.State(0), kept: g.rt.Index().Holds(0, req.Blocks[len(req.Blocks)-1]),
				counted: counterValue(t, g.reg, "kvgate_attempts_total", map[string]string{"verdict": c.v.String()}) == 1}
			if got != c.want {
				t.Fatalf("settled %s (started %v): %+v, want %+v", c.v, c.started, got, c.want)
			}
			if g.rt.InFlight(0) != 0 {
				t.Fatal("the ticket is still in flight")
			}
		})
	}
	if len(seen) != len(outcomes) {
		t.Fatalf("the table covers %d verdicts of %d", len(seen), len(outcomes))
	}
}

// The breaker cycle, exactly, on a fake clock: a replica whose /health
// passes but whose every answer is a 500 sees EjectAfter requests, then one
// trial per cooldown (10 s, 20 s, ...), each answered 500 to its client.
func TestBreakerCycleOnFakeClock(t *testing.T) {
	gw, clk, broken := brokenBeside(t, 0)
	send := func(n int) (fails int) {
		for range n {
			if r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`); r.Status == 500 {
				fails++
			}
			waitIdle(t, gw) // the attempt is settled (a client may read its answer a moment before)
		}
		return fails
	}
	fails := 0
	for i := 0; broken.calls.Load() < 3 && i < 20; i++ {
		fails += send(1)
	}
	if fails != 3 || gw.g.Fleet().State(0) != "open" {
		for _, v := range []string{"served", "failed", "client_gone", "rejected"} {
			t.Logf("%s: %v", v, counterValue(t, gw.g.reg, "kvgate_attempts_total", map[string]string{"verdict": v, "replica": broken.srv.URL}))
		}
		t.Fatalf("%d of %d requests to the broken replica failed; breaker %s", fails, broken.calls.Load(), gw.g.Fleet().State(0))
	}
	if send(10); broken.calls.Load() != 3 {
		t.Fatalf("an open breaker let %d requests through", broken.calls.Load()-3)
	}
	for i, cooldown := range []time.Duration{10 * time.Second, 20 * time.Second, 40 * time.Second} {
		clk.Advance(cooldown)
		// The health loop runs on the clock too: step it until its check,
		// after the cooldown, puts the replica back half-open.
		eventually(t, "back in rotation half-open", func() bool {
			clk.Advance(gw.g.cfg.HealthInterval.D())
			return gw.g.Router().Healthy(0)
		})
		send(4)
		if want := int64(4 + i); broken.calls.Load() != want {
			t.Fatalf("cooldown %d: %d requests reached the broken replica, want %d (one trial)", i, broken.calls.Load(), want)
		}
		if st := gw.g.Fleet().State(0); st != "open" {
			t.Fatalf("after a failed trial: %s", st)
		}
	}
}

// A replica whose breaker's cooldown ends is back in rotation, half-open,
// at that instant: not at its next health check (here an hour away), while
// nothing else would bring it back (and coming back moves the router's
// queue: Replica.setHealthy). Before, it stayed out until that check.
func TestBreakerCooldownEndRejoins(t *testing.T) {
	gw, clk, broken := brokenBeside(t, time.Hour)
	for i := 0; broken.calls.Load() < 3 && i < 20; i++ {
		testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
		waitIdle(t, gw)
	}
	if st := gw.g.Fleet().State(0); st != "open" || gw.g.Router().Healthy(0) {
		t.Fatalf("after %d failures: breaker %s, in rotation %v", broken.calls.Load(), st, gw.g.Router().Healthy(0))
	}
	clk.Advance(10*time.Second - time.Millisecond)
	if gw.g.Router().Healthy(0) {
		t.Fatal("back in rotation before its cooldown ended")
	}
	clk.Advance(time.Millisecond)
	if !gw.g.Router().Healthy(0) || gw.g.Fleet().State(0) != "half-open" {
		t.Fatalf("at its cooldown's end: in rotation %v, breaker %s; want back, half-open", gw.g.Router().Healthy(0), gw.g.Fleet().State(0))
	}
}

// brokenBeside is a gateway on a fake clock, round robin over a replica
// whose /health passes and every answer is a 500 (slot 0; its breaker
// opens after 3, cooling down 10 s, then 20 s, ...) and a good one;
// healthInterval 0: the default.
func brokenBeside(t *testing.T, healthInterval time.Duration) (*testGW, *clock.Fake, *stub) {
	t.Helper()
	broken := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(500)
		_, _ = io.WriteString(w, `{"error":{"message":"engine dead","type":"InternalServerError","code":500}}`)
	})
	good := newStub(t, "", okStream(1))
	cfg := baseConfig(broken.srv.URL, good.srv.URL)
	cfg.Policy = "round_robin"
	cfg.EjectAfter = 3
	cfg.EjectCooldown = Duration(10 * time.Second)
	if healthInterval > 0 {
		cfg.HealthInterval = Duration(healthInterval)
	}
	gw, clk := gwWithClock(t, cfg)
	return gw, clk, broken
}
