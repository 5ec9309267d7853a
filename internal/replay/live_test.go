package replay

import (
	"context"
	"net"
	"os"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/bench"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
	"github.com/kvgate/kvgate/internal/workload"
)

// liveWorkload is a small multiturn workload: 75 chat requests.
func liveWorkload(t *testing.T, conversations, turns float64) []workload.Request {
	t.Helper()
	spec, err := workload.Parse("multiturn")
	if err != nil {
		t.Fatal(err)
	}
	spec.Seed = 11
	spec.Params = map[string]float64{"conversations": conversations, "turns": turns, "system_prompt_len": 64,
		"user_len_min": 200, "user_len_max": 300, "output_len": 16, "think_ms": 500}
	reqs, err := workload.Generate(spec)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

// sequentialLive runs reqs through a gateway routing by policy in front of
// simulated replicas (what `bench --embedded` runs), starting the load only
// once the gateway has seen every replica healthy and listing its models,
// so that no request is routed over part of the fleet. It returns the
// records and each replica's engine counters.
func sequentialLive(t *testing.T, simCfg sim.Config, policy string, reqs []workload.Request) ([]report.Record, []engine.Stats) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fl, err := sim.Start(ctx, simCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer fl.Close()
	g := gateway.Defaults()
	g.Policy, g.Seed = policy, simCfg.Seed
	for _, u := range fl.URLs() {
		g.Replicas = append(g.Replicas, gateway.ReplicaConfig{URL: u})
	}
	// Health checks only at start: a check timing out on a busy machine
	// would take a replica out of the rotation.
	g.HealthInterval = gateway.Duration(time.Hour)
	gw, err := gateway.New(g, gateway.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := gw.Server()
	var wg sync.WaitGroup
	wg.Go(func() { gw.Run(ctx) })
	wg.Go(func() { _ = srv.Serve(ln) })
	defer func() {
		cancel()
		_ = srv.Close()
		wg.Wait()
	}()
	rt := gw.Router()
	testutil.Eventually(t, 30*time.Second, "every replica healthy and listing its models", func() bool {
		for i := range simCfg.Replicas {
			if !rt.Healthy(i) || rt.Replica(i).Served() == nil {
				return false
			}
		}
		return true
	})
	client := bench.NewClient()
	defer client.CloseIdleConnections()
	recs, _, err := bench.Run(ctx, bench.Config{Target: "http://" + ln.Addr().String(), Model: sim.DefaultModel,
		TimeScale: simCfg.TimeScale, Replicas: fl.URLs(), MaxDuration: 5 * time.Minute, Client: client}, reqs)
	if err != nil {
		t.Fatalf("live %s: %v", policy, err)
	}
	var stats []engine.Stats
	for _, r := range fl.Replicas() {
		stats = append(stats, r.Stats())
	}
	return recs, stats
}

// TestReplayMatchesSequentialLive is the part of "the replay describes the
// gateway" that no timing can change: the same requests sent one after the
// other (each waits for the previous to finish) through the gateway to
// simulated replicas over HTTP, as `bench --embedded` sends them, and
// through the replay (virtual time), with round robin, whose choices depend
// neither on load nor on when a scrape lands. Every request must go to the
// same replica with the same prompt, cached and output tokens, and every
// replica's engine must end with the same counters (prefix queries and
// hits, evictions, preemptions): the gateway's prompt rendering and
// hashing, the sim's engine (prefix cache, LRU eviction of a cache too
// small for the workload) and the replay's agree exactly. The wall-clock
// comparison of cache-aware policies is TestReplayAgreesWithLive (make
// bench).
func TestReplayMatchesSequentialLive(t *testing.T) {
	convs, turns := 12.0, 5.0
	if testing.Short() {
		convs, turns = 6, 4
	}
	reqs := liveWorkload(t, convs, turns)
	// One chain: request i depends on request i-1, no think time, so
	// that at most one request is ever in flight, in both runs.
	for i := range reqs {
		reqs[i].At, reqs[i].Think, reqs[i].Prev = 0, 0, i-1
	}
	const (
		replicas = 4
		kvBlocks = 160 // 2,560 tokens a replica: later turns evict earlier conversations
		seed     = 11
	)
	live, liveStats := sequentialLive(t, sim.Config{Replicas: replicas, KVBlocks: kvBlocks, TimeScale: 20, Seed: seed},
		"round_robin", reqs)
	cfg, pl, err := prepare(Config{Replicas: replicas, KVBlocks: kvBlocks, Seed: seed}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	vr, err := newVirtualRun(cfg, pl, specsOf(t, "round_robin")[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := vr.loop(context.Background()); err != nil {
		t.Fatalf("replay: %v", err)
	}
	recs := vr.reportRecords()
	if len(live) != len(reqs) || len(recs) != len(reqs) {
		t.Fatalf("%d live and %d replayed records for %d requests", len(live), len(recs), len(reqs))
	}
	cached := 0
	for i, l := range live {
		r := recs[i]
		if l.Err || r.Err || l.Replica != r.Replica || l.PromptTokens != r.PromptTokens ||
			l.CachedTokens != r.CachedTokens || l.OutputTokens != r.OutputTokens {
			t.Errorf("request %d: live replica %d prompt %d cached %d output %d err %v (%s); "+
				"replay replica %d prompt %d cached %d output %d err %v (%s)", i,
				l.Replica, l.PromptTokens, l.CachedTokens, l.OutputTokens, l.Err, l.ErrKind,
				r.Replica, r.PromptTokens, r.CachedTokens, r.OutputTokens, r.Err, r.ErrKind)
		}
		cached += r.CachedTokens
	}
	var evicted int64
	for i, rep := range vr.replicas {
		st := rep.engine.Stats()
		evicted += st.EvictedBlocks
		if liveStats[i] != st {
			t.Errorf("replica %d's engine: live %+v, replay %+v", i, liveStats[i], st)
		}
	}
	t.Logf("%d requests, %d cached tokens, %d blocks evicted", len(reqs), cached, evicted)
	// The workload must exercise what it checks: prefix hits and eviction.
	if cached == 0 || evicted == 0 {
		t.Errorf("%d cached tokens, %d evicted blocks: the workload no longer exercises the cache", cached, evicted)
	}
}

// TestReplayAgreesWithLive runs one small workload twice per policy: live
// through `bench --embedded` (simulated replicas over HTTP, the gateway,
// wall clock, requests concurrent) and through the replay (virtual time, no
// HTTP), with the same engine settings, and reports the hit rates and
// rankings side by side. Live hit rates of load-aware policies depend on
// when scrapes land and requests overlap on the wall clock, so this runs
// only in make bench (KVGATE_BENCH=1) and reports its figures; what timing
// cannot change is asserted by TestReplayMatchesSequentialLive.
func TestReplayAgreesWithLive(t *testing.T) {
	if testing.Short() || os.Getenv("KVGATE_BENCH") == "" {
		t.Skip("live fleet on the wall clock: set KVGATE_BENCH=1 (make bench)")
	}
	reqs := liveWorkload(t, 15, 5)
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
		gap := ""
		if d := er.Run.HitRate - run.HitRate; d > 0.05 || d < -0.05 {
			gap = "  (more than 5 points apart)"
		}
		t.Logf("%-12s hit rate live %.3f replay %.3f   ttft p50 live %.1f ms replay %.1f ms%s",
			pol, er.Run.HitRate, run.HitRate, er.Run.TTFTms.P50, run.TTFTms.P50, gap)
	}
	rank := func(m map[string]float64) []string {
		out := append([]string(nil), policies...)
		sort.SliceStable(out, func(i, j int) bool { return m[out[i]] > m[out[j]] })
		return out
	}
	// Policies within 3 points of each other may swap.
	lr, rr := rank(live), rank(replayed)
	for i := range lr {
		if lr[i] != rr[i] && abs(replayed[lr[i]]-replayed[rr[i]]) > 0.03 {
			t.Logf("ranking by hit rate differs: live %v, replay %v", lr, rr)
			return
		}
	}
	t.Logf("ranking by hit rate: live %v, replay %v", lr, rr)
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}
