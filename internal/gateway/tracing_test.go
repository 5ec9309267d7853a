package gateway

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sim"
)

const (
	clientTraceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	clientSpanID  = "00f067aa0ba902b7"
	clientParent  = "00-" + clientTraceID + "-" + clientSpanID + "-01"
)

// tracedGateway starts a gateway whose spans go to a recorder.
func tracedGateway(t *testing.T, cfg Config) (*testGW, *tracetest.SpanRecorder) {
	t.Helper()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	g, err := New(cfg, Options{TracerProvider: tp})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	tg := &testGW{g: g, srv: httptest.NewServer(g.Handler()), cancel: cancel, done: make(chan struct{})}
	go func() { defer close(tg.done); g.Run(ctx) }()
	t.Cleanup(func() { tg.srv.Close(); cancel(); <-tg.done })
	return tg, rec
}

// spansNamed are the ended spans of one name, in the order they ended.
func spansNamed(rec *tracetest.SpanRecorder, name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range rec.Ended() {
		if s.Name() == name {
			out = append(out, s)
		}
	}
	return out
}

func attr(s sdktrace.ReadOnlySpan, key string) (attribute.Value, bool) {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == key {
			return kv.Value, true
		}
	}
	return attribute.Value{}, false
}

// traceparent is the W3C header naming span s.
func traceparent(s sdktrace.ReadOnlySpan) string {
	return "00-" + s.SpanContext().TraceID().String() + "-" + s.SpanContext().SpanID().String() + "-01"
}

