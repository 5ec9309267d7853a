package report

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
)

// Names of the charts a verdict points to.
const (
	ChartTTFTPercentiles = "ttft_percentiles"
	ChartCapacity        = "capacity"
)

// Objectives a verdict ranks runs on.
const (
	ObjectiveTTFTP90  = "ttft_p90" // lowest p90 TTFT
	ObjectiveCapacity = "capacity" // highest capacity speed-up
)

// Verdict is what a comparison's report opens with: the best policy on the run's objective,
// by how much against the runner-up and round_robin, and whether that is more than noise.
type Verdict struct {
	Objective string   // ObjectiveTTFTP90 or ObjectiveCapacity
	Best      string   // the best run; "" when none qualifies
	RunnerUp  string   // the second; "" when none
	Tied      []string // the best and every run within noise of it, best first; nil when the best wins clearly
	Left      []string // runs left out of the ranking, with why
	Chart     string   // the chart that shows why
	Headline  string   // the verdict in a sentence
	Rule      string   // how it was decided
}

// Clear reports whether the verdict names a winner.
func (v Verdict) Clear() bool { return v.Best != "" && len(v.Tied) == 0 }

// Decide ranks the runs of a comparison; false with fewer than two runs (nothing to compare).
//
// With capacities (replay --capacity) the highest capacity wins: the largest speed-up of the
// arrivals at which the run met its SLO. Ties (capacities equal to the search's precision,
// Meta["capacity_precision"], else exactly equal) go to the TTFT ranking below; the search does
// not estimate run-to-run noise, so only those are called ties.
//
// Otherwise the lowest p90 TTFT wins among runs without a failed request (a run that dropped
// requests has shed its hardest ones); equal p90s go to the lower p99, then the higher hit rate.
// The best is only named when it is clear of the noise: every run whose 90 % interval of the
// p90 (Run.TTFTP90CI: the bootstrap of the run's requests, and for a live bench also sectioning
// in arrival order, bench.Summarize) overlaps the best's is tied with it, and the verdict then
// says so instead. Overlap of two 90 % intervals is a conservative test (about a 1 % two-sided
// level for intervals of equal width). What no interval from one run can see is a change
// between runs (bench runs the policies one after another: another process starting on the
// machine); runs without an interval (JSON from an older kvgate) are ranked on the figures alone.
func Decide(res Result) (Verdict, bool) {
	if len(res.Runs) < 2 {
		return Verdict{}, false
	}
	if hasCapacity(res) {
		return decideCapacity(res), true
	}
	return decideTTFT(res), true
}

// byTTFT orders runs by p90 TTFT, then p99, then hit rate (higher first); stable.
func byTTFT(a, b Run) int {
	return cmp.Or(cmp.Compare(a.TTFTms.P90, b.TTFTms.P90), cmp.Compare(a.TTFTms.P99, b.TTFTms.P99),
		cmp.Compare(b.HitRate, a.HitRate))
}

