package gateway

import (
	"errors"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/router"
)

// tenantMetrics are the series of tenants and flow control: the router's
// queue by pool, band and tenant, the waits in it, the requests shed and
// the tokens each tenant was served. Their labels come from the
// configuration only (tenants, the bands their priorities are clamped
// to, shed reasons): no client chooses a label.
type tenantMetrics struct {
	shed   *prometheus.CounterVec   // reason, tenant
	tokens *prometheus.CounterVec   // tenant, kind: prompt, cached, output
	wait   *prometheus.HistogramVec // band, tenant
}

func newTenantMetrics(reg prometheus.Registerer, rt *router.Router) *tenantMetrics {
	m := &tenantMetrics{
		shed: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_shed_total",
			Help: "Requests refused with 429 before anything was sent, by reason (queue_full, ttl, deadline, saturated, " +
				"displaced: the flow controller; quota: the tenant's token quota) and tenant."}, []string{"reason", "tenant"}),
		tokens: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_tenant_tokens_total",
			Help: "Tokens served per tenant, by kind: prompt, cached (of the prompt, from the replica's cache), output; " +
				"from the replicas' usage."}, []string{"tenant", "kind"}),
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvgate_queue_wait_seconds",
			Help:    "Time requests waited in the router's flow-control queue, by band and tenant (routed or shed).",
			Buckets: prometheus.ExponentialBuckets(0.001, 4, 10)}, []string{"band", "tenant"}),
	}
	reg.MustRegister(m.shed, m.tokens, m.wait, queueDepths{rt})
	return m
}

// queueDepths collects kvgate_queue_depth from the router at each scrape.
type queueDepths struct{ rt *router.Router }

var queueDepthDesc = prometheus.NewDesc("kvgate_queue_depth",
	"Requests waiting in the router's flow-control queue, by pool, band and tenant (only those waiting).",
	[]string{"pool", "band", "tenant"}, nil)

func (q queueDepths) Describe(ch chan<- *prometheus.Desc) { ch <- queueDepthDesc }

func (q queueDepths) Collect(ch chan<- prometheus.Metric) {
	for _, d := range q.rt.QueueDepths() {
		ch <- prometheus.MustNewConstMetric(queueDepthDesc, prometheus.GaugeValue, float64(d.Requests),
			d.Pool, strconv.Itoa(d.Band), d.Tenant)
	}
}

// waited observes an exchange's wait in the router's queue, from t0.
func (tc *tenancy) waited(x *exchange, t0 time.Time, now func() time.Time) {
	tc.met.wait.WithLabelValues(strconv.Itoa(x.band), x.tenant.label()).Observe(now().Sub(t0).Seconds())
}

// noteShed counts a request refused by the flow controller or its
// tenant's quota (other errors: nothing).
func (tc *tenancy) noteShed(x *exchange, err error) {
	var se *router.ShedError
	switch {
	case errors.As(err, &se):
		tc.met.shed.WithLabelValues(se.Reason, x.tenant.label()).Inc()
	case isAPIError(err, errQuota):
		tc.met.shed.WithLabelValues("quota", x.tenant.label()).Inc()
	}
}

// settled counts a settled attempt's tokens for its tenant (the answering
// step's usage: a prefill step's is counted by its decode step's).
func (tc *tenancy) settled(s *settledAttempt) {
	a := s.a
	if s.sent {
		s.x.usage.sent = true
	}
	if !s.sent || a.step == stepPrefill || (a.prompt == 0 && a.output == 0) {
		return
	}
	s.x.usage = exchangeUsage{known: true, sent: true, prompt: a.prompt, output: a.output}
	name := s.x.tenant.label()
	tc.met.tokens.WithLabelValues(name, "prompt").Add(float64(a.prompt))
	tc.met.tokens.WithLabelValues(name, "output").Add(float64(a.output))
	if a.cached > 0 {
		tc.met.tokens.WithLabelValues(name, "cached").Add(float64(a.cached))
	}
}
