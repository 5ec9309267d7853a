package gateway

import (
	"slices"
	"testing"
	"time"
)

func TestReloadConfigAppliesLimitsAndParamsAndIgnoresTheRest(t *testing.T) {
	a := newFakeReplica(t)
	cfg := baseConfig(a.srv.URL)
	cfg.Policy = "sglang"
	cfg.MaxConcurrency = 4
	tg := startGateway(t, cfg)
	g := tg.g
	oldPolicy := g.rt.Policy()

	next := cfg
	next.Retries = 5
	next.FirstByteTimeout = Duration(3 * time.Second)
	next.PolicyParams = map[string]any{"cache_threshold": 0.3}
	next.EjectAfter = 1
	next.MaxConcurrency = 8
	next.Listen = "127.0.0.1:9999"
	next.Tokenizer = "remote"
	applied, ignored, err := g.ReloadConfig(next)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"retries", "first_byte_timeout", "policy_params", "eject_after", "max_concurrency"} {
		if !slices.Contains(applied, k) {
			t.Errorf("%s not applied (applied %v)", k, applied)
		}
	}
	if !slices.Equal(ignored, []string{"listen", "tokenizer"}) {
		t.Errorf("ignored %v, want listen and tokenizer", ignored)
	}
	if c := g.conf(); c.Retries != 5 || c.FirstByteTimeout.D() != 3*time.Second || c.Listen != cfg.Listen || c.Tokenizer != "approx" {
		t.Fatalf("live config %+v", c)
	}
	if g.rt.Policy() == oldPolicy || cap(g.lim.Load().slots) != 8 {
		t.Fatal("the policy or the limiter was not replaced")
	}
	// eject_after 1: one failure opens the breaker.
	ok, pass := g.fleet.Allow(0)
	if !ok {
		t.Fatal("breaker closed, no pass")
	}
	g.fleet.Failure(0, pass)
	if g.fleet.State(0) != "open" {
		t.Fatalf("breaker %s after one failure with eject_after 1", g.fleet.State(0))
	}

	// A bad parameter changes nothing.
	bad := next
	bad.Retries = 1
	bad.PolicyParams = map[string]any{"no_such_param": 1}
	if _, _, err := g.ReloadConfig(bad); err == nil {
		t.Fatal("an unknown policy parameter was taken")
	}
	invalid := next
	invalid.MaxQueue = -1
	if _, _, err := g.ReloadConfig(invalid); err == nil {
		t.Fatal("an invalid config was taken")
	}
	if g.conf().Retries != 5 {
		t.Fatalf("a refused reload changed retries to %d", g.conf().Retries)
	}
}
