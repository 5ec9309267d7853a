package report

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

func fptr(v float64) *float64 { return &v }

func goldenRun() Run {
	return Run{
		Policy: "ttft", Requests: 500, Errors: 2,
		TTFTms:           Dist{Mean: 120.5, P50: 100, P90: 250.25, P99: 400},
		ITLms:            Dist{Mean: 10, P50: 9.5, P90: 12, P99: 20},
		E2Ems:            Dist{Mean: 2100, P50: 2000, P90: 2600, P99: 3100},
		ThroughputRPS:    12.5,
		OutputTokensPerS: 2500,
		HitRate:          0.625,
		Imbalance:        1.2,
		ReplicaShare:     []float64{0.3, 0.25, 0.25, 0.2},
	}
}

func TestWriteJSONGolden(t *testing.T) {
	withCap := goldenRun()
	withCap.CapacitySpeedup = fptr(3.5)
	withCap.Extra = map[string]float64{"hit_rate_vs_bound": 0.9}
	noShares := goldenRun()
	noShares.ReplicaShare = nil
	noShares.Series = &Series{TTFTCDF: []Point{{1, 1}}} // never written

	tests := []struct {
		name string
		res  Result
		want string
	}{
		{
			name: "bench",
			res:  Result{Runs: []Run{goldenRun()}},
			want: `{
  "runs": [
    {
      "policy": "ttft",
      "requests": 500,
      "errors": 2,
      "ttft_ms": {
        "mean": 120.5,
        "p50": 100,
        "p90": 250.25,
        "p99": 400
      },
      "itl_ms": {
        "mean": 10,
        "p50": 9.5,
        "p90": 12,
        "p99": 20
      },
      "e2e_ms": {
        "mean": 2100,
        "p50": 2000,
        "p90": 2600,
        "p99": 3100
      },
      "throughput_rps": 12.5,
      "output_tokens_per_s": 2500,
      "hit_rate": 0.625,
      "imbalance": 1.2,
      "replica_share": [
        0.3,
        0.25,
        0.25,
        0.2
      ]
    }
  ]
}
`,
		},
		{
			name: "replay with bound, capacity and extra",
			res:  Result{Bound: &Bound{PrefixReuse: 0.8, MergedLRU: 0.7}, Runs: []Run{withCap}},
			want: `{
  "bound": {
    "prefix_reuse": 0.8,
    "merged_lru": 0.7
  },
  "runs": [
    {
      "policy": "ttft",
      "requests": 500,
      "errors": 2,
      "ttft_ms": {
        "mean": 120.5,
        "p50": 100,
        "p90": 250.25,
        "p99": 400
      },
      "itl_ms": {
        "mean": 10,
        "p50": 9.5,
        "p90": 12,
        "p99": 20
      },
      "e2e_ms": {
        "mean": 2100,
        "p50": 2000,
        "p90": 2600,
        "p99": 3100
      },
      "throughput_rps": 12.5,
      "output_tokens_per_s": 2500,
      "hit_rate": 0.625,
      "imbalance": 1.2,
      "replica_share": [
        0.3,
        0.25,
        0.25,
        0.2
      ],
      "capacity_speedup": 3.5,
      "extra": {
        "hit_rate_vs_bound": 0.9
      }
    }
  ]
}
`,
		},
		{
			name: "nil slices are empty arrays, series never written",
			res:  Result{},
			want: "{\n  \"runs\": []\n}\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b bytes.Buffer
			if err := WriteJSON(&b, tt.res); err != nil {
				t.Fatal(err)
			}
			if b.String() != tt.want {
				t.Errorf("got\n%s\nwant\n%s", b.String(), tt.want)
			}
		})
	}

	t.Run("nil replica_share", func(t *testing.T) {
		var b bytes.Buffer
		if err := WriteJSON(&b, Result{Runs: []Run{noShares}}); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(b.String(), `"replica_share": []`) || strings.Contains(b.String(), "null") {
			t.Errorf("want replica_share [] and no null:\n%s", b.String())
		}
		if strings.Contains(b.String(), "TTFTCDF") || strings.Contains(b.String(), "series") {
			t.Errorf("series leaked into JSON:\n%s", b.String())
		}
	})
}

