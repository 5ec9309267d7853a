// Package report turns per-request outcomes into the summary every kvgate verb reports
// (bench and replay alike), and writes it as a terminal table, the JSON contract, charts
// (SVG and PNG via gonum/plot) and one self-contained HTML page.
//
// There is exactly one summary computation, Summarize, so that a figure from `replay`
// (virtual time) and a figure from `bench` (wall clock) mean the same thing.
package report

import (
	"math"
	"slices"
	"time"
)

// Record is one request's outcome, produced by bench (measured) or replay (simulated).
// It is kept small on purpose (no per-token slices): a replay of a long trace holds
// millions of them.
type Record struct {
	Start time.Duration // arrival, relative to run start
	TTFT  time.Duration // time to first token; 0 when Err
	E2E   time.Duration // arrival to last token; 0 when Err

	PromptTokens int // prompt tokens as counted by the replica (usage.prompt_tokens)
	CachedTokens int // of which served from its prefix cache (usage.prompt_tokens_details.cached_tokens)
	OutputTokens int // generated tokens (usage.completion_tokens)
	// MaxITL is the longest gap between two of its output tokens (0: not
	// measured): what a reader of the stream sees freeze, which the mean
	// gap (ITL) hides in a long answer.
	MaxITL time.Duration

	// EngineTTFT and EngineE2E are the replica's own part of TTFT and E2E,
	// from its arrival at the engine to its first and last token, in model
	// time, when the replica reported them (0: not reported). TTFT and E2E
	// are then that part plus the time outside the engine — the gateway,
	// the network, the client — counted once in real time (bench.Run).
	EngineTTFT, EngineE2E time.Duration

	// Program and Batch number the request's program (an agent's session
	// with its subagents, a conversation) and RL batch, 1, 2, …; 0: none.
	// They group the records for the makespan measures (programs.go).
	Program, Batch int32

	Replica int    // index of the replica that served (or was sent) it; -1 if none
	Err     bool   // the request failed: excluded from latency, throughput and hit rate, counted in Errors
	ErrKind string // short class of the failure (e.g. "timeout", "http_503"), for the caller's breakdowns

	// Tenant and Priority are the tenant the request was sent for ("":
	// none) and its priority band: a run with either gets a summary per
	// tenant and per priority (Run.Tenants, Run.Priorities).
	Tenant   string
	Priority int
}

// Dist summarises one latency distribution in milliseconds.
type Dist struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
}

// Interval is a confidence interval, in the unit of the figure it bounds.
type Interval struct {
	Lo float64 `json:"lo"`
	Hi float64 `json:"hi"`
}

// Overlaps reports whether the two intervals share a point.
func (i Interval) Overlaps(j Interval) bool { return i.Lo <= j.Hi && j.Lo <= i.Hi }

// Point is one (x, y) sample of a chart series.
type Point struct{ X, Y float64 }

// Series holds what the charts need beyond the scalar summary. It is not part of the JSON
// contract: a Result read back from JSON has no Series, and the report then draws what the
// scalars allow (see WriteReport).
type Series struct {
	// TTFTCDF is the empirical CDF of TTFT over successful requests: X in ms (ascending),
	// Y = fraction of requests with TTFT ≤ X. At most maxCDFPoints points: beyond that the
	// CDF is sampled at evenly spaced ranks, always keeping the first and the last.
	TTFTCDF []Point
	// HitRate is the prefix-cache hit rate (cached / prompt tokens, 0..1) of the requests
	// arriving in each of about hitRateBuckets equal time buckets; X is the bucket's centre
	// in seconds since run start. Buckets without prompt tokens are left out.
	HitRate []Point
	// ReplicaRequests counts the requests routed to each replica, errors included.
	ReplicaRequests []int
}

