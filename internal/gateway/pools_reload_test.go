package gateway

import (
	"log/slog"
	"slices"
	"strings"
	"testing"
)

// A reload changes a pool's parameters at once (its own, or the top-level
// ones a pool without a policy inherits), never logs a replica's key, and
// leaves any other change of pools: to a restart.
func TestReloadPoolParams(t *testing.T) {
	a, b := newFakeReplica(t), newFakeReplica(t)
	cfg := baseConfig()
	cfg.Policy = "sglang"
	cfg.Pools = []PoolConfig{
		{Name: "own", Models: []string{"m"}, Policy: "sglang", Replicas: []ReplicaConfig{{URL: a.srv.URL, APIKey: "secret-key"}}},
		{Name: "inherits", Models: []string{"n-*"}, Replicas: []ReplicaConfig{{URL: b.srv.URL}}},
	}
	var logs lockedBuffer
	g, err := New(cfg, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	own, _ := g.rt.PoolPolicy("own")
	inh, _ := g.rt.PoolPolicy("inherits")

	next := cfg
	next.Pools = slices.Clone(cfg.Pools)
	next.Pools[0].PolicyParams = map[string]any{"cache_threshold": 0.3}
	applied, ignored, err := g.ReloadConfig(next)
	if err != nil || !slices.Contains(applied, "pools") || len(ignored) != 0 {
		t.Fatalf("applied %v ignored %v: %v", applied, ignored, err)
	}
	if p, _ := g.rt.PoolPolicy("own"); p == own {
		t.Fatal("the pool's policy was not rebuilt with its new parameters")
	}
	if p, _ := g.rt.PoolPolicy("inherits"); p != inh {
		t.Fatal("a pool whose parameters did not change lost its policy's state")
	}
	if strings.Contains(logs.String(), "secret-key") || !strings.Contains(logs.String(), "cache_threshold") {
		t.Fatalf("reload log: %s", logs.String())
	}

	// The top-level parameters reach the pool that inherits them.
	next2 := next
	next2.PolicyParams = map[string]any{"cache_threshold": 0.2}
	if _, _, err := g.ReloadConfig(next2); err != nil {
		t.Fatal(err)
	}
	if p, _ := g.rt.PoolPolicy("inherits"); p == inh {
		t.Fatal("the inheriting pool kept the old top-level parameters")
	}

	// A bad pool parameter changes nothing; another change of pools is
	// ignored until a restart.
	bad := next2
	bad.Pools = slices.Clone(next2.Pools)
	bad.Pools[0].PolicyParams = map[string]any{"no_such_param": 1}
	before, _ := g.rt.PoolPolicy("own")
	if _, _, err := g.ReloadConfig(bad); err == nil {
		t.Fatal("an unknown pool parameter was taken")
	}
	moved := next2
	moved.Pools = slices.Clone(next2.Pools)
	moved.Pools[1].Models = []string{"other-*"}
	moved.Pools[0].PolicyParams = map[string]any{"cache_threshold": 0.9}
	applied, ignored, err = g.ReloadConfig(moved)
	if err != nil || slices.Contains(applied, "pools") || !slices.Contains(ignored, "pools") {
		t.Fatalf("a structural change: applied %v ignored %v: %v", applied, ignored, err)
	}
	if p, _ := g.rt.PoolPolicy("own"); p != before || g.live.pools[1].Models[0] != "n-*" {
		t.Fatal("an ignored change of pools was applied")
	}
}
