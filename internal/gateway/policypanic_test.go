package gateway

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
)

// panicPolicy is a routing policy whose Pick panics.
type panicPolicy struct{}

func (panicPolicy) Name() string { return "panic_policy" }

func (panicPolicy) Pick(*policy.Request, []policy.ReplicaView) (policy.Decision, error) {
	panic("index out of range [-1]")
}

// TestPolicyPanicIsCountedAndLogged: a policy that panics on every request
// costs no request: each is served (routed by least load), counted in
// kvgate_policy_panics_total{policy}, and the stack is logged once for
// two panics within a minute of the gateway's clock, and again after it.
func TestPolicyPanicIsCountedAndLogged(t *testing.T) {
	a, b := newFakeReplica(t), newFakeReplica(t)
	sink := &lockedBuffer{}
	reg := prometheus.NewRegistry()
	clk := clock.NewFake(time.Unix(1000, 0))
	gw := startGatewayWith(t, baseConfig(a.srv.URL, b.srv.URL),
		Options{Clock: clk, Registry: reg, Logger: slog.New(slog.NewJSONHandler(sink, nil))})
	waitListed(t, gw)
	gw.g.Router().SetPolicy(panicPolicy{})
	logged := func() int { return strings.Count(sink.String(), "routing policy panicked") }
	steps := []struct {
		advance time.Duration
		panics  float64
		logged  int
	}{
		{0, 1, 1},
		{30 * time.Second, 2, 1},
		{31 * time.Second, 3, 2}, // 61 s after the first line
	}
	for k, s := range steps {
		clk.Advance(s.advance)
		resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"hello world","max_tokens":3}`)
		if resp.StatusCode != 200 {
			t.Fatalf("step %d: %d %s", k, resp.StatusCode, body)
		}
		if n := counterValue(t, reg, "kvgate_policy_panics_total", map[string]string{"policy": "panic_policy"}); n != s.panics {
			t.Fatalf("step %d: kvgate_policy_panics_total = %v, want %v", k, n, s.panics)
		}
		if n := logged(); n != s.logged {
			t.Fatalf("step %d: %d log lines, want %d:\n%s", k, n, s.logged, sink.String())
		}
	}
	if !strings.Contains(sink.String(), "panicPolicy.Pick") {
		t.Fatalf("the log line carries no stack:\n%s", sink.String())
	}
	waitIdle(t, gw)
}
