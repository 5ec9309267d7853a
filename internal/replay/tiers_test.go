package replay

import (
	"context"
	"testing"

	"github.com/kvgate/kvgate/internal/workload"
)

// multiturnReqs is a multiturn workload whose conversations outgrow small
// GPU caches.
func multiturnReqs(t testing.TB) []workload.Request {
	t.Helper()
	reqs, err := workload.Generate(workload.Spec{Name: "multiturn", Seed: 5, Params: map[string]float64{"conversations": 40, "turns": 6}})
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

// With a host tier, what the small GPU caches evict is loaded instead of
// computed: ttft's hit rate (tokens not computed, vLLM's cached tokens)
// rises and its TTFT falls; with pulls, replicas also pull from their peers;
// the same seed gives the same figures.
func TestReplayTiers(t *testing.T) {
	reqs := multiturnReqs(t)
	run := func(offload int, pulls bool) map[string]float64 {
		cfg := Config{Replicas: 4, KVBlocks: 600, OffloadBlocks: offload, Pulls: pulls, Seed: 1, Speedup: 4}
		r, err := Run(context.Background(), cfg, reqs, PolicySpec{Name: "ttft"})
		if err != nil {
			t.Fatal(err)
		}
		if r.Errors != 0 {
			t.Fatalf("offload %d pulls %v: %d errors", offload, pulls, r.Errors)
		}
		r.Extra["hit"], r.Extra["p90"] = r.HitRate, r.TTFTms.P90
		return r.Extra
	}
	gpu, host, pulls := run(0, false), run(2400, false), run(2400, true)
	t.Logf("hit / p90: GPU only %.3f / %.0f ms, host tier %.3f / %.0f ms (%v tokens loaded), pulls %.3f / %.0f ms (%v tokens pulled)",
		gpu["hit"], gpu["p90"], host["hit"], host["p90"], host["host_load_tokens"], pulls["hit"], pulls["p90"], pulls["peer_pull_tokens"])
	switch {
	case !(host["hit"] > gpu["hit"]+0.05) || host["host_load_tokens"] == 0 || host["p90"] > gpu["p90"]:
		t.Errorf("the host tier did not pay: GPU only %v, host tier %v", gpu, host)
	case pulls["peer_pull_tokens"] == 0 || pulls["peer_pulls"] == 0:
		t.Errorf("no pull: %v", pulls)
	}
	if again := run(2400, true); again["p90"] != pulls["p90"] || again["peer_pull_tokens"] != pulls["peer_pull_tokens"] {
		t.Errorf("same seed, other figures: %v then %v", pulls, again)
	}
}

// In precise mode the router follows the host tiers' events (medium CPU,
// hashes only) without dropping any.
func TestReplayPreciseFollowsHostTier(t *testing.T) {
	cfg := Config{Replicas: 4, KVBlocks: 600, OffloadBlocks: 2400, Seed: 1, Speedup: 4, KVEvents: KVOn}
	r, err := Run(context.Background(), cfg, multiturnReqs(t), PolicySpec{Name: "precise"})
	if err != nil {
		t.Fatal(err)
	}
	if r.Errors != 0 || r.Extra["kv_event_errors"] != 0 || r.Extra["host_load_tokens"] == 0 {
		t.Fatalf("errors %d, extras %v", r.Errors, r.Extra)
	}
}
