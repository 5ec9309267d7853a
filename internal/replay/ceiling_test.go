package replay

import (
	"context"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/workload"
)

// A trace the fleet swallows at once (a few requests) meets the SLO at
// every speed-up: the capacity search stops at its upper limit, start ×
// 2^12, and says so (Run.CapacityCeiling, and the oracle's); a trace that
// loads the fleet finds its capacity below and does not.
func TestCapacityCeilingSaid(t *testing.T) {
	few, err := workload.Generate(workload.Spec{Name: "shared_prefix", Seed: 3, Params: map[string]float64{
		"groups": 2, "prompts_per_group": 3, "system_prompt_len": 256, "question_len": 32, "output_len": 8,
	}})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(few, 1, 3)
	slo := SLO{TTFTP90: 2 * time.Second}
	cfg := Config{Replicas: 4, Seed: 3}
	res, err := Compare(context.Background(), cfg, few, []PolicySpec{{Name: "ttft"}, {Name: "round_robin"}},
		Options{Capacity: &slo, Oracle: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res.Runs {
		if r.CapacitySpeedup == nil || *r.CapacitySpeedup != 4096 || !r.CapacityCeiling {
			t.Errorf("%s: capacity %v, ceiling %v; want 4096 at the ceiling", r.Policy, r.CapacitySpeedup, r.CapacityCeiling)
		}
	}
	if b := res.Bound; b.OracleCapacity == nil || !b.OracleCapacityCeiling {
		t.Errorf("oracle: capacity %v, ceiling %v", b.OracleCapacity, b.OracleCapacityCeiling)
	}

	res, err = Compare(context.Background(), Config{Replicas: 2, Seed: 5}, smallShared(t, 5), []PolicySpec{{Name: "ttft"}},
		Options{Capacity: &SLO{TTFTP90: 150 * time.Millisecond}})
	if err != nil {
		t.Fatal(err)
	}
	if r := res.Runs[0]; r.CapacityCeiling || r.CapacitySpeedup == nil || *r.CapacitySpeedup >= 4096 {
		t.Errorf("a loaded fleet: capacity %v, ceiling %v", r.CapacitySpeedup, r.CapacityCeiling)
	}
}

// Range.Ceiling: passing at the last doubling, and only then.
func TestRangeCeiling(t *testing.T) {
	for _, tc := range []struct {
		threshold float64
		want      bool
	}{{1e9, true}, {100, false}, {0.001, false}} {
		rg, err := Search(1, Limits{}, func(x float64) (Probe, error) { return Probe{Pass: x <= tc.threshold, Excess: 0}, nil })
		if err != nil {
			t.Fatal(err)
		}
		if rg.Ceiling() != tc.want {
			t.Errorf("threshold %v: %+v, ceiling %v", tc.threshold, rg, rg.Ceiling())
		}
	}
}