// Run is the summary of one policy's run: one element of "runs" in the JSON contract.
//
// ttft_p90_ci_ms is a 90 % interval of ttft_ms.p90 from the run's own requests (see
// Summarize; bench widens it for requests slowed together, bench.Summarize): how far the figure
// could move on another run of the same kind; absent without successful requests. capacity_below, with a capacity_speedup of 0, is the lowest speed-up the
// capacity search tried, at which the run already failed: the capacity is below it.
type Run struct {
	Policy    string    `json:"policy"`
	Requests  int       `json:"requests"`
	Errors    int       `json:"errors"`
	TTFTms    Dist      `json:"ttft_ms"`
	TTFTP90CI *Interval `json:"ttft_p90_ci_ms,omitempty"`
	ITLms     Dist      `json:"itl_ms"`
	// ITLMaxms is the distribution of each request's longest inter-token
	// gap (Record.MaxITL), absent when no record measured it.
	ITLMaxms         *Dist     `json:"itl_max_ms,omitempty"`
	E2Ems            Dist      `json:"e2e_ms"`
	ThroughputRPS    float64   `json:"throughput_rps"`
	OutputTokensPerS float64   `json:"output_tokens_per_s"`
	HitRate          float64   `json:"hit_rate"`
	Imbalance        float64   `json:"imbalance"`
	ReplicaShare     []float64 `json:"replica_share"`
	CapacitySpeedup  *float64  `json:"capacity_speedup,omitempty"`
	CapacityBelow    *float64  `json:"capacity_below,omitempty"`
	// CapacityCeiling: the capacity search reached its upper limit (its
	// start × 4096) with the SLO still met, so that capacity_speedup is a
	// lower bound: the trace is too short or too light to load the fleet,
	// and capacities cannot rank the policies.
	CapacityCeiling bool               `json:"capacity_ceiling,omitempty"`
	Extra           map[string]float64 `json:"extra,omitempty"` // e.g. hit_rate_vs_bound
	// Split is where the time went: in the engines and outside them; absent
	// when the replicas told nothing of their own times.
	Split *Split `json:"split,omitempty"`
	// Programs and Batches: the makespans of programs and RL batches
	// (programs.go); absent when no record names one.
	Programs *Makespans `json:"programs,omitempty"`
	Batches  *Makespans `json:"batches,omitempty"`
	Series   *Series    `json:"-"`
	// Tenants and Priorities summarise the run per tenant and per priority
	// band (groups.go), when its records name any.
	Tenants    map[string]Group `json:"tenants,omitempty"`
	Priorities map[string]Group `json:"priorities,omitempty"`
}

// Sources of a Split.
const (
	// SplitPerRequest: each request's answer carried the replica's own
	// times (kvgate sim's usage.kvgate_sim; Record.EngineTTFT).
	SplitPerRequest = "per_request"
	// SplitEngineMetrics: the replicas' vLLM histograms
	// (vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds)
	// read before and after the run; means only outside the engine.
	SplitEngineMetrics = "engine_metrics"
)

// Split is where a run's latency went (issue 30): in the engines — the
// replicas' own time to first token and between tokens, in model time —
// and outside them: the gateway, the network and the client, in real time,
// never multiplied by a time scale. Client TTFT = engine + outside.
//
// Source per_request: every distribution is over the successful requests
// whose replica reported its times (Requests of them); outside = the
// request's TTFT − its engine TTFT, and its ITL − its engine ITL ((E2E −
// TTFT) / (output tokens − 1) on either side). Source engine_metrics: the
// engine distributions are the replicas' histograms over the run (Requests
// = the first tokens they counted, other clients' included; mean exact,
// percentiles interpolated within the buckets as Prometheus's
// histogram_quantile does; ITL per token rather than per request), and
// outside only the means: the client's mean − the engine's.
type Split struct {
	Source            string  `json:"source"`
	Requests          int     `json:"requests"`
	EngineTTFTms      Dist    `json:"engine_ttft_ms"`
	OutsideTTFTms     *Dist   `json:"outside_ttft_ms,omitempty"`
	OutsideTTFTMeanms float64 `json:"outside_ttft_mean_ms"`
	EngineITLms       Dist    `json:"engine_itl_ms"`
	OutsideITLms      *Dist   `json:"outside_itl_ms,omitempty"`
	OutsideITLMeanms  float64 `json:"outside_itl_mean_ms"`
}

const (
	// hitRateBuckets is how many arrival-time buckets the hit-rate-over-time series uses.
	hitRateBuckets = 20
	// maxCDFPoints bounds the TTFT CDF kept for charts: enough for a smooth curve at any
	// chart width, small enough that a million-request replay does not keep every sample.
	maxCDFPoints = 1000
)

