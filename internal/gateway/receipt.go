package gateway

import (
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
)

// Route receipts: what a decision was and how it turned out, per request.
// Every settled attempt has one (receiptOf): the policy that decided, the
// replica, the prompt tokens the decision counted on that replica holding
// (by the index the router trusts), the policy's TTFT estimate, the
// branch (held: the replica held the most of the prompt; spilled: another
// held more and load won; miss: none held any), the wait in the router's
// queue, and the check against the replica's own report: a wrong route is
// one where the engine reported fewer cached prompt tokens than the
// decision counted on, by more than a block (router.Ticket.WrongRoute).
// The access log and the attempt's span carry it always; the
// X-Kvgate-Route response header only when route_receipts is on (it tells
// a client about the fleet's caches). Matched tokens are the GPU tier's
// until the index tells tiers apart: matched_gpu_tokens is that field.

// headerRoute is the route receipt's response header.
const headerRoute = "X-Kvgate-Route"

// ReceiptQueueWait reads a route receipt's wait in the router's queue
// (queue_ms, in the gateway's clock: model time for an embedded gateway)
// from h: false without a receipt, or when queue_ms is not a number of
// milliseconds in [0, 1e9] (the queue's TTL is far below). The one reader
// of the field String writes.
func ReceiptQueueWait(h http.Header) (time.Duration, bool) {
	for f := range strings.SplitSeq(h.Get(headerRoute), ";") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(f), "queue_ms="); ok {
			ms, err := strconv.ParseFloat(v, 64)
			if err != nil || !(ms >= 0 && ms <= 1e9) {
				return 0, false
			}
			return time.Duration(ms * float64(time.Millisecond)), true
		}
	}
	return 0, false
}

// ReceiptPrefillCached reads, from a disaggregated request's route
// receipt in h, the prompt tokens its prefill step's replica reported
// cached (prefill_cached_tokens): its cache hit, which the decode
// replica's usage does not tell (it counts the pulled prompt as cached).
// false without one, or when it is not a count of tokens within
// maxUsageTokens.
func ReceiptPrefillCached(h http.Header) (int, bool) {
	for f := range strings.SplitSeq(h.Get(headerRoute), ";") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(f), "prefill_cached_tokens="); ok {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 || n > maxUsageTokens {
				return 0, false
			}
			return n, true
		}
	}
	return 0, false
}

// receipt is one decision's record.
type receipt struct {
	policy, branch  string
	matched, prompt int // tokens
	prefillCached   int // a decode step's: its prefill step's cached tokens, as reported (-1: none)
	estTTFT, queue  time.Duration
	checked, wrong  bool // the replica reported its cached tokens; fewer than counted on
}

// decided is the receipt of attempt a's decision, before its outcome.
func decided(x *exchange, a *attempt) receipt {
	tk := a.tk
	r := receipt{policy: tk.Policy(), branch: branchOf(tk), matched: tk.Predicted(), prompt: tk.Request().Tokens,
		estTTFT: tk.Decision.EstTTFT, queue: x.waited, prefillCached: -1}
	if a.step == stepDecode && a.prefill != nil {
		r.prefillCached = a.prefillCached
	}
	return r
}

// receiptOf is the receipt of settled attempt a (settle calls it once),
// with the wrong-route check, counted here.
func (g *Gateway) receiptOf(x *exchange, a *attempt) receipt {
	tk := a.tk
	r := decided(x, a)
	if a.v == served {
		if r.wrong, r.checked = tk.WrongRoute(a.cached); r.checked {
			name := g.rt.Name(tk.Replica)
			g.met.series.of(r.policy, name).checks.get(func() prometheus.Counter {
				return g.met.routeChecks.WithLabelValues(r.policy, name)
			}).Inc()
			if r.wrong {
				g.met.wrongRoutes.WithLabelValues(r.policy, name).Inc()
			}
		}
	}
	return r
}

// String is the receipt as X-Kvgate-Route writes it: "key=value" pairs
// separated by "; ".
func (r receipt) String() string {
	var b strings.Builder
	b.WriteString("policy=" + r.policy)
	b.WriteString("; matched_tokens=" + strconv.Itoa(r.matched))
	b.WriteString("; matched_gpu_tokens=" + strconv.Itoa(r.matched))
	b.WriteString("; prompt_tokens=" + strconv.Itoa(r.prompt))
	b.WriteString("; est_ttft_ms=" + strconv.FormatFloat(ms(r.estTTFT), 'f', -1, 64))
	if r.branch != "" {
		b.WriteString("; branch=" + r.branch)
	}
	b.WriteString("; queue_ms=" + strconv.FormatFloat(ms(r.queue), 'f', -1, 64))
	if r.prefillCached >= 0 {
		b.WriteString("; prefill_cached_tokens=" + strconv.Itoa(r.prefillCached))
	}
	return b.String()
}

// addReceipt writes the receipt of attempt a's decision into h when
// route_receipts is on. The answer's header goes before the replica's
// usage is known: the header holds the decision, the access log and the
// span the check too.
func (g *Gateway) addReceipt(h http.Header, x *exchange, a *attempt) {
	if !g.cfg.RouteReceipts {
		return
	}
	h.Set(headerRoute, decided(x, a).String())
}

// attrs are the receipt's fields for the access log.
func (r receipt) attrs() []slog.Attr {
	out := []slog.Attr{slog.String("policy", r.policy), slog.Int("matched_tokens", r.matched),
		slog.Float64("est_ttft_ms", ms(r.estTTFT)), slog.Float64("queue_ms", ms(r.queue))}
	if r.branch != "" {
		out = append(out, slog.String("branch", r.branch))
	}
	if r.checked {
		out = append(out, slog.Bool("misrouted", r.wrong))
	}
	if r.prefillCached >= 0 {
		out = append(out, slog.Int("prefill_cached_tokens", r.prefillCached))
	}
	return out
}

// spanAttrs are the receipt's fields for the attempt's span.
func (r receipt) spanAttrs() []attribute.KeyValue {
	out := []attribute.KeyValue{attribute.String("kvgate.policy", r.policy), attribute.Int("kvgate.matched_tokens", r.matched),
		attribute.Float64("kvgate.estimated_ttft_ms", ms(r.estTTFT)), attribute.Float64("kvgate.queue_ms", ms(r.queue)),
		attribute.String("kvgate.branch", r.branch)}
	if r.checked {
		out = append(out, attribute.Bool("kvgate.wrong_route", r.wrong))
	}
	return out
}

// newRouteMetrics registers the receipts' counters.
func (m *metrics) newRouteMetrics(reg prometheus.Registerer) {
	m.routeChecks = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_route_checks_total",
		Help: "Served requests whose replica reported its cached prompt tokens, checked against the decision, by policy and replica."},
		[]string{"policy", "replica"})
	m.wrongRoutes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_wrong_routes_total",
		Help: "Wrong routes: served requests whose replica reported fewer cached prompt tokens than the decision counted on, " +
			"by more than a block (an index that was wrong: evicted, never held, another tokenizer), by policy and replica. " +
			"The incorrect-routing rate is this over kvgate_route_checks_total."}, []string{"policy", "replica"})
	reg.MustRegister(m.routeChecks, m.wrongRoutes)
}
