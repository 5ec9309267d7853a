package gateway

import (
	"fmt"
	"net/http"
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// metrics are the gateway's Prometheus series, on a registry passed in.
type metrics struct {
	requests       *prometheus.CounterVec   // policy, replica, code
	errors         *prometheus.CounterVec   // kind
	ttft           *prometheus.HistogramVec // policy, replica
	e2e            *prometheus.HistogramVec // policy
	decision       prometheus.Histogram
	matchRatio     prometheus.Histogram
	retries        prometheus.Counter
	ejections      *prometheus.CounterVec // replica
	attempts       *prometheus.CounterVec // replica, verdict
	tokenize       *prometheus.CounterVec // result
	underpredicted *prometheus.CounterVec // replica
	routerQueued   prometheus.Gauge
	policyPanics   *prometheus.CounterVec // policy
	routerWait     prometheus.Histogram
	// Prefill/decode disaggregation.
	pdAttempts      *prometheus.CounterVec // step, replica, verdict
	prefillSkipped  *prometheus.CounterVec // reason
	prefillFallback *prometheus.CounterVec // reason
	prefillHeldKV   *prometheus.CounterVec // outcome
	prefillStep     prometheus.Histogram
	// What the router decided and how it turned out (settled).
	decisions     *prometheus.CounterVec   // replica, branch
	ttftRatio     *prometheus.HistogramVec // replica
	promptTokens  *prometheus.CounterVec   // replica
	cachedTokens  *prometheus.CounterVec   // replica
	genTokens     *prometheus.CounterVec   // replica
	usageReported *prometheus.CounterVec   // replica
	// Route receipts' checks (receipt.go).
	routeChecks, wrongRoutes *prometheus.CounterVec // policy, replica
	// series keeps the children a served attempt updates (metrics_series.go).
	series seriesCache
}

var latencyBuckets = []float64{.005, .01, .025, .05, .075, .1, .15, .2, .3, .5, .75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 40, 80}

func newMetrics(reg prometheus.Registerer, rt *router.Router, clk clock.Clock) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_requests_total",
			Help: "Requests proxied, by policy, replica and HTTP status."}, []string{"policy", "replica", "code"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_request_errors_total",
			Help: "Requests answered with a gateway error, by kind."}, []string{"kind"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvgate_time_to_first_token_seconds",
			Help: "Time to first token of streamed requests, seen by the gateway (from the request's arrival), by the " +
				"replica that answered (a disaggregated request's decode replica).", Buckets: latencyBuckets}, []string{"policy", "replica"}),
		e2e: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvgate_e2e_request_latency_seconds",
			Help: "End-to-end request latency seen by the gateway.", Buckets: latencyBuckets}, []string{"policy"}),
		decision: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvgate_routing_decision_seconds",
			Help:    "Time to route one request: hashing, index match and policy pick.",
			Buckets: prometheus.ExponentialBuckets(1e-6, 2, 16)}),
		matchRatio: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvgate_prefix_match_ratio",
			Help: "Matched blocks / prompt blocks credited to the chosen replica.", Buckets: prometheus.LinearBuckets(0, 0.1, 11)}),
		retries: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_retries_total",
			Help: "Requests sent again to another replica before their first byte."}),
		ejections: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_ejections_total",
			Help: "Replicas taken out of rotation after consecutive failures."}, []string{"replica"}),
		attempts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_attempts_total",
			Help: "Attempts at a replica by verdict: served, refused, busy, failed (these two count against the replica), " +
				"rejected (the client's fault), client_gone, gateway_limit."}, []string{"replica", "verdict"}),
		tokenize: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_remote_tokenize_total",
			Help: "Remote /tokenize lookups by result: cache, remote, shared (joined a concurrent lookup of the same prompt), fallback (the approximate tokenizer routed)."}, []string{"result"}),
	}
	m.underpredicted = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_precise_underpredicted_total",
		Help: "Requests whose engine reported more cached prompt tokens than the trusted precise index predicted " +
			"(by over two blocks): events that do not match requests (tokenizer, model name, block size)."}, []string{"replica"})
	m.routerQueued = prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvgate_router_queue_depth",
		Help: "Requests waiting in the router's queue (a policy deferred them: late binding, e.g. dynamo's router queue)."})
	m.routerWait = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvgate_router_queue_wait_seconds",
		Help: "Time requests waited in the router's queue.", Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)})
	m.policyPanics = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_policy_panics_total",
		Help: "Panics recovered from a routing policy's pick, by policy (a pool's own included): each such request " +
			"was routed by least load instead; the stack is logged at most once a minute per policy."}, []string{"policy"})
	reg.MustRegister(m.routerQueued, m.routerWait, m.policyPanics)
	m.newPDMetrics(reg)
	m.newOutcomeMetrics(reg)
	m.newRouteMetrics(reg)
	reg.MustRegister(m.requests, m.errors, m.ttft, m.e2e, m.decision, m.matchRatio, m.retries, m.ejections, m.attempts, m.tokenize,
		m.underpredicted)
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvgate_index_entries",
		Help: "(block, replica) entries in the approximate prefix index."}, func() float64 { return float64(rt.Index().Len()) }))
	return m
}

