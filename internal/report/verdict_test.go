package report

import (
	"bytes"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/testutil"
)

// ttftRun summarises n synthetic requests whose TTFTs are base + Exp(scale) ms, seeded.
func ttftRun(policy string, seed uint64, n int, base, scale float64) Run {
	rng := rand.New(rand.NewPCG(seed, 3))
	recs := make([]Record, n)
	for i := range recs {
		recs[i] = rec(float64(i)*10, base+scale*rng.ExpFloat64(), 10, 8, 1000, 500, i%4)
	}
	return Summarize(policy, recs, 4, 0)
}

// The exact bootstrap interval is the one resampling converges to.
func TestQuantileIntervalMatchesResampling(t *testing.T) {
	testutil.Deterministic(t)
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{20, 301, 2000} {
		x := make([]float64, n)
		for i := range x {
			x[i] = 30 + 50*rng.ExpFloat64()
		}
		slices.Sort(x)
		got := QuantileInterval(x, 0.9, 0.9)
		const resamples = 4000
		q := make([]float64, resamples)
		buf := make([]float64, n)
		for b := range q {
			for i := range buf {
				buf[i] = x[rng.IntN(n)]
			}
			slices.Sort(buf)
			q[b] = Percentile(buf, 0.9)
		}
		slices.Sort(q)
		want := Interval{Lo: Percentile(q, 0.05), Hi: Percentile(q, 0.95)}
		// Within two ranks of the sample at the ends (Monte Carlo error).
		rank := func(v float64) int { i, _ := slices.BinarySearch(x, v); return i }
		if d := rank(got.Lo) - rank(want.Lo); d < -2 || d > 2 {
			t.Errorf("n=%d: low end %v (rank %d), resampling %v (rank %d)", n, got.Lo, rank(got.Lo), want.Lo, rank(want.Lo))
		}
		if d := rank(got.Hi) - rank(want.Hi); d < -2 || d > 2 {
			t.Errorf("n=%d: high end %v (rank %d), resampling %v (rank %d)", n, got.Hi, rank(got.Hi), want.Hi, rank(want.Hi))
		}
		if p90 := Percentile(x, 0.9); !(got.Lo <= p90 && p90 <= got.Hi) {
			t.Errorf("n=%d: interval %+v misses the p90 %v", n, got, p90)
		}
	}
	if got := QuantileInterval([]float64{7}, 0.9, 0.9); got != (Interval{7, 7}) {
		t.Errorf("one sample: %+v", got)
	}
	if got := QuantileInterval(nil, 0.9, 0.9); got != (Interval{}) {
		t.Errorf("no samples: %+v", got)
	}
}

// A million requests cost milliseconds, not a resampling loop.
func BenchmarkQuantileInterval(b *testing.B) {
	x := make([]float64, 1_000_000)
	for i := range x {
		x[i] = float64(i)
	}
	for b.Loop() {
		QuantileInterval(x, 0.9, 0.9)
	}
}

func TestDecideTTFT(t *testing.T) {
	t.Run("a clear win", func(t *testing.T) {
		res := Result{Runs: []Run{
			ttftRun("round_robin", 1, 400, 80, 60),
			ttftRun("ttft", 2, 400, 40, 25),
			ttftRun("sglang", 3, 400, 50, 35),
		}}
		v, ok := Decide(res)
		if !ok || v.Best != "ttft" || v.RunnerUp != "sglang" || !v.Clear() || v.Chart != ChartTTFTPercentiles {
			t.Fatalf("verdict %+v", v)
		}
		for _, want := range []string{"verdict: ttft has the lowest p90 TTFT", "the runner-up sglang", "round_robin", "×", "90% interval"} {
			if !strings.Contains(v.Headline, want) {
				t.Errorf("headline lacks %q: %s", want, v.Headline)
			}
		}
		ratio := res.Runs[0].TTFTms.P90 / res.Runs[1].TTFTms.P90
		if !strings.Contains(v.Headline, fmtTimes(ratio)) {
			t.Errorf("headline lacks round_robin's ratio %s: %s", fmtTimes(ratio), v.Headline)
		}
		if !strings.Contains(v.Rule, "lowest p90 TTFT among runs without errors") || !strings.Contains(v.Rule, "overlap") {
			t.Errorf("rule %q", v.Rule)
		}
	})
	t.Run("a tie", func(t *testing.T) {
		// The same distribution drawn twice: p90s differ by chance only.
		res := Result{Runs: []Run{
			ttftRun("round_robin", 1, 400, 80, 60),
			ttftRun("ttft", 2, 400, 40, 25),
			ttftRun("sglang", 3, 400, 40, 25),
		}}
		if res.Runs[1].TTFTms.P90 == res.Runs[2].TTFTms.P90 {
			t.Fatal("the two draws have the same p90: not a test of noise")
		}
		v, _ := Decide(res)
		if v.Clear() || len(v.Tied) != 2 || v.Tied[0] != v.Best || !slices.Contains(v.Tied, "ttft") || !slices.Contains(v.Tied, "sglang") {
			t.Fatalf("verdict %+v", v)
		}
		if !strings.HasPrefix(v.Headline, "verdict: no clear winner: ") || !strings.Contains(v.Headline, "within this run's noise") ||
			!strings.Contains(v.Headline, "round_robin") {
			t.Errorf("headline %s", v.Headline)
		}
	})
	t.Run("errors leave a run out", func(t *testing.T) {
		fast := ttftRun("ttft", 2, 400, 10, 5)
		fast.Errors = 3
		res := Result{Runs: []Run{ttftRun("round_robin", 1, 400, 80, 60), fast, ttftRun("sglang", 3, 400, 40, 25)}}
		v, _ := Decide(res)
		if v.Best != "sglang" || v.RunnerUp != "round_robin" || !strings.Contains(v.Rule, "ttft (3 errors)") {
			t.Fatalf("verdict %+v", v)
		}
		// round_robin is the runner-up: named once.
		if strings.Count(v.Headline, "round_robin") != 1 {
			t.Errorf("headline %s", v.Headline)
		}
	})
	t.Run("equal p90s: p99 decides", func(t *testing.T) {
		a, b := goldenRun(), goldenRun()
		a.Errors, b.Errors = 0, 0
		a.Policy, b.Policy = "a", "b"
		a.TTFTms.P99 = 500
		v, _ := Decide(Result{Runs: []Run{a, b}})
		if v.Best != "b" || v.RunnerUp != "a" || !v.Clear() || !strings.Contains(v.Headline, "noise was not estimated") {
			t.Errorf("verdict %+v", v)
		}
	})
	if _, ok := Decide(Result{Runs: []Run{ttftRun("target", 1, 10, 1, 1)}}); ok {
		t.Error("a verdict on one run")
	}
}

