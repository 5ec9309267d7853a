package replay

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/workload"
)

// The three questions of the seed on cache-aware routing, each answered by
// one function: a Result (every run, labelled with its setting) and the
// charts that answer it.

// CacheAware are the cache-aware policies the questions compare by default.
func CacheAware() []string {
	return []string{"ttft", "sglang", "dynamo", "llmd", "precise", "preble"}
}

// SharingPolicies are the default policies of the sharing question: the
// cache-aware ones against two load balancers that ignore the cache.
func SharingPolicies() []string {
	return append([]string{"round_robin", "least_load"}, CacheAware()...)
}

// DefaultSharingRatios are the sharing ratios the sharing question sweeps.
func DefaultSharingRatios() []float64 { return []float64{0.05, 0.25, 0.5, 0.75, 0.95} }

// DefaultStaleness are the staleness values the staleness question sweeps.
func DefaultStaleness() []time.Duration {
	return []time.Duration{0, 50 * time.Millisecond, 250 * time.Millisecond, time.Second, 5 * time.Second}
}

// DefaultScoreWeights are the values of both weights of the score surface.
func DefaultScoreWeights() []float64 { return []float64{0, 0.5, 1, 2, 4} }

// sharingParams names, per workload, the parameters whose lengths make the
// shared and the unshared part of a prompt.
func sharingParams(workload string) ([2]string, bool) {
	switch workload {
	case "shared_prefix":
		return [2]string{"system_prompt_len", "question_len"}, true
	case "prefix_repetition", "zipf":
		return [2]string{"prefix_len", "suffix_len"}, true
	}
	return [2]string{}, false
}

// SharingWorkloads lists the workloads the sharing question can sweep.
func SharingWorkloads() []string { return []string{"prefix_repetition", "shared_prefix", "zipf"} }

// SharingSpec is base with its shared part set to ratio of the prompt: the
// prompt length (shared + unshared, from base or the workload's defaults)
// is kept, and split as round(ratio·L) shared tokens and the rest unshared,
// each at least one token.
func SharingSpec(base workload.Spec, ratio float64) (workload.Spec, error) {
	names, ok := sharingParams(base.Name)
	if !ok {
		return workload.Spec{}, fmt.Errorf("%w: the sharing question needs one of %v, not %q", ErrConfig, SharingWorkloads(), base.Name)
	}
	if !(ratio > 0 && ratio < 1) {
		return workload.Spec{}, fmt.Errorf("%w: sharing ratio %v out of (0, 1)", ErrConfig, ratio)
	}
	ps, err := workload.ParamsOf(base.Name)
	if err != nil {
		return workload.Spec{}, err
	}
	length := 0.0
	for _, n := range names {
		v, ok := base.Params[n]
		if !ok {
			for _, p := range ps {
				if p.Name == n {
					v = p.Default
				}
			}
		}
		length += v
	}
	shared := min(max(math.Round(ratio*length), 1), length-1)
	out := base
	out.Params = make(map[string]float64, len(base.Params)+2)
	for k, v := range base.Params {
		out.Params[k] = v
	}
	out.Params[names[0]], out.Params[names[1]] = shared, length-shared
	return out, nil
}

