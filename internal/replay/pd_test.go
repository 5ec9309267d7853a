package replay

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/workload"
)

// seedConversations is seed 004's workload: 20 conversations × 5 turns,
// each conversation its own context (no system prompt shared), answers of
// 2 tokens, arrivals and think times sparse enough that requests rarely
// meet on a replica.
func seedConversations(t testing.TB) []workload.Request {
	t.Helper()
	reqs, err := workload.Generate(workload.Spec{Name: "multiturn", Seed: 1, Params: map[string]float64{
		"conversations": 20, "turns": 5, "system_prompts": 20, "output_len": 2, "think_ms": 4000,
	}})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(reqs, 0.5, 1)
	return reqs
}

// seedConfig is seed 004's fleet: its fixed costs (every step 50 ms, a
// 2 ms transfer), one request per step, 2 prefill and 2 decode replicas;
// a decode replica that lacks fewer than 512 prompt tokens (a new turn's
// user message and reply) serves the turn itself.
func seedConfig() Config {
	return Config{
		PrefillReplicas: 2, DecodeReplicas: 2, MaxSeqs: 1, NonCachedTokens: 512,
		Profile: costmodel.MustLookup(costmodel.Seed004), Seed: 1,
	}
}

// runPD runs one policy on a prefill/decode fleet and returns the run with
// its engines, to check their accounts.
func runPD(t *testing.T, cfg Config, reqs []workload.Request, name string) *virtualRun {
	t.Helper()
	cfg, pl, err := prepare(cfg, reqs)
	if err != nil {
		t.Fatal(err)
	}
	vr, err := newVirtualRun(cfg, pl, PolicySpec{Name: name})
	if err != nil {
		t.Fatal(err)
	}
	if err := vr.loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	return vr
}

// Seed 004's sanity check: kv-aware routing keeps a conversation on the
// decode replica that holds it, so that its 4 follow-up turns of 5 skip
// the prefill step and the transfer (80 % of requests), each answered in
// the seed's 100 ms instead of 50 + 2 + 100; round robin sends follow-ups
// to either decode replica and prefills more of them.
func TestPDSeedSanity(t *testing.T) {
	reqs := seedConversations(t)
	ttft := runPD(t, seedConfig(), reqs, "ttft")
	rr := runPD(t, seedConfig(), reqs, "round_robin")
	tr, rrRun := ttft.summary("ttft"), rr.summary("round_robin")
	if tr.Errors != 0 || rrRun.Errors != 0 {
		t.Fatalf("errors: ttft %d, round_robin %d", tr.Errors, rrRun.Errors)
	}
	if ttft.pd.steps != 20 || ttft.pd.skipped["threshold"] != 80 {
		t.Fatalf("ttft: %d prefill steps, %v skipped; want 20 and 80 (every follow-up on its conversation's decode replica)",
			ttft.pd.steps, ttft.pd.skipped)
	}
	if rr.pd.steps <= ttft.pd.steps {
		t.Fatalf("round robin prefilled %d requests, ttft %d: want more", rr.pd.steps, ttft.pd.steps)
	}
	// The seed's costs: a request with a prefill step ends in 152 ms, one
	// without in 100 ms, when it meets no other on its replicas.
	if p50 := tr.E2Ems.P50; math.Abs(p50-100) > 1 {
		t.Errorf("ttft's median end-to-end %.1f ms, want the seed's 100 ms", p50)
	}
	if tr.E2Ems.Mean >= rrRun.E2Ems.Mean {
		t.Errorf("mean end-to-end: ttft %.1f ms, round robin %.1f ms: want ttft below", tr.E2Ems.Mean, rrRun.E2Ems.Mean)
	}
	checkTransfers(t, ttft)
	checkTransfers(t, rr)
}

// checkTransfers checks a run's books: each prefill step pulled once by
// its decode replica, each hold released by the pull, none left.
func checkTransfers(t *testing.T, vr *virtualRun) {
	t.Helper()
	if vr.pd.pulls != vr.pd.steps || vr.pd.expired != 0 || vr.pd.fallback != 0 {
		t.Errorf("%d prefill steps, %d pulls, %d holds expired, %d fallbacks: want as many pulls as steps, nothing else",
			vr.pd.steps, vr.pd.pulls, vr.pd.expired, vr.pd.fallback)
	}
	var released int64
	for e := range vr.replicas {
		st := vr.replicas[e].engine.Stats()
		if st.Held != 0 || st.Running != 0 || st.Waiting != 0 {
			t.Errorf("engine %d ends with %d held, %d running, %d waiting", e, st.Held, st.Running, st.Waiting)
		}
		released += st.HoldsReleased
	}
	if released != int64(vr.pd.steps) {
		t.Errorf("%d holds released, %d prefill steps", released, vr.pd.steps)
	}
}

