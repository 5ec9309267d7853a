package report

import (
	"bytes"
	"encoding/json"
	"math"
	"slices"
	"testing"
	"time"

	"go.uber.org/goleak"
	"pgregory.net/rapid"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const msec = time.Millisecond

// rec builds a successful record: ttft and itl in ms, e2e = ttft + (out−1)·itl.
func rec(start, ttft, itl float64, out, prompt, cached, replica int) Record {
	d := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	return Record{
		Start: d(start), TTFT: d(ttft), E2E: d(ttft + float64(max(out-1, 0))*itl),
		PromptTokens: prompt, CachedTokens: cached, OutputTokens: out, Replica: replica,
	}
}

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

func distNear(a, b Dist) bool {
	return near(a.Mean, b.Mean) && near(a.P50, b.P50) && near(a.P90, b.P90) && near(a.P99, b.P99)
}

func TestPercentile(t *testing.T) {
	tests := []struct {
		name   string
		sorted []float64
		p      float64
		want   float64
	}{
		{"empty", nil, 0.5, 0},
		{"single", []float64{7}, 0.99, 7},
		{"min", []float64{1, 2, 3}, 0, 1},
		{"max", []float64{1, 2, 3}, 1, 3},
		{"median odd", []float64{1, 2, 3}, 0.5, 2},
		{"median even interpolates", []float64{1, 2, 3, 4}, 0.5, 2.5},
		{"p90 of 1..10", []float64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, 0.9, 9.1},
		{"p99 of 1..100", seq(1, 100), 0.99, 99.01},
		{"clamped above", []float64{1, 2}, 1.5, 2},
		{"clamped below", []float64{1, 2}, -1, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Percentile(tt.sorted, tt.p); !near(got, tt.want) {
				t.Errorf("Percentile(%v, %v) = %v, want %v", tt.sorted, tt.p, got, tt.want)
			}
		})
	}
}

func seq(lo, hi int) []float64 {
	var s []float64
	for i := lo; i <= hi; i++ {
		s = append(s, float64(i))
	}
	return s
}

