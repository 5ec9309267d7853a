package report

import (
	"bytes"
	"encoding/xml"
	"errors"
	"image/png"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"gonum.org/v1/plot"

	"github.com/kvgate/kvgate/internal/testutil"
)

// sampleResult summarises seeded synthetic runs: per policy, exponential TTFTs on a
// different scale, a hit rate that grows over time, and random replicas.
func sampleResult(t *testing.T, policies []string, replicas, n int) Result {
	t.Helper()
	rng := rand.New(rand.NewPCG(7, 11))
	var res Result
	for pi, pol := range policies {
		recs := make([]Record, 0, n)
		for i := range n {
			ttft := 15 + rng.ExpFloat64()*float64(40*(pi+1))
			r := rec(float64(i)*25, ttft, 8+rng.Float64()*4, 1+rng.IntN(256), 2000, min(2000, i*(pi+1)*2), rng.IntN(replicas))
			r.Err = rng.IntN(100) == 0
			recs = append(recs, r)
		}
		res.Runs = append(res.Runs, Summarize(pol, recs, replicas, 0))
	}
	return res
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

var (
	externalRef = regexp.MustCompile(`(?i)(https?://|//[a-z0-9.-]+\.[a-z]{2,}/|<script|<link|<iframe|<img)`)
	inlineSVGRe = regexp.MustCompile(`(?s)<svg\b.*?</svg>`)
)

func TestWriteReport(t *testing.T) {
	testutil.Deterministic(t)
	res := sampleResult(t, []string{"round_robin", "least_load", "ttft"}, 4, 400)
	res.Bound = &Bound{PrefixReuse: 0.83, MergedLRU: 0.71}
	res.Runs[2].CapacitySpeedup = fptr(2.75)
	res.Runs[2].Extra = map[string]float64{"hit_rate_vs_bound": 0.8765}
	res.Meta = map[string]any{
		"command":  "kvgate bench --target http://127.0.0.1:8000 --workload multiturn",
		"seed":     42,
		"workload": "multiturn",
		"replicas": 4,
	}
	staleness := Chart{
		Name: "p90_vs_staleness", Title: "p90 TTFT vs staleness",
		XLabel: "staleness (ms)", YLabel: "p90 TTFT (ms)", LogX: true,
		Caption: "Lower is better.",
		Series: []ChartSeries{
			{Name: "ttft", X: []float64{1, 10, 100, 1000}, Y: []float64{120, 125, 160, 400}, Points: true},
			{Name: "llmd", X: []float64{1, 10, 100, 1000}, Y: []float64{150, 150, 170, 300}, Points: true},
		},
		Refs: []RefLine{{Label: "SLO p90 2 s", Y: 2000}},
	}
	dir := filepath.Join(t.TempDir(), "out", "report") // created by WriteReport
	if err := WriteReport(dir, res, "kvgate bench <multiturn>", staleness); err != nil {
		t.Fatal(err)
	}

	names := []string{ChartTTFTCDF, ChartHitRate, ChartReplicaShare, "p90_vs_staleness"}
	for _, n := range names {
		svg := readFile(t, filepath.Join(dir, n+".svg"))
		// The standalone SVG is well-formed XML with its namespace.
		if err := wellFormed(svg); err != nil {
			t.Errorf("%s.svg: %v", n, err)
		}
		if !bytes.Contains(svg, []byte(`xmlns="http://www.w3.org/2000/svg"`)) {
			t.Errorf("%s.svg lacks the SVG namespace (needed standalone)", n)
		}
		img, err := png.Decode(bytes.NewReader(readFile(t, filepath.Join(dir, n+".png"))))
		if err != nil {
			t.Fatalf("%s.png: %v", n, err)
		}
		if b := img.Bounds(); b.Dx() != 8*pngDPI || b.Dy() < 4*pngDPI {
			t.Errorf("%s.png is %v, want 8 in × ≥4 in at %d dpi", n, b, pngDPI)
		}
	}

	got, err := ReadJSON(bytes.NewReader(readFile(t, filepath.Join(dir, "result.json"))))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Runs) != 3 || got.Runs[2].Policy != "ttft" || got.Runs[2].TTFTms != res.Runs[2].TTFTms || *got.Runs[2].CapacitySpeedup != 2.75 {
		t.Errorf("result.json = %+v", got)
	}

	page := string(readFile(t, filepath.Join(dir, "index.html")))
	if m := externalRef.FindString(page); m != "" {
		i := strings.Index(page, m)
		t.Errorf("index.html has an external reference %q: …%s…", m, page[max(0, i-80):min(len(page), i+80)])
	}
	if strings.Contains(page, "<?xml") || strings.Contains(page, "xmlns") {
		t.Error("index.html inlines SVG with its XML header or namespaces")
	}
	svgs := inlineSVGRe.FindAllString(page, -1)
	if len(svgs) != len(names) {
		t.Errorf("index.html has %d inline <svg>, want %d", len(svgs), len(names))
	}
	for i, s := range svgs {
		if err := wellFormed([]byte(s)); err != nil {
			t.Errorf("inline svg %d: %v", i, err)
		}
	}
	for _, n := range names {
		if !strings.Contains(page, `<figure id="`+n+`">`) {
			t.Errorf("index.html lacks figure %s", n)
		}
	}
	// Every figure of the table, as the terminal prints it, is on the page.
	for _, row := range htmlTable(res).Rows {
		for _, cell := range row {
			if !strings.Contains(page, ">"+cell+"</td>") {
				t.Errorf("index.html lacks table cell %q", cell)
			}
		}
	}
	var term bytes.Buffer
	WriteTable(&term, res)
	for _, f := range strings.Fields(term.String()) {
		if !strings.Contains(page, strings.ReplaceAll(f, "'", "&#39;")) {
			t.Errorf("index.html lacks %q of the terminal table", f)
		}
	}
	for _, want := range []string{
		"2.75x", "0.8765", "hit_rate_vs_bound", // capacity and extra columns
		"prefix reuse 83.0%", "merged LRU 71.0%", // bounds
		"kvgate bench --target http:&#47;&#47;127.0.0.1:8000 --workload multiturn", // meta, shown as text
		"<dt>seed</dt><dd>42</dd>", "<dt>workload</dt><dd>multiturn</dd>",
		"<title>kvgate bench &lt;multiturn&gt;</title>", // escaped
		"How to read", "Lower is better.",
		`href="result.json"`, `href="ttft_cdf.png"`,
	} {
		if !strings.Contains(page, want) {
			t.Errorf("index.html lacks %q", want)
		}
	}
	// meta order: command, seed, workload, then the rest by name
	if a, b, c, d := strings.Index(page, "<dt>command"), strings.Index(page, "<dt>seed"), strings.Index(page, "<dt>workload"), strings.Index(page, "<dt>replicas"); !(a < b && b < c && c < d) {
		t.Errorf("meta order: command@%d seed@%d workload@%d replicas@%d", a, b, c, d)
	}
}

