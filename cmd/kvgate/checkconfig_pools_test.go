package main

import (
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/gateway"
)

// --check-config with pools: each pool's models, policy (its own or the
// inherited one) and replicas in the summary; a pool's bad policy or
// parameter is refused with the pool named.
func TestCheckConfigPools(t *testing.T) {
	path := writeConfig(t, `
policy: ttft
pools:
  - name: llama
    models: ["meta-llama/Llama-3.1-8B-Instruct", "llama-*"]
    policy: sglang
    policy_params: {cache_threshold: 0.3}
    replicas: [{url: "http://127.0.0.1:1"}, {url: "http://127.0.0.1:2", api_key: secret-key}]
  - name: qwen
    models: ["Qwen/*"]
    replicas: [{url: "http://127.0.0.1:3"}]
`)
	code, out, errs := runCmd(t, "", "serve", "--check-config", "--config", path)
	if code != 0 || errs != "" {
		t.Fatalf("exit %d: %s", code, errs)
	}
	for _, want := range []string{"pool llama: models meta-llama/Llama-3.1-8B-Instruct, llama-*; policy sglang (cache_threshold=0.3)",
		"http://127.0.0.1:2  role both, api key set", "pool qwen: models Qwen/*; policy ttft (the top-level policy)",
		"http://127.0.0.1:3  role both"} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "secret") {
		t.Errorf("the summary shows a secret:\n%s", out)
	}
	for _, tc := range []struct{ yaml, want string }{
		{`pools: [{name: a, models: [m], policy: fastest, replicas: [{url: "http://127.0.0.1:1"}]}]`, `kvgate.yaml:1: pools[0].policy: unknown policy "fastest"`},
		{`pools: [{name: a, models: [m], policy: sglang, policy_params: {cache_treshold: 1}, replicas: [{url: "http://127.0.0.1:1"}]}]`, `cache_treshold`},
		{`pools: [{name: a, models: [], replicas: [{url: "http://127.0.0.1:1"}]}]`, `kvgate.yaml:1: pools[0].models: empty`},
		{`pools: [{name: a, models: [m], replicas_file: /nonexistent/a.yaml}]`, `kvgate.yaml:1: pools[0].replicas_file: /nonexistent/a.yaml`},
	} {
		code, out, errs := runCmd(t, "", "serve", "--check-config", "--config", writeConfig(t, tc.yaml))
		if code != 2 || out != "" || !strings.Contains(errs, tc.want) {
			t.Errorf("exit %d, stdout %q, stderr %q; want 2 naming %q", code, out, errs, tc.want)
		}
	}
}

// serve's startup line names each pool, its replicas and its policy.
func TestPoolsSummary(t *testing.T) {
	cfg := gateway.Defaults()
	cfg.ReplicasFile = "/etc/kvgate/qwen.yaml"
	cfg.Pools = []gateway.PoolConfig{
		{Name: "llama", Models: []string{"llama-*"}, Policy: "least_load",
			Replicas: []gateway.ReplicaConfig{{URL: "http://a:1"}, {URL: "http://b:1", Role: "prefill"}}},
		{Name: "qwen", Models: []string{"Qwen/*"}},
	}
	want := "pools llama (1 prefill + 1 both replicas, least_load); qwen (replicas of /etc/kvgate/qwen.yaml (watched; SIGHUP re-reads it), ttft)"
	if got := replicaSummary(cfg); got != want {
		t.Fatalf("got  %s\nwant %s", got, want)
	}
}
