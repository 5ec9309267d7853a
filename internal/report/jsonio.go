package report

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
)

// Bound is the replay's upper bounds on the hit rate of any policy on a trace.
type Bound struct {
	PrefixReuse float64 `json:"prefix_reuse"` // one unbounded cache: every repeated prefix hits
	MergedLRU   float64 `json:"merged_lru"`   // one LRU cache with the whole fleet's capacity
	// The oracle bound (replay --oracle): every request hits as in
	// merged_lru and goes where the engines' exact queues give it its first
	// token soonest. Its TTFT and hit rate at the replay's speed-up, and
	// with --capacity its capacity speed-up at the same SLO.
	OracleTTFTms   *Dist    `json:"oracle_ttft_ms,omitempty"`
	OracleHitRate  *float64 `json:"oracle_hit_rate,omitempty"`
	OracleCapacity *float64 `json:"oracle_capacity,omitempty"`
	// OracleCapacityCeiling: the oracle's capacity search reached its
	// upper limit still meeting the SLO (as Run.CapacityCeiling).
	OracleCapacityCeiling bool `json:"oracle_capacity_ceiling,omitempty"`
}

// Result is what bench and replay write: the runs, and for replay the bounds.
type Result struct {
	Bound *Bound         `json:"bound,omitempty"`
	Runs  []Run          `json:"runs"`
	Meta  map[string]any `json:"meta,omitempty"` // command, seed, workload, … shown in the report
}

var (
	// ErrNonFinite is returned by WriteJSON when a number is NaN or ±Inf, which JSON cannot
	// carry; the error names the run and the field.
	ErrNonFinite = errors.New("report: non-finite number")
	// ErrMalformed is returned by ReadJSON for input that is not a kvgate result.
	ErrMalformed = errors.New("report: malformed result JSON")
)

// WriteJSON writes res as indented JSON, exactly the bench/replay contract: nil slices are
// written as [] (never null), optional fields are omitted when unset.
func WriteJSON(w io.Writer, res Result) error {
	if err := checkFinite(res); err != nil {
		return err
	}
	out := res
	out.Runs = make([]Run, len(res.Runs))
	for i, r := range res.Runs {
		if r.ReplicaShare == nil {
			r.ReplicaShare = []float64{}
		}
		out.Runs[i] = r
	}
	b, err := json.MarshalIndent(out, "", "  ")
	if err != nil {
		return fmt.Errorf("report: encode result: %w", err)
	}
	b = append(b, '\n')
	_, err = w.Write(b)
	return err
}

// ReadJSON reads a result written by WriteJSON (or by anything following the contract).
// Unknown fields are ignored, so that newer writers stay readable; a missing "runs" array
// or trailing data is ErrMalformed. Runs read back carry no Series.
func ReadJSON(r io.Reader) (Result, error) {
	dec := json.NewDecoder(r)
	var res Result
	if err := dec.Decode(&res); err != nil {
		return Result{}, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return Result{}, fmt.Errorf("%w: trailing data after the result object", ErrMalformed)
	}
	if res.Runs == nil {
		return Result{}, fmt.Errorf("%w: no \"runs\" array", ErrMalformed)
	}
	return res, nil
}

func checkFinite(res Result) error {
	bad := func(v float64) bool { return math.IsNaN(v) || math.IsInf(v, 0) }
	if b := res.Bound; b != nil {
		if bad(b.PrefixReuse) || bad(b.MergedLRU) {
			return fmt.Errorf("%w: bound", ErrNonFinite)
		}
		if d := b.OracleTTFTms; d != nil && (bad(d.Mean) || bad(d.P50) || bad(d.P90) || bad(d.P99)) {
			return fmt.Errorf("%w: bound oracle_ttft_ms", ErrNonFinite)
		}
		if (b.OracleHitRate != nil && bad(*b.OracleHitRate)) || (b.OracleCapacity != nil && bad(*b.OracleCapacity)) {
			return fmt.Errorf("%w: bound oracle", ErrNonFinite)
		}
	}
	for _, r := range res.Runs {
		fields := []struct {
			name string
			v    float64
		}{
			{"ttft_ms.mean", r.TTFTms.Mean}, {"ttft_ms.p50", r.TTFTms.P50}, {"ttft_ms.p90", r.TTFTms.P90}, {"ttft_ms.p99", r.TTFTms.P99},
			{"itl_ms.mean", r.ITLms.Mean}, {"itl_ms.p50", r.ITLms.P50}, {"itl_ms.p90", r.ITLms.P90}, {"itl_ms.p99", r.ITLms.P99},
			{"e2e_ms.mean", r.E2Ems.Mean}, {"e2e_ms.p50", r.E2Ems.P50}, {"e2e_ms.p90", r.E2Ems.P90}, {"e2e_ms.p99", r.E2Ems.P99},
			{"throughput_rps", r.ThroughputRPS}, {"output_tokens_per_s", r.OutputTokensPerS},
			{"hit_rate", r.HitRate}, {"imbalance", r.Imbalance},
		}
		if d := r.ITLMaxms; d != nil {
			fields = append(fields, []struct {
				name string
				v    float64
			}{{"itl_max_ms.mean", d.Mean}, {"itl_max_ms.p50", d.P50}, {"itl_max_ms.p90", d.P90}, {"itl_max_ms.p99", d.P99}}...)
		}
		for _, f := range fields {
			if bad(f.v) {
				return fmt.Errorf("%w: run %q field %s = %v", ErrNonFinite, r.Policy, f.name, f.v)
			}
		}
		if slices.ContainsFunc(r.ReplicaShare, bad) {
			return fmt.Errorf("%w: run %q field replica_share", ErrNonFinite, r.Policy)
		}
		if r.CapacitySpeedup != nil && bad(*r.CapacitySpeedup) {
			return fmt.Errorf("%w: run %q field capacity_speedup", ErrNonFinite, r.Policy)
		}
		if r.CapacityBelow != nil && bad(*r.CapacityBelow) {
			return fmt.Errorf("%w: run %q field capacity_below", ErrNonFinite, r.Policy)
		}
		if ci := r.TTFTP90CI; ci != nil && (bad(ci.Lo) || bad(ci.Hi)) {
			return fmt.Errorf("%w: run %q field ttft_p90_ci_ms", ErrNonFinite, r.Policy)
		}
		if err := checkSplit(r.Split); err != nil {
			return fmt.Errorf("%w: run %q field split.%s", ErrNonFinite, r.Policy, err.Error())
		}
		for k, v := range r.Extra {
			if bad(v) {
				return fmt.Errorf("%w: run %q field extra.%s", ErrNonFinite, r.Policy, k)
			}
		}
	}
	return nil
}

// checkSplit names the first non-finite figure of a split, nil when all are finite.
func checkSplit(s *Split) error {
	if s == nil {
		return nil
	}
	dists := []struct {
		name string
		d    *Dist
	}{{"engine_ttft_ms", &s.EngineTTFTms}, {"outside_ttft_ms", s.OutsideTTFTms}, {"engine_itl_ms", &s.EngineITLms}, {"outside_itl_ms", s.OutsideITLms}}
	for _, f := range dists {
		if f.d == nil {
			continue
		}
		for _, v := range []float64{f.d.Mean, f.d.P50, f.d.P90, f.d.P99} {
			if math.IsNaN(v) || math.IsInf(v, 0) {
				return errors.New(f.name)
			}
		}
	}
	for name, v := range map[string]float64{"outside_ttft_mean_ms": s.OutsideTTFTMeanms, "outside_itl_mean_ms": s.OutsideITLMeanms} {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return errors.New(name)
		}
	}
	return nil
}
