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
	// capacityDoublings bounds the bracket search: the speed-up doubles (or
	// halves) at most this many times from the start, i.e. a factor 2^12.
	capacityDoublings = 12
	// capacityIterations is the number of bisection steps inside the
	// bracket: the answer is within a factor 2^(1/2^8) ≈ 1.003 of the edge.
	capacityIterations = 8
	// MaxErrorRate is the share of failed requests above which a run fails
	// the SLO whatever its latency.
	MaxErrorRate = 0.01
)

// SLO is the service-level objective of the capacity search.
type SLO struct {
	TTFTP90 time.Duration // p90 time to first token
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
	return r.TTFTms.P90 <= float64(o.TTFTP90)/float64(time.Millisecond)
}

// Bisect finds the largest x at which pass holds, assuming pass is monotone
// (true below a threshold, false above). From start it doubles while pass
// holds (or halves while it fails) to bracket the threshold, at most
// doublings times, then bisects the bracket geometrically iterations times
// (the midpoint of [lo, hi] is √(lo·hi), since speed-ups are ratios). It
// returns the largest x found to pass: 0 if none did, the largest probed if
// all did. Probes run one after another; an error stops the search.
func Bisect(start float64, doublings, iterations int, pass func(x float64) (bool, error)) (float64, error) {
	if !(start > 0) || math.IsInf(start, 0) {
		return 0, fmt.Errorf("%w: bisection start %v", ErrConfig, start)
	}
	ok, err := pass(start)
	if err != nil {
		return 0, err
	}
	var lo, hi float64
	if ok {
		lo = start
		for k := 0; ; k++ {
			if k == doublings {
				return lo, nil // passes everywhere probed
			}
			ok, err := pass(2 * lo)
			if err != nil {
				return 0, err
			}
			if !ok {
				hi = 2 * lo
				break
			}
			lo *= 2
		}
	} else {
		hi = start
		for k := 0; ; k++ {
			if k == doublings {
				return 0, nil // fails everywhere probed
			}
			ok, err := pass(hi / 2)
			if err != nil {
				return 0, err
			}
			if ok {
				lo = hi / 2
				break
			}
			hi /= 2
		}
	}
	for range iterations {
		mid := math.Sqrt(lo * hi)
		ok, err := pass(mid)
		if err != nil {
			return 0, err
		}
		if ok {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo, nil
}

// Capacity is the largest speed-up (arrival times divided by it) at which
// spec meets slo on reqs, found by Bisect from cfg.Speedup. Each probe is a
// whole replay on a fresh fleet.
func Capacity(ctx context.Context, cfg Config, reqs []workload.Request, spec PolicySpec, slo SLO) (float64, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return 0, err
	}
	pl, err := newPlan(reqs)
	if err != nil {
		return 0, err
	}
	return capacityPlan(ctx, cfg, pl, spec, slo)
}

func capacityPlan(ctx context.Context, cfg Config, pl *plan, spec PolicySpec, slo SLO) (float64, error) {
	if slo.TTFTP90 <= 0 {
		return 0, fmt.Errorf("%w: SLO p90 TTFT %v ≤ 0", ErrConfig, slo.TTFTP90)
	}
	return Bisect(cfg.Speedup, capacityDoublings, capacityIterations, func(x float64) (bool, error) {
		c := cfg
		c.Speedup = x
		run, err := runPlan(ctx, c, pl, spec)
		if err != nil {
			return false, err
		}
		return slo.Meets(run), nil
	})
}
