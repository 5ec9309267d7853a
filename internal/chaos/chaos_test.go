package chaos

import (
	"bytes"
	"context"
	"net/http"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestChaos runs every fault scenario at the default (short) size and
// checks the suite's invariants, and for each kind that the fault was met.
func TestChaos(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	results, err := Run(ctx, Options{})
	var table bytes.Buffer
	_ = WriteTable(&table, results)
	t.Logf("\n%s", table.String())
	if err != nil {
		t.Fatal(err)
	}
	if len(results) != len(Kinds()) {
		t.Fatalf("%d results for %d kinds", len(results), len(Kinds()))
	}
	for _, r := range results {
		t.Run(string(r.Kind), func(t *testing.T) {
			checkInvariants(t, r)
			checkFaultMet(t, r)
		})
	}
}

// checkInvariants: what every scenario must keep.
func checkInvariants(t *testing.T, r *Result) {
	t.Helper()
	if r.Sent == 0 || r.Sent != r.Succeeded+r.FailedClear+r.Lost {
		t.Errorf("sent %d ≠ succeeded %d + failed %d + lost %d", r.Sent, r.Succeeded, r.FailedClear, r.Lost)
	}
	if r.Lost != 0 {
		t.Errorf("%d requests lost: %v", r.Lost, r.LostReasons)
	}
	if r.RuleViolations != 0 {
		t.Errorf("%d requests broke the retry rule", r.RuleViolations)
	}
	if len(r.Mismatches) != 0 {
		t.Errorf("engine counts do not reconcile with the gateway's attempts: %v", r.Mismatches)
	}
	if !r.InFlightZero {
		t.Error("the gateway's in-flight counts did not return to zero")
	}
	if !r.Back {
		t.Error("a healthy replica was not back in rotation")
	}
	if !r.StayedOut {
		t.Error("a failed replica stayed in rotation")
	}
	if r.Attempts < r.Sent-r.Status[http.StatusTooManyRequests]-r.Status[http.StatusServiceUnavailable] {
		// Every request the gateway admitted and routed made an attempt.
		t.Errorf("%d attempts for %d requests", r.Attempts, r.Sent)
	}
	if r.RetriesMetric < r.RecordedRetries {
		t.Errorf("kvgate_retries_total +%d, fewer than the %d retries recorded", r.RetriesMetric, r.RecordedRetries)
	}
}

// checkFaultMet: evidence that the scenario's fault happened and was
// handled its way — a test whose fault never fired proves nothing.
func checkFaultMet(t *testing.T, r *Result) {
	t.Helper()
	switch r.Kind {
	case Refuse:
		if r.Retried == 0 || r.Ejections == 0 {
			t.Errorf("refuse: retried %d, ejections %d; want both > 0", r.Retried, r.Ejections)
		}
	case Die:
		if r.StreamErrors == 0 || r.Retried == 0 {
			t.Errorf("die: stream error events %d, retried %d; want both > 0", r.StreamErrors, r.Retried)
		}
		if r.Wasted == 0 {
			t.Error("die: no generation wasted, yet non-streamed answers died after the work")
		}
	case Stall:
		if r.Retried == 0 || r.Succeeded != r.Sent {
			t.Errorf("stall: retried %d, succeeded %d of %d; want every stalled request answered elsewhere",
				r.Retried, r.Succeeded, r.Sent)
		}
	case Error500:
		if r.Status[http.StatusInternalServerError] == 0 || r.FailedClear == 0 {
			t.Errorf("error500: %d answered 500", r.Status[http.StatusInternalServerError])
		}
	case Fail503:
		if r.Retried == 0 || r.Ejections == 0 || r.Succeeded != r.Sent {
			t.Errorf("fail503: retried %d, ejections %d, succeeded %d of %d", r.Retried, r.Ejections, r.Succeeded, r.Sent)
		}
	case Limit429:
		if r.Retried == 0 {
			t.Error("limit429: nothing retried")
		}
	case Flap:
		if r.FaultWindows < 2 || r.Retried == 0 || r.Ejections == 0 {
			t.Errorf("flap: %d down windows, retried %d, ejections %d", r.FaultWindows, r.Retried, r.Ejections)
		}
	case Timeout:
		if r.Status[http.StatusGatewayTimeout] == 0 {
			t.Errorf("timeout: no 504 among %v", r.Status)
		}
	case Overload:
		if r.Shed == 0 || r.Admitted == 0 {
			t.Errorf("overload: %d shed, %d admitted", r.Shed, r.Admitted)
		}
		if r.Baseline == nil || r.Baseline.P99 <= 0 || r.P99 > 3*r.Baseline.P99 {
			t.Errorf("overload: admitted p99 %v against baseline p99 %v: want ≤ 3×", r.P99, r.Baseline.P99)
		}
		if r.NoRetryAfter != 0 {
			t.Errorf("overload: %d sheds without Retry-After", r.NoRetryAfter)
		}
	}
	if r.PreEngine && r.Wasted != 0 {
		t.Errorf("%s: %d generations wasted though the fault strikes before the engine", r.Kind, r.Wasted)
	}
}

// TestChaosReport prints the report; it runs only when KVGATE_CHAOS is
// set (make chaos), with KVGATE_CHAOS_REQUESTS requests per scenario.
func TestChaosReport(t *testing.T) {
	if os.Getenv("KVGATE_CHAOS") == "" {
		t.Skip("set KVGATE_CHAOS=1 to run the chaos report (make chaos)")
	}
	opts := Options{}
	if s := os.Getenv("KVGATE_CHAOS_REQUESTS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil {
			t.Fatal(err)
		}
		opts.Requests = n
	}
	kinds, err := ParseKinds(os.Getenv("KVGATE_CHAOS_KINDS"))
	if err != nil {
		t.Fatal(err)
	}
	opts.Kinds = kinds
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err = Report(ctx, &out, opts)
	t.Logf("\n%s", out.String())
	if err != nil {
		t.Fatal(err)
	}
}