// A streamed completion refused by its first replica: the client's
// traceparent is the request span's parent; parse, two routing decisions
// and two upstream attempts are its children, with their attributes; each
// replica got a traceparent naming its own attempt's span (and the
// client's tracestate); the first token is an event of the attempt that
// answered.
func TestTracingSpansAndPropagation(t *testing.T) {
	a, b := newFakeReplica(t), newFakeReplica(t)
	a.status.Store(http.StatusServiceUnavailable)
	cfg := baseConfig(a.srv.URL, b.srv.URL)
	cfg.Policy, cfg.EjectAfter = "round_robin", 100 // replica a first, and kept in rotation
	gw, rec := tracedGateway(t, cfg)
	eventually(t, "both replicas listed", func() bool { // an unlisted replica is no candidate beside a listed one
		return gw.g.rt.Replica(0).Served() != nil && gw.g.rt.Replica(1).Served() != nil
	})
	resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"`+strings.Repeat("trace me. ", 40)+`","stream":true}`,
		"traceparent", clientParent, "tracestate", "vendor=1")
	if resp.StatusCode != 200 || !strings.Contains(body, "[DONE]") || resp.Header.Get("X-Kvgate-Replica") != b.srv.URL {
		t.Fatalf("%d %q from %s", resp.StatusCode, body, resp.Header.Get("X-Kvgate-Replica"))
	}
	eventually(t, "the request span ended", func() bool { return len(spansNamed(rec, "POST /v1/completions")) == 1 })
	root := spansNamed(rec, "POST /v1/completions")[0]
	if root.SpanKind() != trace.SpanKindServer || root.SpanContext().TraceID().String() != clientTraceID ||
		root.Parent().SpanID().String() != clientSpanID || !root.Parent().IsRemote() {
		t.Fatalf("request span %v %v, parent %v", root.SpanKind(), root.SpanContext(), root.Parent())
	}
	if v, _ := attr(root, "http.response.status_code"); v.AsInt64() != 200 {
		t.Fatalf("status attribute %v", v)
	}
	parse, routes, ups := spansNamed(rec, "kvgate.parse"), spansNamed(rec, "kvgate.route"), spansNamed(rec, "kvgate.upstream")
	if len(parse) != 1 || len(routes) != 2 || len(ups) != 2 {
		t.Fatalf("%d parse, %d route, %d upstream spans", len(parse), len(routes), len(ups))
	}
	for _, s := range slices.Concat(parse, routes, ups) {
		if s.Parent().SpanID() != root.SpanContext().SpanID() || s.SpanContext().TraceID() != root.SpanContext().TraceID() {
			t.Fatalf("%s is not a child of the request span", s.Name())
		}
	}
	for k, want := range []string{a.srv.URL, b.srv.URL} {
		r, u := routes[k], ups[k]
		if p, _ := attr(r, "kvgate.policy"); p.AsString() != "round_robin" {
			t.Fatalf("route %d policy %v", k, p)
		}
		for _, key := range []string{"kvgate.matched_tokens", "kvgate.estimated_ttft_ms", "kvgate.prompt_tokens"} {
			if _, ok := attr(r, key); !ok {
				t.Fatalf("route %d lacks %s", k, key)
			}
		}
		if rep, _ := attr(r, "kvgate.replica"); rep.AsString() != want {
			t.Fatalf("route %d replica %v, want %s", k, rep, want)
		}
		retry, _ := attr(u, "kvgate.retry")
		rep, _ := attr(u, "kvgate.replica")
		if retry.AsInt64() != int64(k) || rep.AsString() != want || u.SpanKind() != trace.SpanKindClient {
			t.Fatalf("attempt %d: retry %v replica %v kind %v", k, retry, rep, u.SpanKind())
		}
	}
	if st, _ := attr(ups[0], "http.response.status_code"); st.AsInt64() != 503 {
		t.Fatalf("first attempt status %v", st)
	}
	if v, _ := attr(ups[1], "kvgate.verdict"); v.AsString() != "served" || len(ups[1].Events()) != 1 ||
		ups[1].Events()[0].Name != "first_token" {
		t.Fatalf("second attempt verdict %v, events %v", v, ups[1].Events())
	}
	if c, _ := attr(ups[1], "gen_ai.usage.cached_tokens"); c.AsInt64() != 8 { // the fake replica's usage
		t.Fatalf("cached tokens %v", c)
	}
	if m, _ := attr(routes[0], "gen_ai.request.model"); m.AsString() != "m" {
		t.Fatalf("model %v", m)
	}
	for k, f := range []*fakeReplica{a, b} {
		f.mu.Lock()
		h := f.headers[len(f.headers)-1]
		f.mu.Unlock()
		if got := h.Get("traceparent"); got != traceparent(ups[k]) || h.Get("tracestate") != "vendor=1" {
			t.Fatalf("replica %d got traceparent %q tracestate %q, want %q", k, got, h.Get("tracestate"), traceparent(ups[k]))
		}
	}
	waitIdle(t, gw)
}

// Off, a client's traceparent and tracestate reach the replica as sent,
// and the passthrough paths are traced as the others when on.
func TestTracingOffForwardsTraceparent(t *testing.T) {
	a := newFakeReplica(t)
	gw := startGateway(t, baseConfig(a.srv.URL))
	resp, _ := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "traceparent", clientParent, "tracestate", "v=2")
	a.mu.Lock()
	h := a.headers[len(a.headers)-1]
	a.mu.Unlock()
	if resp.StatusCode != 200 || h.Get("traceparent") != clientParent || h.Get("tracestate") != "v=2" {
		t.Fatalf("%d: the replica got traceparent %q tracestate %q", resp.StatusCode, h.Get("traceparent"), h.Get("tracestate"))
	}
	waitIdle(t, gw)
}

// recordingProxy fronts a replica and keeps the traceparent of every
// request to path.
type recordingProxy struct {
	srv  *httptest.Server
	mu   sync.Mutex
	seen []string
}

func newRecordingProxy(t *testing.T, target, path string) *recordingProxy {
	u, _ := url.Parse(target)
	rp := httputil.NewSingleHostReverseProxy(u)
	p := &recordingProxy{}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == path {
			p.mu.Lock()
			p.seen = append(p.seen, r.Header.Get("traceparent"))
			p.mu.Unlock()
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(p.srv.Close)
	return p
}

// A disaggregated request: the prefill step and the decode step are each
// an attempt span, and each replica got its own step's traceparent.
func TestTracingPrefillStep(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 2, Roles: []engine.Role{engine.RolePrefill, engine.RoleDecode}})
	urls := fl.URLs()
	pre := newRecordingProxy(t, urls[0], "/v1/completions")
	dec := newRecordingProxy(t, urls[1], "/v1/completions")
	cfg := simConfig("round_robin")
	rs, err := ParseReplicaList(dec.srv.URL, ReplicaLists{Prefill: pre.srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Replicas, cfg.NonCachedTokens = rs, 0
	gw, rec := tracedGateway(t, cfg)
	eventually(t, "both replicas listed", func() bool {
		return gw.g.rt.Replica(0).Served() != nil && gw.g.rt.Replica(1).Served() != nil
	})
	req := `{"model":"` + sim.DefaultModel + `","prompt":"` + strings.Repeat("tell me about prefill and decode. ", 12) +
		`","max_tokens":3,"ignore_eos":true}`
	resp, body := post(t, gw.srv.URL+"/v1/completions", req, "traceparent", clientParent)
	if resp.StatusCode != 200 || resp.Header.Get(headerPrefill) != pre.srv.URL {
		t.Fatalf("%d %s, prefill %q", resp.StatusCode, body, resp.Header.Get(headerPrefill))
	}
	eventually(t, "the request span ended", func() bool { return len(spansNamed(rec, "POST /v1/completions")) == 1 })
	ups := spansNamed(rec, "kvgate.upstream")
	if len(ups) != 2 {
		t.Fatalf("%d upstream spans", len(ups))
	}
	steps := map[string]sdktrace.ReadOnlySpan{}
	for _, u := range ups {
		s, _ := attr(u, "kvgate.step")
		steps[s.AsString()] = u
	}
	for step, p := range map[string]*recordingProxy{stepPrefill: pre, stepDecode: dec} {
		u, ok := steps[step]
		p.mu.Lock()
		seen := slices.Clone(p.seen)
		p.mu.Unlock()
		if !ok || len(seen) != 1 || seen[0] != traceparent(u) || u.SpanContext().TraceID().String() != clientTraceID {
			t.Fatalf("%s step: span %v, the replica got %q", step, ok, seen)
		}
	}
	route := spansNamed(rec, "kvgate.route")
	if len(route) != 1 {
		t.Fatalf("%d route spans", len(route))
	}
	if p, _ := attr(route[0], "kvgate.prefill_replica"); p.AsString() != pre.srv.URL {
		t.Fatalf("route span prefill replica %v", p)
	}
	waitIdle(t, gw)
}

