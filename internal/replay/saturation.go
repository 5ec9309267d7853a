package replay

import (
	"context"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/workload"
)

// The scaling signal checked in virtual time: the pool saturation gauge
// (router.Saturation, the gateway's kvgate_pool_saturation) computed from
// the replayed router's own state at each of its scrapes, against the TTFT
// the engines give. On a trace whose arrival rate ramps up, the gauge
// should cross 1 before the measured p90 TTFT exceeds the objective (the
// lead is the time an autoscaler has to add replicas); at steady rates the
// fleet serves within the objective, it should stay below 1.

// SaturationOptions configure the saturation question.
type SaturationOptions struct {
	Objective time.Duration // the p90 TTFT objective (the gauge's and the check's)
	Window    time.Duration // the gauge's rate window (saturation_window)
	// P90Window is the trailing window, by arrival, of the measured p90.
	P90Window time.Duration
	// From and To are the ramp's arrival rates at its start and end,
	// requests per second.
	From, To float64
	// Steady are the steady rates checked, requests per second.
	Steady []float64
	Seed   uint64
}

// SaturationFinding is what the ramp showed.
type SaturationFinding struct {
	// GaugeCross and P90Cross are when the gauge first reached 1 and when
	// the measured p90 first exceeded the objective (-1: never); Lead is
	// P90Cross − GaugeCross.
	GaugeCross, P90Cross, Lead time.Duration
	// RateAtGauge and RateAtP90 are the ramp's arrival rates then.
	RateAtGauge, RateAtP90 float64
}

// minP90Samples is the fewest arrivals in a window whose p90 is read.
const minP90Samples = 20

// RampArrivals sets reqs' arrivals to a Poisson process whose rate grows
// linearly from `from` to `to` requests per second over the requests:
// unit-rate exponential gaps mapped through the inverse of the cumulative
// rate Λ(t) = from·t + (to−from)·t²/(2T), T the time the ramp takes
// (the time-change theorem: Λ of a nonhomogeneous Poisson process's times
// is a unit-rate one).
func RampArrivals(reqs []workload.Request, from, to float64, seed uint64) {
	n := float64(len(reqs))
	T := 2 * n / (from + to) // Λ(T) = n: the ramp ends with the requests
	k := (to - from) / T
	workload.Arrivals(reqs, 1, seed) // unit-rate times, seeded as every arrival
	for i := range reqs {
		u := reqs[i].At.Seconds() // Λ(t) = u
		t := u / from
		if k != 0 {
			t = (-from + math.Sqrt(from*from+2*k*u)) / k
		}
		reqs[i].At = time.Duration(t * float64(time.Second))
	}
}

// rampRate is the ramp's rate at t.
func rampRate(reqs []workload.Request, from, to float64, t time.Duration) float64 {
	T := 2 * float64(len(reqs)) / (from + to)
	return from + (to-from)*min(t.Seconds()/T, 1)
}

// gaugeSample is the gauge at one scrape.
type gaugeSample struct {
	at  time.Duration
	sat router.PoolSaturation
}

// replaySaturation replays reqs with spec, sampling the first pool's gauge
// at each scrape, and returns the samples and the requests' records.
func replaySaturation(ctx context.Context, cfg Config, reqs []workload.Request, spec PolicySpec, o SaturationOptions) (
	[]gaugeSample, []report.Record, report.Run, error) {
	cfg, pl, err := prepare(cfg, reqs)
	if err != nil {
		return nil, nil, report.Run{}, err
	}
	vr, err := newVirtualRun(cfg, pl, spec)
	if err != nil {
		return nil, nil, report.Run{}, err
	}
	sat := router.NewSaturation(vr.gateways[0].router, router.SaturationConfig{Profile: cfg.Profile,
		BatchTokens: cfg.MaxBatchTokens, Objective: o.Objective, Window: o.Window})
	var samples []gaugeSample
	vr.cfg.observe = func(ev observation) {
		if ev.scrape != nil && ev.scrape.replica == 0 {
			samples = append(samples, gaugeSample{at: ev.scrape.at, sat: sat.Sample()[0]})
		}
	}
	if err := vr.loop(ctx); err != nil {
		return nil, nil, report.Run{}, err
	}
	return samples, vr.reportRecords(), vr.summary(spec.RunName()), nil
}