func TestSummarize(t *testing.T) {
	tests := []struct {
		name     string
		recs     []Record
		replicas int
		wall     time.Duration
		want     Run // Series not compared here
	}{
		{
			name:     "no records",
			replicas: 4,
			want:     Run{Policy: "p", ReplicaShare: []float64{0, 0, 0, 0}},
		},
		{
			// TTFT 10..50 ms: mean 30, p50 30, p90 = 40 + 0.6·10, p99 = 40 + 0.96·10.
			// ITL 1..5 ms over 11 tokens each; E2E = TTFT + 10·ITL.
			name: "known percentiles",
			recs: []Record{
				rec(0, 50, 5, 11, 100, 0, 0),
				rec(0, 10, 1, 11, 100, 0, 1),
				rec(0, 30, 3, 11, 100, 0, 2),
				rec(0, 20, 2, 11, 100, 0, 3),
				rec(0, 40, 4, 11, 100, 0, 0),
			},
			replicas: 4,
			wall:     time.Second,
			want: Run{
				Policy: "p", Requests: 5,
				TTFTms:           Dist{Mean: 30, P50: 30, P90: 46, P99: 49.6},
				ITLms:            Dist{Mean: 3, P50: 3, P90: 4.6, P99: 4.96},
				E2Ems:            Dist{Mean: 60, P50: 60, P90: 92, P99: 99.2},
				ThroughputRPS:    5,
				OutputTokensPerS: 55,
				ReplicaShare:     []float64{0.4, 0.2, 0.2, 0.2},
				Imbalance:        1.6, // 0.4 / 0.25
			},
		},
		{
			// Errors count in Requests/Errors and in the replica shares (they were routed),
			// nowhere else: their huge prompt must not dilute the hit rate.
			name: "errors excluded from latency, throughput and hit rate",
			recs: []Record{
				rec(0, 100, 10, 2, 1000, 750, 0),
				rec(1000, 300, 10, 2, 1000, 250, 1),
				{Start: 500 * msec, PromptTokens: 1_000_000, Replica: 1, Err: true, ErrKind: "http_503"},
				{Start: 600 * msec, Replica: -1, Err: true, ErrKind: "no_replica"},
			},
			replicas: 2,
			want: Run{
				Policy: "p", Requests: 4, Errors: 2,
				TTFTms: Dist{Mean: 200, P50: 200, P90: 280, P99: 298},
				ITLms:  Dist{Mean: 10, P50: 10, P90: 10, P99: 10},
				E2Ems:  Dist{Mean: 210, P50: 210, P90: 290, P99: 308},
				// wall = first arrival (0) to last completion (1000 + 310 ms)
				ThroughputRPS:    2 / 1.31,
				OutputTokensPerS: 4 / 1.31,
				HitRate:          0.5,
				ReplicaShare:     []float64{1.0 / 3, 2.0 / 3},
				Imbalance:        4.0 / 3,
			},
		},
		{
			name: "all on one replica is imbalance N",
			recs: []Record{
				rec(0, 10, 1, 1, 10, 10, 2), rec(0, 10, 1, 1, 10, 0, 2), rec(0, 10, 1, 1, 20, 5, 2),
			},
			replicas: 3,
			wall:     3 * time.Second,
			want: Run{
				Policy: "p", Requests: 3,
				TTFTms:           Dist{Mean: 10, P50: 10, P90: 10, P99: 10},
				E2Ems:            Dist{Mean: 10, P50: 10, P90: 10, P99: 10},
				ThroughputRPS:    1,
				OutputTokensPerS: 1,
				HitRate:          15.0 / 40,
				ReplicaShare:     []float64{0, 0, 1},
				Imbalance:        3,
				// one output token each: no inter-token gap, ITL stays zero
			},
		},
		{
			name:     "replica index beyond replicas widens the shares",
			recs:     []Record{rec(0, 10, 1, 1, 0, 0, 0), rec(0, 10, 1, 1, 0, 0, 2)},
			replicas: 2,
			wall:     time.Second,
			want: Run{
				Policy: "p", Requests: 2,
				TTFTms:           Dist{Mean: 10, P50: 10, P90: 10, P99: 10},
				E2Ems:            Dist{Mean: 10, P50: 10, P90: 10, P99: 10},
				ThroughputRPS:    2,
				OutputTokensPerS: 2,
				ReplicaShare:     []float64{0.5, 0, 0.5},
				Imbalance:        1.5,
			},
		},
		{
			name:     "only errors: no throughput, zero distributions",
			recs:     []Record{{Start: time.Second, Replica: 0, Err: true}},
			replicas: 1,
			want:     Run{Policy: "p", Requests: 1, Errors: 1, ReplicaShare: []float64{1}, Imbalance: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := Summarize("p", tt.recs, tt.replicas, tt.wall)
			if got.Series == nil {
				t.Fatal("Series is nil")
			}
			w := tt.want
			if got.Policy != w.Policy || got.Requests != w.Requests || got.Errors != w.Errors {
				t.Errorf("policy/requests/errors = %q/%d/%d, want %q/%d/%d", got.Policy, got.Requests, got.Errors, w.Policy, w.Requests, w.Errors)
			}
			for _, d := range []struct {
				name      string
				got, want Dist
			}{{"ttft", got.TTFTms, w.TTFTms}, {"itl", got.ITLms, w.ITLms}, {"e2e", got.E2Ems, w.E2Ems}} {
				if !distNear(d.got, d.want) {
					t.Errorf("%s = %+v, want %+v", d.name, d.got, d.want)
				}
			}
			for _, f := range []struct {
				name      string
				got, want float64
			}{
				{"throughput_rps", got.ThroughputRPS, w.ThroughputRPS},
				{"output_tokens_per_s", got.OutputTokensPerS, w.OutputTokensPerS},
				{"hit_rate", got.HitRate, w.HitRate},
				{"imbalance", got.Imbalance, w.Imbalance},
			} {
				if !near(f.got, f.want) {
					t.Errorf("%s = %v, want %v", f.name, f.got, f.want)
				}
			}
			if !slices.EqualFunc(got.ReplicaShare, w.ReplicaShare, near) {
				t.Errorf("replica_share = %v, want %v", got.ReplicaShare, w.ReplicaShare)
			}
		})
	}
}

