package replay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/metrics"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/testutil"
	"github.com/kvgate/kvgate/internal/workload"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	conversationTrace = "../../../shared/traces/mooncake_conversation_trace.jsonl"
	syntheticTrace    = "../../../shared/traces/mooncake_synthetic_trace.jsonl"
)

// smallShared is a shared_prefix workload that replays in milliseconds: 16
// groups of 8 prompts sharing a 1,024-token system prompt, 20 requests/s.
func smallShared(t testing.TB, seed uint64) []workload.Request {
	t.Helper()
	reqs, err := workload.Generate(workload.Spec{Name: "shared_prefix", Seed: seed, Params: map[string]float64{
		"groups": 16, "prompts_per_group": 8, "system_prompt_len": 1024, "question_len": 64, "output_len": 32,
	}})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(reqs, 20, seed)
	return reqs
}

func traceReqs(t testing.TB, path string, n int) []workload.Request {
	t.Helper()
	if _, err := os.Stat(path); err != nil {
		t.Skipf("../shared/traces not found (%v): the Mooncake traces live in the repository's sibling shared/", err)
	}
	reqs, err := workload.Generate(workload.Spec{Name: workload.TraceName, Path: path, Requests: n})
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

func specsOf(t testing.TB, names ...string) []PolicySpec {
	t.Helper()
	s, err := Specs(names)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func runOf(t testing.TB, res report.Result, name string) report.Run {
	t.Helper()
	for _, r := range res.Runs {
		if r.Policy == name {
			return r
		}
	}
	t.Fatalf("no run %q", name)
	return report.Run{}
}

func TestCacheAwareBeatRoundRobin(t *testing.T) {
	reqs := smallShared(t, 1)
	res, err := Compare(context.Background(), Config{Replicas: 4, Seed: 1}, reqs, specsOf(t, "all"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	rr := runOf(t, res, "round_robin")
	if rr.Errors != 0 || rr.Requests != len(reqs) {
		t.Fatalf("round_robin: %d requests, %d errors", rr.Requests, rr.Errors)
	}
	// Round robin spreads each group over all 4 replicas: about 4 of 8
	// prompts per group miss. Cache-aware policies keep a group together.
	for _, name := range []string{"ttft", "sglang", "dynamo", "llmd", "precise", "preble"} {
		t.Run(name, func(t *testing.T) {
			r := runOf(t, res, name)
			if r.Errors != 0 {
				t.Fatalf("%d errors", r.Errors)
			}
			if r.HitRate < rr.HitRate+0.03 {
				t.Errorf("hit rate %.3f, round_robin %.3f: want at least 3 points more", r.HitRate, rr.HitRate)
			}
		})
	}
}

// A fleet with one replica twice as slow as the profile the gateway assumes
// (the 70B profile on replica 0, the 8B profile assumed): ttft sends it less
// than its equal share, the more so with its online correction, and keeps
// the tail below round robin's.
func TestSlowReplicaGetsLess(t *testing.T) {
	reqs, err := workload.Generate(workload.Spec{Name: "random", Seed: 1, Requests: 600})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(reqs, 20, 1)
	cfg := Config{Replicas: 4, Seed: 1, ReplicaProfiles: map[int]costmodel.Profile{0: costmodel.MustLookup("llama3-70b-h100-tp2")}}
	specs := []PolicySpec{
		{Name: "round_robin"},
		{Name: "ttft"},
		{Name: "ttft", Label: "ttft-uncorrected", Params: map[string]any{"correction_alpha": 0}},
	}
	res, err := Compare(context.Background(), cfg, reqs, specs, Options{})
	if err != nil {
		t.Fatal(err)
	}
	rr, tt, un := runOf(t, res, "round_robin"), runOf(t, res, "ttft"), runOf(t, res, "ttft-uncorrected")
	for _, r := range []report.Run{rr, tt, un} {
		if r.Errors != 0 || r.Requests != len(reqs) || len(r.ReplicaShare) != 4 {
			t.Fatalf("%s: %d requests, %d errors, shares %v", r.Policy, r.Requests, r.Errors, r.ReplicaShare)
		}
	}
	t.Logf("slow replica's share: ttft %.3f, uncorrected %.3f; p99 TTFT: ttft %.1f, uncorrected %.1f, round_robin %.1f ms",
		tt.ReplicaShare[0], un.ReplicaShare[0], tt.TTFTms.P99, un.TTFTms.P99, rr.TTFTms.P99)
	if tt.ReplicaShare[0] >= un.ReplicaShare[0] || un.ReplicaShare[0] >= 0.2 {
		t.Errorf("slow replica's share: ttft %.3f, uncorrected %.3f: want ttft < uncorrected < 0.2", tt.ReplicaShare[0], un.ReplicaShare[0])
	}
	if tt.TTFTms.P99 >= rr.TTFTms.P99 {
		t.Errorf("p99 TTFT: ttft %.1f ms, round_robin %.1f ms", tt.TTFTms.P99, rr.TTFTms.P99)
	}
}

func TestBoundDominatesEveryPolicy(t *testing.T) {
	testutil.Deterministic(t)
	multiturn, err := workload.Generate(workload.Spec{Name: "multiturn", Seed: 3, Params: map[string]float64{"conversations": 12, "turns": 4}})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(multiturn, 10, 3)
	zipf, err := workload.Generate(workload.Spec{Name: "zipf", Seed: 4, Requests: 200})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(zipf, 40, 4)
	tests := []struct {
		name string
		reqs []workload.Request
		cfg  Config
	}{
		{"shared_prefix", smallShared(t, 2), Config{Replicas: 4}},
		{"multiturn", multiturn, Config{Replicas: 3}},
		// A cache too small for the working set: merged_lru falls far
		// below prefix_reuse, and the engines evict.
		{"zipf small cache", zipf, Config{Replicas: 2, KVBlocks: 400}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			res, err := Compare(context.Background(), tc.cfg, tc.reqs, specsOf(t, "all"), Options{})
			if err != nil {
				t.Fatal(err)
			}
			b := res.Bound
			if !(b.PrefixReuse > 0 && b.PrefixReuse < 1 && b.MergedLRU >= 0 && b.MergedLRU <= b.PrefixReuse) {
				t.Fatalf("bounds %+v", *b)
			}
			for _, r := range res.Runs {
				if r.HitRate > b.PrefixReuse+1e-12 {
					t.Errorf("%s: hit rate %.4f above the prefix-reuse bound %.4f", r.Policy, r.HitRate, b.PrefixReuse)
				}
				if v := r.Extra["hit_rate_vs_bound"]; math.Abs(v-r.HitRate/b.PrefixReuse) > 1e-12 {
					t.Errorf("%s: hit_rate_vs_bound %v", r.Policy, v)
				}
			}
		})
	}
}

func TestSameSeedSameJSON(t *testing.T) {
	encode := func(seed uint64) []byte {
		res, err := Compare(context.Background(), Config{Replicas: 4, Seed: seed, Staleness: 100 * time.Millisecond},
			smallShared(t, seed), specsOf(t, "all"), Options{})
		if err != nil {
			t.Fatal(err)
		}
		var b bytes.Buffer
		if err := report.WriteJSON(&b, res); err != nil {
			t.Fatal(err)
		}
		return b.Bytes()
	}
	a, b, c := encode(7), encode(7), encode(8)
	if !bytes.Equal(a, b) {
		t.Fatal("two runs with seed 7 wrote different JSON")
	}
	if bytes.Equal(a, c) {
		t.Fatal("seeds 7 and 8 wrote the same JSON")
	}
}

// TestBoundsHandComputed checks both bounds on sequences small enough to
// count by hand. Blocks are 16 tokens = 64 bytes of text.
func TestBoundsHandComputed(t *testing.T) {
	block := func(c byte, n int) string { return strings.Repeat(string(c), 64*n) }
	req := func(text string) workload.Request { return workload.Request{Prev: -1, Prompt: text, MaxTokens: 1} }
	tests := []struct {
		name          string
		texts         []string
		replicas, kv  int
		reuse, merged float64
	}{
		// 2nd request: 4 blocks seen, but at most prompt−1 tokens hit: 3 blocks.
		{"identical", []string{block('a', 4), block('a', 4)}, 1, 100, 48.0 / 128, 48.0 / 128},
		// 2nd shares 2 blocks (then differs): 2 blocks of its 3 hit.
		{"shared head", []string{block('a', 2) + block('b', 2), block('a', 2) + block('c', 1)}, 1, 100, 32.0 / 112, 32.0 / 112},
		// "x" is one more token (49 = 3 blocks + 1). The LRU holds 3 blocks:
		// request 2's 4 blocks leave none of 'a'.
		{"lru evicts", []string{block('a', 3) + "x", block('b', 4), block('a', 3) + "y"}, 1, 3, 48.0 / 162, 0},
		// Two replicas of 2 blocks pool into 4: the 3 'a' blocks survive
		// request 2's one block.
		{"lru pooled", []string{block('a', 3) + "x", block('b', 1) + "x", block('a', 3) + "y"}, 2, 2, 48.0 / 115, 48.0 / 115},
		{"empty", nil, 1, 1, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			reqs := make([]workload.Request, len(tc.texts))
			for i, s := range tc.texts {
				reqs[i] = req(s)
			}
			b, err := Bounds(context.Background(), Config{Replicas: tc.replicas, KVBlocks: tc.kv}, reqs)
			if err != nil {
				t.Fatal(err)
			}
			if math.Abs(b.PrefixReuse-tc.reuse) > 1e-12 || math.Abs(b.MergedLRU-tc.merged) > 1e-12 {
				t.Errorf("got %+v, want reuse %.4f merged %.4f", b, tc.reuse, tc.merged)
			}
		})
	}
}

// TestTraceBoundsMatchBlocks checks that the hash-id computation of a
// trace's bounds equals the block-hash one, with caches small enough to
// evict, on hand-made traces and on the head of the real one.
func TestTraceBoundsMatchBlocks(t *testing.T) {
	testutil.Deterministic(t)
	handmade, err := workload.FromTrace([]workload.TraceRecord{
		{InputLength: 1500, OutputLength: 1, HashIDs: []int{0, 1, 2}},
		{InputLength: 1100, OutputLength: 1, HashIDs: []int{0, 1, 3}},    // shares 2 ids, then 76 tokens of id 3
		{InputLength: 1600, OutputLength: 1, HashIDs: []int{0, 1, 3, 4}}, // shares id 3 whole: longer than before
		{InputLength: 300, OutputLength: 1, HashIDs: []int{0}},           // a cut prefix of id 0
		{InputLength: 512, OutputLength: 1, HashIDs: []int{5}},
		{InputLength: 2048, OutputLength: 1, HashIDs: []int{0, 1, 2, 6}},
		{InputLength: 1, OutputLength: 1, HashIDs: []int{7}},
		{InputLength: 1300, OutputLength: 1, HashIDs: []int{0, 1, 3}},
	}, 1)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		reqs []workload.Request
	}{{"handmade", handmade}}
	if _, err := os.Stat(conversationTrace); err == nil {
		traceHead := 600
		if testing.Short() {
			traceHead = 150
		}
		cases = append(cases, struct {
			name string
			reqs []workload.Request
		}{"conversation head", traceReqs(t, conversationTrace, traceHead)})
	}
	for _, c := range cases {
		for _, cfg := range []Config{{Replicas: 1, KVBlocks: 40}, {Replicas: 2, KVBlocks: 1500}, {Replicas: 8}} {
			cfg = cfg.WithDefaults()
			pl, err := newPlan(c.reqs)
			if err != nil {
				t.Fatal(err)
			}
			order := nominalOrder(pl.reqs)
			fast, err := traceBounds(context.Background(), cfg, pl.reqs, order)
			if err != nil {
				t.Fatal(err)
			}
			slow, err := blockBounds(context.Background(), cfg, pl.reqs, order)
			if err != nil {
				t.Fatal(err)
			}
			if fast != slow {
				t.Errorf("%s, %d×%d blocks: ids %+v, blocks %+v", c.name, cfg.Replicas, cfg.KVBlocks, fast, slow)
			}
		}
	}
}

func TestCapacity(t *testing.T) {
	reqs := smallShared(t, 5)
	cfg := Config{Replicas: 2, Seed: 5}
	slo := SLO{TTFTP90: 150 * time.Millisecond}
	c, err := Capacity(context.Background(), cfg, reqs, PolicySpec{Name: "ttft"}, slo)
	if err != nil {
		t.Fatal(err)
	}
	if !(c > 1 && c < 4096) {
		t.Fatalf("capacity %v: the SLO should hold at 1× and fail at some speed-up", c)
	}
	at := func(x float64) report.Run {
		c := cfg
		c.Speedup = x
		r, err := Run(context.Background(), c, reqs, PolicySpec{Name: "ttft"})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	if r := at(c); !slo.Meets(r) {
		t.Errorf("at the capacity %.3f× p90 TTFT %.1f ms misses the SLO", c, r.TTFTms.P90)
	}
	if r := at(2 * c); slo.Meets(r) {
		t.Errorf("at twice the capacity %.3f× p90 TTFT %.1f ms still meets the SLO", 2*c, r.TTFTms.P90)
	}
	// Capacity grows with the fleet.
	cfg.Replicas = 4
	c4, err := Capacity(context.Background(), cfg, reqs, PolicySpec{Name: "ttft"}, slo)
	if err != nil {
		t.Fatal(err)
	}
	if c4 <= c {
		t.Errorf("capacity on 4 replicas %.3f ≤ on 2 %.3f", c4, c)
	}
}

func TestSLOMeets(t *testing.T) {
	slo := SLO{TTFTP90: time.Second}
	tests := []struct {
		run  report.Run
		want bool
	}{
		{report.Run{Requests: 100, TTFTms: report.Dist{P90: 1000}}, true},
		{report.Run{Requests: 100, TTFTms: report.Dist{P90: 1000.1}}, false},
		{report.Run{Requests: 100, Errors: 1, TTFTms: report.Dist{P90: 10}}, true},
		{report.Run{Requests: 100, Errors: 2, TTFTms: report.Dist{P90: 10}}, false},
		{report.Run{}, false},
	}
	for i, tc := range tests {
		if got := slo.Meets(tc.run); got != tc.want {
			t.Errorf("%d: got %v want %v", i, got, tc.want)
		}
	}
}

// spy wraps a policy and records what it was shown.
type spy struct {
	policy.Policy
	seen []spyView
}

type spyView struct {
	now time.Time
	v   policy.ReplicaView
}

func (s *spy) Pick(req *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
	for _, v := range rs {
		s.seen = append(s.seen, spyView{req.Now, v})
	}
	return s.Policy.Pick(req, rs)
}

func TestStalenessDelaysMetrics(t *testing.T) {
	reqs := smallShared(t, 6)
	workload.Arrivals(reqs, 60, 6) // busier: queues form, gauges move
	for _, stale := range []time.Duration{0, 50 * time.Millisecond, 700 * time.Millisecond} {
		t.Run(stale.String(), func(t *testing.T) {
			const interval = 100 * time.Millisecond
			type key struct {
				replica int
				at      time.Duration
			}
			scrapes := map[key]snapshot{}
			cfg := Config{Replicas: 2, Staleness: stale, ScrapeInterval: interval}.WithDefaults()
			cfg.observe = func(o observation) {
				if o.scrape != nil {
					scrapes[key{o.scrape.replica, o.scrape.at}] = *o.scrape
				}
			}
			var sp *spy
			spec := PolicySpec{Name: "least_load", New: func(o policy.Options) (policy.Policy, error) {
				p, err := policy.New("least_load", o)
				sp = &spy{Policy: p}
				return sp, err
			}}
			pl, err := newPlan(reqs)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := runPlan(context.Background(), cfg, pl, spec); err != nil {
				t.Fatal(err)
			}
			with, moved := 0, 0
			for _, s := range sp.seen {
				now := s.now.Sub(epoch)
				if !s.v.HaveMetrics {
					// Nothing delivered yet: the first scrape (at 0) lands at stale.
					if now >= stale {
						t.Fatalf("at %v no metrics, staleness %v", now, stale)
					}
					continue
				}
				with++
				age := s.v.MetricsAge
				if age < stale || age >= stale+interval {
					t.Fatalf("at %v metrics %v old, want in [%v, %v)", now, age, stale, stale+interval)
				}
				sn, ok := scrapes[key{s.v.Index, now - age}]
				if !ok {
					t.Fatalf("at %v replica %d shows a scrape from %v that was never taken", now, s.v.Index, now-age)
				}
				if sn.metrics.Waiting != s.v.Waiting || sn.metrics.Running != s.v.Running || sn.metrics.KVUsage != s.v.KVUsage {
					t.Fatalf("at %v replica %d shows %d/%d/%v, the scrape at %v was %+v", now, s.v.Index,
						s.v.Waiting, s.v.Running, s.v.KVUsage, now-age, sn.metrics)
				}
				if s.v.Running > 0 {
					moved++
				}
			}
			if with == 0 || moved == 0 {
				t.Fatalf("%d views with metrics, %d with running requests: the test saw nothing", with, moved)
			}
		})
	}
}

func TestDependenciesHonoured(t *testing.T) {
	reqs, err := workload.Generate(workload.Spec{Name: "multiturn", Seed: 9, Params: map[string]float64{"conversations": 6, "turns": 5}})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(reqs, 50, 9)
	for _, speedup := range []float64{1, 4} {
		cfg := Config{Replicas: 2, Speedup: speedup}.WithDefaults()
		pl, err := newPlan(reqs)
		if err != nil {
			t.Fatal(err)
		}
		vr, err := newVirtualRun(cfg, pl, PolicySpec{Name: "ttft"})
		if err != nil {
			t.Fatal(err)
		}
		if err := vr.loop(context.Background()); err != nil {
			t.Fatal(err)
		}
		deps := 0
		recs := vr.reportRecords()
		for i, r := range reqs {
			rec := recs[i]
			if rec.Err || rec.OutputTokens != r.MaxTokens {
				t.Fatalf("request %d: %+v", i, rec)
			}
			want := scale(r.At, speedup)
			if r.Prev >= 0 {
				p := recs[r.Prev]
				want = max(want, p.Start+p.E2E+scale(r.Think, speedup))
				deps++
			}
			// Sent exactly when both its time and its predecessor allow.
			if rec.Start != want {
				t.Fatalf("speedup %v: request %d (prev %d) sent at %v, want %v", speedup, i, r.Prev, rec.Start, want)
			}
		}
		if deps == 0 {
			t.Fatal("no dependent turns")
		}
	}
}

func TestPreciseFollowsKVEvents(t *testing.T) {
	reqs := smallShared(t, 10)
	for _, stale := range []time.Duration{0, 300 * time.Millisecond} {
		cfg := Config{Replicas: 3, KVBlocks: 600, Staleness: stale}.WithDefaults()
		pl, _ := newPlan(reqs)
		vr, err := newVirtualRun(cfg, pl, PolicySpec{Name: "precise"})
		if err != nil {
			t.Fatal(err)
		}
		if err := vr.loop(context.Background()); err != nil {
			t.Fatal(err)
		}
		if vr.kvEventErrors != 0 {
			t.Fatalf("staleness %v: %d KV events rejected", stale, vr.kvEventErrors)
		}
		px := vr.gateways[0].router.Precise().Index()
		for e, rep := range vr.replicas {
			// Replaying Stored/Removed gives exactly the engine's cached blocks.
			if got, want := px.ReplicaLen(e), rep.engine.Stats().CachedBlocks; got != want {
				t.Errorf("staleness %v: replica %d: precise index holds %d blocks, the engine %d", stale, e, got, want)
			}
		}
		evicted := int64(0)
		for _, rep := range vr.replicas {
			evicted += rep.engine.Stats().EvictedBlocks
		}
		if evicted == 0 {
			t.Errorf("staleness %v: no evictions: Removed events untested", stale)
		}
	}
}

func TestTooLongIsAnError(t *testing.T) {
	reqs := []workload.Request{
		{Prev: -1, Prompt: strings.Repeat("a", 4*100), MaxTokens: 4},
		{Prev: -1, At: time.Millisecond, Prompt: strings.Repeat("b", 4*5000), MaxTokens: 4}, // 313 blocks > 200
		{Prev: 1, Think: time.Millisecond, Prompt: strings.Repeat("a", 4*100) + "c", MaxTokens: 4},
	}
	run, err := Run(context.Background(), Config{Replicas: 2, KVBlocks: 200}, reqs, PolicySpec{Name: "round_robin"})
	if err != nil {
		t.Fatal(err)
	}
	if run.Requests != 3 || run.Errors != 1 || run.Extra["errors_too_long"] != 1 {
		t.Fatalf("requests %d errors %d extra %v", run.Requests, run.Errors, run.Extra)
	}
}

func TestInvalid(t *testing.T) {
	good := []workload.Request{{Prev: -1, Prompt: "hello", MaxTokens: 1}}
	tests := []struct {
		name string
		cfg  Config
		reqs []workload.Request
		spec PolicySpec
		want error
	}{
		{"negative replicas", Config{Replicas: -1}, good, PolicySpec{Name: "ttft"}, ErrConfig},
		{"negative speedup", Config{Speedup: -2}, good, PolicySpec{Name: "ttft"}, ErrConfig},
		{"negative staleness", Config{Staleness: -time.Second}, good, PolicySpec{Name: "ttft"}, ErrConfig},
		{"unknown policy", Config{}, good, PolicySpec{Name: "nope"}, ErrConfig},
		{"bad param", Config{}, good, PolicySpec{Name: "score", Params: map[string]any{"nope": 1}}, ErrConfig},
		{"forward dependency", Config{}, []workload.Request{{Prev: 1}, {Prev: -1}}, PolicySpec{Name: "ttft"}, ErrInput},
		{"self dependency", Config{}, []workload.Request{{Prev: 0}}, PolicySpec{Name: "ttft"}, ErrInput},
		{"replica profile out of range", Config{Replicas: 2, ReplicaProfiles: map[int]costmodel.Profile{2: costmodel.MustLookup(costmodel.Default)}}, good, PolicySpec{Name: "ttft"}, ErrConfig},
		{"invalid replica profile", Config{Replicas: 2, ReplicaProfiles: map[int]costmodel.Profile{1: {C1: -1}}}, good, PolicySpec{Name: "ttft"}, ErrConfig},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := Run(context.Background(), tc.cfg, tc.reqs, tc.spec); !errors.Is(err, tc.want) {
				t.Errorf("got %v, want %v", err, tc.want)
			}
		})
	}
	if _, err := Specs([]string{"ttft", "nope"}); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), "round_robin") {
		t.Errorf("unknown policy: %v (want the known ones listed)", err)
	}
}

func TestCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Run(ctx, Config{}, smallShared(t, 1), PolicySpec{Name: "ttft"}); !errors.Is(err, context.Canceled) {
		t.Fatalf("got %v", err)
	}
}

func TestQuestions(t *testing.T) {
	testutil.Deterministic(t)
	ctx := context.Background()
	base := workload.Spec{Name: "shared_prefix", Seed: 1, Params: map[string]float64{
		"groups": 8, "prompts_per_group": 8, "system_prompt_len": 900, "question_len": 100, "output_len": 16}}
	t.Run("sharing", func(t *testing.T) {
		ratios := []float64{0.1, 0.5, 0.9}
		res, charts, err := Sharing(ctx, Config{Replicas: 4}, base, 20, ratios, specsOf(t, "round_robin", "ttft"), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Runs) != 6 || len(charts) != 2 {
			t.Fatalf("%d runs, %d charts", len(res.Runs), len(charts))
		}
		// More sharing, more hits, for the cache-aware policy.
		hit := charts[1].Series[1]
		if hit.Name != "ttft" || !slices.IsSorted(hit.Y) || hit.Y[2] < hit.Y[0]+0.3 {
			t.Errorf("ttft hit rate against sharing: %v %v", hit.Name, hit.Y)
		}
		for _, r := range res.Runs {
			if r.HitRate > r.Extra["bound_prefix_reuse"]+1e-12 {
				t.Errorf("%s above its bound", r.Policy)
			}
		}
		if err := report.WriteReport(t.TempDir(), res, "sharing", charts...); err != nil {
			t.Fatal(err)
		}
	})
	reqs, err := workload.Generate(base)
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(reqs, 30, 1)
	t.Run("score-surface", func(t *testing.T) {
		res, charts, err := ScoreSurface(ctx, Config{Replicas: 4}, reqs, []float64{0, 1, 4}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Runs) != 8 {
			t.Fatalf("%d runs", len(res.Runs))
		}
		// Only the weights' ratio matters: cache=1 load=1 and cache=4 load=4
		// make the same decisions up to ties.
		a, b := runOf(t, res, "score cache=1 load=1"), runOf(t, res, "score cache=4 load=4")
		if math.Abs(a.HitRate-b.HitRate) > 0.02 {
			t.Errorf("equal ratios, hit rates %.3f and %.3f", a.HitRate, b.HitRate)
		}
		// Routing on the cache alone hits more than on the load alone.
		if c, l := runOf(t, res, "score cache=1 load=0"), runOf(t, res, "score cache=0 load=1"); c.HitRate <= l.HitRate {
			t.Errorf("cache only %.3f ≤ load only %.3f", c.HitRate, l.HitRate)
		}
		if err := report.WriteReport(t.TempDir(), res, "score", charts...); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("staleness", func(t *testing.T) {
		st := []time.Duration{0, time.Second}
		// KV events off: dynamo follows them by default, and they arrive late too.
		res, charts, err := Staleness(ctx, Config{Replicas: 4, KVEvents: KVOff}, reqs, st, specsOf(t, "dynamo", "llmd"), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Runs) != 4 {
			t.Fatalf("%d runs", len(res.Runs))
		}
		// dynamo without KV events reads only the gateway's own counts and
		// index: staleness cannot change a single decision.
		a, b := runOf(t, res, "dynamo staleness=0s"), runOf(t, res, "dynamo staleness=1s")
		a.Extra, b.Extra, a.Policy, b.Policy, a.Series, b.Series = nil, nil, "", "", nil, nil
		var ja, jb bytes.Buffer
		_ = report.WriteJSON(&ja, report.Result{Runs: []report.Run{a}})
		_ = report.WriteJSON(&jb, report.Result{Runs: []report.Run{b}})
		if !bytes.Equal(ja.Bytes(), jb.Bytes()) {
			t.Errorf("dynamo changed with staleness:\n%s\n%s", ja.String(), jb.String())
		}
		if err := report.WriteReport(t.TempDir(), res, "staleness", charts...); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("cache-pressure", func(t *testing.T) {
		blocks := []int{80, 3000}
		res, charts, err := CachePressure(ctx, Config{Replicas: 4}, reqs, blocks, specsOf(t, "round_robin", "ttft"), nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Runs) != 4 || len(charts) != 3 || res.Bound != nil {
			t.Fatalf("%d runs, %d charts, bound %v", len(res.Runs), len(charts), res.Bound)
		}
		// The third chart is ttft's p90 over round_robin's at each size.
		vs := VsBest(res, "ttft")
		ratio := charts[2].Series[0]
		if charts[2].Name != "pressure_ttft_vs_best" || len(vs) != 2 || len(ratio.Y) != 2 {
			t.Fatalf("chart %q, %d points %v", charts[2].Name, len(vs), ratio.Y)
		}
		for i, p := range vs {
			want := runOf(t, res, fmt.Sprintf("ttft kv_blocks=%d", blocks[i])).TTFTms.P90 /
				runOf(t, res, fmt.Sprintf("round_robin kv_blocks=%d", blocks[i])).TTFTms.P90
			if p.KVBlocks != blocks[i] || p.Best != "round_robin" || math.Abs(ratio.Y[i]-want) > 1e-12 {
				t.Errorf("point %d: %+v, ratio %v, want %v", i, p, ratio.Y[i], want)
			}
		}
		// A smaller cache holds less: the bound and the hits fall with it,
		// and each run carries its own point's bound.
		small, large := runOf(t, res, "ttft kv_blocks=80"), runOf(t, res, "ttft kv_blocks=3000")
		if small.Extra["kv_blocks"] != 80 || small.Extra["bound_merged_lru"] >= large.Extra["bound_merged_lru"] ||
			small.HitRate >= large.HitRate {
			t.Errorf("80 blocks %v, 3000 blocks %v", small.Extra, large.Extra)
		}
		for _, r := range res.Runs {
			if r.HitRate > r.Extra["bound_prefix_reuse"]+1e-12 {
				t.Errorf("%s above its bound", r.Policy)
			}
		}
		if err := report.WriteReport(t.TempDir(), res, "pressure", charts...); err != nil {
			t.Fatal(err)
		}
	})
}

func TestConversationTraceHead(t *testing.T) {
	testutil.Deterministic(t)
	if testing.Short() {
		t.Skip("replays 2,000 trace requests twice")
	}
	reqs := traceReqs(t, conversationTrace, 2000)
	res, err := Compare(context.Background(), Config{Replicas: 8}, reqs, specsOf(t, "round_robin", "ttft"), Options{})
	if err != nil {
		t.Fatal(err)
	}
	b := *res.Bound
	// The README's bound for the whole trace is 36.6 % of blocks; the head
	// reuses less (nothing is warm at first).
	if !(b.PrefixReuse > 0.2 && b.PrefixReuse < 0.45 && b.MergedLRU > 0 && b.MergedLRU <= b.PrefixReuse) {
		t.Fatalf("bounds %+v", b)
	}
	rr, ttft := runOf(t, res, "round_robin"), runOf(t, res, "ttft")
	for _, r := range res.Runs {
		if r.Requests != 2000 || r.Errors != 0 || r.HitRate > b.PrefixReuse {
			t.Errorf("%s: %d requests, %d errors, hit %.3f (bound %.3f)", r.Policy, r.Requests, r.Errors, r.HitRate, b.PrefixReuse)
		}
	}
	if ttft.HitRate < rr.HitRate+0.05 || ttft.TTFTms.P50 > rr.TTFTms.P50 {
		t.Errorf("ttft hit %.3f p50 %.1f ms, round_robin hit %.3f p50 %.1f ms", ttft.HitRate, ttft.TTFTms.P50, rr.HitRate, rr.TTFTms.P50)
	}
}

// Under load with full caches, ttft's eviction cost keeps prefixes with
// their holders: the synthetic trace at 3.4× speed-up, where the plain
// estimate scatters them (README: 32.7% against 22.9% hit rate). The plain
// estimate is without the price of the future too (future_weight,
// wait_weight) and the saturated fleet's wider margin (saturated_rel),
// which also keep prefixes where they are kept.
func TestEvictionCostHoldsHitRateUnderLoad(t *testing.T) {
	testutil.Deterministic(t)
	if testing.Short() {
		t.Skip("replays the synthetic trace twice")
	}
	reqs := traceReqs(t, syntheticTrace, 0)
	specs := []PolicySpec{
		{Name: "ttft"},
		{Name: "ttft", Label: "ttft-no-eviction", Params: map[string]any{"eviction_weight": 0, "future_weight": 0, "wait_weight": 0, "saturated_rel": 0}},
	}
	res, err := Compare(context.Background(), Config{Replicas: 8, Speedup: 3.4, Seed: 1}, reqs, specs, Options{})
	if err != nil {
		t.Fatal(err)
	}
	with, without := runOf(t, res, "ttft"), runOf(t, res, "ttft-no-eviction")
	t.Logf("hit %.3f / p90 %.0f ms with the eviction cost, %.3f / %.0f ms without", with.HitRate, with.TTFTms.P90, without.HitRate, without.TTFTms.P90)
	if with.HitRate < without.HitRate+0.05 || with.TTFTms.P90 > without.TTFTms.P90 {
		t.Errorf("eviction cost: hit %.3f p90 %.0f ms, without: hit %.3f p90 %.0f ms", with.HitRate, with.TTFTms.P90, without.HitRate, without.TTFTms.P90)
	}
}

// BenchmarkReplayConversation8 replays the whole Mooncake conversation
// trace (12,031 requests) on 8 replicas, one policy per sub-benchmark, and
// reports the peak live heap sampled during the run and the process's peak
// RSS. Run it alone: go test -run '^$' -bench ReplayConversation8 -benchtime=1x.
func BenchmarkReplayConversation8(b *testing.B) {
	reqs := traceReqs(b, conversationTrace, 0)
	for _, name := range []string{"ttft", "round_robin", "sglang"} {
		b.Run(name, func(b *testing.B) {
			runtime.GC()
			sample := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
			var peak uint64
			cfg := Config{Replicas: 8}
			cfg.observe = func(observation) {
				metrics.Read(sample)
				peak = max(peak, sample[0].Value.Uint64())
			}
			var run report.Run
			for b.Loop() {
				var err error
				if run, err = Run(context.Background(), cfg, reqs, PolicySpec{Name: name}); err != nil {
					b.Fatal(err)
				}
			}
			var ru syscall.Rusage
			_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
			b.ReportMetric(b.Elapsed().Seconds()/float64(b.N), "s/op")
			b.ReportMetric(float64(peak)/(1<<20), "peak-heap-MiB")
			b.ReportMetric(float64(ru.Maxrss)/1024, "max-rss-MiB")
			b.ReportMetric(run.HitRate*100, "hit-%")
			b.ReportMetric(run.TTFTms.P90, "ttft-p90-ms")
		})
	}
}

// BenchmarkBoundsConversation is the bound computation of the whole trace.
func BenchmarkBoundsConversation(b *testing.B) {
	reqs := traceReqs(b, conversationTrace, 0)
	for b.Loop() {
		if _, err := Bounds(context.Background(), Config{Replicas: 8}, reqs); err != nil {
			b.Fatal(err)
		}
	}
}