func wellFormed(doc []byte) error {
	d := xml.NewDecoder(bytes.NewReader(doc))
	for {
		_, err := d.Token()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

func TestWriteReportDeterministic(t *testing.T) {
	testutil.Deterministic(t)
	res := sampleResult(t, []string{"p2c", "ttft"}, 3, 200)
	res.Meta = map[string]any{"seed": 1, "b": "x", "a": "y", "workload": "zipf"}
	var pages [2][]byte
	var svgs [2][]byte
	for i := range pages {
		dir := t.TempDir()
		if err := WriteReport(dir, res, "t"); err != nil {
			t.Fatal(err)
		}
		pages[i] = readFile(t, filepath.Join(dir, "index.html"))
		svgs[i] = readFile(t, filepath.Join(dir, ChartTTFTCDF+".svg"))
	}
	if !bytes.Equal(pages[0], pages[1]) || !bytes.Equal(svgs[0], svgs[1]) {
		t.Error("same input, different report")
	}
}

func TestWriteReportFromJSON(t *testing.T) {
	testutil.Deterministic(t)
	// A result read back from JSON has no series: the TTFT chart falls back to the three
	// percentiles, the hit-rate chart is left out with a note, and the shares still draw.
	res := sampleResult(t, []string{"round_robin", "ttft"}, 4, 100)
	var b bytes.Buffer
	if err := WriteJSON(&b, res); err != nil {
		t.Fatal(err)
	}
	back, err := ReadJSON(&b)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := WriteReport(dir, back, "from json"); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, ChartHitRate+".svg")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("hit-rate chart written without series (stat err %v)", err)
	}
	for _, n := range []string{ChartTTFTCDF, ChartReplicaShare} {
		if _, err := png.Decode(bytes.NewReader(readFile(t, filepath.Join(dir, n+".png")))); err != nil {
			t.Errorf("%s.png: %v", n, err)
		}
	}
	page := string(readFile(t, filepath.Join(dir, "index.html")))
	for _, want := range []string{"ttft (p50/p90/p99)", "round_robin (p50/p90/p99)", "Hit rate over time: not available"} {
		if !strings.Contains(page, want) {
			t.Errorf("index.html lacks %q", want)
		}
	}
}

