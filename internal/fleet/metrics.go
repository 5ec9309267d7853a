package fleet

import (
	"fmt"
	"io"
	"math"
	"strconv"

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
	var m router.Metrics
	found := false
	sum := func(name string) (float64, bool) {
		f, ok := fams[name]
		if !ok {
			return 0, false
		}
		t := 0.0
		for _, s := range f.GetMetric() {
			t += value(s)
		}
		return t, true
	}
	if v, ok := sum("vllm:num_requests_waiting"); ok {
		m.Waiting, found = int(v), true
	}
	if v, ok := sum("vllm:num_requests_running"); ok {
		m.Running, found = int(v), true
	}
	for _, name := range []string{"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"} {
		if f, ok := fams[name]; ok {
			for _, s := range f.GetMetric() {
				m.KVUsage = max(m.KVUsage, value(s))
			}
			found = true
			break
		}
	}
	if f, ok := fams["vllm:cache_config_info"]; ok {
		for _, s := range f.GetMetric() {
			for _, l := range s.GetLabel() {
				n, err := strconv.Atoi(l.GetValue())
				if err != nil {
					continue
				}
				switch l.GetName() {
				case "num_gpu_blocks":
					m.NumBlocks = n
				case "block_size":
					m.BlockSize = n
				}
			}
		}
	}
	if !found {
		return router.Metrics{}, fmt.Errorf("metrics: no vllm:num_requests_waiting, vllm:num_requests_running or KV usage series")
	}
	if math.IsNaN(m.KVUsage) || m.KVUsage < 0 || m.KVUsage > 1.0001 || m.Waiting < 0 || m.Running < 0 {
		return router.Metrics{}, fmt.Errorf("metrics: values out of range (waiting %d, running %d, kv usage %g)", m.Waiting, m.Running, m.KVUsage)
	}
	return m, nil
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