// TestBreakerCycle measures the gateway's breaker on a replica whose
// /health answers 200 while every inference request fails 500 (a broken
// engine behind a healthy process). The breaker opens after EjectAfter
// consecutive failures; after the cooldown it is half-open and lets one
// trial request through; the trial fails and it opens again for twice as
// long. So the broken replica sees EjectAfter requests plus one per
// opening, every one answered with its clear 500 (not hidden, not retried).
func TestBreakerCycle(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const ejectAfter = 3
	sc := scenario{kind: "breaker", replicas: 2, timeScale: 20, faultReplicas: []int{0},
		faults: sim.Faults{ErrorRate: 1},
		gateway: func(c *gateway.Config) {
			c.EjectAfter = ejectAfter
			c.EjectCooldown = gateway.Duration(100 * time.Millisecond)
			c.HealthInterval = gateway.Duration(50 * time.Millisecond)
		}}
	e, err := start(ctx, sc, Options{}.withDefaults())
	if err != nil {
		t.Fatal(err)
	}
	defer e.stop()
	cl := &client{http: &http.Client{Transport: e.clientTr}, base: e.base, model: sim.DefaultModel,
		maxTokens: 8, timeout: 10 * time.Second, prefix: "breaker-"}
	var mu sync.Mutex
	var results []result
	runLoad(ctx, loadSpec{n: 150, rate: 100, maxInFlight: 64, seed: 3}, func(ctx context.Context, i int) {
		r := cl.do(ctx, i)
		mu.Lock()
		results = append(results, r)
		mu.Unlock()
	})
	failed, toBroken := 0, 0
	for _, r := range results {
		if r.verdict.class == Lost {
			t.Fatalf("%s lost: %s", r.id, r.verdict.reason)
		}
		if r.status == http.StatusInternalServerError {
			failed++
		}
		for _, a := range e.rec.attempts(r.id) {
			if a.target == e.urls[0] {
				toBroken++
			}
		}
	}
	ejections := int(metricSum(e.reg, "kvgate_ejections_total"))
	t.Logf("%d requests: %d to the broken replica, %d answered 500, %d ejections", len(results), toBroken, failed, ejections)
	if ejections < 2 {
		t.Fatalf("%d ejections: the breaker did not re-open", ejections)
	}
	if failed != toBroken {
		t.Fatalf("%d requests reached the broken replica but %d answered 500: a 500 was retried or hidden", toBroken, failed)
	}
	if bound := ejectAfter + ejections; toBroken > bound {
		t.Fatalf("%d of %d requests reached the broken replica over %d openings: more than EjectAfter + one trial per opening (%d)",
			toBroken, len(results), ejections, bound)
	}
}