func TestDecideCapacity(t *testing.T) {
	capRun := func(name string, c float64, below float64) Run {
		r := goldenRun()
		r.Policy, r.CapacitySpeedup = name, fptr(c)
		if below > 0 {
			r.CapacityBelow = fptr(below)
		}
		return r
	}
	meta := map[string]any{"slo_ttft_p90": "2s", "capacity_precision": 1.0025}
	res := Result{Meta: meta, Runs: []Run{capRun("round_robin", 1.6727, 0), capRun("ttft", 3.8826, 0),
		capRun("score", 1.8093, 0), capRun("llmd", 0, 0.01)}}
	v, _ := Decide(res)
	if v.Best != "ttft" || v.RunnerUp != "score" || !v.Clear() || v.Chart != ChartCapacity {
		t.Fatalf("verdict %+v", v)
	}
	for _, want := range []string{"ttft has the highest capacity: 3.88x", "p90 TTFT ≤ 2s", "the runner-up score 1.81x (ttft serves 2.15× its load)",
		"round_robin 1.67x (ttft serves 2.32× its load)"} {
		if !strings.Contains(v.Headline, want) {
			t.Errorf("headline lacks %q: %s", want, v.Headline)
		}
	}
	// Within the search's precision: a tie.
	res.Runs[2] = capRun("score", 3.8826*1.001, 0)
	if v, _ := Decide(res); v.Clear() || !slices.Equal(v.Tied, []string{"score", "ttft"}) {
		t.Errorf("verdict %+v", v)
	}
	// Nobody passes.
	none := Result{Meta: meta, Runs: []Run{capRun("a", 0, 0.01), capRun("b", 0, 0.01)}}
	if v, _ := Decide(none); v.Best != "" || !strings.Contains(v.Headline, "no policy meets p90 TTFT ≤ 2s at any speed-up searched (down to 0.01x)") {
		t.Errorf("verdict %+v", v)
	}
}

func TestOutputsVerdict(t *testing.T) {
	testutil.Deterministic(t)
	res := Result{Runs: []Run{ttftRun("round_robin", 1, 300, 80, 60), ttftRun("ttft", 2, 300, 40, 25)}}
	dir := filepath.Join(t.TempDir(), "r")
	var table, log bytes.Buffer
	if err := (Outputs{ReportDir: dir, Title: "t", Verdict: true}).Write(&table, &log, res); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(table.String(), "\n")
	if !strings.HasPrefix(lines[0], "verdict: ttft has the lowest p90 TTFT") || !strings.HasPrefix(lines[1], "  rule: ") ||
		lines[2] != "  chart: "+filepath.Join(dir, "ttft_percentiles.svg") || lines[3] != "" || !strings.HasPrefix(lines[4], "policy ") {
		t.Fatalf("table output:\n%s", table.String())
	}
	page := string(readFile(t, filepath.Join(dir, "index.html")))
	// The verdict, then its chart, come before the run's description and the table.
	order := []string{`<section class="verdict"`, "verdict: ttft has the lowest p90 TTFT", `<figure id="ttft_percentiles">`,
		"<h2>Results</h2>", `<figure id="ttft_cdf">`}
	at := -1
	for _, s := range order {
		i := strings.Index(page, s)
		if i <= at {
			t.Fatalf("%q at %d, after the previous at %d", s, i, at)
		}
		at = i
	}
	if strings.Count(page, `<figure id="ttft_percentiles">`) != 1 {
		t.Error("the verdict's chart is shown twice")
	}
	if _, err := os.Stat(filepath.Join(dir, "ttft_percentiles.png")); err != nil {
		t.Error(err)
	}
	// The whiskers: one 90 % interval per policy, drawn as three strokes each.
	svg := string(readFile(t, filepath.Join(dir, "ttft_percentiles.svg")))
	if !strings.Contains(strings.ToLower(svg), "stroke:#222222") {
		t.Error("no whisker in ttft_percentiles.svg")
	}

	// Without Verdict (a sweep of one policy's settings): none.
	table.Reset()
	if err := (Outputs{}).Write(&table, &log, res); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(table.String(), "verdict") {
		t.Errorf("verdict without asking:\n%s", table.String())
	}
}

