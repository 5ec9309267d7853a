package replay

import (
	"context"

	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/workload"
)

// Options are the extras of Compare.
type Options struct {
	// Capacity, when set, searches each policy's capacity speed-up for it
	// (Run.CapacitySpeedup).
	Capacity *SLO
	// Oracle, when set, computes the oracle bound (oracle.go) into the
	// result's bound: its TTFT and hit rate, and with Capacity its
	// capacity, and each run's capacity_vs_bound.
	Oracle bool
	// Progress, when set, is called after each policy's run (and capacity
	// search) with its summary.
	Progress func(spec PolicySpec, run report.Run)
}

// Compare replays reqs once per policy, one after another, each on a fresh
// fleet and router with the same request sequence, and returns the bounds
// and the runs in the order of specs. Each run's Extra carries
// hit_rate_vs_bound, its hit rate as a share of prefix_reuse.
func Compare(ctx context.Context, cfg Config, reqs []workload.Request, specs []PolicySpec, opt Options) (report.Result, error) {
	cfg, pl, bound, err := prepareBounded(ctx, cfg, reqs)
	if err != nil {
		return report.Result{}, err
	}
	if opt.Oracle {
		if err := oracleBound(ctx, cfg, pl, opt.Capacity, &bound); err != nil {
			return report.Result{}, err
		}
	}
	res := report.Result{Bound: &bound}
	for _, spec := range specs {
		if err := ctx.Err(); err != nil {
			return report.Result{}, err
		}
		run, err := runPlan(ctx, cfg, pl, spec)
		if err != nil {
			return report.Result{}, err
		}
		setVsBound(&run, bound)
		if bound.MergedLRU > 0 {
			run.Extra["hit_rate_vs_merged_lru"] = run.HitRate / bound.MergedLRU
		}
		if opt.Capacity != nil {
			rg, err := capacityPlan(ctx, cfg, pl, spec, *opt.Capacity)
			if err != nil {
				return report.Result{}, err
			}
			c := rg.Pass
			run.CapacitySpeedup, run.CapacityCeiling = &c, rg.Ceiling()
			if o := bound.OracleCapacity; o != nil && *o > 0 {
				run.Extra["capacity_vs_bound"] = c / *o
			}
		}
		if opt.Progress != nil {
			opt.Progress(spec, run)
		}
		res.Runs = append(res.Runs, run)
	}
	return res, nil
}