// rollingP90 is the p90 TTFT of the requests that arrived in (t−w, t], at
// each of times (NaN: fewer than minP90Samples arrived then).
func rollingP90(recs []report.Record, times []time.Duration, w time.Duration) []float64 {
	sorted := slices.Clone(recs)
	slices.SortFunc(sorted, func(a, b report.Record) int { return int(a.Start - b.Start) })
	out := make([]float64, len(times))
	lo, hi := 0, 0
	var buf []float64
	for i, t := range times {
		for hi < len(sorted) && sorted[hi].Start <= t {
			hi++
		}
		for lo < hi && sorted[lo].Start <= t-w {
			lo++
		}
		buf = buf[:0]
		for _, r := range sorted[lo:hi] {
			if !r.Err {
				buf = append(buf, float64(r.TTFT.Microseconds())/1000)
			}
		}
		out[i] = math.NaN()
		if len(buf) >= minP90Samples {
			slices.Sort(buf)
			out[i] = report.Percentile(buf, 0.90)
		}
	}
	return out
}

// SaturationQuestion answers the scaling signal's question with one
// policy: reqs replayed on a ramp from o.From to o.To requests per second
// (the gauge's lead on the measured p90), then at each steady rate of
// o.Steady (the gauge's mean over the run's second half against the p90).
func SaturationQuestion(ctx context.Context, cfg Config, reqs []workload.Request, spec PolicySpec, o SaturationOptions) (
	report.Result, []report.Chart, SaturationFinding, error) {
	ramp := slices.Clone(reqs)
	RampArrivals(ramp, o.From, o.To, o.Seed)
	samples, recs, run, err := replaySaturation(ctx, cfg, ramp, spec, o)
	if err != nil {
		return report.Result{}, nil, SaturationFinding{}, err
	}
	times := make([]time.Duration, len(samples))
	for i, s := range samples {
		times[i] = s.at
	}
	p90 := rollingP90(recs, times, o.P90Window)
	f := crossings(samples, p90, o.Objective)
	if f.GaugeCross >= 0 {
		f.RateAtGauge = rampRate(ramp, o.From, o.To, f.GaugeCross)
	}
	if f.P90Cross >= 0 {
		f.RateAtP90 = rampRate(ramp, o.From, o.To, f.P90Cross)
	}
	run.Policy = fmt.Sprintf("%s ramp %g→%g req/s", spec.RunName(), o.From, o.To)
	run.Extra["gauge_cross_s"], run.Extra["p90_cross_s"], run.Extra["lead_s"] = f.GaugeCross.Seconds(), f.P90Cross.Seconds(), f.Lead.Seconds()
	res := report.Result{Runs: []report.Run{run}, Meta: map[string]any{"objective": o.Objective.String(), "window": o.Window.String()}}
	steady := report.ChartSeries{Name: "gauge (mean, 2nd half)", Points: true}
	measured := report.ChartSeries{Name: "measured p90 / objective", Points: true, Dashed: true}
	for _, rate := range o.Steady {
		st := slices.Clone(reqs)
		workload.Arrivals(st, rate, o.Seed)
		ss, recs, r, err := replaySaturation(ctx, cfg, st, spec, o)
		if err != nil {
			return report.Result{}, nil, SaturationFinding{}, err
		}
		mean, peak := secondHalf(ss)
		p90 := secondHalfP90(recs, ss)
		r.Policy = fmt.Sprintf("%s steady %g req/s", spec.RunName(), rate)
		r.Extra["rate"], r.Extra["saturation_mean"], r.Extra["saturation_max"], r.Extra["p90_ttft_2nd_half_ms"] = rate, mean, peak, p90
		res.Runs = append(res.Runs, r)
		steady.X, steady.Y = append(steady.X, rate), append(steady.Y, mean)
		measured.X, measured.Y = append(measured.X, rate), append(measured.Y, p90/ms(o.Objective))
	}
	return res, saturationCharts(samples, p90, o, f, steady, measured), f, nil
}