// Off, the tracing hooks of the request path allocate nothing; on, they
// do (they are not dead code).
func TestTracingOffAllocatesNothing(t *testing.T) {
	a := newFakeReplica(t)
	hooks := func(g *Gateway) float64 {
		rt := g.Router()
		req := rt.Prepare(&prompt.Parsed{Model: "m", Text: strings.Repeat("x", 400)}, "", "")
		tk, err := rt.RouteWith(allocPolicy{}, req)
		if err != nil {
			t.Fatal(err)
		}
		defer tk.Done(g.clock.Now(), router.Outcome{CachedTokens: -1})
		r := httptest.NewRequest(http.MethodPost, "/v1/completions", nil)
		x := &exchange{r: r, req: req, ctx: context.Background()}
		h := http.Header{}
		return testing.AllocsPerRun(200, func() {
			span := g.startSpan(x.ctx, "kvgate.parse")
			endSpan(span, nil)
			span = g.startSpan(x.ctx, "kvgate.route")
			g.traceRoute(span, x, tk, nil, nil)
			at := attempt{tk: tk}
			ctx := g.traceAttempt(x.ctx, x, &at)
			g.injectTrace(ctx, h)
			traceFirstToken(&at)
			endAttempt(&at, &receipt{})
		})
	}
	off := startGateway(t, baseConfig(a.srv.URL))
	if n := hooks(off.g); n != 0 {
		t.Fatalf("tracing off: %v allocations per request", n)
	}
	on, _ := tracedGateway(t, baseConfig(a.srv.URL))
	if n := hooks(on.g); n == 0 {
		t.Fatal("tracing on allocates nothing: the hooks do nothing")
	}
	if on.g.withTracing(plainHandler{}) == http.Handler(plainHandler{}) || off.g.withTracing(plainHandler{}) != http.Handler(plainHandler{}) {
		t.Fatal("the request span's handler is installed only when tracing is on")
	}
}

// plainHandler is a comparable handler: is it wrapped?
type plainHandler struct{}

func (plainHandler) ServeHTTP(http.ResponseWriter, *http.Request) {}

// allocPolicy picks replica 0.
type allocPolicy struct{}

func (allocPolicy) Name() string { return "first" }
func (allocPolicy) Pick(_ *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
	return policy.Decision{Replica: 0}, nil
}

// BenchmarkTracing compares, in one run, a small streamed completion
// through the gateway with tracing off and on (every span recorded and
// sampled; no exporter, so the figure is the instrumentation's own cost).
func BenchmarkTracing(b *testing.B) {
	up := newFakeReplicaB(b)
	body := `{"model":"m","stream":true,"prompt":"` + strings.Repeat("The quick brown fox jumps. ", 45) + `"}`
	for _, on := range []bool{false, true} {
		var o Options
		if on {
			tp := sdktrace.NewTracerProvider()
			defer func() { _ = tp.Shutdown(context.Background()) }()
			o.TracerProvider = tp
		}
		g, err := New(baseConfig(up.URL), o)
		if err != nil {
			b.Fatal(err)
		}
		srv := httptest.NewServer(g.Handler())
		name := map[bool]string{false: "off", true: "on"}[on]
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					b.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatalf("status %d", resp.StatusCode)
				}
			}
		})
		srv.Close()
	}
}

// newFakeReplicaB is a replica streaming three tokens, for benchmarks.
func newFakeReplicaB(b *testing.B) *httptest.Server {
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("/v1/completions", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"t`+string(rune('0'+i))+`"}]}`+"\n\n")
		}
		_, _ = io.WriteString(w, "data: [DONE]\n\n")
	})
	srv := httptest.NewServer(mux)
	b.Cleanup(srv.Close)
	return srv
}
