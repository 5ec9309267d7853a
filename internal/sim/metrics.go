package sim

import (
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric names, exactly as vLLM (v1 engine, ≥ 0.9) exposes them. vLLM
// declares its counters without the suffix and Python's prometheus_client
// appends "_total"; Go's client exposes names as given, so the counters are
// declared with the suffix.
const (
	MetricRunning        = "vllm:num_requests_running"
	MetricWaiting        = "vllm:num_requests_waiting"
	MetricKVUsage        = "vllm:kv_cache_usage_perc"
	MetricPrefixQueries  = "vllm:prefix_cache_queries_total"
	MetricPrefixHits     = "vllm:prefix_cache_hits_total"
	MetricPreemptions    = "vllm:num_preemptions_total"
	MetricPromptTokens   = "vllm:prompt_tokens_total"
	MetricGenTokens      = "vllm:generation_tokens_total"
	MetricRequestSuccess = "vllm:request_success_total"
	MetricTTFT           = "vllm:time_to_first_token_seconds"
	MetricE2E            = "vllm:e2e_request_latency_seconds"
	// MetricITL is vLLM's inter-token latency histogram (≥ 0.11; before,
	// vllm:time_per_output_token_seconds): one sample per output token
	// after the first, the time since the previous one.
	MetricITL         = "vllm:inter_token_latency_seconds"
	MetricCacheConfig = "vllm:cache_config_info"
	MetricLoRAInfo    = "vllm:lora_requests_info"

	// Prefill/decode disaggregation: vLLM's connector-side prefix cache
	// counters and prompt tokens by source (local_compute,
	// local_cache_hit, external_kv_transfer), and the NixlConnector's
	// transfer metrics (NixlPromMetrics).
	MetricExternalQueries         = "vllm:external_prefix_cache_queries_total"
	MetricExternalHits            = "vllm:external_prefix_cache_hits_total"
	MetricPromptBySource          = "vllm:prompt_tokens_by_source_total"
	MetricNixlXferTime            = "vllm:nixl_xfer_time_seconds"
	MetricNixlBytes               = "vllm:nixl_bytes_transferred"
	MetricNixlFailedTransfers     = "vllm:nixl_num_failed_transfers_total"
	MetricNixlFailedNotifications = "vllm:nixl_num_failed_notifications_total"
)

// ContractMetrics are the metrics DESIGN.md's sim contract requires.
var ContractMetrics = []string{
	MetricRunning, MetricWaiting, MetricKVUsage, MetricPrefixQueries, MetricPrefixHits,
	MetricTTFT, MetricE2E, MetricPromptTokens, MetricGenTokens, MetricRequestSuccess,
	MetricCacheConfig,
}

// Buckets of vLLM's v1 PrometheusStatLogger.
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
		0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0}
	// vLLM's inter-token latency buckets.
	itlBuckets = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
		10.0, 20.0, 40.0, 80.0}
	latencyBuckets = []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
		40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0}
	// NixlPromMetrics' buckets: transfer time, and bytes 2 KiB to 8 GiB
	// (2^(10+i) for odd i in [1, 23]).
	nixlTimeBuckets  = []float64{0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0}
	nixlBytesBuckets = prometheus.ExponentialBuckets(1<<11, 4, 12)
)

// Finish reasons, vLLM's FinishReason values and OpenAI's finish_reason.
const (
	finishStop   = "stop"
	finishLength = "length"
	finishAbort  = "abort"
)

// metrics is one replica's registry. Gauges and engine counters are read
// from each core's engine at scrape time (engineCollector); latency
// histograms and finish reasons, which the engine does not know, are
// observed by each core's driver (coreMetrics). Latencies are in virtual
// seconds: what the simulated GPU would report.
type metrics struct {
	reg *prometheus.Registry
}

// coreMetrics are the series one engine core observes.
type coreMetrics struct {
	ttft    prometheus.Histogram
	itl     prometheus.Histogram
	e2e     prometheus.Histogram
	success map[string]prometheus.Counter

	// NIXL: a decode core's transfers (virtual seconds, bytes), pulls it
	// gave up (the prompt computed here instead) and release
	// notifications that did not reach the prefill side.
	xferTime, xferBytes                  prometheus.Histogram
	failedTransfers, failedNotifications prometheus.Counter
}

