package report

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"unicode/utf8"
)

// table is the one tabular view of a Result, shared by WriteTable and the HTML report so
// that both print the same figures, formatted the same way.
type table struct {
	Header []string
	Rows   [][]string
	Right  []bool // column is right-aligned (numbers)
}

// Number formats, one per kind of figure.
func fmtMs(v float64) string      { return fmt.Sprintf("%.1f", v) }
func fmtRate(v float64) string    { return fmt.Sprintf("%.2f", v) }
func fmtTokRate(v float64) string { return fmt.Sprintf("%.0f", v) }
func fmtPercent(v float64) string { return fmt.Sprintf("%.1f", 100*v) }
func fmtRatio(v float64) string   { return fmt.Sprintf("%.2f", v) }
func fmtSpeedup(v float64) string { return fmt.Sprintf("%.2fx", v) }
func fmtExtra(v float64) string   { return fmt.Sprintf("%.4g", v) }
func hasCapacity(res Result) bool {
	return anyRun(res, func(r Run) bool { return r.CapacitySpeedup != nil })
}
func anyRun(res Result, f func(Run) bool) bool {
	for _, r := range res.Runs {
		if f(r) {
			return true
		}
	}
	return false
}

// buildTable lays out the columns of the terminal table: policy, TTFT p50/p90/p99, ITL p50,
// E2E p50, req/s, out tok/s, hit %, imbalance, errors, and capacity when any run has it.
func buildTable(res Result) table {
	t := table{Header: []string{
		"policy", "ttft p50 ms", "ttft p90 ms", "ttft p99 ms", "itl p50 ms", "e2e p50 ms",
		"req/s", "out tok/s", "hit %", "imbalance", "errors",
	}}
	merged := res.Bound != nil && res.Bound.MergedLRU > 0
	if merged {
		t.Header = append(t.Header, "hit/merged")
	}
	capacity := hasCapacity(res)
	if capacity {
		t.Header = append(t.Header, "capacity")
	}
	split := hasSplit(res)
	if split {
		t.Header = append(t.Header, "engine ttft ms", "outside ttft ms")
	}
	programs, batches := hasPrograms(res), hasBatches(res)
	if programs {
		t.Header = append(t.Header, "program p50 s", "program p90 s")
	}
	if batches {
		t.Header = append(t.Header, "batch p50 s", "prefill/batch")
	}
	for _, r := range res.Runs {
		row := []string{
			r.Policy,
			fmtMs(r.TTFTms.P50), fmtMs(r.TTFTms.P90), fmtMs(r.TTFTms.P99),
			fmtMs(r.ITLms.P50), fmtMs(r.E2Ems.P50),
			fmtRate(r.ThroughputRPS), fmtTokRate(r.OutputTokensPerS),
			fmtPercent(r.HitRate), fmtRatio(r.Imbalance), fmt.Sprint(r.Errors),
		}
		if merged {
			// The hit rate as a share of the merged-LRU bound: how close the
			// policy comes to one cache as large as the fleet's.
			row = append(row, fmtPercent(r.HitRate/res.Bound.MergedLRU))
		}
		if capacity {
			switch {
			case r.CapacitySpeedup != nil && *r.CapacitySpeedup == 0 && r.CapacityBelow != nil:
				row = append(row, "< "+fmtBelow(*r.CapacityBelow)+"x")
			case r.CapacitySpeedup != nil:
				row = append(row, fmtCapacity(r))
			default:
				row = append(row, "-")
			}
		}
		if split {
			row = append(row, timeSplitCells(r)...)
		}
		if programs {
			row = append(row, makespanCells(r.Programs, false)...)
		}
		if batches {
			row = append(row, makespanCells(r.Batches, true)...)
		}
		t.Rows = append(t.Rows, row)
	}
	t.Right = make([]bool, len(t.Header))
	for i := 1; i < len(t.Right); i++ {
		t.Right[i] = true
	}
	return t
}

func hasSplit(res Result) bool { return anyRun(res, func(r Run) bool { return r.Split != nil }) }

func hasPrograms(res Result) bool { return anyRun(res, func(r Run) bool { return r.Programs != nil }) }
func hasBatches(res Result) bool  { return anyRun(res, func(r Run) bool { return r.Batches != nil }) }

// makespanCells are a run's makespan cells: programs' p50 and p90 (s), or
// batches' p50 (s) and mean prefill tokens; "-" without any.
func makespanCells(m *Makespans, batches bool) []string {
	switch {
	case m == nil:
		return []string{"-", "-"}
	case batches:
		return []string{fmtSeconds(m.Makespanms.P50), fmtTokRate(m.PrefillTokensMean)}
	}
	return []string{fmtSeconds(m.Makespanms.P50), fmtSeconds(m.Makespanms.P90)}
}

func fmtSeconds(ms float64) string { return fmt.Sprintf("%.1f", ms/1000) }

