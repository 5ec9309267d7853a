package gateway

import (
	"context"
	"net/http"
	"strconv"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvgate/kvgate/internal/router"
)

// OpenTelemetry tracing, off by default. On, every proxied request is a
// trace: a server span for the request (its parent the client's W3C
// traceparent, when sent), and inside it a span for the parse (body to
// routing key, tokenization included), one per routing decision (policy,
// replica, matched tokens, estimated TTFT), and one per upstream attempt
// (client kind: replica, step, retry number, status, verdict; an event
// "first_token" when the first token arrives). Each attempt sends the
// replica a traceparent naming its own span (tracestate kept), so vLLM's
// own spans (--otlp-traces-endpoint) nest under it, on every retry and on
// a disaggregated request's prefill step as on its decode step. Off, a
// client's traceparent and tracestate still reach the replica unchanged
// (they are forwarded as any header), and the request path allocates
// nothing for tracing: every hook returns at a nil check.

// tracing is the gateway's tracer and propagator (nil: off).
type tracing struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
}

// newTracing is the tracing of a gateway given tp (nil: off).
func newTracing(tp trace.TracerProvider) *tracing {
	if tp == nil {
		return nil
	}
	return &tracing{tracer: tp.Tracer("github.com/kvgate/kvgate/internal/gateway"), prop: propagation.TraceContext{}}
}

// withTracing wraps the gateway's handler with a request's server span
// when tracing is on (probes, scrapes, /ui and the admin endpoints are not
// traced).
func (g *Gateway) withTracing(h http.Handler) http.Handler {
	if g.tr == nil {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if quietPath(r.URL.Path) || strings.HasPrefix(r.URL.Path, "/debug/") || strings.HasPrefix(r.URL.Path, "/admin/") {
			h.ServeHTTP(w, r)
			return
		}
		ctx := g.tr.prop.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
		ctx, span := g.tr.tracer.Start(ctx, r.Method+" "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer),
			trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("url.path", r.URL.Path)))
		sw := &statusWriter{ResponseWriter: w}
		defer func() { // deferred: an aborted stream (ErrAbortHandler) ends its span too
			span.SetAttributes(attribute.Int("http.response.status_code", sw.code()),
				attribute.String("kvgate.request_id", w.Header().Get("X-Request-Id")))
			if sw.code() >= 500 {
				span.SetStatus(codes.Error, http.StatusText(sw.code()))
			}
			span.End()
		}()
		h.ServeHTTP(sw, r.WithContext(ctx))
	})
}

// statusWriter keeps the status the client got; Unwrap lets
// http.ResponseController reach the connection (flush, deadlines).
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *statusWriter) code() int {
	if w.status == 0 {
		return http.StatusOK
	}
	return w.status
}

// startSpan starts an internal span under ctx's (nil when tracing is off).
func (g *Gateway) startSpan(ctx context.Context, name string) trace.Span {
	if g.tr == nil {
		return nil
	}
	_, span := g.tr.tracer.Start(ctx, name)
	return span
}

// endSpan ends a span of startSpan, marking err.
func endSpan(span trace.Span, err error) {
	if span == nil {
		return
	}
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// traceRoute records a routing decision on its span and ends it: the
// ticket of the replica serving the request (the decode step's, for a
// pair) and, for a disaggregated request, its prefill step's (nil: none).
func (g *Gateway) traceRoute(span trace.Span, x *exchange, tk, prefill *router.Ticket, err error) {
	if span == nil {
		return
	}
	var policy string
	switch {
	case tk != nil:
		policy = tk.Policy() // the pool's own, or the one a passthrough request is routed by
	case x.pol != nil:
		policy = x.pol.Name()
	case x.model.Policy() != nil:
		policy = x.model.Policy().Name()
	}
	span.SetAttributes(attribute.String("kvgate.policy", policy), attribute.Int("kvgate.retry", len(x.exclude)),
		attribute.String("gen_ai.request.model", x.req.Model), attribute.Int("kvgate.prompt_tokens", x.req.Tokens))
	if id := x.req.Program.ID; id != 0 {
		// The program's hash, not the client's id: a trace backend need not see it.
		span.SetAttributes(attribute.String("kvgate.program", strconv.FormatUint(id, 16)))
	}
	if tk != nil {
		d := tk.Decision
		span.SetAttributes(attribute.String("kvgate.replica", g.rt.Name(tk.Replica)),
			attribute.Int("kvgate.matched_tokens", d.Matched*g.cfg.BlockSize),
			attribute.Float64("kvgate.estimated_ttft_ms", float64(d.EstTTFT.Microseconds())/1000),
			attribute.String("kvgate.reason", d.Reason))
	}
	if prefill != nil {
		span.SetAttributes(attribute.String("kvgate.prefill_replica", g.rt.Name(prefill.Replica)),
			attribute.Int("kvgate.prefill_matched_tokens", prefill.Decision.Matched*g.cfg.BlockSize))
	}
	endSpan(span, err)
}

// traceAttempt starts the span of an upstream attempt (a.span) and returns
// the context its request carries: the traceparent sent names this span.
func (g *Gateway) traceAttempt(ctx context.Context, x *exchange, a *attempt) context.Context {
	if g.tr == nil {
		return ctx
	}
	ctx, a.span = g.tr.tracer.Start(ctx, "kvgate.upstream", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("kvgate.replica", g.rt.Name(a.tk.Replica)),
			attribute.Int("kvgate.retry", len(x.exclude)), attribute.String("kvgate.step", a.step),
			attribute.String("url.path", x.r.URL.Path)))
	return ctx
}

// endAttempt ends an attempt's span with its status, verdict and usage:
// the tracing sink, when settle settles the attempt.
func endAttempt(a *attempt, r *receipt) {
	if a.span == nil {
		return
	}
	a.span.SetAttributes(attribute.String("kvgate.verdict", a.v.String()))
	a.span.SetAttributes(r.spanAttrs()...)
	if a.status != 0 {
		a.span.SetAttributes(attribute.Int("http.response.status_code", a.status))
	}
	if a.cached >= 0 { // the replica's usage: what its cache held, what it generated
		a.span.SetAttributes(attribute.Int("gen_ai.usage.cached_tokens", a.cached),
			attribute.Int("gen_ai.usage.output_tokens", a.output))
	}
	if a.v == failed || a.v == refused {
		msg := a.v.String()
		if a.err != nil {
			msg = a.err.Error()
		}
		a.span.SetStatus(codes.Error, msg)
	}
	a.span.End()
}

// traceFirstToken marks the attempt's first token.
func traceFirstToken(a *attempt) {
	if a.span != nil {
		a.span.AddEvent("first_token")
	}
}

// injectTrace writes the attempt's traceparent (and the client's
// tracestate) into an upstream request's header.
func (g *Gateway) injectTrace(ctx context.Context, h http.Header) {
	if g.tr != nil {
		g.tr.prop.Inject(ctx, propagation.HeaderCarrier(h))
	}
}