// Under load (the default multiturn workload, 4 prefill and 4 decode
// replicas, every policy with a P/D rule of its own and one without), the
// books balance, every request is answered by a decode replica, and its
// TTFT covers its prefill step and transfer.
func TestPDUnderLoad(t *testing.T) {
	reqs, err := workload.Generate(workload.Spec{Name: "multiturn", Seed: 2, Params: map[string]float64{"conversations": 24, "turns": 4}})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(reqs, 40, 2)
	cfg := Config{PrefillReplicas: 4, DecodeReplicas: 4, Seed: 2}
	prof := costmodel.MustLookup(costmodel.Default)
	for _, name := range []string{"ttft", "llmd", "dynamo", "sglang", "round_robin", "least_load"} {
		t.Run(name, func(t *testing.T) {
			vr := runPD(t, cfg, reqs, name)
			run := vr.summary(name)
			if run.Errors != 0 || run.Requests != len(reqs) {
				t.Fatalf("%d requests, %d errors", run.Requests, run.Errors)
			}
			checkTransfers(t, vr)
			if vr.pd.steps == 0 {
				t.Fatal("no prefill step")
			}
			for i, rec := range vr.reportRecords() {
				if rec.Replica >= cfg.DecodeReplicas {
					t.Fatalf("request %d answered by engine %d, a prefill replica", i, rec.Replica)
				}
				// At least one step on the decode replica after its prompt is there.
				if min := time.Duration(prof.C0 * float64(time.Millisecond)); rec.TTFT < min {
					t.Fatalf("request %d: TTFT %v below one step (%v)", i, rec.TTFT, min)
				}
			}
			if len(run.ReplicaShare) != cfg.DecodeReplicas {
				t.Fatalf("replica shares %v: want one per decode replica", run.ReplicaShare)
			}
		})
	}
}

// A conversation's follow-up turn on the decode replica that pulled its
// earlier turn pulls only what that replica's cache lacks.
func TestPDFollowUpPullsOnlyTheNewPart(t *testing.T) {
	reqs := seedConversations(t)
	cfg := seedConfig()
	cfg.NonCachedTokens = -1 // never skip: every turn is prefilled and pulled
	vr := runPD(t, cfg, reqs, "ttft")
	if vr.pd.steps != len(reqs) || vr.pd.pulls != len(reqs) {
		t.Fatalf("%d steps, %d pulls of %d requests", vr.pd.steps, vr.pd.pulls, len(reqs))
	}
	var prompt int64
	for _, r := range vr.reportRecords() {
		prompt += int64(r.PromptTokens)
	}
	// Each turn's new part is a reply and a user message (≤ 2 + 200 tokens
	// and the chat template's); first turns pull their whole prompt.
	if vr.pd.pulled*2 > prompt {
		t.Errorf("pulled %d of %d prompt tokens: follow-ups pulled their whole prompt", vr.pd.pulled, prompt)
	}
}

func TestPDConfigInvalid(t *testing.T) {
	good := []workload.Request{{Prev: -1, Prompt: "hello", MaxTokens: 1}}
	for _, cfg := range []Config{
		{PrefillReplicas: 2},
		{DecodeReplicas: 2},
		{PrefillReplicas: -1, DecodeReplicas: 2},
	} {
		if _, err := Run(context.Background(), cfg, good, PolicySpec{Name: "ttft"}); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: got %v, want ErrConfig", cfg, err)
		}
	}
	// Aggregated replicas beside a prefill/decode fleet are fine.
	run, err := Run(context.Background(), Config{Replicas: 1, PrefillReplicas: 1, DecodeReplicas: 1}, good, PolicySpec{Name: "ttft"})
	if err != nil || run.Errors != 0 {
		t.Fatalf("mixed fleet: %v, %d errors", err, run.Errors)
	}
}

func TestSLOITL(t *testing.T) {
	slo := SLO{TTFTP90: time.Second, ITLP99: 50 * time.Millisecond}
	ok := report.Run{Requests: 10, TTFTms: report.Dist{P90: 900}, ITLms: report.Dist{P99: 50}}
	if !slo.Meets(ok) {
		t.Fatal("a run within both objectives fails")
	}
	slow := ok
	slow.ITLms.P99 = 60
	if slo.Meets(slow) {
		t.Fatal("a run over the ITL objective passes")
	}
	if p := slo.probe(slow); !(p.Excess > 0) || p.Pass {
		t.Fatalf("probe %+v: want the ITL's excess, failing", p)
	}
}

// Each request's longest inter-token gap is at least its mean gap, so the
// distribution of the one dominates the other's; and on a prefill/decode
// fleet, where no prompt is computed beside the decodes but a last token,
// the longest gaps are shorter than on aggregated replicas of the same
// count under the same load.
func TestLongestGap(t *testing.T) {
	reqs, err := workload.Generate(workload.Spec{Name: "multiturn", Seed: 3, Params: map[string]float64{
		"conversations": 32, "turns": 4, "system_prompt_len": 4096}})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(reqs, 40, 3)
	stall := func(cfg Config) report.Run {
		run, err := Run(context.Background(), cfg, reqs, PolicySpec{Name: "ttft"})
		if err != nil || run.Errors != 0 || run.ITLMaxms == nil {
			t.Fatalf("%+v: %v, %d errors, longest gaps %v", cfg, err, run.Errors, run.ITLMaxms)
		}
		if run.ITLMaxms.P50 < run.ITLms.P50 || run.ITLMaxms.P99 < run.ITLms.P99 {
			t.Fatalf("longest gaps p50 %.1f p99 %.1f ms below the mean gaps' p50 %.1f p99 %.1f",
				run.ITLMaxms.P50, run.ITLMaxms.P99, run.ITLms.P50, run.ITLms.P99)
		}
		return run
	}
	agg := stall(Config{Replicas: 4, Seed: 3})
	pd := stall(Config{PrefillReplicas: 2, DecodeReplicas: 2, Seed: 3})
	if pd.ITLMaxms.P99 >= agg.ITLMaxms.P99 {
		t.Errorf("longest gap p99: P/D %.1f ms, aggregated %.1f ms: want P/D below", pd.ITLMaxms.P99, agg.ITLMaxms.P99)
	}
}