// Sharing answers "how do TTFT and hit rate depend on how much of a prompt
// is shared?": for each ratio it generates base with that sharing ratio
// (SharingSpec), gives it Poisson arrivals at rate (≤ 0: all at once) and
// replays every policy on it. Runs are labelled "POLICY sharing=R" and carry
// extra.sharing_ratio and extra.bound_prefix_reuse (bounds differ per ratio,
// so the Result has none).
func Sharing(ctx context.Context, cfg Config, base workload.Spec, rate float64, ratios []float64, specs []PolicySpec, progress func(PolicySpec, report.Run)) (report.Result, []report.Chart, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return report.Result{}, nil, err
	}
	var res report.Result
	ttft := map[string]*report.ChartSeries{}
	hit := map[string]*report.ChartSeries{}
	bound := &report.ChartSeries{Name: "bound: prefix reuse", Dashed: true, Points: true}
	for _, ratio := range ratios {
		ws, err := SharingSpec(base, ratio)
		if err != nil {
			return report.Result{}, nil, err
		}
		reqs, err := workload.Generate(ws)
		if err != nil {
			return report.Result{}, nil, err
		}
		workload.Arrivals(reqs, rate, ws.Seed)
		pl, err := newPlan(reqs)
		if err != nil {
			return report.Result{}, nil, err
		}
		b, err := boundsPlan(ctx, cfg, pl)
		if err != nil {
			return report.Result{}, nil, err
		}
		bound.X, bound.Y = append(bound.X, ratio), append(bound.Y, b.PrefixReuse)
		for _, spec := range specs {
			s := spec
			s.Label = fmt.Sprintf("%s sharing=%s", spec.RunName(), fmtF(ratio))
			run, err := runPlan(ctx, cfg, pl, s)
			if err != nil {
				return report.Result{}, nil, err
			}
			run.Extra["sharing_ratio"] = ratio
			run.Extra["bound_prefix_reuse"] = b.PrefixReuse
			if progress != nil {
				progress(s, run)
			}
			res.Runs = append(res.Runs, run)
			addPoint(ttft, spec.RunName(), ratio, run.TTFTms.P90)
			addPoint(hit, spec.RunName(), ratio, run.HitRate)
		}
	}
	charts := []report.Chart{
		{
			Name: "sharing_ttft_p90", Title: "p90 TTFT against the sharing ratio",
			XLabel: "sharing ratio (shared tokens / prompt tokens)", YLabel: "p90 TTFT (ms)",
			Caption: fmt.Sprintf("Workload %s at %s req/s, prompt length fixed, its shared part swept. "+
				"Lower is better; the gap between a policy and round_robin is what cache-aware routing buys.", base.Name, fmtF(rate)),
			Series: seriesOf(ttft, specs, res.Runs),
		},
		{
			Name: "sharing_hit_rate", Title: "Prefix-cache hit rate against the sharing ratio",
			XLabel: "sharing ratio (shared tokens / prompt tokens)", YLabel: "hit rate (cached / prompt tokens)",
			Caption: "The dashed line is the prefix-reuse bound (one unlimited cache): no policy can hit more.",
			YMin:    0, YMax: 1,
			Series: append(seriesOf(hit, specs, res.Runs), *bound),
		},
	}
	return res, logTTFT(charts), nil
}

// ScoreSurface answers "how should the score policy weigh the cache against
// the load?": it replays reqs with score at every (cache_weight,
// load_weight) of weights × weights but (0, 0). Since the score is
// cache_weight·cache + load_weight·load and the maximum wins, only the ratio
// of the weights matters (up to ties): equal ratios draw equal points, and
// the chart is the surface seen along the cache-weight axis, one line per
// load weight. Runs are labelled "score cache=C load=L".
func ScoreSurface(ctx context.Context, cfg Config, reqs []workload.Request, weights []float64, progress func(PolicySpec, report.Run)) (report.Result, []report.Chart, error) {
	for _, w := range weights {
		if !(w >= 0) || math.IsInf(w, 0) {
			return report.Result{}, nil, fmt.Errorf("%w: score weight %v", ErrConfig, w)
		}
	}
	cfg, pl, b, err := prepareBounded(ctx, cfg, reqs)
	if err != nil {
		return report.Result{}, nil, err
	}
	res := report.Result{Bound: &b}
	ttft := map[string]*report.ChartSeries{}
	hit := map[string]*report.ChartSeries{}
	var order []string
	for _, lw := range weights {
		name := "load_weight=" + fmtF(lw)
		for _, cw := range weights {
			if cw == 0 && lw == 0 {
				continue
			}
			spec := PolicySpec{
				Name:   "score",
				Label:  fmt.Sprintf("score cache=%s load=%s", fmtF(cw), fmtF(lw)),
				Params: map[string]any{"cache_weight": cw, "load_weight": lw},
			}
			run, err := runPlan(ctx, cfg, pl, spec)
			if err != nil {
				return report.Result{}, nil, err
			}
			run.Extra["cache_weight"], run.Extra["load_weight"] = cw, lw
			setVsBound(&run, b)
			if progress != nil {
				progress(spec, run)
			}
			res.Runs = append(res.Runs, run)
			if _, ok := ttft[name]; !ok {
				order = append(order, name)
			}
			addPoint(ttft, name, cw, run.TTFTms.P90)
			addPoint(hit, name, cw, run.HitRate)
		}
	}
	named := make([]PolicySpec, len(order))
	for i, n := range order {
		named[i] = PolicySpec{Name: n}
	}
	charts := []report.Chart{
		{
			Name: "score_surface_ttft_p90", Title: "score: p90 TTFT by cache weight and load weight",
			XLabel: "cache_weight", YLabel: "p90 TTFT (ms)",
			Caption: "One line per load weight. Only the ratio cache_weight/load_weight matters: " +
				"a line's point at cache weight c equals the load-weight-1 line at c/load weight. " +
				"load_weight=0 routes on the cache alone; cache_weight=0 on the load alone.",
			Series: seriesOf(ttft, named, res.Runs),
		},
		{
			Name: "score_surface_hit_rate", Title: "score: hit rate by cache weight and load weight",
			XLabel: "cache_weight", YLabel: "hit rate (cached / prompt tokens)",
			Caption: "The dashed grey line is the prefix-reuse bound.",
			YMin:    0, YMax: 1,
			Series: seriesOf(hit, named, res.Runs),
			Refs:   []report.RefLine{{Label: "bound: prefix reuse", Y: b.PrefixReuse}},
		},
	}
	return res, logTTFT(charts), nil
}

