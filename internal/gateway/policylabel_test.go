package gateway

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/sim"
)

// With pools, what a request's outcome is filed under names the policy
// that decided it, its pool's: requests{policy}, e2e{policy},
// ttft{policy}, the live view's decisions and the routing span's
// kvgate.policy, never the top-level policy that routed none of them.
func TestPoolPolicyNamedWhereOutcomesAreFiled(t *testing.T) {
	llama := startSim(t, sim.Config{Replicas: 1, Model: "llama-3-8b"})
	qwen := startSim(t, sim.Config{Replicas: 1, Model: "Qwen/Qwen2.5-7B"})
	cfg := baseConfig()
	cfg.Policy = "ttft" // routes nothing: every model has its pool
	cfg.AdminToken = "tok"
	cfg.Pools = []PoolConfig{
		{Name: "llama", Models: []string{"llama-*"}, Policy: "least_load", Replicas: []ReplicaConfig{{URL: llama.URLs()[0]}}},
		{Name: "qwen", Models: []string{"Qwen/*"}, Policy: "round_robin", Replicas: []ReplicaConfig{{URL: qwen.URLs()[0]}}},
	}
	gw, spans := tracedGateway(t, cfg)
	waitListed(t, gw)
	sent := map[string]string{"llama-3-8b": "least_load", "Qwen/Qwen2.5-7B": "round_robin"}
	for model := range sent {
		for _, stream := range []bool{false, true} {
			body := fmt.Sprintf(`{"model":%q,"prompt":"a request for %s","max_tokens":2,"stream":%v}`, model, model, stream)
			if resp, out := post(t, gw.srv.URL+"/v1/completions", body); resp.StatusCode != 200 {
				t.Fatalf("%s: %d %s", model, resp.StatusCode, out)
			}
		}
	}
	waitIdle(t, gw)
	reg := gw.g.reg
	for _, pol := range []string{"least_load", "round_robin", "ttft"} {
		want := map[bool]float64{true: 2, false: 0}[pol != "ttft"]
		if got := counterValue(t, reg, "kvgate_requests_total", map[string]string{"policy": pol}); got != want {
			t.Errorf("kvgate_requests_total{policy=%q} = %v, want %v", pol, got, want)
		}
		for name, n := range map[string]float64{"kvgate_e2e_request_latency_seconds": want, "kvgate_time_to_first_token_seconds": want / 2} {
			if got := sampleCount(t, reg, name, map[string]string{"policy": pol}); got != n {
				t.Errorf("%s{policy=%q}: %v samples, want %v", name, pol, got, n)
			}
		}
	}
	_, body := get(t, gw.srv.URL+"/ui/state", "Authorization", "Bearer tok")
	var st struct {
		Decisions []struct {
			Model  string `json:"model"`
			Policy string `json:"policy"`
		} `json:"decisions"`
	}
	if err := json.Unmarshal([]byte(body), &st); err != nil || len(st.Decisions) != 4 {
		t.Fatalf("/ui/state decisions: %v, %s", err, body)
	}
	for _, d := range st.Decisions {
		if d.Policy != sent[d.Model] {
			t.Errorf("/ui's decision for %s names policy %q, want %q", d.Model, d.Policy, sent[d.Model])
		}
	}
	routes := spansNamed(spans, "kvgate.route")
	if len(routes) != 4 {
		t.Fatalf("%d routing spans, want 4", len(routes))
	}
	for _, s := range routes {
		model, _ := attr(s, "gen_ai.request.model")
		pol, _ := attr(s, "kvgate.policy")
		if pol.AsString() != sent[model.AsString()] {
			t.Errorf("the routing span of %s names policy %q, want %q", model.AsString(), pol.AsString(), sent[model.AsString()])
		}
	}
}

// sampleCount is the observations of the histogram name over the series
// whose labels include labels.
func sampleCount(t *testing.T, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0.0
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if matches(m, labels) {
				n += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return n
}
