package replay

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/workload"
)

// Search bounds of the capacity search.
const (
	// capacityDoublings bounds the bracket search upward: the speed-up
	// doubles at most this many times from the start, i.e. a factor 2^12.
	capacityDoublings = 12
	// CapacityFloor is the lowest speed-up searched, as a fraction of the
	// start: a policy that needs its arrivals slowed a hundredfold (a fleet a
	// hundred times larger) does not serve the trace, and "capacity below
	// 0.01×" says all there is to say. A policy failing at the start is
	// probed here next, so that it costs two replays, not a dozen halvings.
	CapacityFloor = 0.01
	// CapacityPrecision is where the search stops: once the largest speed-up
	// found to pass and the smallest found to fail are within this ratio.
	// 0.5 %: the answer is at most one unit of the table's last digit (2
	// decimals) under the threshold for capacities up to 2×, a few units
	// at 4×; finer than that, a p90 wobbles from one speed-up to the next
	// as requests trade places around it, and each step costs a replay.
	CapacityPrecision = 1.005
	// MaxErrorRate is the share of failed requests above which a run fails
	// the SLO whatever its latency.
	MaxErrorRate = 0.01
)

// SLO is the service-level objective of the capacity search.
type SLO struct {
	TTFTP90 time.Duration // p90 time to first token
	// ITLP99, when set, is an objective on the p99 of the requests' mean
	// inter-token latency too (report.Run.ITLms): the steady decoding that
	// prefill/decode disaggregation is deployed for. Both must hold.
	ITLP99 time.Duration
	// MaxErrorRate is the largest share of failed requests (default 1 %).
	MaxErrorRate float64
}

