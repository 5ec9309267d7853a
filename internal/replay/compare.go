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
	// search) with its summary, in the order of the specs, on Compare's
	// goroutine.
	Progress func(spec PolicySpec, run report.Run)
	// Parallel is how many of Compare's jobs run at once: the hit-rate
	// bounds, the oracle's run (and capacity search), and each policy's run
	// (and capacity search), each on a fleet of its own. 0: GOMAXPROCS; 1:
	// one after another. The result is the same whatever it is; memory
	// grows with it (a fleet, and a run's per-request state, per job).
	Parallel int
}

// Compare replays reqs once per policy, each on a fresh fleet and router
// with the same request sequence, and returns the bounds and the runs in
// the order of specs. Each run's Extra carries hit_rate_vs_bound, its hit
// rate as a share of prefix_reuse. The runs, the bounds and the oracle's run
// are independent and go opt.Parallel at a time.
func Compare(ctx context.Context, cfg Config, reqs []workload.Request, specs []PolicySpec, opt Options) (report.Result, error) {
	cfg, pl, err := prepare(cfg, reqs)
	if err != nil {
		return report.Result{}, err
	}
	c := comparison{opt: opt, specs: specs}
	jobs := []func(context.Context) error{func(ctx context.Context) (err error) {
		c.bound, err = boundsPlan(ctx, cfg, pl)
		return err
	}}
	if opt.Oracle {
		jobs = append(jobs, func(ctx context.Context) error { return oracleBound(ctx, cfg, pl, opt.Capacity, &c.oracle) })
	}
	c.first = len(jobs)
	if len(specs) > 0 {
		c.runs = make([]report.Run, len(specs))
	}
	for i, spec := range specs {
		jobs = append(jobs, func(ctx context.Context) (err error) {
			c.runs[i], err = comparedRun(ctx, cfg, pl, spec, opt.Capacity)
			return err
		})
	}
	c.done = make([]bool, len(jobs))
	if err := parallel(ctx, opt.Parallel, jobs, c.finished); err != nil {
		return report.Result{}, err
	}
	return report.Result{Bound: &c.bound, Runs: c.runs}, nil
}

// comparedRun is spec's run, and with slo its capacity search.
func comparedRun(ctx context.Context, cfg Config, pl *plan, spec PolicySpec, slo *SLO) (report.Run, error) {
	run, err := runPlan(ctx, cfg, pl, spec)
	if err != nil || slo == nil {
		return run, err
	}
	rg, err := capacityPlan(ctx, cfg, pl, spec, *slo)
	c := rg.Pass
	run.CapacitySpeedup, run.CapacityCeiling = &c, rg.Ceiling()
	return run, err
}

// comparison is Compare's state: its jobs' results (job 0 the bounds, then
// the oracle's when asked, then the runs from first on) and how far they
// have been reported.
type comparison struct {
	opt           Options
	specs         []PolicySpec
	bound, oracle report.Bound
	runs          []report.Run
	first         int    // the job of runs[0]
	done          []bool // by job
	reported      int    // runs finished and reported
}

// finished notes job i's end and finishes the runs it completes: once the
// bounds (and the oracle's) are in, each run in order, as soon as it ends,
// gets its shares of the bounds and is reported.
func (c *comparison) finished(i int) {
	c.done[i] = true
	if !c.done[0] || (c.opt.Oracle && !c.done[1]) {
		return
	}
	b := &c.bound
	o := &c.oracle
	b.OracleTTFTms, b.OracleHitRate = o.OracleTTFTms, o.OracleHitRate
	b.OracleCapacity, b.OracleCapacityCeiling = o.OracleCapacity, o.OracleCapacityCeiling
	for ; c.reported < len(c.runs) && c.done[c.first+c.reported]; c.reported++ {
		run := &c.runs[c.reported]
		setVsBound(run, *b)
		if b.MergedLRU > 0 {
			run.Extra["hit_rate_vs_merged_lru"] = run.HitRate / b.MergedLRU
		}
		if o := b.OracleCapacity; run.CapacitySpeedup != nil && o != nil && *o > 0 {
			run.Extra["capacity_vs_bound"] = *run.CapacitySpeedup / *o
		}
		if c.opt.Progress != nil {
			c.opt.Progress(c.specs[c.reported], *run)
		}
	}
}