// makespanLine explains the makespan columns in one line, "" without them.
func makespanLine(res Result) string {
	var parts []string
	if hasPrograms(res) {
		parts = append(parts, "program p50/p90 s: a program's makespan, its first request's arrival to its last answer "+
			"(an agent with its subagents, a conversation)")
	}
	if hasBatches(res) {
		parts = append(parts, "batch p50 s: an RL batch's makespan, its release to its last answer; prefill/batch: "+
			"the prompt tokens its requests computed (prompt − cached), mean over the batches")
	}
	return strings.Join(parts, "; ")
}

// timeSplitCells are a run's engine and outside TTFT means, "-" without a split.
func timeSplitCells(r Run) []string {
	if r.Split == nil {
		return []string{"-", "-"}
	}
	return []string{fmtMs(r.Split.EngineTTFTms.Mean), fmtMs(r.Split.OutsideTTFTMeanms)}
}

// splitLine explains the split columns in one line, "" without a split.
func splitLine(res Result) string {
	if !hasSplit(res) {
		return ""
	}
	var sources []string
	for _, r := range res.Runs {
		if r.Split != nil && !slices.Contains(sources, r.Split.Source) {
			sources = append(sources, r.Split.Source)
		}
	}
	from := map[string]string{SplitPerRequest: "each request's answer (the replica's own times)",
		SplitEngineMetrics: "the replicas' vLLM histograms over the run"}
	var parts []string
	for _, s := range sources {
		parts = append(parts, cmp.Or(from[s], s))
	}
	return "engine/outside ttft: means of the TTFT's two parts — in the engine (the replicas' own time to first token, " +
		"model time) and outside it (gateway, network, load generator: real time, never multiplied by a time scale); from " +
		strings.Join(parts, " and ") + "."
}

// boundLine describes the replay's hit-rate bounds in one line, "" without bounds.
func boundLine(b *Bound) string {
	if b == nil {
		return ""
	}
	line := fmt.Sprintf("hit-rate bounds: prefix reuse %s%% (unbounded cache), merged LRU %s%% (one LRU with the fleet's capacity)",
		fmtPercent(b.PrefixReuse), fmtPercent(b.MergedLRU))
	if b.OracleTTFTms != nil {
		line += fmt.Sprintf("\noracle bound (merged-LRU hits, placed by the exact queues): ttft p50 %s p90 %s p99 %s ms",
			fmtMs(b.OracleTTFTms.P50), fmtMs(b.OracleTTFTms.P90), fmtMs(b.OracleTTFTms.P99))
		if b.OracleCapacity != nil {
			c := fmtSpeedup(*b.OracleCapacity)
			if b.OracleCapacityCeiling {
				c = "≥ " + c + " (the search's upper limit)"
			}
			line += ", capacity " + c
		}
	}
	return line
}

// WriteTable writes res as an aligned plain-text table (policy left-aligned, figures
// right-aligned, two spaces between columns), followed by the bound line when present.
// Write errors are not reported: the table goes to a terminal.
func WriteTable(w io.Writer, res Result) {
	t := buildTable(res)
	width := make([]int, len(t.Header))
	for i, h := range t.Header {
		width[i] = utf8.RuneCountInString(h)
	}
	for _, row := range t.Rows {
		for i, c := range row {
			width[i] = max(width[i], utf8.RuneCountInString(c))
		}
	}
	var b strings.Builder
	line := func(cells []string) {
		for i, c := range cells {
			pad := strings.Repeat(" ", width[i]-utf8.RuneCountInString(c))
			if i > 0 {
				b.WriteString("  ")
			}
			if t.Right[i] {
				b.WriteString(pad + c)
			} else if i < len(cells)-1 {
				b.WriteString(c + pad)
			} else {
				b.WriteString(c)
			}
		}
		b.WriteByte('\n')
	}
	line(t.Header)
	for _, row := range t.Rows {
		line(row)
	}
	for _, s := range []string{groupLines(res), splitLine(res), makespanLine(res), ceilingNote(res), boundLine(res.Bound)} {
		if s != "" {
			b.WriteString(s)
			b.WriteByte('\n')
		}
	}
	_, _ = io.WriteString(w, b.String())
}

// fmtCapacity is a run's capacity cell: "≥ 4096.00x" when its search
// reached the ceiling (a lower bound).
func fmtCapacity(r Run) string {
	s := fmtSpeedup(*r.CapacitySpeedup)
	if r.CapacityCeiling {
		s = "≥ " + s
	}
	return s
}

// ceilingNote explains a table's "≥" capacities, "" without one.
func ceilingNote(res Result) string {
	if !anyRun(res, func(r Run) bool { return r.CapacityCeiling }) {
		return ""
	}
	return "≥: the capacity search reached its upper limit with the SLO still met: " + ceilingWhy
}

// ceilingWhy is what a capacity at the search's ceiling means.
const ceilingWhy = "the trace is too short or too light to load the fleet (its requests fit in the fleet at once), " +
	"so such a capacity is only a lower bound and cannot rank policies: replay a longer trace, or compare p90 TTFT " +
	"without --capacity"
