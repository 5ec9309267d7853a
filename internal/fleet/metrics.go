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

func metricsOf(fams map[string]*dto.MetricFamily, engine int) (router.Metrics, error) {
	var m router.Metrics
	found := false
	sum := func(name string) (float64, bool) {
		f, ok := fams[name]
		if !ok {
			return 0, false
		}
		t, any := 0.0, false
		for _, s := range f.GetMetric() {
			if ofEngine(s, engine) {
				t += value(s)
				any = true
			}
		}
		return t, any
	}
	if v, ok := sum("vllm:num_requests_waiting"); ok {
		m.Waiting, found = toCount(v), true
	}
	if v, ok := sum("vllm:num_requests_running"); ok {
		m.Running, found = toCount(v), true
	}
	for _, name := range []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"} {
		if f, ok := fams[name]; ok {
			for _, s := range f.GetMetric() {
				if ofEngine(s, engine) {
					m.KVUsage = max(m.KVUsage, value(s))
					found = true
				}
			}
			break
		}
	}
	m.NumBlocks, m.BlockSize = cacheConfig(fams, engine)
	if !found && engine != allEngines {
		return router.Metrics{}, fmt.Errorf("metrics: no series of data-parallel engine %d (label engine=%q)", engine, strconv.Itoa(engine))
	}
	if !found {
		return router.Metrics{}, fmt.Errorf("metrics: no vllm:num_requests_waiting, vllm:num_requests_running or KV usage series")
	}
	if math.IsNaN(m.KVUsage) || m.KVUsage < 0 || m.KVUsage > 1.0001 || m.Waiting < 0 || m.Running < 0 ||
		m.Waiting > maxCount || m.Running > maxCount || m.NumBlocks < 0 || m.NumBlocks > maxCount ||
		m.BlockSize < 0 || m.BlockSize > maxBlockSize {
		return router.Metrics{}, fmt.Errorf("metrics: values out of range (waiting %d, running %d, kv usage %g)", m.Waiting, m.Running, m.KVUsage)
	}
	return m, nil
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
				blocks = n
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

// toCount converts a sample to a count; NaN and values out of range become
// -1, which the range check rejects (a float's conversion to int is not
// defined out of range).
func toCount(v float64) int {
	if math.IsNaN(v) || v < 0 || v > maxCount {
		return -1
	}
	return int(v)
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