// Staleness answers "how much do cache-aware policies suffer when their
// view of the replicas is old?": it replays reqs with every policy at every
// staleness (scrapes, and KV events for precise, reach the router that much
// later). Policies that read only the gateway's own counts and index do not
// change; those that read scraped metrics do. Runs are labelled
// "POLICY staleness=D".
func Staleness(ctx context.Context, cfg Config, reqs []workload.Request, staleness []time.Duration, specs []PolicySpec, progress func(PolicySpec, report.Run)) (report.Result, []report.Chart, error) {
	cats := make([]string, len(staleness))
	xs := make([]float64, len(staleness))
	for i, d := range staleness {
		cats[i], xs[i] = d.String(), float64(d)/float64(time.Millisecond)
	}
	sw := sweepSpec{name: "staleness", extra: "staleness_ms", cats: cats, xs: xs,
		set: func(c *Config, i int) { c.Staleness = staleness[i] }}
	res, b, ttft, hit, err := sw.run(ctx, cfg, reqs, specs, progress)
	if err != nil {
		return report.Result{}, nil, err
	}
	res.Bound = &b
	charts := []report.Chart{
		{
			Name: "staleness_ttft_p90", Title: "p90 TTFT against the staleness of the replicas' metrics",
			XLabel: "staleness", YLabel: "p90 TTFT (ms)", Bars: true, Categories: cats,
			Caption: fmt.Sprintf("Scrapes every %s reach the router this much later (KV events too, for precise). "+
				"A policy whose bars stay level does not depend on scraped state.", scrapeLabel(cfg.ScrapeInterval)),
			Series: seriesOf(ttft, specs, res.Runs),
		},
		{
			Name: "staleness_hit_rate", Title: "Hit rate against the staleness of the replicas' metrics",
			XLabel: "staleness", YLabel: "hit rate (cached / prompt tokens)", Bars: true, Categories: cats,
			YMin: 0, YMax: 1,
			Series: seriesOf(hit, specs, res.Runs),
			Refs:   []report.RefLine{{Label: "bound: prefix reuse", Y: b.PrefixReuse}},
		},
	}
	return res, logTTFT(charts), nil
}

// DefaultPressureBlocks are the KV cache sizes (blocks per replica) the
// cache-pressure question sweeps: from a cache that holds a few prompts to
// one that holds most of a workload's working set.
func DefaultPressureBlocks() []int { return []int{1000, 1500, 2000, 3000, 4000, 6000, 8000} }

