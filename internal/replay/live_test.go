package replay

import (
	"context"
	"sort"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/bench"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/workload"
)

// TestReplayAgreesWithLive runs one small workload twice per policy: live
// through `bench --embedded` (simulated replicas over HTTP, the gateway,
// wall clock) and through the replay (virtual time, no HTTP), with the same
// engine settings. The hit rates must agree within a few points and rank
// the policies the same way: the replay describes the gateway.
func TestReplayAgreesWithLive(t *testing.T) {
	if testing.Short() {
		t.Skip("live fleet run")
	}
	spec, err := workload.Parse("multiturn")
	if err != nil {
		t.Fatal(err)
	}
	spec.Seed = 11
	spec.Params = map[string]float64{"conversations": 15, "turns": 5, "system_prompt_len": 64,
		"user_len_min": 200, "user_len_max": 300, "output_len": 16, "think_ms": 500}
	reqs, err := workload.Generate(spec)
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(reqs, 8, 11)
	const replicas = 4
	policies := []string{"round_robin", "ttft", "sglang"}
	live, replayed := map[string]float64{}, map[string]float64{}
	for _, pol := range policies {
		g := gateway.Defaults()
		g.ScrapeInterval = gateway.Duration(20 * time.Millisecond)
		g.HealthInterval = gateway.Duration(50 * time.Millisecond)
		er, err := bench.RunEmbedded(context.Background(), bench.EmbeddedConfig{
			Sim:     sim.Config{Replicas: replicas, TimeScale: 5, Seed: 11},
			Gateway: g,
			Load:    bench.Config{MaxDuration: 2 * time.Minute},
		}, pol, reqs)
		if err != nil {
			t.Fatalf("live %s: %v", pol, err)
		}
		specs, err := Specs([]string{pol})
		if err != nil {
			t.Fatal(err)
		}
		run, err := Run(context.Background(), Config{Replicas: replicas, Seed: 11}, reqs, specs[0])
		if err != nil {
			t.Fatalf("replay %s: %v", pol, err)
		}
		live[pol], replayed[pol] = er.Run.HitRate, run.HitRate
		t.Logf("%-12s hit rate live %.3f replay %.3f   ttft p50 live %.1f ms replay %.1f ms",
			pol, er.Run.HitRate, run.HitRate, er.Run.TTFTms.P50, run.TTFTms.P50)
		if d := er.Run.HitRate - run.HitRate; d > 0.05 || d < -0.05 {
			t.Errorf("%s: live hit rate %.3f, replay %.3f: more than 5 points apart", pol, er.Run.HitRate, run.HitRate)
		}
	}
	rank := func(m map[string]float64) []string {
		out := append([]string(nil), policies...)
		sort.SliceStable(out, func(i, j int) bool { return m[out[i]] > m[out[j]] })
		return out
	}
	// Policies within 3 points of each other may swap; the rest must rank alike.
	lr, rr := rank(live), rank(replayed)
	for i := range lr {
		if lr[i] != rr[i] && abs(replayed[lr[i]]-replayed[rr[i]]) > 0.03 {
			t.Errorf("ranking by hit rate differs: live %v, replay %v", lr, rr)
			break
		}
	}
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}
