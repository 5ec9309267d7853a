package fleet

import (
	"bytes"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvgate/kvgate/internal/router"
)

// ParseMetrics reads a vLLM /metrics page (Prometheus text format) into
// what routing uses. Series of several models (label model_name) are
// summed; the KV usage is their maximum. vLLM ≥ 0.10 names the usage
// vllm:kv_cache_usage_perc; older releases vllm:gpu_cache_usage_perc.
func ParseMetrics(r io.Reader) (router.Metrics, error) {
	fams, err := ParseText(r)
	if err != nil {
		return router.Metrics{}, fmt.Errorf("metrics: %w", err)
	}
	return metricsOf(fams, allEngines)
}

// allEngines selects every series of a page; a rank k ≥ 0 only those of
// data-parallel engine k (label engine="k": vLLM exports one series per
// engine core).
const allEngines = -1

// ofEngine reports whether series s belongs to engine (allEngines: any).
func ofEngine(s *dto.Metric, engine int) bool {
	if engine == allEngines {
		return true
	}
	for _, l := range s.GetLabel() {
		if l.GetName() == "engine" {
			return l.GetValue() == strconv.Itoa(engine)
		}
	}
	return false
}

// Engines is the number of data-parallel engines a page reports: the
// distinct engine labels of vllm:num_requests_running (0: none labelled).
func Engines(fams map[string]*dto.MetricFamily) int {
	seen := map[string]bool{}
	for _, s := range fams["vllm:num_requests_running"].GetMetric() {
		for _, l := range s.GetLabel() {
			if l.GetName() == "engine" {
				seen[l.GetValue()] = true
			}
		}
	}
	return len(seen)
}

// A replica's /metrics page comes from outside the process, and what
// routing reads of it is bounded here, where it is parsed: a NaN or
// infinite sample is refused (the whole scrape: the page means no number),
// a negative one is 0, counts are at most maxCount and the KV usage within
// [0, 1], so that a policy never sees an impossible number.
func metricsOf(fams map[string]*dto.MetricFamily, engine int) (router.Metrics, error) {
	var m router.Metrics
	found := false
	// sum is the engine's series of name summed, each sample checked.
	sum := func(name string) (float64, bool, error) {
		t, any := 0.0, false
		for _, s := range fams[name].GetMetric() {
			if ofEngine(s, engine) {
				v, err := sample(name, s)
				if err != nil {
					return 0, false, err
				}
				t, any = t+v, true
			}
		}
		return t, any, nil
	}
	for _, c := range []struct {
		name string
		dst  *int
	}{{"vllm:num_requests_waiting", &m.Waiting}, {"vllm:num_requests_running", &m.Running}} {
		v, ok, err := sum(c.name)
		if err != nil {
			return router.Metrics{}, err
		}
		if ok {
			*c.dst, found = toCount(v), true
		}
	}
	usage := "vllm:kv_cache_usage_perc"
	if _, ok := fams[usage]; !ok {
		usage = "vllm:gpu_cache_usage_perc" // vLLM < 0.10
	}
	for _, s := range fams[usage].GetMetric() {
		if ofEngine(s, engine) {
			v, err := sample(usage, s)
			if err != nil {
				return router.Metrics{}, err
			}
			m.KVUsage, found = max(m.KVUsage, min(v, 1)), true
		}
	}
	m.NumBlocks, m.BlockSize = cacheConfig(fams, engine)
	switch {
	case !found && engine != allEngines:
		return router.Metrics{}, fmt.Errorf("metrics: no series of data-parallel engine %d (label engine=%q)", engine, strconv.Itoa(engine))
	case !found:
		return router.Metrics{}, fmt.Errorf("metrics: no vllm:num_requests_waiting, vllm:num_requests_running or KV usage series")
	case m.BlockSize < 0 || m.BlockSize > maxBlockSize:
		// A configuration value, not a count: clamping it would scale the
		// block count wrongly.
		return router.Metrics{}, fmt.Errorf("metrics: block_size %d out of range [0, %d]", m.BlockSize, maxBlockSize)
	}
	return m, nil
}

// sample is s's value, a sample of the series name: a NaN or infinite
// value is an error, a negative one 0.
func sample(name string, s *dto.Metric) (float64, error) {
	v := value(s)
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, fmt.Errorf("metrics: %s is %v", name, v)
	}
	return max(v, 0), nil
}

// cacheConfig is an engine's num_gpu_blocks and block_size from
// vllm:cache_config_info (its own series when there is one per engine).
func cacheConfig(fams map[string]*dto.MetricFamily, engine int) (blocks, blockSize int) {
	f, ok := fams["vllm:cache_config_info"]
	if !ok {
		return 0, 0
	}
	for _, s := range f.GetMetric() {
		if engine != allEngines && !ofEngine(s, engine) && len(f.GetMetric()) > 1 {
			continue // one series per engine: this engine's
		}
		for _, l := range s.GetLabel() {
			n, err := strconv.Atoi(l.GetValue())
			if err != nil {
				continue
			}
			switch l.GetName() {
			case "num_gpu_blocks":
				blocks = min(max(n, 0), maxCount) // negative: unknown
			case "block_size":
				blockSize = n
			}
		}
	}
	return blocks, blockSize
}

// maxCount bounds the counts a page may report (requests, blocks): far
// above any engine's, far below where the router's arithmetic overflows.
const (
	maxCount     = 1 << 31
	maxBlockSize = 1 << 16
)

// toCount converts a checked sample (finite, at least 0) to a count, at
// most maxCount (a float's conversion to int is not defined out of range).
func toCount(v float64) int {
	return int(min(v, maxCount))
}

// ParseAdapters is the LoRA adapters a vLLM page reports running or waiting
// (vllm:lora_requests_info, labels running_lora_adapters and
// waiting_lora_adapters: comma-separated names), sorted, without duplicates.
func ParseAdapters(fams map[string]*dto.MetricFamily) []string {
	f, ok := fams["vllm:lora_requests_info"]
	if !ok {
		return nil
	}
	var out []string
	for _, s := range f.GetMetric() {
		for _, l := range s.GetLabel() {
			if l.GetName() != "running_lora_adapters" && l.GetName() != "waiting_lora_adapters" {
				continue
			}
			for _, a := range strings.Split(l.GetValue(), ",") {
				if a = strings.TrimSpace(a); a != "" && !slices.Contains(out, a) {
					out = append(out, a)
				}
			}
		}
	}
	slices.Sort(out)
	return out
}

func value(s *dto.Metric) float64 {
	switch {
	case s.Gauge != nil:
		return s.Gauge.GetValue()
	case s.Counter != nil:
		return s.Counter.GetValue()
	case s.Untyped != nil:
		return s.Untyped.GetValue()
	}
	return 0
}

type metricFamily = dto.MetricFamily

func parseBytes(data []byte) (map[string]*metricFamily, error) {
	fams, err := ParseText(bytes.NewReader(data))
	if err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	return fams, nil
}

// ParseText runs Prometheus's text parser, turning its panics into errors:
// prometheus/common v0.66's parser dereferences nil on a page such as "{}"
// (fixed upstream in a release this module cannot use yet), and a replica's
// bad /metrics page must not take the gateway down.
func ParseText(r io.Reader) (fams map[string]*dto.MetricFamily, err error) {
	defer func() {
		if v := recover(); v != nil {
			fams, err = nil, fmt.Errorf("unparsable metrics page (%v)", v)
		}
	}()
	p := expfmt.NewTextParser(model.LegacyValidation)
	return p.TextToMetricFamilies(r)
}