// policyPanicked is the router's OnPolicyPanic: every panic counted, and
// logged with its stack when the router attaches one (at most once a
// minute per policy, on the gateway's clock).
func policyPanicked(g **Gateway) func(router.PolicyPanic) {
	return func(p router.PolicyPanic) {
		gw := *g
		if gw == nil || gw.met == nil {
			return // no request is routed before New returns
		}
		gw.met.policyPanics.WithLabelValues(p.Policy).Inc()
		if p.Stack != nil {
			gw.log.Error("routing policy panicked: the request was routed by least load", "policy", p.Policy,
				"panic", fmt.Sprint(p.Value), "suppressed_since_last_log", p.Suppressed, "stack", string(p.Stack))
		}
	}
}

// ejected is the router's OnEject: a replica's breaker opened on a
// failed attempt (settle): counted, and logged by the fleet with the
// replica's other rotation changes.
func ejected(g **Gateway) func(router.Ejection) {
	return func(e router.Ejection) {
		gw := *g
		if gw == nil || gw.met == nil {
			return // no request is settled before New returns
		}
		gw.met.ejections.WithLabelValues(e.Name).Inc()
		gw.fleet.NoteEjection(e.Slot, e.Cooldown)
	}
}

// newPDMetrics makes and registers the prefill/decode series.
func (m *metrics) newPDMetrics(reg prometheus.Registerer) {
	m.pdAttempts = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_pd_attempts_total",
		Help: "Attempts of disaggregated requests' steps (prefill, decode) at a replica by verdict, as " +
			"kvgate_attempts_total (which counts them too)."}, []string{"step", "replica", "verdict"})
	m.prefillSkipped = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_prefill_skipped_total",
		Help: "Requests routed to a prefill/decode fleet without a prefill step, by reason: threshold (the decode " +
			"replica lacked fewer than non_cached_tokens of the prompt), aggregated (a replica of role both serves it " +
			"whole), no_prefill_replica (none healthy, or all tried)."}, []string{"reason"})
	m.prefillFallback = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_prefill_fallbacks_total",
		Help: "Requests whose decode replica computed the prompt itself after a prefill step, by reason: " +
			"prefill_failed (every retry failed), no_kv_transfer_params (the prefill replica is not a KV producer), " +
			"prefill_stopped (generation ended at the first token: nothing to pull)."}, []string{"reason"})
	m.prefillStep = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvgate_prefill_step_seconds",
		Help: "Duration of prefill steps answered 2xx, from the request to the prefill replica to its answer.", Buckets: latencyBuckets})
	m.prefillHeldKV = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_prefill_held_kv_total",
		Help: "Completed prefill steps whose decode step was refused before it started, by outcome: reused (a " +
			"decode step routed again pulls the held KV; counted per try), released (no decode replica took it: " +
			"the prefill replica frees it after its hold timeout)."}, []string{"outcome"})
	reg.MustRegister(m.pdAttempts, m.prefillSkipped, m.prefillFallback, m.prefillHeldKV, m.prefillStep)
}

// ttftRatioBuckets are observed/estimated TTFT ratios: 1 is a perfect
// estimate; the buckets are finer near it, and symmetric on a log scale
// (x and 1/x are as far from 1).
var ttftRatioBuckets = []float64{1. / 8, 1. / 4, 1. / 2, 2. / 3, 0.8, 0.9, 1, 1.0 / 0.9, 1.25, 1.5, 2, 4, 8}

// newOutcomeMetrics makes and registers the decision and per-replica
// usage series (fed by settled).
func (m *metrics) newOutcomeMetrics(reg prometheus.Registerer) {
	m.decisions = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_route_decisions_total",
		Help: "Routing decisions by the replica chosen and the branch taken: held_prefix (the chosen replica held " +
			"the longest prefix of the prompt any candidate held), spilled_load (another candidate held more of it: " +
			"the policy moved the request for load), miss (no candidate held a block of it). A disaggregated request's " +
			"decision is its prefill step's (or its decode step's when the prefill is skipped); retries count again."},
		[]string{"replica", "branch"})
	m.ttftRatio = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvgate_ttft_estimate_ratio",
		Help: "Observed / estimated time to first token of streamed requests, both from routing, for policies that " +
			"estimate it (ttft): 1 is exact, above 1 the policy was optimistic, below pessimistic.",
		Buckets: ttftRatioBuckets}, []string{"replica"})
	m.promptTokens = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_replica_prompt_tokens_total",
		Help: "Prompt tokens of the answers the gateway relayed from the replica (its usage.prompt_tokens)."}, []string{"replica"})
	m.cachedTokens = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_replica_cached_tokens_total",
		Help: "Prompt tokens the replica found in its prefix cache, from the answers' usage.prompt_tokens_details." +
			"cached_tokens (a decode step's pulled tokens included). Divide by kvgate_replica_usage_prompt_tokens_total " +
			"for the hit rate."}, []string{"replica"})
	m.usageReported = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_replica_usage_prompt_tokens_total",
		Help: "Prompt tokens of the answers whose usage reported cached_tokens: the hit rate's denominator (a replica " +
			"without --enable-prompt-tokens-details reports none)."}, []string{"replica"})
	m.genTokens = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_replica_generation_tokens_total",
		Help: "Generated tokens of the answers the gateway relayed from the replica (usage.completion_tokens)."}, []string{"replica"})
	reg.MustRegister(m.decisions, m.ttftRatio, m.promptTokens, m.cachedTokens, m.usageReported, m.genTokens)
}