// Summarize computes the one summary kvgate reports for a policy's run.
//
//   - Requests counts every record, Errors the failed ones. Failed requests are excluded
//     from the latency distributions, the throughputs and the hit rate (their usage is unknown).
//   - Percentiles use linear interpolation between closest ranks (Hyndman & Fan type 7, the
//     default of numpy and R): for sorted x[0..n-1], p → x[h] interpolated at h = (n−1)·p.
//   - ITL per request is (E2E − TTFT) / (OutputTokens − 1): the mean gap between consecutive
//     tokens, since the gaps telescope from the first token to the last. Requests with fewer
//     than two output tokens have no gap and are left out of the ITL distribution. itl_max_ms
//     is the distribution of the records' MaxITL, where measured (two tokens or more).
//   - Throughput is successful requests (and their output tokens) per second of wall; when
//     wall is 0 it is the span from the first arrival to the last completion.
//   - hit_rate = Σ cached prompt tokens / Σ prompt tokens over successful requests.
//   - replica_share[i] = requests routed to replica i / requests routed to any replica
//     (errors included: a failed request still took a routing decision). imbalance = the
//     largest share / the mean share (1/N), so 1.0 is perfect balance and N is "all on one";
//     0 when nothing was routed. replicas sets N; a record naming a replica ≥ N widens it.
//   - ttft_p90_ci_ms is the 90 % percentile-bootstrap interval of the p90 TTFT, computed
//     exactly rather than by resampling (QuantileInterval).
func Summarize(policy string, recs []Record, replicas int, wall time.Duration) Run {
	n := max(replicas, 0)
	for _, r := range recs {
		n = max(n, r.Replica+1)
	}
	t := newTally(len(recs), n)
	for _, r := range recs {
		t.add(r)
	}
	run := Run{Policy: policy, Requests: len(recs), Errors: t.errors}

	slices.Sort(t.ttft)
	slices.Sort(t.itl)
	slices.Sort(t.e2e)
	run.TTFTms, run.ITLms, run.E2Ems = distOf(t.ttft), distOf(t.itl), distOf(t.e2e)
	if len(t.maxITL) > 0 {
		slices.Sort(t.maxITL)
		d := distOf(t.maxITL)
		run.ITLMaxms = &d
	}
	if len(t.ttft) > 0 {
		ci := QuantileInterval(t.ttft, 0.90, 0.90)
		run.TTFTP90CI = &ci
	}

	if wall <= 0 && t.seen {
		wall = t.last - t.first
	}
	if wall > 0 {
		run.ThroughputRPS = float64(t.ok) / wall.Seconds()
		run.OutputTokensPerS = float64(t.outTokens) / wall.Seconds()
	}
	if t.prompt > 0 {
		run.HitRate = float64(t.cached) / float64(t.prompt)
	}
	run.ReplicaShare, run.Imbalance = shares(t.perReplica)
	run.Split = t.split.summary()
	run.Programs, run.Batches = makespans(recs)
	run.Series = &Series{
		TTFTCDF:         cdfOf(t.ttft),
		HitRate:         hitRateSeries(recs, t.firstOK, t.lastOK),
		ReplicaRequests: t.perReplica,
	}
	run.Tenants, run.Priorities = groups(recs, wall)
	return run
}

// tally accumulates a run's records in one pass, for Summarize.
type tally struct {
	perReplica                []int     // requests routed to each replica, errors included
	ttft, itl, e2e            []float64 // ms, successful requests
	maxITL                    []float64 // ms, successful requests that measured it
	prompt, cached, outTokens int64     // tokens of successful requests
	ok, errors                int
	first, last               time.Duration // first arrival, last completion
	seen                      bool
	firstOK, lastOK           time.Duration // arrival range of successful requests, for hit-rate buckets
	seenOK                    bool
	split                     splitTally
}

// splitTally gathers the per-request split (ms) of the records that carry
// their engine's times.
type splitTally struct {
	engineTTFT, outsideTTFT, engineITL, outsideITL []float64
}

func (s *splitTally) add(r Record) {
	if r.EngineTTFT <= 0 {
		return
	}
	s.engineTTFT = append(s.engineTTFT, ms(r.EngineTTFT))
	s.outsideTTFT = append(s.outsideTTFT, ms(r.TTFT-r.EngineTTFT))
	if r.OutputTokens >= 2 && r.EngineE2E >= r.EngineTTFT {
		gaps := float64(r.OutputTokens - 1)
		eng := ms(r.EngineE2E-r.EngineTTFT) / gaps
		s.engineITL = append(s.engineITL, eng)
		s.outsideITL = append(s.outsideITL, ms(r.E2E-r.TTFT)/gaps-eng)
	}
}

// summary is the per-request Split, nil without records that carry one.
func (s *splitTally) summary() *Split {
	if len(s.engineTTFT) == 0 {
		return nil
	}
	dist := func(v []float64) Dist {
		slices.Sort(v)
		return distOf(v)
	}
	out := &Split{Source: SplitPerRequest, Requests: len(s.engineTTFT), EngineTTFTms: dist(s.engineTTFT), EngineITLms: dist(s.engineITL)}
	ot, oi := dist(s.outsideTTFT), dist(s.outsideITL)
	out.OutsideTTFTms, out.OutsideITLms = &ot, &oi
	out.OutsideTTFTMeanms, out.OutsideITLMeanms = ot.Mean, oi.Mean
	return out
}

func newTally(records, replicas int) *tally {
	return &tally{
		perReplica: make([]int, replicas),
		ttft:       make([]float64, 0, records),
		itl:        make([]float64, 0, records),
		e2e:        make([]float64, 0, records),
	}
}

