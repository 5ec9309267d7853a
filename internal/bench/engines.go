package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvgate/kvgate/internal/fleet"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/sim"
)

// The engine split of a run against real engines (bench --target): vLLM
// tells no client its own times per request, but it exports them as
// histograms. Read from every replica before and after the run, their
// difference is what the engines spent on the run's requests — their time
// to first token (vllm:time_to_first_token_seconds, from the request's
// arrival at vLLM to its first token) and between tokens
// (vllm:inter_token_latency_seconds; vllm:time_per_output_token_seconds
// before vLLM 0.11) — and the client's mean minus the engines' is the time
// spent outside them: the gateway, the network, the client. Means only:
// the histograms hold no per-request figures.

// Histograms of the engine split, in the order they are looked for.
var (
	ttftHistograms = []string{sim.MetricTTFT}
	itlHistograms  = []string{sim.MetricITL, "vllm:time_per_output_token_seconds"}
)

// maxMetricsPage bounds one replica's /metrics page.
const maxMetricsPage = 64 << 20

// histogram is the sum of a family's series: bucket counts by upper bound
// (cumulative), the sample count and the sum of the samples (seconds).
type histogram struct {
	buckets map[float64]float64
	count   float64
	sum     float64
}

// engineSnapshot is one replica's engine histograms at one time; a nil
// histogram is a family the page does not have.
type engineSnapshot struct{ ttft, itl *histogram }

// ErrNoEngineMetrics: no replica exported vLLM's latency histograms.
var ErrNoEngineMetrics = errors.New("no replica exports vLLM's vllm:time_to_first_token_seconds")

// EngineURLs are the replicas to scrape for a --target run: the base URLs
// of the gateway's targets (a data-parallel rank's #k cut off), or the
// target itself when it names none (an engine itself, or a router that does
// not list its replicas).
func EngineURLs(target string, targets []string) []string {
	var out []string
	for _, t := range targets {
		base, _, _ := strings.Cut(t, "#")
		if base != "" && !slices.Contains(out, base) {
			out = append(out, base)
		}
	}
	if len(out) == 0 {
		out = []string{strings.TrimRight(target, "/")}
	}
	return out
}

// EngineMetrics is a reading of the replicas' engine histograms.
type EngineMetrics struct {
	snaps  map[string]engineSnapshot
	failed map[string]error // replicas whose page could not be read
}

// scrapeTimeout bounds one replica's /metrics read (ScrapeEngines' default
// client).
const scrapeTimeout = 10 * time.Second

// ScrapeEngines reads each replica's /metrics (with header) for the engine
// histograms; c nil: a client that gives up on a replica after
// scrapeTimeout. A replica that cannot be read is noted, not fatal.
func ScrapeEngines(ctx context.Context, c *http.Client, urls []string, header http.Header) EngineMetrics {
	if c == nil {
		c = &http.Client{Timeout: scrapeTimeout}
	}
	m := EngineMetrics{snaps: map[string]engineSnapshot{}, failed: map[string]error{}}
	for _, u := range urls {
		s, err := scrapeEngine(ctx, c, u, header)
		if err != nil {
			m.failed[u] = err
			continue
		}
		m.snaps[u] = s
	}
	return m
}

func scrapeEngine(ctx context.Context, c *http.Client, url string, header http.Header) (engineSnapshot, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(url, "/")+"/metrics", nil)
	if err != nil {
		return engineSnapshot{}, err
	}
	for k, vs := range header {
		req.Header[k] = vs
	}
	resp, err := c.Do(req)
	if err != nil {
		return engineSnapshot{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		return engineSnapshot{}, fmt.Errorf("GET /metrics: %s", resp.Status)
	}
	fams, err := fleet.ParseText(io.LimitReader(resp.Body, maxMetricsPage))
	if err != nil {
		return engineSnapshot{}, err
	}
	return engineSnapshot{ttft: histogramOf(fams, ttftHistograms), itl: histogramOf(fams, itlHistograms)}, nil
}

// histogramOf sums the series of the first of names the page has; nil
// when it has none. A series with a count, sum or bucket that no histogram
// can have (negative, not finite, buckets not cumulative) is left out.
func histogramOf(fams map[string]*dto.MetricFamily, names []string) *histogram {
	for _, name := range names {
		f, ok := fams[name]
		if !ok || f.GetType() != dto.MetricType_HISTOGRAM {
			continue
		}
		h := &histogram{buckets: map[float64]float64{}}
		for _, m := range f.GetMetric() {
			if s := m.GetHistogram(); validSeries(s) {
				h.count += float64(s.GetSampleCount())
				h.sum += s.GetSampleSum()
				for _, b := range s.GetBucket() {
					h.buckets[b.GetUpperBound()] += float64(b.GetCumulativeCount())
				}
			}
		}
		return h
	}
	return nil
}

