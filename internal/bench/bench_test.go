package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/replay"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/workload"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func generate(t *testing.T, name string, params map[string]float64) []workload.Request {
	t.Helper()
	spec, err := workload.Parse(name)
	if err != nil {
		t.Fatal(err)
	}
	spec.Seed = 7
	spec.Params = params
	reqs, err := workload.Generate(spec)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

func embedded(replicas int) EmbeddedConfig {
	g := gateway.Defaults()
	g.ScrapeInterval = gateway.Duration(20 * time.Millisecond)
	g.HealthInterval = gateway.Duration(50 * time.Millisecond)
	return EmbeddedConfig{
		Sim:     sim.Config{Replicas: replicas, TimeScale: 2, Seed: 7},
		Gateway: g,
		Load:    Config{Concurrency: 8, MaxDuration: 2 * time.Minute},
	}
}

// cacheAwareCases are the two workloads on which a cache-aware policy must
// beat round_robin clearly.
var cacheAwareCases = []struct {
	workload string
	params   map[string]float64
}{
	// 4 prompts per group over 4 replicas: round robin computes a group's
	// system prompt up to 4 times, a cache-aware policy once.
	{"shared_prefix", map[string]float64{"groups": 12, "prompts_per_group": 4, "system_prompt_len": 2048,
		"question_len": 64, "output_len": 16}},
	// Short system prompt, growing histories: the history is the prefix.
	{"multiturn", map[string]float64{"conversations": 15, "turns": 6, "system_prompt_len": 32,
		"user_len_min": 300, "user_len_max": 350, "output_len": 16, "think_ms": 0}},
}

var cacheAwarePolicies = []string{"round_robin", "ttft", "sglang"}

// Cache-aware policies must show a clearly higher hit rate and a lower TTFT
// p50 than round_robin, on both workloads the issue names. The claim is
// about the policies and the engine model, so it is asserted where they run
// in virtual time (internal/replay: the gateway's router and policies, the
// sim's engine, no HTTP, no wall clock), where a busy machine cannot change
// the figures. TestCacheAwareBeatsRoundRobinLive measures the same through
// the live gateway under make bench.
func TestCacheAwareBeatsRoundRobin(t *testing.T) {
	for _, tc := range cacheAwareCases {
		t.Run(tc.workload, func(t *testing.T) {
			reqs := generate(t, tc.workload, tc.params)
			workload.Arrivals(reqs, cacheAwareRate, 7)
			specs, err := replay.Specs(cacheAwarePolicies)
			if err != nil {
				t.Fatal(err)
			}
			res, err := replay.Compare(context.Background(), replay.Config{Replicas: 4, Seed: 7}, reqs, specs, replay.Options{})
			if err != nil {
				t.Fatal(err)
			}
			runs := map[string]report.Run{}
			for _, r := range res.Runs {
				if r.Errors != 0 || r.Requests != len(reqs) {
					t.Fatalf("%s: %d errors of %d", r.Policy, r.Errors, r.Requests)
				}
				runs[r.Policy] = r
				t.Logf("%-12s hit %.3f ttft p50 %.1f ms imbalance %.2f", r.Policy, r.HitRate, r.TTFTms.P50, r.Imbalance)
			}
			for _, pol := range cacheAwarePolicies[1:] {
				if why := beats(runs[pol], runs["round_robin"]); why != "" {
					t.Errorf("%s: %s", pol, why)
				}
			}
		})
	}
}

// cacheAwareRate is the replay's Poisson arrival rate: about one request
// per replica in flight, so prefill time, not queueing, decides TTFT.
const cacheAwareRate = 8

// beats says how r fails to beat round robin's run rr clearly ("" when it does).
func beats(r, rr report.Run) string {
	if r.HitRate < rr.HitRate+0.15 {
		return fmt.Sprintf("hit rate %.3f not clearly above round_robin's %.3f", r.HitRate, rr.HitRate)
	}
	if r.TTFTms.P50 >= rr.TTFTms.P50 {
		return fmt.Sprintf("TTFT p50 %.1f ms not below round_robin's %.1f ms", r.TTFTms.P50, rr.TTFTms.P50)
	}
	return ""
}

// TestCacheAwareBeatsRoundRobinLive runs the same comparison through the
// live gateway and simulated replicas (wall clock, HTTP). It runs under make
// bench (KVGATE_BENCH=1) and reports its figures; on a busy machine the
// wall-clock TTFTs may not hold the ordering, so only errors fail it.
func TestCacheAwareBeatsRoundRobinLive(t *testing.T) {
	if testing.Short() || os.Getenv("KVGATE_BENCH") == "" {
		t.Skip("live embedded fleet: set KVGATE_BENCH=1 (make bench)")
	}
	for _, tc := range cacheAwareCases {
		t.Run(tc.workload, func(t *testing.T) {
			reqs := generate(t, tc.workload, tc.params)
			runs := map[string]report.Run{}
			for _, pol := range cacheAwarePolicies {
				e := embedded(4)
				e.Load.Concurrency = 4 // one request per replica: prefill time, not queueing, decides TTFT
				res, err := RunEmbedded(context.Background(), e, pol, reqs)
				if err != nil {
					t.Fatalf("%s: %v", pol, err)
				}
				if res.Run.Errors != 0 || res.Run.Requests != len(reqs) {
					t.Fatalf("%s: %d errors of %d", pol, res.Run.Errors, res.Run.Requests)
				}
				runs[pol] = res.Run
				t.Logf("%-12s hit %.3f ttft p50 %.1f ms imbalance %.2f", pol, res.Run.HitRate, res.Run.TTFTms.P50, res.Run.Imbalance)
			}
			for _, pol := range cacheAwarePolicies[1:] {
				if why := beats(runs[pol], runs["round_robin"]); why != "" {
					t.Logf("%s: %s (wall clock; the replay's ordering is what make test asserts)", pol, why)
				}
			}
		})
	}
}

func TestRunRecordsAndDependencies(t *testing.T) {
	reqs := generate(t, "multiturn", map[string]float64{"conversations": 3, "turns": 3, "system_prompt_len": 16,
		"user_len_min": 8, "user_len_max": 8, "output_len": 4, "think_ms": 0})
	res, err := RunEmbedded(context.Background(), embedded(2), "ttft", reqs)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Records) != len(reqs) {
		t.Fatalf("%d records for %d requests", len(res.Records), len(reqs))
	}
	for i, rec := range res.Records {
		if rec.Err || rec.TTFT <= 0 || rec.E2E < rec.TTFT || rec.OutputTokens != 4 || rec.Replica < 0 ||
			rec.PromptTokens != reqs[i].InputTokens {
			t.Fatalf("record %d: %+v (request %d tokens)", i, rec, reqs[i].InputTokens)
		}
		// Start is model time; E2E adds the wall time spent outside the
		// engine (unscaled, #30), which a busy host stretches past the model
		// time the previous turn took: the engine's own part is what the
		// timeline ran through before the next turn could start.
		if p := reqs[i].Prev; p >= 0 && (res.Records[p].EngineE2E <= 0 || rec.Start < res.Records[p].Start+res.Records[p].EngineE2E/2) {
			t.Fatalf("turn %d started at %v before its previous turn (start %v, engine e2e %v) finished",
				i, rec.Start, res.Records[p].Start, res.Records[p].EngineE2E)
		}
	}
}