// CachePressure answers "how does each policy hold up as the replicas'
// KV caches shrink?": it replays reqs with every policy at every cache size
// (blocks per replica). A smaller cache evicts prefixes sooner, so a policy
// that scatters a conversation or a shared prefix pays for it in prefills.
// Runs are labelled "POLICY kv_blocks=N" and carry extra.kv_blocks and, as
// the bounds differ per size, extra.bound_merged_lru (the Result has none).
func CachePressure(ctx context.Context, cfg Config, reqs []workload.Request, blocks []int, specs []PolicySpec, progress func(PolicySpec, report.Run)) (report.Result, []report.Chart, error) {
	cats := make([]string, len(blocks))
	xs := make([]float64, len(blocks))
	for i, n := range blocks {
		cats[i], xs[i] = strconv.Itoa(n), float64(n)
	}
	sw := sweepSpec{name: "kv_blocks", extra: "kv_blocks", cats: cats, xs: xs, perPointBound: true,
		set: func(c *Config, i int) { c.KVBlocks = blocks[i] }}
	res, _, ttft, hit, err := sw.run(ctx, cfg, reqs, specs, progress)
	if err != nil {
		return report.Result{}, nil, err
	}
	charts := []report.Chart{
		{
			Name: "pressure_ttft_p90", Title: "p90 TTFT against the replicas' KV cache size",
			XLabel: "KV blocks per replica (16 tokens each)", YLabel: "p90 TTFT (ms)",
			Caption: "The same requests on ever smaller caches: a policy that keeps prefixes together holds its TTFT longer.",
			Series:  seriesOf(ttft, specs, res.Runs),
		},
		{
			Name: "pressure_hit_rate", Title: "Hit rate against the replicas' KV cache size",
			XLabel: "KV blocks per replica (16 tokens each)", YLabel: "hit rate (cached / prompt tokens)", YMin: 0, YMax: 1,
			Series: seriesOf(hit, specs, res.Runs),
		},
	}
	if vs := VsBest(res, "ttft"); len(vs) > 0 {
		charts = append(charts, vsBestChart(vs))
	}
	return res, logTTFT(charts), nil
}

// PressurePoint is one cache size of a cache-pressure result: a policy's
// p90 TTFT and the lowest of the other policies'.
type PressurePoint struct {
	KVBlocks int
	P90      float64 // ms
	BestP90  float64 // ms, the best other policy's
	Best     string  // that policy
}

// Ratio is the policy's p90 over the best other's.
func (p PressurePoint) Ratio() float64 { return p.P90 / p.BestP90 }

// VsBest reads a cache-pressure result (runs labelled "POLICY kv_blocks=N",
// extra.kv_blocks N) and returns, by cache size, policy's p90 TTFT against
// the best other policy's at the same size; nothing for a size without
// policy or without another policy.
func VsBest(res report.Result, policy string) []PressurePoint {
	type point struct {
		p90, best float64
		name      string
		have      bool
	}
	by := map[int]*point{}
	var sizes []int
	for _, r := range res.Runs {
		name, _, ok := strings.Cut(r.Policy, " kv_blocks=")
		kb, hasKB := r.Extra["kv_blocks"]
		if !ok || !hasKB || r.Errors >= r.Requests { // no request served: no p90
			continue
		}
		n := int(kb)
		pt := by[n]
		if pt == nil {
			pt = &point{best: math.Inf(1)}
			by[n] = pt
			sizes = append(sizes, n)
		}
		switch {
		case name == policy:
			pt.p90, pt.have = r.TTFTms.P90, true
		case r.TTFTms.P90 < pt.best:
			pt.best, pt.name = r.TTFTms.P90, name
		}
	}
	slices.Sort(sizes)
	var out []PressurePoint
	for _, n := range sizes {
		if pt := by[n]; pt.have && pt.name != "" && pt.best > 0 {
			out = append(out, PressurePoint{KVBlocks: n, P90: pt.p90, BestP90: pt.best, Best: pt.name})
		}
	}
	return out
}

// vsBestChart draws ttft's p90 over the best other policy's by cache size,
// with the 1.05 line the sweep is held to.
func vsBestChart(vs []PressurePoint) report.Chart {
	s := report.ChartSeries{Name: "ttft", Points: true}
	for _, p := range vs {
		s.X = append(s.X, float64(p.KVBlocks))
		s.Y = append(s.Y, p.Ratio())
	}
	return report.Chart{
		Name: "pressure_ttft_vs_best", Title: "ttft's p90 TTFT over the best other policy's",
		XLabel: "KV blocks per replica (16 tokens each)", YLabel: "p90 TTFT / best other's",
		Caption: "Below 1, ttft is ahead of every other policy at that cache size; the line is the 5% it is held to.",
		Series:  []report.ChartSeries{s},
		Refs:    []report.RefLine{{Label: "1.05", Y: 1.05}},
	}
}

