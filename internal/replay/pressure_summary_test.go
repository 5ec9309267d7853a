package replay

import (
	"cmp"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/report"
)

// TestPressureSweepSummary is the summary of scripts/pressure-sweep.sh:
// for each cache-pressure result (*.json) in $KVGATE_PRESSURE_DIR, ttft's
// p90 TTFT over the best other policy's at each cache size, and the worst
// points; it fails on a file that is not such a result, and, when
// $KVGATE_PRESSURE_MAX is set, on a point above that ratio. Skipped without
// the directory: it reads a sweep, it does not run one.
func TestPressureSweepSummary(t *testing.T) {
	dir := os.Getenv("KVGATE_PRESSURE_DIR")
	if dir == "" {
		t.Skip("KVGATE_PRESSURE_DIR is not set (scripts/pressure-sweep.sh sets it)")
	}
	limit := 0.0
	if s := os.Getenv("KVGATE_PRESSURE_MAX"); s != "" {
		var err error
		if limit, err = strconv.ParseFloat(s, 64); err != nil || !(limit > 0) {
			t.Fatalf("KVGATE_PRESSURE_MAX=%q: want a ratio > 0", s)
		}
	}
	files, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no *.json in %s (%v)", dir, err)
	}
	type worst struct {
		file string
		p    PressurePoint
	}
	var all []worst
	charts := map[string]*report.Chart{} // by workload: one line per replica count and rate
	fmt.Printf("ttft p90 TTFT / the best other policy's, by KV blocks per replica\n")
	for _, f := range files {
		res, err := readResult(f)
		if err != nil {
			t.Fatal(err)
		}
		vs := VsBest(res, "ttft")
		if len(vs) == 0 {
			t.Fatalf("%s: no cache-pressure runs of ttft and another policy", f)
		}
		line := fmt.Sprintf("%-24s", filepath.Base(f))
		for _, p := range vs {
			line += fmt.Sprintf("  %d:%.2f", p.KVBlocks, p.Ratio())
			all = append(all, worst{filepath.Base(f), p})
		}
		fmt.Println(line)
		addSweepLine(charts, filepath.Base(f), vs)
	}
	if err := writeSweepCharts(filepath.Join(dir, "summary"), charts); err != nil {
		t.Fatal(err)
	}
	slices.SortFunc(all, func(a, b worst) int { return -cmpFloat(a.p.Ratio(), b.p.Ratio()) })
	above := 0
	for _, w := range all {
		if w.p.Ratio() > 1.05 {
			above++
		}
	}
	fmt.Printf("%d of %d points above 1.05; the worst:\n", above, len(all))
	for _, w := range all[:min(len(all), 8)] {
		fmt.Printf("  %.2f  %s kv_blocks=%d: ttft %.1f ms, %s %.1f ms\n", w.p.Ratio(), w.file, w.p.KVBlocks, w.p.P90, w.p.Best, w.p.BestP90)
	}
	for _, w := range all {
		if limit > 0 && w.p.Ratio() > limit {
			t.Errorf("%s kv_blocks=%d: ttft p90 %.1f ms is %.2f× %s's %.1f ms, above %v", w.file, w.p.KVBlocks,
				w.p.P90, w.p.Ratio(), w.p.Best, w.p.BestP90, limit)
		}
	}
}

// sweepWorkloads are the sweep's workloads by the prefix of its file names.
var sweepWorkloads = map[string]string{"mt": "multiturn", "sp": "shared prefix"}

// addSweepLine adds the file's ratios to its workload's chart: a file
// named WORKLOAD-REPLICAS-rRATE.json (the sweep's names) is a line named
// "REPLICAS replicas, RATE/s" on the chart of WORKLOAD.
func addSweepLine(charts map[string]*report.Chart, file string, vs []PressurePoint) {
	var w, rate string
	var n int
	if _, err := fmt.Sscanf(strings.ReplaceAll(strings.TrimSuffix(file, ".json"), "-", " "), "%s %d %s", &w, &n, &rate); err != nil {
		w, n, rate = "sweep", 0, file
	}
	c := charts[w]
	title := cmp.Or(sweepWorkloads[w], w)
	if c == nil {
		c = &report.Chart{Name: "sweep_" + w, Title: "ttft's p90 TTFT over the best other policy's: " + title,
			XLabel: "KV blocks per replica (16 tokens each)", YLabel: "p90 TTFT / best other's",
			Caption: "One line per fleet and rate; below 1, ttft is ahead of every other policy. The line is the 5% it is held to.",
			Refs:    []report.RefLine{{Label: "1.05", Y: 1.05}}}
		charts[w] = c
	}
	s := report.ChartSeries{Name: fmt.Sprintf("%d replicas, %s/s", n, strings.TrimLeft(strings.TrimPrefix(rate, "r"), "0")), Points: true}
	for _, p := range vs {
		s.X, s.Y = append(s.X, float64(p.KVBlocks)), append(s.Y, p.Ratio())
	}
	c.Series = append(c.Series, s)
}

// writeSweepCharts writes the sweep's charts (dir/sweep_WORKLOAD.png and
// .svg, and an index.html showing them).
func writeSweepCharts(dir string, charts map[string]*report.Chart) error {
	var cs []report.Chart
	for _, w := range slices.Sorted(maps.Keys(charts)) {
		cs = append(cs, *charts[w])
	}
	return report.WriteReport(dir, report.Result{}, "ttft under KV-cache pressure: the sweep", cs...)
}

func readResult(path string) (report.Result, error) {
	f, err := os.Open(path)
	if err != nil {
		return report.Result{}, err
	}
	defer f.Close()
	res, err := report.ReadJSON(f)
	if err != nil {
		return report.Result{}, fmt.Errorf("%s: %w", path, err)
	}
	return res, nil
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