func validSeries(s *dto.Histogram) bool {
	if s == nil || !(s.GetSampleSum() >= 0) || math.IsInf(s.GetSampleSum(), 0) {
		return false
	}
	prev := uint64(0)
	for _, b := range s.GetBucket() {
		if math.IsNaN(b.GetUpperBound()) || b.GetCumulativeCount() < prev || b.GetCumulativeCount() > s.GetSampleCount() {
			return false
		}
		prev = b.GetCumulativeCount()
	}
	return true
}

// since is h − before: what was observed between the two readings; a
// histogram that went back (the replica restarted) counts from zero.
func (h *histogram) since(before *histogram) *histogram {
	if before == nil || h.count < before.count || h.sum < before.sum {
		return h
	}
	d := &histogram{buckets: map[float64]float64{}, count: h.count - before.count, sum: h.sum - before.sum}
	for le, n := range h.buckets {
		d.buckets[le] = max(n-before.buckets[le], 0)
	}
	return d
}

func (h *histogram) add(o *histogram) {
	h.count += o.count
	h.sum += o.sum
	for le, n := range o.buckets {
		h.buckets[le] += n
	}
}

// dist is the histogram's distribution in ms: the mean exact, the
// percentiles interpolated linearly within their bucket as Prometheus's
// histogram_quantile does (the lowest bucket from 0; a rank in the +Inf
// bucket is the highest finite bound).
func (h *histogram) dist() report.Dist {
	les := make([]float64, 0, len(h.buckets))
	for le := range h.buckets {
		les = append(les, le)
	}
	slices.Sort(les)
	q := func(p float64) float64 {
		rank := p * h.count
		lower, below := 0.0, 0.0
		for _, le := range les {
			n := h.buckets[le]
			if n >= rank {
				if math.IsInf(le, 1) {
					return 1000 * lower
				}
				if n == below {
					return 1000 * le
				}
				return 1000 * (lower + (le-lower)*(rank-below)/(n-below))
			}
			lower, below = le, n
		}
		return 1000 * lower
	}
	return report.Dist{Mean: 1000 * h.sum / h.count, P50: q(0.5), P90: q(0.9), P99: q(0.99)}
}

// EngineSplit is the run's split from the replicas' histograms read before
// and after it, for a run whose summary is run; false, with why, when they
// tell nothing: no replica read both times, none with vLLM's TTFT
// histogram, or no first token counted between the readings. note says
// what the reader should know besides: replicas that could not be read,
// and first tokens the replicas counted beyond the run's own requests
// (other clients of the same replicas).
func EngineSplit(before, after EngineMetrics, run report.Run) (split *report.Split, note string, err error) {
	ttft, itl := &histogram{buckets: map[float64]float64{}}, &histogram{buckets: map[float64]float64{}}
	var read, unread []string
	for u, a := range after.snaps {
		b, ok := before.snaps[u]
		if !ok || a.ttft == nil {
			unread = append(unread, u)
			continue
		}
		read = append(read, u)
		ttft.add(a.ttft.since(b.ttft))
		if a.itl != nil {
			itl.add(a.itl.since(b.itl))
		}
	}
	for u := range before.failed {
		unread = append(unread, u)
	}
	for u := range after.failed {
		unread = append(unread, u)
	}
	slices.Sort(unread)
	unread = slices.Compact(unread)
	switch {
	case len(read) == 0 && len(after.failed)+len(before.failed) > 0:
		return nil, "", fmt.Errorf("no replica's /metrics could be read (%s)", firstFailure(before, after))
	case len(read) == 0:
		return nil, "", ErrNoEngineMetrics
	case ttft.count == 0:
		return nil, "", errors.New("the replicas' vllm:time_to_first_token_seconds counted no first token during the run")
	}
	split = &report.Split{Source: report.SplitEngineMetrics, Requests: int(ttft.count), EngineTTFTms: ttft.dist()}
	split.OutsideTTFTMeanms = run.TTFTms.Mean - split.EngineTTFTms.Mean
	if itl.count > 0 {
		split.EngineITLms = itl.dist()
		split.OutsideITLMeanms = run.ITLms.Mean - split.EngineITLms.Mean
	}
	return split, engineNote(unread, int(ttft.count), run.Requests-run.Errors), nil
}

func firstFailure(ms ...EngineMetrics) string {
	for _, m := range ms {
		keys := make([]string, 0, len(m.failed))
		for u := range m.failed {
			keys = append(keys, u)
		}
		slices.Sort(keys)
		if len(keys) > 0 {
			return fmt.Sprintf("%s: %v", keys[0], m.failed[keys[0]])
		}
	}
	return ""
}

// engineNote says what limits an engine split: replicas left out, and
// first tokens the histograms counted that were not the run's.
func engineNote(unread []string, counted, served int) string {
	var parts []string
	if len(unread) > 0 {
		parts = append(parts, "without "+strings.Join(unread, ", ")+" (no histogram, or /metrics unreadable)")
	}
	if counted > served+served/20 {
		parts = append(parts, fmt.Sprintf("the replicas counted %d first tokens for the run's %d requests: other clients' are in the engine figures", counted, served))
	}
	return strings.Join(parts, "; ")
}