func TestWriteReportRejectsBadCharts(t *testing.T) {
	res := sampleResult(t, []string{"ttft"}, 2, 20)
	ok := ChartSeries{Name: "a", X: []float64{1, 2}, Y: []float64{1, 2}}
	tests := []struct {
		name  string
		chart Chart
	}{
		{"empty name", Chart{Series: []ChartSeries{ok}}},
		{"path in name", Chart{Name: "../x", Series: []ChartSeries{ok}}},
		{"upper case", Chart{Name: "Chart", Series: []ChartSeries{ok}}},
		{"clashes with builtin", Chart{Name: ChartTTFTCDF, Series: []ChartSeries{ok}}},
		{"clashes with hit rate", Chart{Name: ChartHitRate, Series: []ChartSeries{ok}}},
		{"length mismatch", Chart{Name: "c", Series: []ChartSeries{{Name: "a", X: []float64{1}, Y: []float64{1, 2}}}}},
		{"NaN y", Chart{Name: "c", Series: []ChartSeries{{Name: "a", X: []float64{1}, Y: []float64{math.NaN()}}}}},
		{"Inf x", Chart{Name: "c", Series: []ChartSeries{{Name: "a", X: []float64{math.Inf(1)}, Y: []float64{1}}}}},
		{"zero on log x", Chart{Name: "c", LogX: true, Series: []ChartSeries{{Name: "a", X: []float64{0, 1}, Y: []float64{1, 2}}}}},
		{"negative on log y", Chart{Name: "c", LogY: true, Series: []ChartSeries{{Name: "a", X: []float64{1, 2}, Y: []float64{-1, 2}}}}},
		{"ref on log y", Chart{Name: "c", LogY: true, Series: []ChartSeries{ok}, Refs: []RefLine{{Label: "r", Y: 0}}}},
		{"log y from zero", Chart{Name: "c", LogY: true, YMin: 0, YMax: 10, Series: []ChartSeries{ok}}},
		{"log x bars", Chart{Name: "c", LogX: true, Bars: true, Series: []ChartSeries{ok}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "r")
			err := WriteReport(dir, res, "t", Chart{Name: "fine", Series: []ChartSeries{ok}}, tt.chart)
			if !errors.Is(err, ErrInvalidChart) {
				t.Fatalf("err = %v, want ErrInvalidChart", err)
			}
			if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("report directory written before validation (stat err %v)", err)
			}
		})
	}
	t.Run("duplicate extra", func(t *testing.T) {
		c := Chart{Name: "same", Series: []ChartSeries{ok}}
		if err := WriteReport(t.TempDir(), res, "t", c, c); !errors.Is(err, ErrInvalidChart) {
			t.Errorf("err = %v, want ErrInvalidChart", err)
		}
	})
}

func TestWriteReportNonFinite(t *testing.T) {
	res := sampleResult(t, []string{"ttft"}, 2, 20)
	res.Runs[0].HitRate = math.NaN()
	dir := filepath.Join(t.TempDir(), "r")
	if err := WriteReport(dir, res, "t"); !errors.Is(err, ErrNonFinite) {
		t.Fatalf("err = %v, want ErrNonFinite", err)
	}
}

