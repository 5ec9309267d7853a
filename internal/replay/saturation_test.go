package replay

import (
	"context"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/workload"
)

// On a trace whose arrival rate ramps up past what the fleet can serve,
// the saturation gauge crosses 1 before the measured p90 TTFT exceeds the
// objective; at steady rates the fleet serves within the objective (up to
// 40 req/s on two replicas here, about 0.85 of the gauge's capacity) it
// stays below 1 all along the runs' steady halves.
func TestSaturationGaugeLeadsTheRamp(t *testing.T) {
	reqs, err := workload.Generate(workload.Spec{Name: "shared_prefix", Requests: 6000, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	specs, err := Specs([]string{"ttft"})
	if err != nil {
		t.Fatal(err)
	}
	o := SaturationOptions{Objective: time.Second, Window: 5 * time.Second, P90Window: 10 * time.Second,
		From: 5, To: 100, Steady: []float64{10, 25, 40}, Seed: 1}
	res, charts, f, err := SaturationQuestion(context.Background(), Config{Replicas: 2}, reqs, specs[0], o)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("gauge crossed 1 at %v (%.1f req/s), p90 crossed at %v (%.1f req/s): lead %v", f.GaugeCross, f.RateAtGauge,
		f.P90Cross, f.RateAtP90, f.Lead)
	for _, r := range res.Runs[1:] {
		t.Logf("%s: gauge mean %.3f max %.3f, p90 TTFT %.0f ms (second half)", r.Policy, r.Extra["saturation_mean"], r.Extra["saturation_max"],
			r.Extra["p90_ttft_2nd_half_ms"])
	}
	if f.GaugeCross < 0 || f.P90Cross < 0 || f.Lead <= 0 {
		t.Fatalf("no lead: %+v", f)
	}
	for _, r := range res.Runs[1:] {
		if p90 := r.Extra["p90_ttft_2nd_half_ms"]; p90 > float64(o.Objective.Milliseconds()) || r.Extra["saturation_max"] >= 1 {
			t.Errorf("%s: p90 %.0f ms against the %v objective, gauge up to %.2f: want a rate served, with the gauge below 1",
				r.Policy, p90, o.Objective, r.Extra["saturation_max"])
		}
	}
	if len(charts) != 2 {
		t.Fatalf("%d charts", len(charts))
	}
}
