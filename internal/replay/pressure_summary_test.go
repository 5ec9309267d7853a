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
// $KVGATE_PRESSURE_MAX is set, on a point above that ratio. A sweep over
// several seeds (the script's SEEDS: a seed-N directory each) is summed up
// on each policy's mean p90 over the seeds, with the seeds on which ttft
// was above 1.05× that seed's best. Last, for every policy, the points
// where it is above 1.05× the best of the others: what a single policy
// scores on the same mark. Skipped without the directory: it reads a
// sweep, it does not run one.
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
	names, byName, seeds, err := sweepResults(dir)
	if err != nil {
		t.Fatal(err)
	}
	type worst struct {
		file  string
		p     PressurePoint
		above int // seeds on which ttft was above 1.05× that seed's best (several seeds)
	}
	var all []worst
	floor := map[string]int{}            // every policy's points above 1.05× the best of the others
	charts := map[string]*report.Chart{} // by workload: one line per replica count and rate
	if len(seeds) > 1 {
		fmt.Printf("mean p90 TTFT over seeds %s\n", strings.Join(seeds, ", "))
	}
	fmt.Printf("ttft p90 TTFT / the best other policy's, by KV blocks per replica\n")
	for _, name := range names {
		rs := byName[name]
		res := meanP90(rs)
		vs := VsBest(res, "ttft")
		if len(vs) == 0 {
			t.Fatalf("%s: no cache-pressure runs of ttft and another policy", name)
		}
		above := seedsAbove(rs, 1.05)
		line := fmt.Sprintf("%-24s", name)
		for _, p := range vs {
			line += fmt.Sprintf("  %d:%.2f", p.KVBlocks, p.Ratio())
			all = append(all, worst{name, p, above[p.KVBlocks]})
		}
		fmt.Println(line)
		addSweepLine(charts, name, vs)
		for _, pol := range policiesOf(res) {
			floor[pol] += 0 // listed with none
			for _, p := range VsBest(res, pol) {
				if p.Ratio() > 1.05 {
					floor[pol]++
				}
			}
		}
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
		fmt.Printf("  %.2f  %s kv_blocks=%d: ttft %.1f ms, %s %.1f ms", w.p.Ratio(), w.file, w.p.KVBlocks, w.p.P90, w.p.Best, w.p.BestP90)
		if len(seeds) > 1 {
			fmt.Printf(" (above 1.05× that seed's best on %d of %d seeds)", w.above, len(seeds))
		}
		fmt.Println()
	}
	var marks []string
	for _, pol := range slices.SortedFunc(maps.Keys(floor), func(a, b string) int { return cmp.Or(floor[a]-floor[b], strings.Compare(a, b)) }) {
		marks = append(marks, fmt.Sprintf("%s %d", pol, floor[pol]))
	}
	fmt.Printf("points above 1.05× the best of the others, every policy on the same mark: %s\n", strings.Join(marks, ", "))
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

// sweepResults reads the sweep in dir: its results (*.json) by file name,
// one per seed; a sweep over several seeds keeps each in dir/seed-N
// (seeds: the Ns, in order), one seed's sweep in dir itself (seeds: "").
// Every seed must hold the same files.
func sweepResults(dir string) ([]string, map[string][]report.Result, []string, error) {
	seedDirs, err := filepath.Glob(filepath.Join(dir, "seed-*"))
	if err != nil {
		return nil, nil, nil, err
	}
	seeds := []string{""}
	dirs := []string{dir}
	if len(seedDirs) > 0 {
		slices.SortFunc(seedDirs, func(a, b string) int { return cmp.Compare(seedOf(a), seedOf(b)) })
		seeds, dirs = nil, seedDirs
		for _, d := range seedDirs {
			seeds = append(seeds, strconv.Itoa(seedOf(d)))
		}
	}
	byName := map[string][]report.Result{}
	var names []string
	for i, d := range dirs {
		files, err := filepath.Glob(filepath.Join(d, "*.json"))
		if err != nil || len(files) == 0 {
			return nil, nil, nil, fmt.Errorf("no *.json in %s (%v)", d, err)
		}
		var these []string
		for _, f := range files {
			res, err := readResult(f)
			if err != nil {
				return nil, nil, nil, err
			}
			name := filepath.Base(f)
			byName[name] = append(byName[name], res)
			these = append(these, name)
		}
		if i == 0 {
			names = these
		} else if !slices.Equal(these, names) {
			return nil, nil, nil, fmt.Errorf("%s holds %v, %s %v: every seed must hold the same points", d, these, dirs[0], names)
		}
	}
	return names, byName, seeds, nil
}

// seedOf is N of a directory seed-N (-1 when it is not one).
func seedOf(dir string) int {
	n, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(dir), "seed-"))
	if err != nil {
		return -1
	}
	return n
}

