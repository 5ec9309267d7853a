package report

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// split adds engine times (ms) to a record built by rec: its TTFT and E2E
// keep their values, of which the engine took these.
func split(r Record, engineTTFT, engineE2E float64) Record {
	d := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	r.EngineTTFT, r.EngineE2E = d(engineTTFT), d(engineE2E)
	return r
}

// Summarize splits the TTFT and ITL of the records that carry their
// engine's times into the engine's part and the rest, per request; records
// without (failed, or from a replica that told nothing) stay out of it.
func TestSummarizeSplit(t *testing.T) {
	recs := []Record{
		// TTFT 30 of which engine 20; e2e 30 + 4×10 = 70 of which engine 20 + 4×8.
		split(rec(0, 30, 10, 5, 100, 0, 0), 20, 52),
		// TTFT 50 of which engine 44; e2e 50 + 2×12 = 74 of which engine 44 + 2×11.
		split(rec(10, 50, 12, 3, 100, 0, 1), 44, 66),
		// One token: in the TTFT split, not in the ITL split.
		split(rec(20, 40, 0, 1, 100, 0, 1), 39, 39),
		// No engine times: left out of the split.
		rec(30, 500, 10, 5, 100, 0, 0),
		{Start: 40 * msec, Replica: 0, Err: true, EngineTTFT: 5 * msec},
	}
	run := Summarize("p", recs, 2, 0)
	sp := run.Split
	if sp == nil {
		t.Fatal("no split")
	}
	if sp.Source != SplitPerRequest || sp.Requests != 3 {
		t.Errorf("source %q requests %d, want %q 3", sp.Source, sp.Requests, SplitPerRequest)
	}
	want := map[string]Dist{
		"engine ttft":  {Mean: 103.0 / 3, P50: 39, P90: 44 - 0.2*5, P99: 44 - 0.02*5},
		"outside ttft": {Mean: 17.0 / 3, P50: 6, P90: 10 - 0.2*4, P99: 10 - 0.02*4},
		"engine itl":   {Mean: 9.5, P50: 9.5, P90: 10.7, P99: 10.97},
		"outside itl":  {Mean: 1.5, P50: 1.5, P90: 1.9, P99: 1.99},
	}
	got := map[string]Dist{"engine ttft": sp.EngineTTFTms, "engine itl": sp.EngineITLms}
	if sp.OutsideTTFTms != nil && sp.OutsideITLms != nil {
		got["outside ttft"], got["outside itl"] = *sp.OutsideTTFTms, *sp.OutsideITLms
	}
	for k, w := range want {
		if g, ok := got[k]; !ok || !distNear(g, w) {
			t.Errorf("%s = %+v, want %+v", k, g, w)
		}
	}
	if !near(sp.OutsideTTFTMeanms, want["outside ttft"].Mean) || !near(sp.OutsideITLMeanms, want["outside itl"].Mean) {
		t.Errorf("outside means %v, %v", sp.OutsideTTFTMeanms, sp.OutsideITLMeanms)
	}
	if run := Summarize("p", recs[3:], 2, 0); run.Split != nil {
		t.Errorf("split %+v from records without engine times", run.Split)
	}
}

func splitRun() Run {
	r := goldenRun()
	ot, oi := Dist{Mean: 4, P50: 3, P90: 8, P99: 12}, Dist{Mean: 0.5, P50: 0.4, P90: 1, P99: 2}
	r.Split = &Split{Source: SplitPerRequest, Requests: 3, EngineTTFTms: Dist{Mean: 30, P50: 25, P90: 60, P99: 90},
		OutsideTTFTms: &ot, OutsideTTFTMeanms: 4, EngineITLms: Dist{Mean: 10, P50: 10, P90: 12, P99: 14},
		OutsideITLms: &oi, OutsideITLMeanms: 0.5}
	return r
}

// The split is in the JSON (read back whole), in the table (the means,
// with a line saying what they are) and on the HTML page; a non-finite
// figure in it is refused like any other.
func TestSplitOutputs(t *testing.T) {
	res := Result{Runs: []Run{splitRun(), goldenRun()}}
	var b bytes.Buffer
	if err := WriteJSON(&b, res); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Runs []map[string]json.RawMessage `json:"runs"`
	}
	if err := json.Unmarshal(b.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	if _, ok := doc.Runs[1]["split"]; ok {
		t.Error("a run without a split has a split key")
	}
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(doc.Runs[0]["split"], &keys); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"source", "requests", "engine_ttft_ms", "outside_ttft_ms", "outside_ttft_mean_ms",
		"engine_itl_ms", "outside_itl_ms", "outside_itl_mean_ms"} {
		if _, ok := keys[k]; !ok {
			t.Errorf("split lacks %q: %s", k, doc.Runs[0]["split"])
		}
	}
	back, err := ReadJSON(&b)
	if err != nil {
		t.Fatal(err)
	}
	if g, w := back.Runs[0].Split, res.Runs[0].Split; g == nil || *g.OutsideTTFTms != *w.OutsideTTFTms || g.EngineTTFTms != w.EngineTTFTms {
		t.Errorf("split read back %+v, want %+v", g, w)
	}

	var tb bytes.Buffer
	WriteTable(&tb, res)
	lines := strings.Split(strings.TrimSpace(tb.String()), "\n")
	if !strings.Contains(lines[0], "engine ttft ms") || !strings.Contains(lines[0], "outside ttft ms") ||
		!strings.HasSuffix(lines[1], "30.0              4.0") || !strings.HasSuffix(lines[2], "-                -") ||
		!strings.HasPrefix(lines[3], "engine/outside ttft: means") {
		t.Errorf("table:\n%s", tb.String())
	}
	WriteTable(&tb, Result{Runs: []Run{goldenRun()}})
	if strings.Count(tb.String(), "engine ttft") != 1 {
		t.Errorf("split columns without a split:\n%s", tb.String())
	}

	dir := t.TempDir()
	if err := WriteReport(dir, res, "split"); err != nil {
		t.Fatal(err)
	}
	page, err := os.ReadFile(filepath.Join(dir, "index.html"))
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{`<h2 id="split">Where the time went</h2>`, "<td class=\"txt\">" + res.Runs[0].Policy + "</td><td class=\"txt\">per_request</td>",
		"<b>engine</b> and <b>outside</b> ttft"} {
		if !bytes.Contains(page, []byte(s)) {
			t.Errorf("index.html lacks %q", s)
		}
	}

	for _, mod := range []func(*Split){
		func(s *Split) { s.EngineTTFTms.P90 = math.NaN() },
		func(s *Split) { s.OutsideITLms.Mean = math.Inf(1) },
		func(s *Split) { s.OutsideTTFTMeanms = math.NaN() },
	} {
		r := splitRun()
		mod(r.Split)
		if err := WriteJSON(&bytes.Buffer{}, Result{Runs: []Run{r}}); !errors.Is(err, ErrNonFinite) {
			t.Errorf("err = %v, want ErrNonFinite", err)
		}
	}
}
