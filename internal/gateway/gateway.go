// Package gateway is kvgate's OpenAI-compatible reverse proxy: it parses
// each request into a routing key, routes it with the configured policy
// through internal/router, proxies it to the chosen replica (streaming SSE
// as it comes), retries on another replica only where the request surely
// did not start there, and reports each attempt's verdict once to the
// breaker, the router and the metrics (exchange.go, upstream.go, relay.go,
// verdict.go).
package gateway

import (
	"context"
	crand "crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/pprof"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/fleet"
	"github.com/kvgate/kvgate/internal/gateway/ui"
	"github.com/kvgate/kvgate/internal/h1"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// Gateway is the proxy.
type Gateway struct {
	// cfg is the configuration given at start; live holds the reloadable
	// settings of the moment, which only conf reads (config_reload.go).
	cfg   startConfig
	live  *liveSettings
	rt    *router.Router
	ctl   controlPlane // sources, membership, KV events, shared state (control_plane.go)
	fleet *fleet.Fleet // the control plane's, which the request path reports to
	// upstream is how the gateway calls its replicas: its HTTP client and
	// remote tokenizer (upstream.go).
	upstream
	log    *slog.Logger
	reg    *prometheus.Registry
	mux    http.Handler // the routes, behind the access log when on
	clock  clock.Clock
	bodies *bodyBudget // request-body bytes held at once (bodyread.go)
	prof   costmodel.Profile

	// draining: SIGTERM was received; /ready answers 503 and new requests
	// are refused while in-flight ones finish. cut ends when drain_timeout
	// has passed: the requests still in flight are cut.
	draining atomic.Bool
	inFlight atomic.Int64 // exchanges admitted and not ended
	cut      context.Context
	cutNow   context.CancelFunc

	jitter backoff // retry_backoff's random part

	// sinks hear every settled attempt: the metrics (met), the live view's
	// tallies (ui), the recording (rec, record.path), tracing (tr), the
	// access log and the debug log (sinks.go).
	sinks
	// via is this gateway's Via pseudonym (loop.go): kvgate-<its id>.
	via string
	// ten is the gateway's tenants (tenants.go; nil without tenants and
	// flow control).
	ten *tenancy
	// records are the stored responses' records in the shared state
	// (passthrough_responses.go; nil: none).
	records responseRecords
	// pt routes the passthrough paths (passthrough.go): the HTTP front's
	// and the endpoint picker's (stored responses' homes and owners).
	pt *passthrough
}

// Options are a Gateway's injected parts.
type Options struct {
	Registry *prometheus.Registry // default: a new one
	Logger   *slog.Logger         // default: discard
	Clock    clock.Clock          // default: the wall clock
	// Transport for upstream calls (default: a tuned http.Transport).
	Transport http.RoundTripper
	// TracerProvider turns tracing on (nil: off); cmd/kvgate builds
	// serve's (SDK, OTLP exporter) from the configuration and OTEL_*.
	TracerProvider trace.TracerProvider
	// Resolver answers DNS discovery's lookups (default net.DefaultResolver).
	Resolver discovery.Resolver
}

// New builds a gateway from a validated configuration.
func New(cfg Config, o Options) (*Gateway, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if o.Registry == nil {
		o.Registry = prometheus.NewRegistry()
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	o.Clock = clock.OrReal(o.Clock)
	prof, err := costmodel.Lookup(cfg.Profile)
	if err != nil {
		return nil, err
	}
	tr := o.Transport
	if tr == nil {
		tr = newTransport(cfg)
	}
	syncer, err := newSyncer(cfg, o)
	if err != nil {
		return nil, err
	}
	found, specs, err := initialMembers(cfg, &http.Client{Transport: tr}, o.Logger)
	if err != nil {
		return nil, err
	}
	rcfg := cfg
	rcfg.Seed = policySeed(cfg.Seed, syncer)
	var g *Gateway
	rt, err := newRouter(rcfg, specs, prof, o.Clock, onLearn(syncer), drainLog(&g), policyPanicked(&g), ejected(&g))
	if err != nil {
		return nil, err
	}
	g = &Gateway{cfg: startConfig{Config: cfg}, live: newLiveSettings(cfg, rcfg.Seed), rt: rt,
		upstream: upstream{proxy: tr, client: &http.Client{Transport: tr}}, log: o.Logger, reg: o.Registry,
		clock: o.Clock, prof: prof, jitter: newBackoff(cfg.Seed),
		bodies: newBodyBudget(cfg), via: viaName(gatewayID(syncer))}
	g.cut, g.cutNow = context.WithCancel(context.Background())
	ctl, err := newControl(cfg, controlOptions{Router: rt, Client: &http.Client{Transport: tr}, Logger: o.Logger, Clock: o.Clock,
		Registry: o.Registry, Resolver: o.Resolver, Shared: syncer, Found: found, OnForget: g.forget})
	if err != nil {
		return nil, err
	}
	g.ctl, g.fleet = ctl, ctl.Fleet()
	g.met = newMetrics(o.Registry, rt, o.Clock)
	o.Registry.MustRegister(newSaturationCollector(rt, cfg, prof)) // saturation.go
	var qsync quotaSyncer
	if syncer != nil {
		qsync, g.records = syncer, syncer
	}
	g.ten = newTenancy(cfg, o, rt, qsync)
	g.registerLimiterMetrics(o.Registry)
	if cfg.Tokenizer == "remote" {
		g.tok = newRemoteTokenizer(g, 8192)
	}
	if cfg.Record.Path != "" {
		if g.rec, err = newRecorder(cfg.Record, cfg.BlockSize, o.Clock, o.Logger, o.Registry); err != nil {
			return nil, err
		}
	}
	g.loadStateFile()
	g.tr = newTracing(o.TracerProvider)
	g.sinks = g.newSinks(g.met, g.rec, g.tr)
	g.routes()
	g.loadResponseHomes()
	return g, nil
}

func newRouter(cfg Config, specs []router.Spec, prof costmodel.Profile, clk clock.Clock, learn func(router.Learned), drained func(int),
	panicked func(router.PolicyPanic), eject func(router.Ejection)) (*router.Router, error) {
	pol, err := policy.New(cfg.Policy, policy.Options{Seed: cfg.Seed, BlockSize: cfg.BlockSize, Profile: prof,
		MaxBatchTokens: cfg.MaxBatchTokens, Params: cfg.PolicyParams, Pulls: cfg.KVPulls.Enabled,
		OffloadBlocks: cfg.OffloadBlocks})
	if err != nil {
		return nil, err
	}
	pools, err := routerPools(cfg, prof)
	if err != nil {
		return nil, err
	}
	nonCached := cfg.NonCachedTokens
	if nonCached == 0 {
		nonCached = -1 // the router's "never skip" (its 0 is its default)
	}
	return router.New(router.Config{Specs: specs, Policy: pol, Pools: pools, BlockSize: cfg.BlockSize, NonCachedTokens: nonCached,
		BlocksPerReplica: cfg.BlocksPerReplica, MaxEntries: cfg.IndexMaxEntries, Precise: cfg.Precise(), Now: clk.Now,
		StaleAfter: cfg.ScrapeStaleAfter.D(), ConfirmOnAccept: true, OnLearn: learn, OnDrained: drained, OnPolicyPanic: panicked, OnEject: eject, Dynamic: cfg.dynamic(),
		Breaker: router.BreakerConfig{EjectAfter: cfg.EjectAfter, Cooldown: cfg.EjectCooldown.D()}, ForgetAfter: cfg.ForgetAfter.D(),
		Flow: cfg.routerFlow(prof), Programs: cfg.Programs.RouterConfig(),
		OffloadBlocks: cfg.OffloadBlocks, Pulls: cfg.KVPulls.Enabled})
}

// newTransport is the upstream transport: no environment proxy, bounded
// connect time, no compression (SSE must not be buffered by gzip). The
// first-byte timeout is the gateway's own, for streamed requests only: a
// non-streamed answer's header comes when its generation ends. Plain
// http:// replicas get the lean HTTP/1.1 client (internal/h1: the request
// written and the answer read on the caller's goroutine, no readLoop and
// writeLoop handoffs); net/http's Transport serves the rest.
func newTransport(cfg Config) http.RoundTripper {
	fallback := &http.Transport{
		Proxy:               nil, // replicas come from configuration only, never through an environment proxy
		DialContext:         (&net.Dialer{Timeout: cfg.ConnectTimeout.D(), KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: upstreamIdlePerHost,
		IdleConnTimeout:     upstreamIdleTimeout,
		ForceAttemptHTTP2:   false,
		DisableCompression:  true,
	}
	return h1.New(h1.Options{Fallback: fallback, ConnectTimeout: cfg.ConnectTimeout.D(),
		MaxIdlePerHost: upstreamIdlePerHost, IdleTimeout: upstreamIdleTimeout})
}

const (
	upstreamIdlePerHost = 1024
	// Below vLLM's keep-alive (uvicorn's 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE):
	// a request written on a connection the replica is closing would
	// fail after it was sent, and could not be retried.
	upstreamIdleTimeout = 4 * time.Second
)

// Router is the gateway's router (tests, embedding).
func (g *Gateway) Router() *router.Router { return g.rt }

// Fleet is the gateway's replica watcher.
func (g *Gateway) Fleet() *fleet.Fleet { return g.fleet }

// Handler serves the API.
func (g *Gateway) Handler() http.Handler { return g.mux }

// Run runs the control plane (scrapes, health checks, sources, KV
// events, the routing state shared with the other gateways), writes the
// recording and paces the collector with gc_heap_floor (gcfloor.go) until
// ctx ends; then it flushes and closes the recording and writes the state
// file (end ctx after the drain, so that they hold every request served).
func (g *Gateway) Run(ctx context.Context) {
	defer startHeapFloor(g.cfg.GCHeapFloor, nil)()
	var wg sync.WaitGroup
	wg.Go(func() { g.ctl.Run(ctx) })
	if g.rec != nil {
		wg.Go(func() { g.rec.run(ctx) })
	}
	if g.ten != nil && g.ten.quotas != nil {
		wg.Go(func() { g.ten.quotas.run(ctx) })
	}
	wg.Wait()
	g.saveStateFile()
}

// logOnce logs one message per replica and cause (the control plane
// keeps what was logged, and forgets it with the replica).
func (g *Gateway) logOnce(i int, cause string, level slog.Level, msg string, args ...any) {
	g.ctl.LogOnce(i, cause, level, msg, args...)
}

// Reload re-reads the replicas files at once (SIGHUP); a no-op with any
// other source (DNS and Kubernetes follow their own intervals and watch).
func (g *Gateway) Reload() { g.ctl.Reload() }

func (g *Gateway) routes() {
	m := http.NewServeMux()
	m.HandleFunc("/v1/completions", func(w http.ResponseWriter, r *http.Request) { g.serveInference(w, r, prompt.Completion) })
	m.HandleFunc("/v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { g.serveInference(w, r, prompt.Chat) })
	m.HandleFunc("/v1/models", g.models)
	g.opsRoutes(m)
	g.passthroughRoutes(m) // the rest of the replicas' API (passthrough.go)
	// (under /v1/messages/: in Anthropic's shape, writeErrorFor)
	m.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { writeErrorFor(w, r, errUnknownPath) })
	g.mux = g.withWriteDeadline(g.withAccessLog(g.withTracing(&guard{g: g, mux: m}))) // withWriteDeadline: relay.go
}

// OpsHandler serves the gateway's own endpoints without the API: probes,
// metrics, the admin and debug endpoints and the live view. An endpoint
// picker (kvgate epp) serves it beside its gRPC service: the proxy in
// front calls the replicas.
func (g *Gateway) OpsHandler() http.Handler {
	m := http.NewServeMux()
	g.opsRoutes(m)
	m.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, errNotFound.with("no such endpoint: this kvgate is an endpoint picker; send requests to the proxy in front of it"))
	})
	return g.withWriteDeadline(&guard{g: g, mux: m})
}

// opsRoutes registers the gateway's own endpoints on m.
func (g *Gateway) opsRoutes(m *http.ServeMux) {
	m.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = io.WriteString(w, "ok\n")
	})
	m.HandleFunc("/ready", g.ready)
	m.Handle("/metrics", promhttp.HandlerFor(g.reg, promhttp.HandlerOpts{}))
	m.HandleFunc("/debug/", g.admin(g.debug))
	// Go's profiler, behind the same admin token: goroutines, heap, CPU.
	m.HandleFunc("/debug/pprof/", g.admin(pprof.Index))
	m.HandleFunc("/debug/pprof/profile", g.admin(pprof.Profile))
	m.HandleFunc("/debug/pprof/trace", g.admin(pprof.Trace))
	m.HandleFunc("/admin/", g.admin(g.adminReplicas))
	// the live view (ui.go); without an admin token, 404 naming --admin-token (adminOn)
	view := g.adminOn(g.serveUI(ui.New(liveView{g}, g.ui, bearer, g.clock.Now)))
	m.HandleFunc("/ui", view)
	m.HandleFunc("/ui/", view)
}