func TestCapacityBelowCell(t *testing.T) {
	r := goldenRun()
	r.CapacitySpeedup, r.CapacityBelow = fptr(0), fptr(0.01)
	tab := buildTable(Result{Runs: []Run{r}})
	if got := tab.Rows[0][len(tab.Rows[0])-1]; got != "< 0.01x" {
		t.Errorf("capacity cell %q", got)
	}
}

func TestWhiskersValidate(t *testing.T) {
	c := Chart{Name: "w", Bars: true, Series: []ChartSeries{{Name: "a", Y: []float64{1, 2}, YLo: []float64{math.NaN(), 3}, YHi: []float64{math.NaN(), 1}}}}
	if err := c.validate(); err == nil {
		t.Error("a whisker with lo > hi accepted")
	}
	c.Series[0].YLo, c.Series[0].YHi = []float64{math.NaN(), 1}, []float64{math.NaN(), 3}
	if err := c.validate(); err != nil {
		t.Error(err)
	}
	c.Bars = false
	c.Series[0].X = []float64{1, 2}
	if err := c.validate(); err == nil {
		t.Error("whiskers on lines accepted")
	}
}

// A policy far behind does not flatten the bars the verdict compares.
func TestPercentileChartCutsFarBehind(t *testing.T) {
	res := Result{Runs: []Run{ttftRun("round_robin", 1, 300, 80, 60), ttftRun("ttft", 2, 300, 40, 25),
		ttftRun("prefix_key", 3, 300, 1e6, 1e5)}}
	v, _ := Decide(res)
	c := percentileChart(res, v)
	if limit := 3 * res.Runs[0].TTFTms.P90; c.YMax > limit*1.05+1e-9 || c.YMax < res.Runs[0].TTFTP90CI.Hi {
		t.Errorf("y axis to %v; round_robin's p90 %v", c.YMax, res.Runs[0].TTFTms.P90)
	}
	if !strings.Contains(c.Caption, "The p90 bars of prefix_key run past the top") {
		t.Errorf("caption %q", c.Caption)
	}
	if err := c.validate(); err != nil {
		t.Error(err)
	}
}

// Sectioning sees requests that are slow together; for requests slow
// independently it is about as wide as the bootstrap.
func TestSectionedP90Interval(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	const n = 600
	ttfts := make([]float64, n)
	for i := range ttfts {
		ttfts[i] = 40 + 20*rng.ExpFloat64()
		if i >= 300 && i < 330 { // a stall: 30 consecutive requests (5 %) wait 400 ms more
			ttfts[i] += 400
		}
	}
	recsOf := func(order []float64) []Record {
		recs := make([]Record, n)
		for i, v := range order {
			recs[i] = rec(float64(i)*10, v, 10, 8, 100, 0, 0)
		}
		return recs
	}
	burst := recsOf(ttfts)
	sorted := slices.Sorted(slices.Values(ttfts))
	boot := QuantileInterval(sorted, 0.9, 0.9)
	sec, ok := SectionedP90Interval(burst)
	if !ok {
		t.Fatal("no interval")
	}
	p90 := Percentile(sorted, 0.9)
	if !(sec.Lo <= p90 && p90 <= sec.Hi) || sec.Hi-sec.Lo < 3*(boot.Hi-boot.Lo) {
		t.Errorf("burst: sectioned %+v, bootstrap %+v, p90 %v", sec, boot, p90)
	}
	// The same TTFTs in random order: no burst.
	shuffled := slices.Clone(ttfts)
	rng.Shuffle(n, func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
	iid, _ := SectionedP90Interval(recsOf(shuffled))
	if w, b := iid.Hi-iid.Lo, boot.Hi-boot.Lo; w > 2.5*b || w < b/2.5 {
		t.Errorf("independent: sectioned width %v, bootstrap width %v", w, b)
	}
	if _, ok := SectionedP90Interval(burst[:99]); ok {
		t.Error("an interval from 99 requests")
	}
}