func decideTTFT(res Result) Verdict {
	v := Verdict{Objective: ObjectiveTTFTP90, Chart: ChartTTFTPercentiles,
		Rule: "rule: the lowest p90 TTFT among runs without errors wins (equal p90s: the lower p99, then the higher hit rate), " +
			"unless it is within noise of another: when the 90% intervals of their p90s overlap (ttft_p90_ci_ms, estimated " +
			"from each run's own requests), no winner is named."}
	var ranked []Run
	for _, r := range res.Runs {
		switch {
		case r.Errors > 0:
			v.Left = append(v.Left, fmt.Sprintf("%s (%d errors)", r.Policy, r.Errors))
		case r.Requests == 0:
			v.Left = append(v.Left, fmt.Sprintf("%s (no requests)", r.Policy))
		default:
			ranked = append(ranked, r)
		}
	}
	if len(ranked) == 0 {
		v.Headline = "verdict: none: every run had failed requests, and the rule ranks only runs without."
		return v
	}
	slices.SortStableFunc(ranked, byTTFT)
	best := ranked[0]
	v.Best = best.Policy
	if len(ranked) > 1 {
		v.RunnerUp = ranked[1].Policy
	}
	noise := best.TTFTP90CI != nil
	if noise {
		for _, r := range ranked[1:] {
			if r.TTFTP90CI != nil && r.TTFTP90CI.Overlaps(*best.TTFTP90CI) {
				v.Tied = append(v.Tied, r.Policy)
			}
		}
		if len(v.Tied) > 0 {
			v.Tied = append([]string{best.Policy}, v.Tied...)
		}
	}
	rr, haveRR := runNamed(ranked, "round_robin")
	var b strings.Builder
	if len(v.Tied) > 0 {
		b.WriteString("verdict: no clear winner: ")
		var parts []string
		for _, name := range v.Tied {
			r, _ := runNamed(ranked, name)
			parts = append(parts, fmt.Sprintf("%s (p90 TTFT %s ms, 90%% interval %s)", name, fmtMs(r.TTFTms.P90), fmtInterval(r.TTFTP90CI)))
		}
		b.WriteString(joinAnd(parts) + " are within this run's noise")
		if haveRR && !slices.Contains(v.Tied, "round_robin") {
			fmt.Fprintf(&b, "; round_robin %s ms (%s %s's)", fmtMs(rr.TTFTms.P90), fmtTimes(rr.TTFTms.P90/best.TTFTms.P90), best.Policy)
		}
		b.WriteString(".")
	} else {
		fmt.Fprintf(&b, "verdict: %s has the lowest p90 TTFT, %s ms", best.Policy, fmtMs(best.TTFTms.P90))
		if noise {
			fmt.Fprintf(&b, " (90%% interval %s)", fmtInterval(best.TTFTP90CI))
		}
		var parts []string
		if v.RunnerUp != "" {
			ru := ranked[1]
			parts = append(parts, fmt.Sprintf("the runner-up %s %s ms (%s %s's)", ru.Policy, fmtMs(ru.TTFTms.P90),
				fmtTimes(ru.TTFTms.P90/best.TTFTms.P90), best.Policy))
		}
		if haveRR && best.Policy != "round_robin" && v.RunnerUp != "round_robin" {
			parts = append(parts, fmt.Sprintf("round_robin %s ms (%s)", fmtMs(rr.TTFTms.P90), fmtTimes(rr.TTFTms.P90/best.TTFTms.P90)))
		}
		if len(parts) > 0 {
			b.WriteString(": " + strings.Join(parts, "; "))
		}
		b.WriteString(".")
		if !noise {
			b.WriteString(" (This result has no p90 intervals: noise was not estimated.)")
		}
	}
	v.Headline = b.String()
	if len(v.Left) > 0 {
		v.Rule += " Left out (failed requests): " + strings.Join(v.Left, ", ") + "."
	}
	return v
}

func decideCapacity(res Result) Verdict {
	slo := "the SLO"
	if s, ok := res.Meta["slo_ttft_p90"].(string); ok && s != "" {
		slo = "p90 TTFT ≤ " + s
	}
	precision := 1.0
	if p, ok := res.Meta["capacity_precision"].(float64); ok && p > 1 {
		precision = p
	}
	v := Verdict{Objective: ObjectiveCapacity, Chart: ChartCapacity, Rule: capacityRule(slo, precision)}
	var ranked []Run
	for _, r := range res.Runs {
		if r.CapacitySpeedup == nil {
			v.Left = append(v.Left, r.Policy+" (no capacity)")
			continue
		}
		ranked = append(ranked, r)
	}
	if len(ranked) == 0 {
		v.Headline = "verdict: none: no run has a capacity."
		return v
	}
	slices.SortStableFunc(ranked, func(a, b Run) int {
		return cmp.Or(cmp.Compare(capOf(b), capOf(a)), byTTFT(a, b))
	})
	best := ranked[0]
	if capOf(best) <= 0 {
		v.Headline = fmt.Sprintf("verdict: no policy meets %s at any speed-up searched", slo)
		if best.CapacityBelow != nil {
			v.Headline += fmt.Sprintf(" (down to %sx)", fmtBelow(*best.CapacityBelow))
		}
		v.Headline += "."
		return v
	}
	if !slices.ContainsFunc(ranked, func(r Run) bool { return !r.CapacityCeiling }) {
		v.Headline = fmt.Sprintf("verdict: none: every policy still meets %s at the capacity search's upper limit, %s the "+
			"workload's arrival rate: %s.", slo, fmtSpeedup(capOf(best)), ceilingWhy)
		return v
	}
	v.Best = best.Policy
	if len(ranked) > 1 {
		v.RunnerUp = ranked[1].Policy
	}
	for _, r := range ranked[1:] {
		if c := capOf(r); c > 0 && capOf(best)/c <= precision {
			v.Tied = append(v.Tied, r.Policy)
		}
	}
	if len(v.Tied) > 0 {
		v.Tied = append([]string{best.Policy}, v.Tied...)
	}
	v.Headline = capacityHeadline(&v, ranked, slo)
	if len(v.Left) > 0 {
		v.Rule += " Left out: " + strings.Join(v.Left, ", ") + "."
	}
	return v
}

