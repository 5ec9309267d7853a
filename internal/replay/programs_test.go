package replay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/workload"
)

// RL batches wait for the batch before them; programs and batches are
// measured by their makespans.
func TestBatchesAndProgramMakespans(t *testing.T) {
	reqs, err := workload.Generate(workload.Spec{Name: "rl", Seed: 1, Params: map[string]float64{
		"batches": 3, "prompts": 4, "samples": 4, "prompt_len": 200, "output_len": 50}})
	if err != nil {
		t.Fatal(err)
	}
	run, err := Run(context.Background(), Config{Replicas: 2}, reqs, PolicySpec{Name: "ttft"})
	if err != nil {
		t.Fatal(err)
	}
	if b := run.Batches; b == nil || b.Count != 3 || b.Failed != 0 || b.Makespanms.P50 <= 0 || b.PrefillTokensMean <= 0 {
		t.Fatalf("batches %+v", run.Batches)
	}
	cfg, pl, err := prepare(Config{Replicas: 2}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	vr, err := newVirtualRun(cfg, pl, PolicySpec{Name: "ttft"})
	if err != nil || vr.loop(context.Background()) != nil {
		t.Fatal(err)
	}
	recs := vr.reportRecords()
	ends := map[int32]time.Duration{}
	for _, rec := range recs {
		ends[rec.Batch] = max(ends[rec.Batch], rec.Start+rec.E2E)
	}
	for i, rec := range recs {
		if b := rec.Batch; b > 1 && rec.Start < ends[b-1] {
			t.Fatalf("request %d of batch %d arrived at %v, before batch %d ended at %v", i, b, rec.Start, b-1, ends[b-1])
		}
	}
	agents, err := workload.Generate(workload.Spec{Name: "agents", Seed: 1, Params: map[string]float64{
		"programs": 5, "turns": 4, "system_prompt_len": 200, "tool_len": 50, "output_len": 20, "subagents": 1}})
	if err != nil {
		t.Fatal(err)
	}
	run, err = Run(context.Background(), Config{Replicas: 2}, agents, PolicySpec{Name: "ttft"})
	if err != nil {
		t.Fatal(err)
	}
	if p := run.Programs; p == nil || p.Count != 5 || p.Makespanms.P50 <= 0 {
		t.Fatalf("programs %+v", run.Programs)
	}
}

func TestBatchPlanChecked(t *testing.T) {
	reqs := []workload.Request{{Prev: -1, Batch: 1}, {Prev: -1, Batch: 3}}
	if _, err := newPlan(reqs); !errors.Is(err, ErrInput) {
		t.Fatalf("batch 3 waits for an empty batch 2: %v", err)
	}
	reqs = []workload.Request{{Prev: -1, Batch: -1}}
	if _, err := newPlan(reqs); !errors.Is(err, ErrInput) {
		t.Fatalf("a negative batch: %v", err)
	}
	reqs = []workload.Request{{Prev: -1, Batch: 1, At: time.Second}, {Prev: -1, Batch: 2}}
	pl, err := newPlan(reqs)
	if err != nil || len(pl.roots) != 1 || len(pl.batchNext[1]) != 1 {
		t.Fatalf("plan %+v %v", pl, err)
	}
}

// An RL batch arrives at once: ttft keeps each prompt's samples together
// (a burst) and gives every replica as many prompts, counting a burst's
// followers among the decodes to come (policy.ReplicaView.BurstPending);
// counting only decodes already running, it spread the prompts by their
// prefill tokens and gave some replicas more samples to decode than
// others (without it: 20, 12, 20 and 12 in the second batch).
func TestRLBatchSpreadsPromptsEvenly(t *testing.T) {
	reqs, err := workload.Generate(workload.Spec{Name: "rl", Seed: 1, Params: map[string]float64{
		"batches": 3, "prompts": 16, "samples": 4, "prompt_len": 1500}})
	if err != nil {
		t.Fatal(err)
	}
	cfg, pl, err := prepare(Config{Replicas: 4}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	vr, err := newVirtualRun(cfg, pl, PolicySpec{Name: "ttft"})
	if err != nil || vr.loop(context.Background()) != nil {
		t.Fatal(err)
	}
	per := map[[2]int32]int{} // (batch, replica) → samples
	for _, rec := range vr.reportRecords() {
		per[[2]int32{rec.Batch, int32(rec.Replica)}]++
	}
	for b := int32(1); b <= 3; b++ {
		for r := int32(0); r < 4; r++ {
			if n := per[[2]int32{b, r}]; n != 16 {
				t.Errorf("batch %d: replica %d decoded %d samples, want 16 (4 prompts × 4)", b, r, n)
			}
		}
	}
}
