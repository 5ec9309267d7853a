package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvgate/kvgate/internal/report"
)

// vllmPage is a /metrics page with vLLM's TTFT histogram (two engine
// series, as a server with two data-parallel ranks has) and its ITL
// histogram under name: cumulative bucket counts at 0.05 s, 0.1 s and
// 0.5 s, and the sums.
func vllmPage(itlName string, ttft [3]int, ttftSum float64, itl [3]int, itlSum float64) string {
	var b strings.Builder
	series := func(name string, engine int, c [3]int, sum float64) {
		for i, le := range []string{"0.05", "0.1", "0.5", "+Inf"} {
			fmt.Fprintf(&b, "%s_bucket{engine=\"%d\",le=\"%s\",model_name=\"m\"} %d\n", name, engine, le, c[min(i, 2)])
		}
		fmt.Fprintf(&b, "%s_sum{engine=\"%d\",model_name=\"m\"} %g\n%s_count{engine=\"%d\",model_name=\"m\"} %d\n", name, engine, sum, name, engine, c[2])
	}
	b.WriteString("# TYPE vllm:time_to_first_token_seconds histogram\n")
	half := [3]int{ttft[0] / 2, ttft[1] / 2, ttft[2] / 2}
	series("vllm:time_to_first_token_seconds", 0, half, ttftSum/2)
	series("vllm:time_to_first_token_seconds", 1, [3]int{ttft[0] - half[0], ttft[1] - half[1], ttft[2] - half[2]}, ttftSum/2)
	fmt.Fprintf(&b, "# TYPE %s histogram\n", itlName)
	series(itlName, 0, itl, itlSum)
	return b.String()
}

// pages serves each GET /metrics the next of pages (the last one again
// once they run out).
func pages(t *testing.T, ps ...string) *httptest.Server {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := min(int(n.Add(1))-1, len(ps)-1)
		if ps[i] == "" {
			http.Error(w, "down", http.StatusInternalServerError)
			return
		}
		_, _ = io.WriteString(w, ps[i])
	}))
	t.Cleanup(srv.Close)
	return srv
}

// The engines' figures over a run are the difference of their histograms
// read before and after it, summed over replicas and series: the mean
// exact, the percentiles interpolated in their bucket; outside = the
// client's mean − the engines'. vLLM's older ITL name counts too.
func TestEngineSplit(t *testing.T) {
	a := pages(t,
		vllmPage("vllm:inter_token_latency_seconds", [3]int{2, 4, 4}, 0.2, [3]int{10, 10, 10}, 0.1),
		vllmPage("vllm:inter_token_latency_seconds", [3]int{2, 10, 12}, 1.4, [3]int{30, 40, 40}, 1.1))
	b := pages(t,
		vllmPage("vllm:time_per_output_token_seconds", [3]int{0, 0, 0}, 0, [3]int{0, 0, 0}, 0),
		vllmPage("vllm:time_per_output_token_seconds", [3]int{0, 2, 4}, 0.8, [3]int{10, 20, 20}, 0.5))
	urls := EngineURLs("http://gw", []string{a.URL + "#0", a.URL + "#1", b.URL})
	if len(urls) != 2 || urls[0] != a.URL || urls[1] != b.URL {
		t.Fatalf("EngineURLs = %v", urls)
	}
	ctx := context.Background()
	before := ScrapeEngines(ctx, nil, urls, nil)
	after := ScrapeEngines(ctx, nil, urls, nil)
	run := report.Run{Requests: 12, TTFTms: report.Dist{Mean: 250}, ITLms: report.Dist{Mean: 40}}
	sp, note, err := EngineSplit(before, after, run)
	if err != nil || note != "" {
		t.Fatalf("EngineSplit: %v (note %q)", err, note)
	}
	// TTFT over the run: a 8 first tokens (6 in 50–100 ms, 2 in 100–500),
	// b 4 (2 and 2), 2 s in all: cumulative 0, 8, 12 at 50, 100, 500 ms.
	// p50: rank 6 in (50, 100] → 50 + 50·6/8; p90: rank 10.8 in (100, 500]
	// → 100 + 400·2.8/4.
	wantTTFT := report.Dist{Mean: 2000.0 / 12, P50: 50 + 50*6.0/8, P90: 100 + 400*2.8/4, P99: 100 + 400*3.88/4}
	// ITL: cumulative 30, 50, 50 gaps (a 20, 30, 30; b 10, 20, 20), 1.5 s.
	wantITL := report.Dist{Mean: 1500.0 / 50, P50: 50 * 25.0 / 30, P90: 50 + 50*15.0/20, P99: 50 + 50*19.5/20}
	if sp.Source != report.SplitEngineMetrics || sp.Requests != 12 || !distClose(sp.EngineTTFTms, wantTTFT) ||
		!distClose(sp.EngineITLms, wantITL) {
		t.Fatalf("split %+v\nwant TTFT %+v ITL %+v", sp, wantTTFT, wantITL)
	}
	if math.Abs(sp.OutsideTTFTMeanms-(250-2000.0/12)) > 1e-9 || math.Abs(sp.OutsideITLMeanms-10) > 1e-9 ||
		sp.OutsideTTFTms != nil {
		t.Errorf("outside means %v, %v (dist %v)", sp.OutsideTTFTMeanms, sp.OutsideITLMeanms, sp.OutsideTTFTms)
	}
	// Fewer requests than first tokens counted: other clients'.
	run.Requests = 6
	if _, note, _ := EngineSplit(before, after, run); !strings.Contains(note, "other clients'") {
		t.Errorf("note %q does not say other clients' are counted", note)
	}
}