// capOf is a run's capacity (-Inf: none).
func capOf(r Run) float64 {
	if r.CapacitySpeedup == nil {
		return math.Inf(-1)
	}
	return *r.CapacitySpeedup
}

// capacityRule states the capacity verdict's rule.
func capacityRule(slo string, precision float64) string {
	rule := fmt.Sprintf("rule: the highest capacity wins: the largest speed-up of the arrivals at which a policy still meets %s "+
		"(equal capacities: the lower p90 TTFT at the start speed, then p99, then hit rate); ", slo)
	if precision > 1 {
		rule += fmt.Sprintf("capacities within the search's precision (%.2g%%) are a tie. ", 100*(precision-1))
	} else {
		rule += "only equal capacities are a tie. "
	}
	return rule + "The capacity search does not estimate run-to-run noise."
}

// capacityHeadline is the verdict's sentence for ranked runs (best first).
func capacityHeadline(v *Verdict, ranked []Run, slo string) string {
	best := ranked[0]
	rr, haveRR := runNamed(ranked, "round_robin")
	against := func(r Run) string {
		c := capOf(r)
		if c <= 0 {
			s := "fails even at the lowest speed-up searched"
			if r.CapacityBelow != nil {
				s = "< " + fmtBelow(*r.CapacityBelow) + "x: " + s
			}
			return fmt.Sprintf("%s (%s)", r.Policy, s)
		}
		times := fmtTimes(capOf(best) / c)
		if best.CapacityCeiling {
			times = "at least " + times // best's capacity is a lower bound
		}
		return fmt.Sprintf("%s %s (%s serves %s its load)", r.Policy, fmtCapacity(r), best.Policy, times)
	}
	var b strings.Builder
	if len(v.Tied) > 0 {
		fmt.Fprintf(&b, "verdict: no clear winner: %s have the same capacity, %s the workload's arrival rate within %s, to the search's precision",
			joinAnd(v.Tied), fmtCapacity(best), slo)
		if haveRR && !slices.Contains(v.Tied, "round_robin") {
			b.WriteString("; " + against(rr))
		}
	} else {
		fmt.Fprintf(&b, "verdict: %s has the highest capacity: %s the workload's arrival rate within %s", best.Policy, fmtCapacity(best), slo)
		var parts []string
		if v.RunnerUp != "" {
			parts = append(parts, "the runner-up "+against(ranked[1]))
		}
		if haveRR && best.Policy != "round_robin" && v.RunnerUp != "round_robin" {
			parts = append(parts, against(rr))
		}
		if len(parts) > 0 {
			b.WriteString(": " + strings.Join(parts, "; "))
		}
	}
	b.WriteString(".")
	return b.String()
}

func runNamed(runs []Run, name string) (Run, bool) {
	for _, r := range runs {
		if r.Policy == name {
			return r, true
		}
	}
	return Run{}, false
}

// joinAnd joins "a", "a and b", "a, b and c".
func joinAnd(s []string) string {
	if len(s) <= 1 {
		return strings.Join(s, "")
	}
	return strings.Join(s[:len(s)-1], ", ") + " and " + s[len(s)-1]
}

func fmtInterval(i *Interval) string {
	if i == nil {
		return "unknown"
	}
	return fmtMs(i.Lo) + "–" + fmtMs(i.Hi)
}