func newMetrics(r *Replica) *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	for _, c := range r.cores {
		// vLLM labels every series with the (first) served model name and
		// the engine index: one series per engine core, as a server
		// started with --data-parallel-size has.
		labels := prometheus.Labels{"model_name": r.cfg.servedName(), "engine": strconv.Itoa(c.rank)}
		c.metrics = newCoreMetrics(m.reg, labels)
		m.reg.MustRegister(newEngineCollector(labels, c), newTierCollector(labels, c))
	}
	// vLLM's cache_config_info carries the CacheConfig fields as labels
	// (plus "engine") and no model_name; one per server.
	cc := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: MetricCacheConfig, Help: "Information of the LLMEngine CacheConfig",
		ConstLabels: prometheus.Labels{
			"block_size":            strconv.Itoa(r.cfg.BlockSize),
			"num_gpu_blocks":        strconv.Itoa(r.cfg.KVBlocks),
			"enable_prefix_caching": "True",
			"cache_dtype":           "auto",
			"engine":                "0",
		},
	})
	cc.Set(1)
	m.reg.MustRegister(cc)
	if len(r.cfg.Adapters) > 0 { // vLLM has it with LoRA enabled only
		m.reg.MustRegister(newLoRACollector(r))
	}
	return m
}

// newCoreMetrics registers one core's histograms and finish-reason
// counters in reg under labels.
func newCoreMetrics(reg *prometheus.Registry, labels prometheus.Labels) *coreMetrics {
	m := &coreMetrics{
		ttft: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: MetricTTFT, Help: "Histogram of time to first token in seconds.",
			Buckets: ttftBuckets, ConstLabels: labels,
		}),
		itl: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: MetricITL, Help: "Histogram of inter-token latency in seconds.",
			Buckets: itlBuckets, ConstLabels: labels,
		}),
		e2e: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: MetricE2E, Help: "Histogram of e2e request latency in seconds.",
			Buckets: latencyBuckets, ConstLabels: labels,
		}),
		success: make(map[string]prometheus.Counter),
	}
	sv := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: MetricRequestSuccess, Help: "Count of successfully processed requests.",
		ConstLabels: labels,
	}, []string{"finished_reason"})
	// vLLM creates one series per FinishReason up front, so they read 0.
	for _, reason := range []string{finishStop, finishLength, finishAbort} {
		m.success[reason] = sv.WithLabelValues(reason)
	}
	reg.MustRegister(m.ttft, m.itl, m.e2e, sv)
	m.registerNixl(reg, labels)
	return m
}

// registerNixl registers the NixlConnector's metrics of one core.
func (m *coreMetrics) registerNixl(reg *prometheus.Registry, labels prometheus.Labels) {
	m.xferTime = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: MetricNixlXferTime, Help: "Histogram of transfer duration for NIXL KV Cache transfers.",
		Buckets: nixlTimeBuckets, ConstLabels: labels,
	})
	m.xferBytes = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: MetricNixlBytes, Help: "Histogram of bytes transferred per NIXL KV Cache transfers.",
		Buckets: nixlBytesBuckets, ConstLabels: labels,
	})
	m.failedTransfers = prometheus.NewCounter(prometheus.CounterOpts{
		Name: MetricNixlFailedTransfers, Help: "Number of failed NIXL KV Cache transfers.", ConstLabels: labels,
	})
	m.failedNotifications = prometheus.NewCounter(prometheus.CounterOpts{
		Name: MetricNixlFailedNotifications, Help: "Number of failed NIXL KV Cache notifications.",
		ConstLabels: labels,
	})
	reg.MustRegister(m.xferTime, m.xferBytes, m.failedTransfers, m.failedNotifications)
}

// engineCollector reads one core's engine gauges and counters at scrape time.
type engineCollector struct {
	c                                                          *core
	running, waiting, kvUsage, queries, hits, preempt, pt, gen *prometheus.Desc
	extQueries, extHits, bySource                              *prometheus.Desc
}

func newEngineCollector(labels prometheus.Labels, c *core) *engineCollector {
	d := func(name, help string) *prometheus.Desc { return prometheus.NewDesc(name, help, nil, labels) }
	return &engineCollector{
		c:       c,
		running: d(MetricRunning, "Number of requests in model execution batches."),
		waiting: d(MetricWaiting, "Number of requests waiting to be processed."),
		kvUsage: d(MetricKVUsage, "KV-cache usage. 1 means 100 percent usage."),
		queries: d(MetricPrefixQueries, "Prefix cache queries, in terms of number of queried tokens."),
		hits:    d(MetricPrefixHits, "Prefix cache hits, in terms of number of cached tokens."),
		preempt: d(MetricPreemptions, "Cumulative number of preemption from the engine."),
		pt:      d(MetricPromptTokens, "Number of prefill tokens processed."),
		gen:     d(MetricGenTokens, "Number of generation tokens processed."),
		extQueries: d(MetricExternalQueries,
			"External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of queried tokens."),
		extHits: d(MetricExternalHits,
			"External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens."),
		bySource: prometheus.NewDesc(MetricPromptBySource, "Number of prompt tokens by source.",
			[]string{"source"}, labels),
	}
}