// guard checks what every request must pass before the mux routes it:
// not a loop (its Via does not name this gateway: loop.go), and a plain
// path (checkPath; the allow-list compares paths).
type guard struct {
	g   *Gateway
	mux *http.ServeMux
}

func (gd *guard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if looped(r.Header, gd.g.via) {
		gd.g.fail(w, r, errLoop)
		return
	}
	if err := checkPath(r.URL); err != nil {
		gd.g.fail(w, r, err)
		return
	}
	gd.mux.ServeHTTP(w, r)
}

// ready answers 200 while some replica that answers requests (role both
// or decode) has passed a health check and is in rotation and the gateway
// is not draining, else 503: a load balancer sends nothing before the
// fleet is known, and stops at once on SIGTERM. At start it also waits
// until every replica's first health check has ended (passed or not), so
// that the first requests are routed over the whole fleet, not to the one
// replica that answered first (on a prefill/decode fleet, without a
// prefill step).
func (g *Gateway) ready(w http.ResponseWriter, r *http.Request) {
	if err := g.Ready(); err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "text/plain")
	_, _ = io.WriteString(w, "ready\n")
}

// Ready is nil when the gateway may take requests (ready's conditions:
// not draining, the first health checks over, a replica that answers in
// rotation), else why not: /ready's answer, and the endpoint picker's
// gRPC readiness.
func (g *Gateway) Ready() error {
	if g.draining.Load() {
		return errDraining
	}
	if err := g.ctl.Ready(); err != nil {
		return err
	}
	for i := range g.rt.Replicas() {
		// A replica that answers: on a prefill/decode fleet a prefill
		// replica alone serves no request.
		if r := g.rt.Replica(i); r.Ready() && !r.Removed() && r.Role().Decodes() {
			return nil
		}
	}
	return errNoReplica
}