// crossings finds when the gauge first reached 1 and the measured p90
// first exceeded the objective.
func crossings(samples []gaugeSample, p90 []float64, objective time.Duration) SaturationFinding {
	f := SaturationFinding{GaugeCross: -1, P90Cross: -1}
	for i, s := range samples {
		if f.GaugeCross < 0 && s.sat.Saturation >= 1 {
			f.GaugeCross = s.at
		}
		if f.P90Cross < 0 && !math.IsNaN(p90[i]) && p90[i] > ms(objective) {
			f.P90Cross = s.at
		}
	}
	if f.GaugeCross >= 0 && f.P90Cross >= 0 {
		f.Lead = f.P90Cross - f.GaugeCross
	}
	return f
}

// secondHalf is the gauge's mean and peak over the second half of a run
// (the first is its warm-up: the rate's window filling).
func secondHalf(ss []gaugeSample) (mean, peak float64) {
	half := ss[len(ss)/2:]
	for _, s := range half {
		mean += s.sat.Saturation
		peak = max(peak, s.sat.Saturation)
	}
	return mean / float64(max(len(half), 1)), peak
}

// secondHalfP90 is the p90 TTFT of the requests that arrived in the
// second half of a run's samples (its steady state, as secondHalf's).
func secondHalfP90(recs []report.Record, ss []gaugeSample) float64 {
	if len(ss) == 0 {
		return 0
	}
	from := ss[len(ss)/2].at
	var ttft []float64
	for _, r := range recs {
		if !r.Err && r.Start >= from {
			ttft = append(ttft, float64(r.TTFT.Microseconds())/1000)
		}
	}
	slices.Sort(ttft)
	return report.Percentile(ttft, 0.90)
}

// saturationCharts are the question's charts: the ramp over time, and
// the steady rates.
func saturationCharts(samples []gaugeSample, p90 []float64, o SaturationOptions, f SaturationFinding,
	steady, measured report.ChartSeries) []report.Chart {
	gauge := report.ChartSeries{Name: "kvgate_pool_saturation"}
	meas := report.ChartSeries{Name: fmt.Sprintf("measured p90 TTFT / objective (%v window)", o.P90Window), Dashed: true}
	for i, s := range samples {
		gauge.X, gauge.Y = append(gauge.X, s.at.Seconds()), append(gauge.Y, s.sat.Saturation)
		if !math.IsNaN(p90[i]) {
			meas.X, meas.Y = append(meas.X, s.at.Seconds()), append(meas.Y, min(p90[i]/ms(o.Objective), 10))
		}
	}
	ramp := report.Chart{Name: "saturation_ramp", Title: fmt.Sprintf("Saturation gauge on a ramp %g→%g req/s", o.From, o.To),
		XLabel: "time (s)", YLabel: "gauge; p90 TTFT / objective", YMin: 0, YMax: 3,
		Caption: fmt.Sprintf("The gauge crossed 1 at %.1f s (%.1f req/s), the measured p90 TTFT exceeded the %v objective at %.1f s "+
			"(%.1f req/s): a lead of %.1f s.", f.GaugeCross.Seconds(), f.RateAtGauge, o.Objective, f.P90Cross.Seconds(), f.RateAtP90, f.Lead.Seconds()),
		Series: []report.ChartSeries{gauge, meas}, Refs: []report.RefLine{{Label: "1: scale out", Y: 1}}}
	charts := []report.Chart{ramp}
	if len(steady.X) > 0 {
		charts = append(charts, report.Chart{Name: "saturation_steady", Title: "Saturation gauge at steady rates",
			XLabel: "arrival rate (req/s)", YLabel: "gauge; p90 TTFT / objective",
			Caption: "At each steady rate, over the run's second half (past the caches' warm-up): the gauge's mean, and the measured p90 TTFT over the objective.",
			Series:  []report.ChartSeries{steady, measured}, Refs: []report.RefLine{{Label: "1", Y: 1}}})
	}
	return charts
}