// TestChartScales renders charts at the edges: many policies (the legend grows the canvas),
// many replicas (lines instead of bars), log axes, empty series, a single point.
func TestChartScales(t *testing.T) {
	testutil.Deterministic(t)
	many := make([]string, 40)
	for i := range many {
		many[i] = "policy_" + string(rune('a'+i%26)) + string(rune('a'+i/26))
	}
	wide := sampleResult(t, many[:16], 64, 50)
	tests := []struct {
		name      string
		chart     Chart
		col       colours
		minHeight int // PNG pixels
	}{
		{"16 policies × 64 replicas as lines", replicaShareChart(wide), newColours(wide), 4 * pngDPI},
		{"4 replicas as bars", replicaShareChart(sampleResult(t, many[:3], 4, 50)), colours{}, 4 * pngDPI},
		{"40 series grow the canvas", func() Chart {
			c := Chart{Name: "many", Title: "many", XLabel: "x", YLabel: "y"}
			for i, n := range many {
				c.Series = append(c.Series, ChartSeries{Name: n, X: []float64{0, 1}, Y: []float64{float64(i), float64(i + 1)}})
			}
			return c
		}(), colours{}, 5 * pngDPI},
		{"log both axes", Chart{Name: "loglog", LogX: true, LogY: true, Series: []ChartSeries{{Name: "a", X: []float64{0.5, 5, 5000}, Y: []float64{1e-3, 1, 1e3}}}}, colours{}, 4 * pngDPI},
		{"empty series and fixed y", Chart{Name: "empty", YMin: 0, YMax: 1, Series: []ChartSeries{{Name: "none"}}}, colours{}, 4 * pngDPI},
		{"no series at all", Chart{Name: "nothing"}, colours{}, 4 * pngDPI},
		{"log axes without data", Chart{Name: "logempty", LogX: true, LogY: true, Series: []ChartSeries{{Name: "none"}}}, colours{}, 4 * pngDPI},
		{"log axes, one point below 1", Chart{Name: "logone", LogX: true, LogY: true, Series: []ChartSeries{{Name: "a", X: []float64{0.5}, Y: []float64{0.25}}}}, colours{}, 4 * pngDPI},
		{"single point", Chart{Name: "one", Series: []ChartSeries{{Name: "a", X: []float64{3}, Y: []float64{3}, Points: true}}}, colours{}, 4 * pngDPI},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := tt.chart.render(tt.col, "png")
			if err != nil {
				t.Fatal(err)
			}
			img, err := png.Decode(bytes.NewReader(b))
			if err != nil {
				t.Fatal(err)
			}
			if img.Bounds().Dy() < tt.minHeight {
				t.Errorf("height %d px, want ≥ %d", img.Bounds().Dy(), tt.minHeight)
			}
			s, err := tt.chart.render(tt.col, "svg")
			if err != nil {
				t.Fatal(err)
			}
			if err := wellFormed(s); err != nil {
				t.Error(err)
			}
		})
	}
	if c := replicaShareChart(wide); c.Bars {
		t.Error("16 × 64 bars: want lines")
	}
	if c := replicaShareChart(sampleResult(t, many[:3], 4, 10)); !c.Bars {
		t.Error("3 × 4 bars: want bars")
	}
}

func TestColoursFollowPolicies(t *testing.T) {
	res := Result{Runs: []Run{{Policy: "b"}, {Policy: "a"}}}
	col := newColours(res)
	// Run order first, then other names as they appear; the same name keeps its colour.
	for _, tt := range []struct {
		name string
		want int
	}{{"b", 0}, {"a", 1}, {"other", 2}, {"a", 1}, {"more", 3}} {
		if got := col.index(tt.name); got != tt.want {
			t.Errorf("index(%q) = %d, want %d", tt.name, got, tt.want)
		}
	}
	if styleFor(0, false).Dashes != nil || styleFor(len(palette), false).Dashes == nil {
		t.Error("want solid lines for the palette's first use, dashed after")
	}
	if styleFor(0, false).Color == styleFor(1, false).Color {
		t.Error("first two colours equal")
	}
}

func TestTicks(t *testing.T) {
	labels := func(ts []string) string { return strings.Join(ts, " ") }
	cases := []struct {
		name   string
		log    bool
		lo, hi float64
		want   string
	}{
		{"percent", false, 0, 100, "0 20 40 60 80 100"},
		{"fraction", false, 0, 1, "0.0 0.2 0.4 0.6 0.8 1.0"},
		{"offset seconds", false, 0.25, 9.75, "2 4 6 8"},
		{"negative", false, -3, 3, "-3 -2 -1 0 1 2 3"},
		{"tiny", false, 0, 0.003, "0.0000 0.0005 0.0010 0.0015 0.0020 0.0025 0.0030"},
		{"degenerate", false, 5, 5, "5"},
		{"log 40-400", true, 40, 400, "50 100 200"},
		{"log decades", true, 1, 10000, "1 2 5 10 20 50 100 200 500 1000 2000 5000 10000"},
		{"log sub-ms", true, 0.05, 0.3, "0.05 0.1 0.2"},
	}
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			var got []string
			var ticks []plot.Tick
			if tt.log {
				ticks = logTicks{}.Ticks(tt.lo, tt.hi)
			} else {
				ticks = niceTicks{}.Ticks(tt.lo, tt.hi)
			}
			for _, tk := range ticks {
				if tk.Value < tt.lo-1e-9 || tk.Value > tt.hi+1e-9 {
					t.Errorf("tick %v outside [%v, %v]", tk.Value, tt.lo, tt.hi)
				}
				if tk.Label != "" {
					got = append(got, tk.Label)
				}
			}
			if labels(got) != tt.want {
				t.Errorf("labels = %q, want %q", labels(got), tt.want)
			}
		})
	}
}