// The first token is openai.Chunk.HasToken's: a reasoning or tool-call
// delta counts, a role-only chunk does not; an error event fails the stream.
func TestReadStream(t *testing.T) {
	const (
		role      = `data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}` + "\n\n"
		reasoning = `data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}` + "\n\n"
		tool      = `data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}` + "\n\n"
		content   = `data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}` + "\n\n"
		usage     = `data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}}` + "\n\n"
		errEvent  = `data: {"error":{"message":"broken","type":"server_error"}}` + "\n\n"
		done      = "data: [DONE]\n\n"
	)
	tests := []struct {
		name    string
		body    string
		tokens  int
		done    bool
		errKind string
	}{
		{"reasoning, tool call and content", role + reasoning + tool + content + usage + done, 3, true, ""},
		{"role only", role + usage + done, 0, true, ""},
		{"no [DONE]", role + content, 1, false, ""},
		{"error event", content + errEvent + done, 1, false, "stream_error"},
		{"malformed chunk", content + "data: {nope\n\n" + done, 1, false, "bad_chunk"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := readStream(strings.NewReader(tc.body), time.Now(), nil)
			if s.tokens != tc.tokens || s.done != tc.done || s.errKind != tc.errKind {
				t.Fatalf("got %d tokens, done %v, error %q; want %d, %v, %q", s.tokens, s.done, s.errKind, tc.tokens, tc.done, tc.errKind)
			}
			if s.tokens > 0 && s.first <= 0 {
				t.Fatal("no first-token time")
			}
		})
	}
	s := readStream(strings.NewReader(role+reasoning+usage+done), time.Now(), nil)
	if s.usage == nil || s.usage.Cached() != 4 || s.usage.CompletionTokens != 3 {
		t.Fatalf("usage %+v", s.usage)
	}
}