func (t *tally) add(r Record) {
	if r.Replica >= 0 {
		t.perReplica[r.Replica]++
	}
	done := r.Start + r.E2E
	if !t.seen {
		t.first, t.last, t.seen = r.Start, done, true
	}
	t.first, t.last = min(t.first, r.Start), max(t.last, done)
	if r.Err {
		t.errors++
		return
	}
	if !t.seenOK {
		t.firstOK, t.lastOK, t.seenOK = r.Start, r.Start, true
	}
	t.firstOK, t.lastOK = min(t.firstOK, r.Start), max(t.lastOK, r.Start)
	t.ok++
	t.ttft = append(t.ttft, ms(r.TTFT))
	t.e2e = append(t.e2e, ms(r.E2E))
	if r.OutputTokens >= 2 {
		t.itl = append(t.itl, ms(r.E2E-r.TTFT)/float64(r.OutputTokens-1))
		if r.MaxITL > 0 {
			t.maxITL = append(t.maxITL, ms(r.MaxITL))
		}
	}
	t.prompt += int64(r.PromptTokens)
	t.cached += int64(r.CachedTokens)
	t.outTokens += int64(r.OutputTokens)
	t.split.add(r)
}

// shares is each replica's share of the routed requests and the imbalance: the largest
// share / the mean share; all zero when nothing was routed.
func shares(perReplica []int) ([]float64, float64) {
	share := make([]float64, len(perReplica))
	routed, most := 0, 0
	for _, c := range perReplica {
		routed += c
		most = max(most, c)
	}
	if routed == 0 {
		return share, 0
	}
	for i, c := range perReplica {
		share[i] = float64(c) / float64(routed)
	}
	// max share / mean share = (most/routed) / (1/n)
	return share, float64(most) * float64(len(perReplica)) / float64(routed)
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// distOf summarises sorted samples; the zero Dist when there are none.
func distOf(sorted []float64) Dist {
	if len(sorted) == 0 {
		return Dist{}
	}
	// Kahan–Babuška (Neumaier) summation: a long replay sums millions of samples of
	// very different magnitudes.
	var sum, comp float64
	for _, v := range sorted {
		t := sum + v
		if math.Abs(sum) >= math.Abs(v) {
			comp += (sum - t) + v
		} else {
			comp += (v - t) + sum
		}
		sum = t
	}
	return Dist{
		Mean: (sum + comp) / float64(len(sorted)),
		P50:  Percentile(sorted, 0.50),
		P90:  Percentile(sorted, 0.90),
		P99:  Percentile(sorted, 0.99),
	}
}

// Percentile returns the p-quantile (0 ≤ p ≤ 1) of ascending samples by linear
// interpolation between closest ranks (Hyndman & Fan type 7): h = (n−1)·p,
// x[⌊h⌋] + (h−⌊h⌋)·(x[⌊h⌋+1] − x[⌊h⌋]). 0 for no samples.
func Percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	p = min(max(p, 0), 1)
	h := float64(n-1) * p
	lo := int(math.Floor(h))
	if lo >= n-1 {
		return sorted[n-1]
	}
	return sorted[lo] + (h-float64(lo))*(sorted[lo+1]-sorted[lo])
}

// cdfOf returns the empirical CDF of ascending samples, sampled at no more than
// maxCDFPoints evenly spaced ranks (first and last kept).
func cdfOf(sorted []float64) []Point {
	n := len(sorted)
	if n == 0 {
		return nil
	}
	m := min(n, maxCDFPoints)
	out := make([]Point, 0, m)
	for k := range m {
		i := k
		if m < n {
			i = int(math.Round(float64(k) * float64(n-1) / float64(m-1)))
		}
		out = append(out, Point{X: sorted[i], Y: float64(i+1) / float64(n)})
	}
	return out
}

// hitRateSeries buckets successful requests by arrival into hitRateBuckets equal spans of
// [first, last] and returns each non-empty bucket's token hit rate at its centre (seconds).
func hitRateSeries(recs []Record, first, last time.Duration) []Point {
	span := last - first
	buckets := hitRateBuckets
	if span <= 0 {
		buckets = 1
	}
	prompt := make([]int64, buckets)
	cached := make([]int64, buckets)
	for _, r := range recs {
		if r.Err {
			continue
		}
		b := 0
		if span > 0 {
			b = min(int(float64(r.Start-first)/float64(span)*float64(buckets)), buckets-1)
		}
		prompt[b] += int64(r.PromptTokens)
		cached[b] += int64(r.CachedTokens)
	}
	var out []Point
	for b := range buckets {
		if prompt[b] == 0 {
			continue
		}
		centre := first.Seconds() + (float64(b)+0.5)*span.Seconds()/float64(buckets)
		out = append(out, Point{X: centre, Y: float64(cached[b]) / float64(prompt[b])})
	}
	return out
}