// Meets reports whether a run meets the SLO.
func (o SLO) Meets(r report.Run) bool {
	maxErr := o.MaxErrorRate
	if maxErr == 0 {
		maxErr = MaxErrorRate
	}
	if r.Requests == 0 || float64(r.Errors) > maxErr*float64(r.Requests) {
		return false
	}
	if o.ITLP99 > 0 && r.ITLms.P99 > ms(o.ITLP99) {
		return false
	}
	return r.TTFTms.P90 <= ms(o.TTFTP90)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Probe is one probe's outcome, for Search.
type Probe struct {
	Pass bool
	// Excess is how far the probe's latency is over the objective,
	// 1 − SLO / p90 TTFT: ≤ 0 when it meets it, approaching 1 as the
	// latency grows without bound (an overloaded fleet's queue). A queueing
	// delay growing as 1/(1 − load) makes it linear in the speed-up, which is
	// what lets interpolation find the knee. It only guides where the next
	// probe goes (Pass decides); NaN when unknown, and that step then bisects.
	Excess float64
}

// probe is the SLO's verdict on a run. With two objectives, the excess is
// the larger: the one that binds.
func (o SLO) probe(r report.Run) Probe {
	ex := excess(ms(o.TTFTP90), r.TTFTms.P90)
	if o.ITLP99 > 0 {
		if e := excess(ms(o.ITLP99), r.ITLms.P99); math.IsNaN(ex) || e > ex {
			ex = e
		}
	}
	return Probe{Pass: o.Meets(r), Excess: ex}
}

// excess is 1 − slo/got, NaN when unknown.
func excess(slo, got float64) float64 {
	if got > 0 && slo > 0 {
		return 1 - slo/got
	}
	return math.NaN()
}

// Limits bound a Search; the zero value means the capacity search's own.
type Limits struct {
	Doublings int     // upward bracket steps from the start (capacityDoublings)
	Floor     float64 // lowest x probed, as a fraction of the start (CapacityFloor)
	Precision float64 // stop when the bracket's hi/lo is below this (CapacityPrecision)
}

func (l Limits) withDefaults() Limits {
	if l.Doublings <= 0 {
		l.Doublings = capacityDoublings
	}
	if !(l.Floor > 0 && l.Floor < 1) {
		l.Floor = CapacityFloor
	}
	if !(l.Precision > 1) {
		l.Precision = CapacityPrecision
	}
	return l
}

// Range is what a Search found: the threshold lies in [Pass, Fail).
type Range struct {
	Pass   float64 // the largest x found to pass; 0 when none did
	Fail   float64 // the smallest x found to fail; 0 when none did (Pass is then the largest probed)
	Probes int
}

// Ceiling reports whether the search reached its upper limit still passing
// (start × 2^Doublings): the threshold is at least Pass, how far above
// unknown. For a capacity it means the trace never loads the fleet to its
// limit, even with its arrivals compressed 4096-fold: too few requests
// (a short recording that the fleet swallows at once), or too light ones.
func (r Range) Ceiling() bool { return r.Pass > 0 && r.Fail == 0 }

// Search finds the largest x at which the probe passes, assuming it is
// monotone (passes below a threshold, fails above):
//
//  1. Probe start. If it passes, double while it passes (at most
//     Doublings times) to bracket the threshold. If it fails, probe the
//     floor (start × Floor) at once: failing there too, the answer is
//     "below the floor" after two probes.
//  2. Narrow the bracket [lo, hi] until hi/lo < Precision with the ITP
//     method (interpolate, truncate, project; Oliveira & Takahashi, ACM
//     TOMS 2021) on u = ln x: regula falsi on the probes' Excess, which is
//     close to linear in x below and across a queueing knee, so a step
//     often lands next to the threshold; kept within a shrinking distance
//     of the geometric bisection's midpoint, so that it never takes more
//     than one probe beyond what bisection would.
//
// Probes run one after another, on a deterministic sequence of x; an error
// stops the search.
func Search(start float64, lim Limits, probe func(x float64) (Probe, error)) (Range, error) {
	if !(start > 0) || math.IsInf(start, 0) {
		return Range{}, fmt.Errorf("%w: search start %v", ErrConfig, start)
	}
	lim = lim.withDefaults()
	var rg Range
	at := func(x float64) (Probe, error) {
		rg.Probes++
		return probe(x)
	}
	p, err := at(start)
	if err != nil {
		return Range{}, err
	}
	lo, hi := start, start
	ylo, yhi := p.Excess, p.Excess
	if p.Pass {
		for k := 0; ; k++ {
			if k == lim.Doublings {
				rg.Pass = lo // passes everywhere probed
				return rg, nil
			}
			p, err := at(2 * lo)
			if err != nil {
				return Range{}, err
			}
			if !p.Pass {
				hi, yhi = 2*lo, p.Excess
				break
			}
			lo, ylo = 2*lo, p.Excess
		}
	} else {
		floor := start * lim.Floor
		p, err := at(floor)
		if err != nil {
			return Range{}, err
		}
		if !p.Pass {
			rg.Fail = floor
			return rg, nil
		}
		lo, ylo = floor, p.Excess
	}
	lo, hi, err = itp(lo, hi, ylo, yhi, lim.Precision, at)
	if err != nil {
		return Range{}, err
	}
	rg.Pass, rg.Fail = lo, hi
	return rg, nil
}

// ITP's parameters (the paper's recommended ones): the truncation
// δ = k1·(b−a)^k2 with k1 = itpK1 / the initial width, and n0 slack probes
// over bisection.
const (
	itpK1 = 0.2
	itpK2 = 2
	itpN0 = 1
)

// itp narrows a bracket (lo passes with excess ylo, hi fails with yhi) in
// log space until hi/lo < precision, and returns it.
func itp(lo, hi, ylo, yhi, precision float64, probe func(x float64) (Probe, error)) (float64, float64, error) {
	a, b := math.Log(lo), math.Log(hi)
	eps := math.Log(precision) / 2 // the search ends when b − a ≤ 2ε
	if b-a <= 2*eps {
		return lo, hi, nil
	}
	// The projection aims a hair inside the stop so that rounding cannot
	// leave the bracket a last ulp too wide after nMax probes.
	aim := eps * (1 - 1e-9)
	nMax := int(math.Ceil(math.Log2((b-a)/(2*aim)))) + itpN0
	k1 := itpK1 / (b - a)
	for j := 0; b-a > 2*eps; j++ {
		mid := (a + b) / 2
		u := mid
		// Interpolate only between a passing end at or under the objective and
		// a failing end over it; otherwise (a failure on errors, a p90 of 0)
		// bisect.
		if finite(ylo) && finite(yhi) && ylo <= 0 && yhi > 0 {
			// regula falsi in x (where Excess is near linear), stepped in u
			uf := math.Log((yhi*lo - ylo*hi) / (yhi - ylo))
			sigma := 1.0
			if mid < uf {
				sigma = -1
			}
			ut := mid // truncation: step δ from the interpolant towards the midpoint
			if delta := k1 * math.Pow(b-a, itpK2); delta <= math.Abs(mid-uf) {
				ut = uf + sigma*delta
			}
			// projection: within r of the midpoint, r shrinking so that the
			// bracket is no wider after j probes than bisection's after j − n0.
			r := aim*math.Exp2(float64(nMax-j)) - (b-a)/2
			u = ut
			if math.Abs(ut-mid) > r {
				u = mid - sigma*r
			}
		}
		p, err := probe(math.Exp(u))
		if err != nil {
			return 0, 0, err
		}
		if p.Pass {
			a, ylo, lo = u, p.Excess, math.Exp(u)
		} else {
			b, yhi, hi = u, p.Excess, math.Exp(u)
		}
	}
	return lo, hi, nil
}

func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }

// CapacityBelow is where a capacity search starting at start gives up: a
// capacity of 0 means the policy failed there too (capacity < this).
func CapacityBelow(start float64) float64 { return start * CapacityFloor }

// Capacity is the largest speed-up (arrival times divided by it) at which
// spec meets slo on reqs, found by Search from cfg.Speedup; 0 when it fails
// even at CapacityBelow(cfg.Speedup). Each probe is a whole replay on a
// fresh fleet. (Compare says, beside, whether the search reached its
// ceiling: Run.CapacityCeiling.)
func Capacity(ctx context.Context, cfg Config, reqs []workload.Request, spec PolicySpec, slo SLO) (float64, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return 0, err
	}
	pl, err := newPlan(reqs)
	if err != nil {
		return 0, err
	}
	rg, err := capacityPlan(ctx, cfg, pl, spec, slo)
	return rg.Pass, err
}

func capacityPlan(ctx context.Context, cfg Config, pl *plan, spec PolicySpec, slo SLO) (Range, error) {
	if slo.TTFTP90 <= 0 {
		return Range{}, fmt.Errorf("%w: SLO p90 TTFT %v ≤ 0", ErrConfig, slo.TTFTP90)
	}
	rg, err := Search(cfg.Speedup, Limits{}, func(x float64) (Probe, error) {
		c := cfg
		c.Speedup = x
		run, err := runPlan(ctx, c, pl, spec)
		if err != nil {
			return Probe{}, err
		}
		return slo.probe(run), nil
	})
	return rg, err
}
