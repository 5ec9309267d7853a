package gateway

import (
	"strings"
	"testing"
)

const twoPoolsYAML = `
policy: ttft
pools:
  - name: llama
    models: ["meta-llama/Llama-3.1-8B-Instruct", "llama-*"]
    policy: ttft
    policy_params: {margin_ms: 5}
    replicas: [{url: "http://a:8000"}, {url: "http://b:8000"}]
  - name: qwen
    models: ["Qwen/*"]
    policy: llmd
    replicas: [{url: "http://c:8000"}]
`

func TestPoolsConfigParses(t *testing.T) {
	cfg, err := ParseConfig([]byte(twoPoolsYAML))
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if len(cfg.Pools) != 2 || cfg.Pools[0].PolicyParams["margin_ms"] != float64(5) || len(cfg.Pools[1].Replicas) != 1 {
		t.Fatalf("parsed %+v", cfg.Pools)
	}
	list, pools := cfg.withPools(map[string][]ReplicaConfig{})
	if len(list) != 3 || strings.Join(pools, ",") != "llama,llama,qwen" {
		t.Fatalf("withPools: %v %v", list, pools)
	}
	specs := poolTargets(list, []int{1, 2, 1}, pools)
	if len(specs) != 4 || specs[2].Pool != "llama" || !specs[2].Ranked || specs[3].Pool != "qwen" {
		t.Fatalf("targets %+v", specs)
	}
}

func TestPoolsConfigErrors(t *testing.T) {
	for _, c := range []struct{ name, yaml, want string }{
		{"unknown policy", `pools: [{name: a, models: [m], policy: nope, replicas: [{url: "http://a:1"}]}]`, `nope`},
		{"unknown param", `pools: [{name: a, models: [m], policy: ttft, policy_params: {nope: 1}, replicas: [{url: "http://a:1"}]}]`, `nope`},
		{"params without policy", `pools: [{name: a, models: [m], policy_params: {margin_ms: 1}, replicas: [{url: "http://a:1"}]}]`, `pools[0].policy_params: given without policy`},
		{"empty models", `pools: [{name: a, models: [], replicas: [{url: "http://a:1"}]}]`, `pools[0].models: empty`},
		{"no name", `pools: [{models: [m], replicas: [{url: "http://a:1"}]}]`, `give the pool a name`},
		{"duplicate", `pools: [{name: a, models: [m], replicas: [{url: "http://a:1"}]}, {name: a, models: [other], replicas: [{url: "http://b:1"}]}]`, `configured twice`},
		{"replica in two pools", `pools: [{name: a, models: [m], replicas: [{url: "http://a:1"}]}, {name: b, models: [other], replicas: [{url: "http://a:1"}]}]`, `also in pool "a"`},
		{"top-level replicas too", "replicas: [{url: \"http://z:1\"}]\npools: [{name: a, models: [m], replicas: [{url: \"http://a:1\"}]}]", `cannot be given with pools`},
		{"a pool without replicas", `pools: [{name: a, models: [m]}]`, `has no replicas`},
		{"two pools without replicas", "replicas_file: x.yaml\npools: [{name: a, models: [m]}, {name: b, models: [other]}]", `at most one pool`},
		{"discovery without an open pool", "replicas_file: x.yaml\npools: [{name: a, models: [m], replicas: [{url: \"http://a:1\"}]}]", `feeds the one pool`},
		{"bad replica url", `pools: [{name: a, models: [m], replicas: [{url: "a:1"}]}]`, `pools[0].replicas[0]`},
		{"replicas and a file", `pools: [{name: a, models: [m], replicas_file: a.yaml, replicas: [{url: "http://a:1"}]}]`, `pools[0]: (a) a pool's replicas come from one source`},
		{"a pool's bad discovery", `pools: [{name: a, models: [m], discovery: {dns: "nope"}}]`, `pools[0].discovery.dns: `},
		{"unknown field", `pools: [{name: a, models: [m], replica: [{url: "http://a:1"}]}]`, `line 1: pools[0].replica: unknown key (did you mean replicas?)`},
	} {
		cfg, err := ParseConfig([]byte(c.yaml))
		if err == nil {
			err = cfg.Validate()
		}
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error naming %q", c.name, err, c.want)
		}
	}
}

// A pool without replicas takes what the replicas file lists; the others
// keep theirs.
func TestPoolsFedByTheReplicasFile(t *testing.T) {
	cfg, err := ParseConfig([]byte("replicas_file: x.yaml\npools: [{name: a, models: [m], replicas: [{url: \"http://a:1\"}]}, {name: b, models: [\"n-*\"]}]"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	list, pools := cfg.withPools(map[string][]ReplicaConfig{"": {{URL: "http://d:1"}, {URL: "http://e:1"}}})
	if len(list) != 3 || list[1].URL != "http://d:1" || strings.Join(pools, ",") != "a,b,b" {
		t.Fatalf("withPools: %v %v", list, pools)
	}
}

// Pools with sources of their own need no top-level one.
func TestPoolsOwnSourcesConfig(t *testing.T) {
	cfg, err := ParseConfig([]byte("pools: [{name: a, models: [m], replicas_file: a.yaml}, " +
		"{name: b, models: [other], discovery: {dns: \"vllm.default.svc:8000\"}}, {name: c, models: [c], replicas: [{url: \"http://c:1\"}]}]"))
	if err != nil {
		t.Fatal(err)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	if !cfg.dynamic() {
		t.Fatal("pools with their own sources: the router must take replicas at run time")
	}
	list, pools := cfg.withPools(map[string][]ReplicaConfig{"a": {{URL: "http://a:1"}}, "b": {{URL: "http://b:1"}, {URL: "http://b:2"}}})
	if len(list) != 4 || strings.Join(pools, ",") != "a,b,b,c" || list[3].URL != "http://c:1" {
		t.Fatalf("withPools: %v %v", list, pools)
	}
}