func distClose(a, b report.Dist) bool {
	near := func(x, y float64) bool { return math.Abs(x-y) < 1e-9*max(1, math.Abs(y)) }
	return near(a.Mean, b.Mean) && near(a.P50, b.P50) && near(a.P90, b.P90) && near(a.P99, b.P99)
}

// Without the histograms, or without a readable page, there is no split,
// and the error says why; a replica read only once is left out and named.
func TestEngineSplitUnavailable(t *testing.T) {
	ctx := context.Background()
	run := report.Run{Requests: 4, TTFTms: report.Dist{Mean: 100}}
	plain := pages(t, "go_goroutines 7\n")
	down := pages(t, "")
	idle := pages(t, vllmPage("vllm:inter_token_latency_seconds", [3]int{1, 1, 1}, 0.01, [3]int{}, 0))
	good := pages(t, vllmPage("vllm:inter_token_latency_seconds", [3]int{}, 0, [3]int{}, 0),
		vllmPage("vllm:inter_token_latency_seconds", [3]int{4, 4, 4}, 0.1, [3]int{}, 0))
	flaky := pages(t, "", vllmPage("vllm:inter_token_latency_seconds", [3]int{4, 4, 4}, 0.1, [3]int{}, 0))
	tests := []struct {
		name string
		urls []string
		want string // in the error, or "" for a split
		note string
	}{
		{"no histograms", []string{plain.URL}, ErrNoEngineMetrics.Error(), ""},
		{"unreadable", []string{down.URL}, "could be read", ""},
		{"no first token", []string{idle.URL}, "counted no first token", ""},
		{"one replica read once", []string{good.URL, flaky.URL}, "", "without " + flaky.URL},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := ScrapeEngines(ctx, nil, tc.urls, nil)
			after := ScrapeEngines(ctx, nil, tc.urls, nil)
			sp, note, err := EngineSplit(before, after, run)
			switch {
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("err = %v, want %q", err, tc.want)
			case tc.want == "" && (err != nil || sp == nil || sp.Requests != 4 || !strings.Contains(note, tc.note)):
				t.Errorf("split %+v note %q err %v, want 4 first tokens and a note %q", sp, note, err, tc.note)
			}
		})
	}
	if _, _, err := EngineSplit(EngineMetrics{}, EngineMetrics{}, run); !errors.Is(err, ErrNoEngineMetrics) {
		t.Errorf("nothing read: %v", err)
	}
}