// TestWriteJSONFieldNames checks the key sets against the contract in DESIGN.md, so that a
// renamed tag fails even where the golden strings would be updated carelessly.
func TestWriteJSONFieldNames(t *testing.T) {
	r := goldenRun()
	r.CapacitySpeedup = fptr(2)
	var b bytes.Buffer
	if err := WriteJSON(&b, Result{Bound: &Bound{}, Runs: []Run{r, goldenRun()}}); err != nil {
		t.Fatal(err)
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(b.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	keysOf := func(raw json.RawMessage) []string {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatal(err)
		}
		var ks []string
		for k := range m {
			ks = append(ks, k)
		}
		slices.Sort(ks)
		return ks
	}
	check := func(what string, got, want []string) {
		t.Helper()
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Errorf("%s keys = %v, want %v", what, got, want)
		}
	}
	check("top", keysOf(b.Bytes()), []string{"bound", "runs"})
	check("bound", keysOf(doc["bound"]), []string{"prefix_reuse", "merged_lru"})
	var runs []json.RawMessage
	if err := json.Unmarshal(doc["runs"], &runs); err != nil {
		t.Fatal(err)
	}
	base := []string{"policy", "requests", "errors", "ttft_ms", "itl_ms", "e2e_ms", "throughput_rps",
		"output_tokens_per_s", "hit_rate", "imbalance", "replica_share"}
	check("run with capacity", keysOf(runs[0]), append(slices.Clone(base), "capacity_speedup"))
	check("run", keysOf(runs[1]), base)
	var run map[string]json.RawMessage
	if err := json.Unmarshal(runs[0], &run); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"ttft_ms", "itl_ms", "e2e_ms"} {
		check(d, keysOf(run[d]), []string{"mean", "p50", "p90", "p99"})
	}
}

func TestWriteJSONNonFinite(t *testing.T) {
	tests := []struct {
		name string
		mod  func(*Result)
	}{
		{"NaN mean", func(r *Result) { r.Runs[0].TTFTms.Mean = math.NaN() }},
		{"Inf throughput", func(r *Result) { r.Runs[0].ThroughputRPS = math.Inf(1) }},
		{"NaN share", func(r *Result) { r.Runs[0].ReplicaShare[1] = math.NaN() }},
		{"NaN capacity", func(r *Result) { r.Runs[0].CapacitySpeedup = fptr(math.NaN()) }},
		{"Inf extra", func(r *Result) { r.Runs[0].Extra = map[string]float64{"x": math.Inf(-1)} }},
		{"NaN bound", func(r *Result) { r.Bound = &Bound{PrefixReuse: math.NaN()} }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res := Result{Runs: []Run{goldenRun()}}
			res.Runs[0].ReplicaShare = slices.Clone(res.Runs[0].ReplicaShare)
			tt.mod(&res)
			var b bytes.Buffer
			if err := WriteJSON(&b, res); !errors.Is(err, ErrNonFinite) {
				t.Fatalf("err = %v, want ErrNonFinite", err)
			}
			if b.Len() != 0 {
				t.Errorf("wrote %d bytes on error", b.Len())
			}
		})
	}
}

func TestReadJSONRoundTrip(t *testing.T) {
	var recs []Record
	for i := range 200 {
		recs = append(recs, rec(float64(i*37), float64(20+i%50), 9.5+float64(i%7), 1+i%120, 1000+i, i*3, i%4))
	}
	recs = append(recs, Record{Start: time.Second, Replica: 2, Err: true, ErrKind: "timeout"})
	a := Summarize("ttft", recs, 4, 0)
	b := Summarize("round_robin", recs[:50], 4, 3*time.Second)
	b.CapacitySpeedup = fptr(1.75)
	b.Extra = map[string]float64{"hit_rate_vs_bound": 0.4321}
	res := Result{
		Bound: &Bound{PrefixReuse: 0.91, MergedLRU: 0.77},
		Runs:  []Run{a, b},
		Meta:  map[string]any{"command": "kvgate replay --trace t.jsonl", "seed": 42.0, "policies": []any{"ttft", "round_robin"}},
	}
	var buf bytes.Buffer
	if err := WriteJSON(&buf, res); err != nil {
		t.Fatal(err)
	}
	got, err := ReadJSON(&buf)
	if err != nil {
		t.Fatal(err)
	}
	want := res
	want.Runs = slices.Clone(res.Runs)
	for i := range want.Runs {
		want.Runs[i].Series = nil
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("round trip differs:\ngot  %+v\nwant %+v", got, want)
	}
}

func TestReadJSONMalformed(t *testing.T) {
	tests := []struct{ name, in string }{
		{"empty", ""},
		{"not json", "policy ttft"},
		{"no runs", `{"bound": {"prefix_reuse": 1, "merged_lru": 1}}`},
		{"runs null", `{"runs": null}`},
		{"runs wrong type", `{"runs": 5}`},
		{"trailing object", `{"runs": []} {"runs": []}`},
		{"trailing garbage", `{"runs": []} x`},
		{"field of wrong type", `{"runs": [{"policy": 3}]}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := ReadJSON(strings.NewReader(tt.in)); !errors.Is(err, ErrMalformed) {
				t.Errorf("err = %v, want ErrMalformed", err)
			}
		})
	}
	t.Run("unknown fields are ignored", func(t *testing.T) {
		res, err := ReadJSON(strings.NewReader(`{"runs": [{"policy": "p", "future": 1}], "version": 2}` + "\n"))
		if err != nil || len(res.Runs) != 1 || res.Runs[0].Policy != "p" {
			t.Errorf("got %+v, %v", res, err)
		}
	})
}