// fmtTimes is a ratio as "1.69×".
func fmtTimes(v float64) string { return fmt.Sprintf("%.2f×", v) }

// fmtBelow is an upper bound ("< X"), to three significant digits.
func fmtBelow(v float64) string { return fmt.Sprintf("%.3g", v) }

// WriteVerdict writes the verdict's headline and rule, and the chart's file when chart is not
// "", then a blank line (the table follows).
func WriteVerdict(w io.Writer, v Verdict, chart string) {
	var b strings.Builder
	b.WriteString(v.Headline + "\n")
	b.WriteString("  " + v.Rule + "\n")
	if chart != "" {
		b.WriteString("  chart: " + chart + "\n")
	}
	b.WriteByte('\n')
	_, _ = io.WriteString(w, b.String())
}

// verdictChart is the chart that shows why: TTFT percentiles per policy (with the p90
// intervals) or capacity per policy.
func verdictChart(res Result, v Verdict) Chart {
	if v.Objective == ObjectiveCapacity {
		return capacityChart(res)
	}
	return percentileChart(res, v)
}

func percentileChart(res Result, v Verdict) Chart {
	c := Chart{
		Name:       ChartTTFTPercentiles,
		Title:      "Time to first token: p50 and p90 per policy",
		XLabel:     "percentile",
		YLabel:     "time to first token (ms)",
		Bars:       true,
		Categories: []string{"p50", "p90"},
		YMin:       0,
		Caption: "One bar per policy at each percentile; lower is better. The whisker on p90 is its 90% bootstrap interval " +
			"from the run's own requests: policies whose whiskers overlap are within the run's noise. The verdict ranks on p90 " +
			"(p99, the tail beyond, is in the table).",
	}
	top := 0.0
	for _, r := range res.Runs {
		s := ChartSeries{Name: r.Policy, Y: []float64{r.TTFTms.P50, r.TTFTms.P90}}
		if ci := r.TTFTP90CI; ci != nil {
			s.YLo, s.YHi = []float64{math.NaN(), ci.Lo}, []float64{math.NaN(), ci.Hi}
			top = max(top, ci.Hi)
		}
		top = max(top, r.TTFTms.P90)
		c.Series = append(c.Series, s)
	}
	// A policy far behind (everything queued on one replica) would flatten the others' bars:
	// the axis stops at three times the highest p90 of the runs the verdict compares, and
	// taller bars run past the top.
	limit := 0.0
	for _, name := range []string{v.Best, v.RunnerUp, "round_robin"} {
		if r, ok := runNamed(res.Runs, name); ok {
			limit = max(limit, 3*r.TTFTms.P90)
		}
	}
	if limit > 0 && top > limit {
		var cut []string
		for _, r := range res.Runs {
			if r.TTFTms.P90 > limit {
				cut = append(cut, r.Policy)
			}
		}
		top = limit
		if len(cut) > 0 {
			c.Caption += " The p90 bars of " + joinAnd(cut) + " run past the top of the axis (their figures are in the table)."
		}
	}
	if top > 0 {
		c.YMax = top * 1.05
	}
	return c
}

func capacityChart(res Result) Chart {
	c := Chart{
		Name:       ChartCapacity,
		Title:      "Capacity per policy",
		XLabel:     "policy",
		YLabel:     "capacity (× the workload's arrival rate)",
		Bars:       true,
		Categories: []string{""},
		YMin:       0,
		Refs:       []RefLine{{Label: "the workload's rate (1×)", Y: 1}},
		Caption: "The largest speed-up of the arrivals at which each policy still meets the SLO: how much more " +
			"load the same fleet serves. Higher is better; a policy with no bar fails the SLO even at the lowest speed-up searched.",
	}
	if s, ok := res.Meta["slo_ttft_p90"].(string); ok && s != "" {
		c.Title += ", p90 TTFT ≤ " + s
	}
	top := 1.0
	for _, r := range res.Runs {
		y := 0.0
		if r.CapacitySpeedup != nil {
			y = *r.CapacitySpeedup
		}
		top = max(top, y)
		c.Series = append(c.Series, ChartSeries{Name: r.Policy, Y: []float64{y}})
	}
	c.YMax = top * 1.05
	return c
}