func TestSummarizeHitRateSeries(t *testing.T) {
	// 40 requests, one every 0.5 s from t=0 to 19.5 s; request i has hit rate i/40, so
	// bucket b (1 s wide, two requests) has (2b + 2b+1)/2/40.
	var recs []Record
	for i := range 40 {
		recs = append(recs, rec(float64(i)*500, 10, 1, 2, 400, 10*i, 0))
	}
	recs = append(recs, Record{Start: 30 * time.Second, Replica: 0, Err: true}) // ignored by the series
	s := Summarize("p", recs, 1, 0).Series
	if len(s.HitRate) != hitRateBuckets {
		t.Fatalf("got %d buckets, want %d: %v", len(s.HitRate), hitRateBuckets, s.HitRate)
	}
	width := 19.5 / hitRateBuckets
	for b, p := range s.HitRate {
		// arrival 19.5 s falls in the last bucket (the end is inclusive)
		var prompt, cached int
		for i := range 40 {
			at := float64(i) * 0.5
			if bb := min(int(at/width), hitRateBuckets-1); bb == b {
				prompt += 400
				cached += 10 * i
			}
		}
		wantX := (float64(b) + 0.5) * width
		if !near(p.X, wantX) || !near(p.Y, float64(cached)/float64(prompt)) {
			t.Errorf("bucket %d = %+v, want (%v, %v)", b, p, wantX, float64(cached)/float64(prompt))
		}
	}
	if got := s.ReplicaRequests; !slices.Equal(got, []int{41}) {
		t.Errorf("ReplicaRequests = %v, want [41]", got)
	}
}

func TestSummarizeHitRateSeriesSkipsEmptyBuckets(t *testing.T) {
	// Two bursts with a gap: the buckets in between have no request and are left out,
	// rather than drawn as a 0 % hit rate.
	recs := []Record{rec(0, 1, 1, 1, 100, 50, 0), rec(10_000, 1, 1, 1, 100, 100, 0)}
	hr := Summarize("p", recs, 1, 0).Series.HitRate
	want := []Point{{X: 0.25, Y: 0.5}, {X: 9.75, Y: 1}}
	if !slices.EqualFunc(hr, want, func(a, b Point) bool { return near(a.X, b.X) && near(a.Y, b.Y) }) {
		t.Errorf("HitRate = %v, want %v", hr, want)
	}
}

func TestSummarizeCDF(t *testing.T) {
	tests := []struct {
		name   string
		n      int
		points int
	}{
		{"small keeps every sample", 10, 10},
		{"exactly the cap", maxCDFPoints, maxCDFPoints},
		{"large is sampled", 5*maxCDFPoints + 3, maxCDFPoints},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			recs := make([]Record, tt.n)
			for i := range recs {
				// reversed, to check the CDF is sorted
				recs[i] = rec(0, float64(tt.n-i), 1, 1, 0, 0, 0)
			}
			cdf := Summarize("p", recs, 1, time.Second).Series.TTFTCDF
			if len(cdf) != tt.points {
				t.Fatalf("len = %d, want %d", len(cdf), tt.points)
			}
			if cdf[0].X != 1 || !near(cdf[0].Y, 1/float64(tt.n)) {
				t.Errorf("first = %+v, want (1, 1/%d)", cdf[0], tt.n)
			}
			if last := cdf[len(cdf)-1]; last.X != float64(tt.n) || last.Y != 1 {
				t.Errorf("last = %+v, want (%d, 1)", last, tt.n)
			}
			for i := 1; i < len(cdf); i++ {
				if cdf[i].X < cdf[i-1].X || cdf[i].Y <= cdf[i-1].Y {
					t.Fatalf("not increasing at %d: %+v then %+v", i, cdf[i-1], cdf[i])
				}
				// X is the TTFT of the request at that rank: rank/n of them are ≤ X.
				if !near(cdf[i].Y, cdf[i].X/float64(tt.n)) {
					t.Fatalf("point %d = %+v: Y is not the rank of X", i, cdf[i])
				}
			}
		})
	}
}

