package replay

import (
	"errors"
	"math"
	"slices"
	"testing"
)

// latency is a synthetic p90 against speed-up that meets an objective of 1
// exactly up to threshold: a queueing knee (1/(1−ρ)) or a step.
type latency func(x float64) float64

func knee(threshold float64) latency {
	// p90 = base / (1 − ρ) with ρ = x / saturation; p90(threshold) = 1.
	const base = 0.4
	sat := threshold / (1 - base)
	return func(x float64) float64 {
		if x >= sat {
			return 1e6
		}
		return base / (1 - x/sat)
	}
}

func power(threshold float64) latency {
	return func(x float64) float64 { return math.Pow(x/threshold, 1.7) }
}

// step: no gradient to follow (a p90 that jumps from one order statistic to
// the next looks like this up close).
func step(threshold float64) latency {
	return func(x float64) float64 {
		if x <= threshold {
			return 0.5
		}
		return 2
	}
}

func probeOf(f latency, probes *[]float64) func(float64) (Probe, error) {
	return func(x float64) (Probe, error) {
		*probes = append(*probes, x)
		y := f(x)
		return Probe{Pass: y <= 1, Excess: 1 - 1/y}, nil
	}
}

func TestSearch(t *testing.T) {
	shapes := []struct {
		name string
		f    func(float64) latency
	}{{"knee", knee}, {"power", power}, {"step", step}}
	thresholds := []float64{3.7, 0.3, 1, 1000, 0.0123, 1.9999}
	for _, sh := range shapes {
		for _, th := range thresholds {
			var probes []float64
			rg, err := Search(1, Limits{}, probeOf(sh.f(th), &probes))
			if err != nil {
				t.Fatal(err)
			}
			if rg.Probes != len(probes) {
				t.Errorf("%s %v: %d probes counted, %d made", sh.name, th, rg.Probes, len(probes))
			}
			// The threshold is bracketed, to the precision, and the answer
			// never exceeds it.
			if !(rg.Pass <= th && th < rg.Fail && rg.Fail/rg.Pass < CapacityPrecision) {
				t.Errorf("%s %v: range [%v, %v) after %d probes", sh.name, th, rg.Pass, rg.Fail, rg.Probes)
			}
			// ITP never needs more than one probe over geometric bisection of
			// the same bracket (start, bracket steps, then ⌈log2(ln(hi/lo) /
			// ln precision)⌉ + 1).
			bracket := math.Log2(1 / CapacityFloor)
			steps := 2.0
			if th >= 1 {
				up := math.Ceil(math.Log2(th + 1e-9))
				steps, bracket = 1+up, 1
			}
			limit := int(steps + math.Ceil(math.Log2(bracket*math.Ln2/math.Log(CapacityPrecision))) + 1)
			if rg.Probes > limit {
				t.Errorf("%s %v: %d probes, bisection bound %d: %v", sh.name, th, rg.Probes, limit, probes)
			}
			t.Logf("%-5s threshold %-7v %2d probes [%v, %v)", sh.name, th, rg.Probes, rg.Pass, rg.Fail)
			// Deterministic: the same probes again.
			var again []float64
			if _, err := Search(1, Limits{}, probeOf(sh.f(th), &again)); err != nil || !slices.Equal(probes, again) {
				t.Errorf("%s %v: probes %v, then %v", sh.name, th, probes, again)
			}
		}
	}
}

// A smooth latency curve is bracketed in far fewer probes than bisection's.
func TestSearchInterpolates(t *testing.T) {
	var probes []float64
	rg, err := Search(1, Limits{}, probeOf(knee(3.7), &probes))
	if err != nil {
		t.Fatal(err)
	}
	// Bisection: 1, 2, 4, then 8 halvings of a factor-2 bracket in log space
	// to reach 1.005 — 11 probes.
	if rg.Probes > 7 {
		t.Errorf("%d probes: %v", rg.Probes, probes)
	}
}

func TestSearchLimits(t *testing.T) {
	t.Run("fails at the start and at the floor: two probes", func(t *testing.T) {
		var probes []float64
		rg, err := Search(2, Limits{}, probeOf(knee(1e-6), &probes))
		if err != nil {
			t.Fatal(err)
		}
		if rg.Pass != 0 || rg.Fail != 2*CapacityFloor || !slices.Equal(probes, []float64{2, 2 * CapacityFloor}) {
			t.Errorf("range %+v after probes %v", rg, probes)
		}
		if CapacityBelow(2) != rg.Fail {
			t.Errorf("CapacityBelow(2) = %v, the search gave up at %v", CapacityBelow(2), rg.Fail)
		}
	})
	t.Run("passes beyond the doublings", func(t *testing.T) {
		var probes []float64
		rg, err := Search(1, Limits{}, probeOf(knee(1e9), &probes))
		if err != nil {
			t.Fatal(err)
		}
		if rg.Pass != 4096 || rg.Fail != 0 || len(probes) != 13 {
			t.Errorf("range %+v after %d probes", rg, len(probes))
		}
	})
	t.Run("no excess known: bisection", func(t *testing.T) {
		rg, err := Search(1, Limits{Precision: 1.01}, func(x float64) (Probe, error) {
			return Probe{Pass: x <= 1.5, Excess: math.NaN()}, nil
		})
		// [1, 2] halved in log space down to 1.01: ⌈log2(ln 2 / ln 1.01)⌉ = 7.
		if err != nil || !(rg.Pass <= 1.5 && 1.5 < rg.Fail && rg.Fail/rg.Pass < 1.01) || rg.Probes != 2+7 {
			t.Errorf("range %+v, %v", rg, err)
		}
	})
	boom := errors.New("boom")
	if _, err := Search(1, Limits{}, func(float64) (Probe, error) { return Probe{}, boom }); !errors.Is(err, boom) {
		t.Errorf("a probe's error: got %v", err)
	}
	if _, err := Search(0, Limits{}, func(float64) (Probe, error) { return Probe{Pass: true}, nil }); !errors.Is(err, ErrConfig) {
		t.Errorf("start 0: got %v", err)
	}
}