// sweepSpec is a question that replays every policy at every point of one
// setting of the fleet (set applies point i to a Config).
type sweepSpec struct {
	name  string    // the setting's name in run labels
	extra string    // the Extra key of the point's value (xs[i])
	cats  []string  // the points as labels
	xs    []float64 // the points as numbers
	set   func(c *Config, i int)
	// perPointBound: the setting changes the bounds; each run carries its
	// point's merged_lru and prefix_reuse bounds in Extra.
	perPointBound bool
}

// run replays every spec at every point, the point outermost (so that the
// first len(specs) runs name the policies' colours), and returns the runs,
// the bound of cfg, and the series of p90 TTFT and hit rate by policy.
func (sw sweepSpec) run(ctx context.Context, cfg Config, reqs []workload.Request, specs []PolicySpec,
	progress func(PolicySpec, report.Run)) (report.Result, report.Bound, map[string]*report.ChartSeries, map[string]*report.ChartSeries, error) {
	cfg, pl, b, err := prepareBounded(ctx, cfg, reqs)
	if err != nil {
		return report.Result{}, b, nil, nil, err
	}
	var res report.Result
	ttft, hit := map[string]*report.ChartSeries{}, map[string]*report.ChartSeries{}
	for i := range sw.xs {
		c := cfg
		sw.set(&c, i)
		if err := c.validate(); err != nil {
			return report.Result{}, b, nil, nil, err
		}
		pb := b
		if sw.perPointBound {
			if pb, err = boundsPlan(ctx, c, pl); err != nil {
				return report.Result{}, b, nil, nil, err
			}
		}
		for _, spec := range specs {
			s := spec
			s.Label = fmt.Sprintf("%s %s=%s", spec.RunName(), sw.name, sw.cats[i])
			run, err := runPlan(ctx, c, pl, s)
			if err != nil {
				return report.Result{}, b, nil, nil, err
			}
			run.Extra[sw.extra] = sw.xs[i]
			setVsBound(&run, pb)
			if sw.perPointBound {
				run.Extra["bound_prefix_reuse"], run.Extra["bound_merged_lru"] = pb.PrefixReuse, pb.MergedLRU
			}
			if progress != nil {
				progress(s, run)
			}
			res.Runs = append(res.Runs, run)
			addPoint(ttft, spec.RunName(), sw.xs[i], run.TTFTms.P90)
			addPoint(hit, spec.RunName(), sw.xs[i], run.HitRate)
		}
	}
	return res, b, ttft, hit, nil
}

func addPoint(m map[string]*report.ChartSeries, name string, x, y float64) {
	s, ok := m[name]
	if !ok {
		s = &report.ChartSeries{Name: name, Points: true}
		m[name] = s
	}
	s.X, s.Y = append(s.X, x), append(s.Y, y)
}

// seriesOf lists the series in the order of specs (map order is random).
// The k-th series takes the colour of the k-th run (ChartSeries.Key): the
// questions order their runs so that the first ones are one per series, and
// the report gives the Result's runs its first, solid colours, so that a
// policy has the same colour here as in the report's own charts.
func seriesOf(m map[string]*report.ChartSeries, specs []PolicySpec, runs []report.Run) []report.ChartSeries {
	out := make([]report.ChartSeries, 0, len(m))
	for _, sp := range specs {
		if s, ok := m[sp.RunName()]; ok {
			if k := len(out); k < len(runs) {
				s.Key = runs[k].Policy
			}
			out = append(out, *s)
		}
	}
	return out
}

// logTTFT puts the TTFT chart (the first of each question) on a log scale
// when it is a line chart and every value allows it: a policy that piles everything on one
// replica waits a thousand times longer than the rest, and a linear axis
// would flatten every other line to the floor.
func logTTFT(charts []report.Chart) []report.Chart {
	c := &charts[0]
	if c.Bars {
		return charts // bars rise from zero, which a log axis lacks
	}
	for _, s := range c.Series {
		for _, y := range s.Y {
			if !(y > 0) {
				return charts
			}
		}
	}
	c.LogY = true
	return charts
}

func fmtF(v float64) string { return strconv.FormatFloat(v, 'g', 4, 64) }

// scrapeLabel names a configured scrape period (0: each policy's own).
func scrapeLabel(d time.Duration) string {
	if d == 0 {
		return "each policy's own period (250 ms unless its upstream refreshes faster)"
	}
	return d.String()
}