func (c *engineCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.running, c.waiting, c.kvUsage, c.queries, c.hits, c.preempt, c.pt, c.gen,
		c.extQueries, c.extHits, c.bySource} {
		ch <- d
	}
}

func (c *engineCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.c.stats()
	g := func(d *prometheus.Desc, v float64) { ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v) }
	k := func(d *prometheus.Desc, v int64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v))
	}
	g(c.running, float64(s.Running))
	g(c.waiting, float64(s.Waiting))
	g(c.kvUsage, s.KVUsage)
	k(c.queries, s.PrefixQueries)
	k(c.hits, s.PrefixHits)
	k(c.preempt, s.Preemptions)
	k(c.pt, s.PromptTokens)
	k(c.gen, s.GenerationTokens)
	k(c.extQueries, s.ExternalQueries)
	k(c.extHits, s.ExternalHits)
	for _, src := range []struct {
		name string
		v    int64
	}{{"local_compute", s.PromptComputed}, {"local_cache_hit", s.PromptLocalHit}, {"external_kv_transfer", s.PromptExternal}} {
		ch <- prometheus.MustNewConstMetric(c.bySource, prometheus.CounterValue, float64(src.v), src.name)
	}
}

var _ prometheus.Collector = (*engineCollector)(nil)

// maxLoRASeries bounds the label sets loraCollector remembers.
const maxLoRASeries = 64

// loraCollector is vLLM's vllm:lora_requests_info: a gauge whose labels
// are max_lora and the comma-separated adapters of the running and the
// waiting requests, and whose value is the Unix time the label set was
// last seen. vLLM sets the gauge of the current label set to the current
// time and never removes the others, so consumers take the series with
// the largest value; the sim does the same at each scrape, remembering
// the last maxLoRASeries label sets. max_lora is the number of adapters
// served: the sim batches them all at once (vLLM's --max-loras).
type loraCollector struct {
	r       *Replica
	desc    *prometheus.Desc
	maxLora string

	mu   sync.Mutex
	seen map[[2]string]float64 // (running, waiting) → last time
}

func newLoRACollector(r *Replica) *loraCollector {
	return &loraCollector{
		r: r,
		desc: prometheus.NewDesc(MetricLoRAInfo, "Running stats on lora requests.",
			[]string{"max_lora", "running_lora_adapters", "waiting_lora_adapters"}, nil),
		maxLora: strconv.Itoa(len(r.cfg.Adapters)),
		seen:    map[[2]string]float64{},
	}
}

func (c *loraCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *loraCollector) Collect(ch chan<- prometheus.Metric) {
	running, waiting := c.r.loraRequests()
	key := [2]string{adapterList(running), adapterList(waiting)}
	now := float64(c.r.clock.Now().UnixNano()) / 1e9
	c.mu.Lock()
	defer c.mu.Unlock()
	c.seen[key] = now
	if len(c.seen) > maxLoRASeries {
		oldest := key
		for k, t := range c.seen {
			if t < c.seen[oldest] {
				oldest = k
			}
		}
		delete(c.seen, oldest)
	}
	for k, t := range c.seen {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, t, c.maxLora, k[0], k[1])
	}
}

// loraRequests counts the live requests of each adapter, running and
// waiting, over the replica's cores: vLLM's lora_requests_info has no engine
// label.
func (r *Replica) loraRequests() (running, waiting map[string]int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	running, waiting = r.cores[0].eng.LoraRequests()
	for _, c := range r.cores[1:] {
		run, wait := c.eng.LoraRequests()
		for a, n := range run {
			running[a] += n
		}
		for a, n := range wait {
			waiting[a] += n
		}
	}
	return running, waiting
}

// adapterList is the sorted, comma-separated names of the adapters with
// requests.
func adapterList(counts map[string]int) string {
	names := slices.Sorted(maps.Keys(counts))
	return strings.Join(names, ",")
}