// TestSoak: rounds of requests against a stand-in target until the
// duration passes, with the target's process metrics read at the start, at
// every interval and at the end.
func TestSoak(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			_, _ = io.WriteString(w, "go_goroutines 7\ngo_memstats_heap_inuse_bytes 1048576\nprocess_resident_memory_bytes 2097152\n")
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"a"}]}`+"\n\n"+
			`data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}`+"\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()
	reqs := generate(t, "multiturn", map[string]float64{"conversations": 2, "turns": 2, "system_prompt_len": 16,
		"user_len_min": 8, "user_len_max": 8, "output_len": 1, "think_ms": 0})
	rounds := 0
	gen := func(int) ([]workload.Request, error) { rounds++; return reqs, nil }
	samples, recs, err := Soak(context.Background(), Config{Target: srv.URL, Model: "m"}, gen, 300*time.Millisecond, 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if len(samples) < 2 || samples[0].Goroutines != 7 || samples[0].HeapBytes != 1<<20 || samples[0].RSSBytes != 2<<20 {
		t.Fatalf("%d samples, first %+v", len(samples), samples)
	}
	last := samples[len(samples)-1]
	if rounds == 0 || len(recs) == 0 || last.Requests < len(recs) || last.Errors != 0 {
		t.Fatalf("%d rounds, %d records, last sample %+v", rounds, len(recs), last)
	}
	for _, r := range recs {
		if r.Err || r.OutputTokens != 1 {
			t.Fatalf("record %+v", r)
		}
	}
}

// An RL batch starts once the last answer of the batch before has come;
// the records carry the batch, and the run its makespans.
func TestRunBatchesWaitForTheBatchBefore(t *testing.T) {
	reqs := generate(t, "rl", map[string]float64{"batches": 3, "prompts": 2, "samples": 3, "system_prompt_len": 16,
		"prompt_len": 16, "output_len": 4})
	res, err := RunEmbedded(context.Background(), embedded(2), "ttft", reqs)
	if err != nil {
		t.Fatal(err)
	}
	// (A record's E2E mixes model and real time, so that Start + E2E is
	// not on the runner's clock: the starts are compared.)
	starts := map[int32]time.Duration{}
	for _, rec := range res.Records {
		if rec.Err || rec.Batch < 1 {
			t.Fatalf("record %+v", rec)
		}
		starts[rec.Batch] = max(starts[rec.Batch], rec.Start)
	}
	for i, rec := range res.Records {
		if b := rec.Batch; b > 1 && rec.Start < starts[b-1] {
			t.Fatalf("request %d of batch %d sent at %v, before batch %d's last was sent at %v", i, b, rec.Start, b-1, starts[b-1])
		}
	}
	if b := res.Run.Batches; b == nil || b.Count != 3 || b.Makespanms.P50 <= 0 || b.PrefillTokensMean <= 0 {
		t.Fatalf("batches: %+v", b)
	}
}