// TestSummarizeProperties checks invariants on arbitrary record sets: shares sum to 1,
// 1 ≤ imbalance ≤ N, percentiles ordered and within the samples, hit rate in [0, 1].
func TestSummarizeProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		replicas := rapid.IntRange(1, 8).Draw(t, "replicas")
		n := rapid.IntRange(0, 60).Draw(t, "n")
		recs := make([]Record, n)
		lo, hi := math.Inf(1), math.Inf(-1)
		for i := range recs {
			prompt := rapid.IntRange(0, 5000).Draw(t, "prompt")
			r := rec(
				float64(rapid.IntRange(0, 100_000).Draw(t, "start")),
				float64(rapid.IntRange(1, 5000).Draw(t, "ttft")),
				float64(rapid.IntRange(0, 50).Draw(t, "itl")),
				rapid.IntRange(0, 300).Draw(t, "out"),
				prompt, rapid.IntRange(0, prompt).Draw(t, "cached"),
				rapid.IntRange(-1, replicas-1).Draw(t, "replica"),
			)
			r.Err = rapid.Float64Range(0, 1).Draw(t, "err") < 0.1
			if !r.Err {
				lo, hi = min(lo, ms(r.TTFT)), max(hi, ms(r.TTFT))
			}
			recs[i] = r
		}
		run := Summarize("p", recs, replicas, 0)
		if len(run.ReplicaShare) != replicas {
			t.Fatalf("len(replica_share) = %d, want %d", len(run.ReplicaShare), replicas)
		}
		sum := 0.0
		for _, s := range run.ReplicaShare {
			sum += s
		}
		if run.Imbalance != 0 && (!near(sum, 1) || run.Imbalance < 1-1e-9 || run.Imbalance > float64(replicas)+1e-9) {
			t.Fatalf("shares %v (sum %v), imbalance %v", run.ReplicaShare, sum, run.Imbalance)
		}
		if run.Imbalance == 0 && sum != 0 {
			t.Fatalf("imbalance 0 with shares %v", run.ReplicaShare)
		}
		d := run.TTFTms
		if !(d.P50 <= d.P90 && d.P90 <= d.P99) {
			t.Fatalf("percentiles out of order: %+v", d)
		}
		if n-run.Errors > 0 && (d.P50 < lo || d.P99 > hi || d.Mean < lo-1e-9 || d.Mean > hi+1e-9) {
			t.Fatalf("ttft %+v outside samples [%v, %v]", d, lo, hi)
		}
		if run.HitRate < 0 || run.HitRate > 1 {
			t.Fatalf("hit rate %v", run.HitRate)
		}
		if run.Requests != n {
			t.Fatalf("requests %d, want %d", run.Requests, n)
		}
	})
}

// itl_max_ms is the distribution of the records' longest gaps, over those
// that measured one (two tokens or more), and absent when none did.
func TestSummarizeLongestGap(t *testing.T) {
	recs := []Record{
		rec(0, 10, 1, 11, 100, 0, 0),
		rec(0, 10, 1, 11, 100, 0, 0),
		rec(0, 10, 1, 11, 100, 0, 0),
		rec(0, 10, 0, 1, 100, 0, 0), // one token: no gap
	}
	if run := Summarize("p", recs, 1, time.Second); run.ITLMaxms != nil {
		t.Fatalf("no record measured a gap: itl_max_ms %+v", run.ITLMaxms)
	}
	for i, gap := range []time.Duration{2, 4, 6, 100} {
		recs[i].MaxITL = gap * time.Millisecond
	}
	run := Summarize("p", recs, 1, time.Second)
	if d := run.ITLMaxms; d == nil || d.P50 != 4 || d.Mean != 4 || d.P99 != 5.96 {
		t.Fatalf("itl_max_ms %+v, want mean 4, p50 4, p99 5.96 over the three records with two tokens or more", d)
	}
	b, err := json.Marshal(run)
	if err != nil || !bytes.Contains(b, []byte(`"itl_max_ms":{"mean":4`)) {
		t.Fatalf("JSON %s, %v", b, err)
	}
}