// requestID is the client's X-Request-Id, or a new one.
func requestID(r *http.Request) string {
	if id := r.Header.Get("X-Request-Id"); id != "" && len(id) <= 128 {
		return id
	}
	var b [8]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// authorized checks the client's API key when keys are configured (a
// tenant's too: identify).
func (g *Gateway) authorized(r *http.Request) bool {
	_, ok := g.identify(r)
	return ok
}

// keysOK checks the client's key against api_keys, when they are configured.
func (g *Gateway) keysOK(r *http.Request) bool {
	if len(g.cfg.APIKeys) == 0 {
		return true
	}
	tok, ok := bearer(r.Header)
	if !ok {
		return false
	}
	for _, k := range g.cfg.APIKeys {
		if subtle.ConstantTimeCompare([]byte(tok), []byte(k)) == 1 {
			return true
		}
	}
	return false
}

// bearer is the token of h's "Authorization: Bearer TOKEN", the one check
// of every door (API keys, the admin token, /ui). The scheme is matched
// case-insensitively (RFC 9110 §11.1: "bearer" is as good as "Bearer"),
// and one or more spaces may follow it; an empty token is none.
func bearer(h http.Header) (string, bool) {
	scheme, tok, ok := strings.Cut(h.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	tok = strings.TrimLeft(tok, " ")
	return tok, tok != ""
}

// hop-by-hop headers (RFC 9110 §7.6.1) are never forwarded.
var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// copyHeaders copies src's fields into dst, less the hop-by-hop ones:
// every value into one array (one allocation, not one per field), each
// field's slice capped at its length (an Add to it copies it).
func copyHeaders(dst, src http.Header) {
	n := 0
	for _, vs := range src {
		n += len(vs)
	}
	all := make([]string, n)
	for k, vs := range src {
		m := copy(all, vs)
		dst[k], all = all[:m:m], all[m:]
	}
	dropHopHeaders(dst, src)
}

// moveHeaders is copyHeaders for a src nobody uses afterwards (an
// upstream answer's): its value slices are taken, not copied.
func moveHeaders(dst, src http.Header) {
	for k, vs := range src {
		dst[k] = vs
	}
	dropHopHeaders(dst, src)
}

// dropHopHeaders deletes from dst the hop-by-hop headers, and those src's
// Connection names.
func dropHopHeaders(dst, src http.Header) {
	for _, f := range src.Values("Connection") {
		for _, name := range strings.Split(f, ",") {
			dst.Del(strings.TrimSpace(name))
		}
	}
	for _, h := range hopHeaders {
		delete(dst, h) // canonical already: Del would canonicalize each again
	}
}

// backoff is the wait before retry attempt n (1-based): exponential, capped,
// with full jitter (retry_backoff, retry_backoff_max).
func (g *Gateway) backoff(n int) time.Duration {
	c := g.conf()
	return g.jitter.wait(n, c.RetryBackoff.D(), c.RetryBackoffMax.D())
}

// backoff draws retry waits: exponential, capped, with full jitter (AWS's
// "Exponential Backoff and Jitter": a wait uniform in [0, base·2^(n-1)]),
// from a seeded source shared by the requests.
type backoff struct {
	mu  sync.Mutex
	rnd *rand.Rand
}

func newBackoff(seed uint64) backoff { return backoff{rnd: rand.New(rand.NewPCG(seed, 99))} }

// wait is the wait before retry n (1-based) for base and limit (limit 0:
// none; base 0: no wait).
func (b *backoff) wait(n int, base, limit time.Duration) time.Duration {
	if base <= 0 {
		return 0
	}
	d := base << min(n-1, 16)
	if limit > 0 && d > limit {
		d = limit
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return time.Duration(b.rnd.Int64N(int64(d) + 1))
}

// Server is the http.Server the gateway runs in: bounded header size and
// header-read time (slow clients), idle connections reaped. No server-wide
// write timeout: streams last as long as generation does; each write to a
// client is bounded by write_timeout instead. The body's read time is
// bounded per request in readBody.
func (g *Gateway) Server() *http.Server {
	return &http.Server{
		Handler:           g.mux,
		ReadHeaderTimeout: g.cfg.ReadHeaderTimeout.D(),
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
}

// drainLog is the router's OnDrained: a removed replica's last request ended.
func drainLog(g **Gateway) func(int) {
	return func(i int) {
		if gw := *g; gw != nil {
			gw.log.Info("replica drained: no request in flight left", "replica", gw.rt.Name(i))
		}
	}
}