// meanP90 is rs[0] with each run's p90 TTFT the mean over the runs of the
// same label in rs that served a request (one result: itself).
func meanP90(rs []report.Result) report.Result {
	if len(rs) == 1 {
		return rs[0]
	}
	type acc struct {
		sum float64
		n   int
	}
	by := map[string]*acc{}
	for _, res := range rs {
		for _, r := range res.Runs {
			if r.Errors >= r.Requests {
				continue
			}
			a := by[r.Policy]
			if a == nil {
				a = &acc{}
				by[r.Policy] = a
			}
			a.sum += r.TTFTms.P90
			a.n++
		}
	}
	out := rs[0]
	out.Runs = slices.Clone(out.Runs)
	for i := range out.Runs {
		r := &out.Runs[i]
		if a := by[r.Policy]; a != nil {
			r.TTFTms.P90 = a.sum / float64(a.n)
			r.Errors = min(r.Errors, r.Requests-1) // served on some seed: a p90 to compare
		}
	}
	return out
}

// seedsAbove counts, by cache size, the results of rs in which ttft's p90
// is above ratio × the best other policy's.
func seedsAbove(rs []report.Result, ratio float64) map[int]int {
	n := map[int]int{}
	for _, res := range rs {
		for _, p := range VsBest(res, "ttft") {
			if p.Ratio() > ratio {
				n[p.KVBlocks]++
			}
		}
	}
	return n
}

// policiesOf lists the policies of a cache-pressure result's runs.
func policiesOf(res report.Result) []string {
	var out []string
	for _, r := range res.Runs {
		if name, _, ok := strings.Cut(r.Policy, " kv_blocks="); ok && !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out
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

// TestSweepMeansOverSeeds checks the several-seed summary on made-up
// results: each policy's p90 is its mean over the seeds that served a
// request, ttft's ratio is taken on the means, and the seeds above the
// mark are counted seed by seed.
func TestSweepMeansOverSeeds(t *testing.T) {
	run := func(policy string, p90 float64, errors int) report.Run {
		r := report.Run{Policy: policy + " kv_blocks=1000", Requests: 10, Errors: errors, Extra: map[string]float64{"kv_blocks": 1000}}
		r.TTFTms.P90 = p90
		return r
	}
	seeds := []report.Result{
		{Runs: []report.Run{run("ttft", 110, 0), run("sglang", 100, 0), run("llmd", 300, 0)}},
		{Runs: []report.Run{run("ttft", 90, 0), run("sglang", 100, 0), run("llmd", 999, 10)}},
	}
	m := meanP90(seeds)
	want := map[string]float64{"ttft kv_blocks=1000": 100, "sglang kv_blocks=1000": 100, "llmd kv_blocks=1000": 300}
	for _, r := range m.Runs {
		if r.TTFTms.P90 != want[r.Policy] {
			t.Errorf("%s: mean p90 %v, want %v", r.Policy, r.TTFTms.P90, want[r.Policy])
		}
	}
	if seeds[0].Runs[0].TTFTms.P90 != 110 {
		t.Errorf("meanP90 changed its input: %v", seeds[0].Runs[0].TTFTms.P90)
	}
	if vs := VsBest(m, "ttft"); len(vs) != 1 || vs[0].Ratio() != 1 || vs[0].Best != "sglang" {
		t.Errorf("ttft on the means: %+v, want 1.00 against sglang", vs)
	}
	if got := seedsAbove(seeds, 1.05); got[1000] != 1 {
		t.Errorf("seeds above 1.05: %v, want 1 at 1000 blocks", got)
	}
	if got := policiesOf(m); !slices.Equal(got, []string{"ttft", "sglang", "llmd"}) {
		t.Errorf("policies %v", got)
	}
}

// TestSweepResultsBySeed reads a sweep written one seed per directory,
// in the seeds' numeric order, and refuses seeds that hold different points.
func TestSweepResultsBySeed(t *testing.T) {
	dir := t.TempDir()
	res := report.Result{Runs: []report.Run{{Policy: "ttft kv_blocks=1000", Requests: 1}}}
	write := func(path string) {
		t.Helper()
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		f, err := os.Create(path)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := report.WriteJSON(f, res); err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range []string{"10", "2"} {
		write(filepath.Join(dir, "seed-"+s, "mt-4-r016.json"))
	}
	names, byName, seeds, err := sweepResults(dir)
	if err != nil || !slices.Equal(names, []string{"mt-4-r016.json"}) || len(byName["mt-4-r016.json"]) != 2 || !slices.Equal(seeds, []string{"2", "10"}) {
		t.Fatalf("sweepResults: %v %d %v %v", names, len(byName["mt-4-r016.json"]), seeds, err)
	}
	write(filepath.Join(dir, "seed-2", "sp-4-r012.json"))
	if _, _, _, err := sweepResults(dir); err == nil {
		t.Fatal("seeds holding different points: no error")
	}
}
