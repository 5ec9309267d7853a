package gateway

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// The decision counters name each branch, and the per-replica usage
// counters add up what the replicas reported.
func TestDecisionAndUsageMetrics(t *testing.T) {
	a, b := newFakeReplica(t), newFakeReplica(t)
	cfg := baseConfig(a.srv.URL, b.srv.URL)
	cfg.Policy = "round_robin"
	gw := startGateway(t, cfg)
	waitListed(t, gw)
	body, _ := json.Marshal(map[string]any{"model": "m", "prompt": strings.Repeat("a shared prompt ", 40), "max_tokens": 3})
	for range 3 {
		if resp, out := post(t, gw.srv.URL+"/v1/completions", string(body)); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
	}
	waitIdle(t, gw)
	reg := gw.g.reg
	for branch, want := range map[string]float64{branchMiss: 1, branchSpilled: 1, branchHeld: 1} {
		if got := counterValue(t, reg, "kvgate_route_decisions_total", map[string]string{"branch": branch}); got != want {
			t.Errorf("decisions %s: %v, want %v", branch, got, want)
		}
	}
	for name, want := range map[string]float64{"kvgate_replica_prompt_tokens_total": 30, "kvgate_replica_cached_tokens_total": 24,
		"kvgate_replica_usage_prompt_tokens_total": 30, "kvgate_replica_generation_tokens_total": 9} {
		if got := counterValue(t, reg, name, nil); got != want {
			t.Errorf("%s: %v, want %v", name, got, want)
		}
	}
	// Per replica: round robin sent two to one replica and one to the other.
	pa := counterValue(t, reg, "kvgate_replica_prompt_tokens_total", map[string]string{"replica": a.srv.URL})
	if pa != 10 && pa != 20 {
		t.Errorf("replica %s: %v prompt tokens, want 10 or 20", a.srv.URL, pa)
	}
}

// waitListed waits until every replica has listed its models: before, a
// listed replica keeps the requests from the unlisted ones, and a decision
// sees only the replicas that may take it.
func waitListed(t *testing.T, gw *testGW) {
	t.Helper()
	rt := gw.g.Router()
	eventually(t, "every replica's models listed", func() bool {
		for i := range rt.Replicas() {
			if rt.Replica(i).Served() == nil {
				return false
			}
		}
		return true
	})
}

// The ttft policy's estimate is compared with the first token observed:
// one ratio per streamed request, and the TTFT histogram names the
// replica.
func TestTTFTEstimateRatio(t *testing.T) {
	a := newFakeReplica(t)
	gw := startGateway(t, baseConfig(a.srv.URL)) // ttft, the default
	for _, stream := range []bool{true, false, true} {
		body, _ := json.Marshal(map[string]any{"model": "m", "prompt": "hello there", "max_tokens": 3, "stream": stream})
		if resp, out := post(t, gw.srv.URL+"/v1/completions", string(body)); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
	}
	waitIdle(t, gw)
	if n := histogramCount(t, gw, "kvgate_ttft_estimate_ratio"); n != 2 {
		t.Errorf("%d ratios observed, want 2 (the streamed requests)", n)
	}
	fams, err := gw.g.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != "kvgate_time_to_first_token_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			if !matches(m, map[string]string{"replica": a.srv.URL, "policy": "ttft"}) || m.GetHistogram().GetSampleCount() != 2 {
				t.Errorf("TTFT series %v: want replica %s, policy ttft, 2 samples", m.GetLabel(), a.srv.URL)
			}
		}
	}
}

// Finding 9 (the gateway side; the rule itself is tested in fleet): the
// scrape age of each replica is a metric.
func TestScrapeAgeMetric(t *testing.T) {
	a := newStub(t, "", okStream(1))
	gw, clk := gwWithClock(t, baseConfig(a.srv.URL))
	eventually(t, "first scrape", func() bool {
		_, _, ok := gw.g.Router().ReplicaMetrics(0)
		return ok
	})
	before := counterValue(t, gw.g.reg, "kvgate_scrape_age_seconds", nil)
	a.srv.Close() // scrapes fail from now on
	clk.Advance(5 * time.Second)
	after := counterValue(t, gw.g.reg, "kvgate_scrape_age_seconds", nil)
	if after < before+5 || after > before+6 {
		t.Fatalf("scrape age %v → %v after 5 s without a good scrape", before, after)
	}
	if gw.g.Router().Views(gw.g.Router().Prepare(mustParse(t, `{"model":"m","prompt":"x"}`), "", ""))[0].HaveMetrics {
		t.Fatal("stale metrics still used")
	}
}