func (g *Gateway) registerLimiterMetrics(reg prometheus.Registerer) {
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvgate_request_body_bytes",
		Help: "Bytes of request bodies the gateway holds (bounded by max_body_memory)."},
		func() float64 { return float64(g.bodies.held.Load()) }))
	if g.live.lim.Load() == nil {
		return
	}
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvgate_admitted_requests",
		Help: "Requests holding a concurrency slot."}, func() float64 { return float64(g.live.lim.Load().inUse()) }))
	reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvgate_queued_requests",
		Help: "Requests waiting for a concurrency slot."}, func() float64 { return float64(g.live.lim.Load().queued()) }))
}

func codeLabel(code int) string { return strconv.Itoa(code) }

// Branches of a routing decision (kvgate_route_decisions_total).
const (
	branchHeld    = "held_prefix"
	branchSpilled = "spilled_load"
	branchMiss    = "miss"
)

// branchOf names what a decision did with the prompt's prefix: followed it
// to the candidate holding the most of it, moved it elsewhere (for load),
// or found it nowhere; "" for a decode step after a prefill step, which
// pulls the prompt (the prefix decision was the prefill step's).
func branchOf(tk *router.Ticket) string {
	if tk.Phase() == policy.PhaseDecode {
		return ""
	}
	switch best := max(tk.BestHeld, tk.Held); {
	case best == 0:
		return branchMiss
	case tk.Held >= best:
		return branchHeld
	}
	return branchSpilled
}

// settled is the metrics' sink: every settled attempt's verdict, status
// and latency under the policy that decided it, its decision's branch, its
// first token against the estimate, and the usage the replica reported.
// A served attempt's series come from the cache (metrics_series.go).
func (m *metrics) settled(s *settledAttempt) {
	a := s.a
	ss := m.series.of(s.policy, s.name)
	switch {
	case a.status == http.StatusOK:
		ss.ok.get(func() prometheus.Counter { return m.requests.WithLabelValues(s.policy, s.name, "200") }).Inc()
	case a.status != 0:
		m.requests.WithLabelValues(s.policy, s.name, codeLabel(a.status)).Inc()
	}
	if a.started {
		ss.e2e.get(func() prometheus.Observer { return m.e2e.WithLabelValues(s.policy) }).Observe(s.end.Sub(s.x.start).Seconds())
	}
	if !s.sent {
		return
	}
	if a.v == served {
		ss.served.get(func() prometheus.Counter { return m.attempts.WithLabelValues(s.name, "served") }).Inc()
	} else {
		m.attempts.WithLabelValues(s.name, a.v.String()).Inc()
	}
	if a.step != "" {
		m.pdAttempts.WithLabelValues(a.step, s.name, a.v.String()).Inc()
	}
	if b := branchIndex(s.branch); b >= 0 {
		ss.branch[b].get(func() prometheus.Counter { return m.decisions.WithLabelValues(s.name, s.branch) }).Inc()
	}
	if s.ttft >= 0 {
		ss.ttft.get(func() prometheus.Observer { return m.ttft.WithLabelValues(s.policy, s.name) }).Observe(s.ttft.Seconds())
		if est := a.tk.Decision.EstTTFT; est > 0 {
			// The estimate is made at routing: compare from there.
			m.ttftRatio.WithLabelValues(s.name).Observe(a.firstAt.Sub(a.tk.Request().Now).Seconds() / est.Seconds())
		}
	}
	if a.v == served && a.prompt > 0 {
		m.usage(ss, s.name, a)
	}
}

// usage counts a served attempt's reported usage.
func (m *metrics) usage(ss *servedSeries, name string, a *attempt) {
	ss.prompt.get(func() prometheus.Counter { return m.promptTokens.WithLabelValues(name) }).Add(float64(a.prompt))
	ss.gen.get(func() prometheus.Counter { return m.genTokens.WithLabelValues(name) }).Add(float64(a.output))
	if a.cached >= 0 {
		ss.cached.get(func() prometheus.Counter { return m.cachedTokens.WithLabelValues(name) }).Add(float64(a.cached))
		ss.reported.get(func() prometheus.Counter { return m.usageReported.WithLabelValues(name) }).Add(float64(a.prompt))
	}
}

// branchIndex is a branch's place in servedSeries.branch (-1: none).
func branchIndex(b string) int {
	switch b {
	case branchHeld:
		return 0
	case branchSpilled:
		return 1
	case branchMiss:
		return 2
	}
	return -1
}
