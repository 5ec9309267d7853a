// Package gateway is kvgate's OpenAI-compatible reverse proxy: it parses
// each request into a routing key, routes it with the configured policy
// through internal/router, proxies it to the chosen replica (streaming SSE
// as it comes), retries on another replica only before the first response
// byte, and feeds outcomes back to the router.
package gateway

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/pprof"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/fleet"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// Gateway is the proxy.
type Gateway struct {
	cfg    Config
	rt     *router.Router
	fleet  *fleet.Fleet
	client *http.Client
	log    *slog.Logger
	met    *metrics
	reg    *prometheus.Registry
	mux    *http.ServeMux
	now    func() time.Time
	tok    *remoteTokenizer
	lim    *limiter
	prof   costmodel.Profile

	jmu    sync.Mutex
	jitter *rand.Rand
}

// Options are a Gateway's injected parts.
type Options struct {
	Registry *prometheus.Registry // default: a new one
	Logger   *slog.Logger         // default: discard
	Now      func() time.Time     // default: time.Now
	// Transport for upstream calls (default: a tuned http.Transport).
	Transport http.RoundTripper
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
	if o.Now == nil {
		o.Now = time.Now
	}
	prof, err := costmodel.Lookup(cfg.Profile)
	if err != nil {
		return nil, err
	}
	pol, err := policy.New(cfg.Policy, policy.Options{Seed: cfg.Seed, BlockSize: cfg.BlockSize, Profile: prof,
		MaxBatchTokens: cfg.MaxBatchTokens, Params: cfg.PolicyParams})
	if err != nil {
		return nil, err
	}
	urls := make([]string, len(cfg.Replicas))
	keys := make([]string, len(cfg.Replicas))
	for i, r := range cfg.Replicas {
		urls[i] = strings.TrimRight(r.URL, "/")
		keys[i] = r.APIKey
	}
	rt, err := router.New(router.Config{Replicas: urls, Policy: pol, BlockSize: cfg.BlockSize,
		BlocksPerReplica: cfg.BlocksPerReplica, MaxEntries: cfg.IndexMaxEntries, Precise: cfg.Precise(), Now: o.Now})
	if err != nil {
		return nil, err
	}
	tr := o.Transport
	if tr == nil {
		tr = &http.Transport{
			Proxy:                 nil, // replicas come from configuration only, never through an environment proxy
			DialContext:           (&net.Dialer{Timeout: cfg.ConnectTimeout.D(), KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:          4096,
			MaxIdleConnsPerHost:   1024,
			IdleConnTimeout:       90 * time.Second,
			ResponseHeaderTimeout: cfg.FirstByteTimeout.D(),
			ForceAttemptHTTP2:     false,
			DisableCompression:    true, // pass bytes through; SSE must not be buffered by gzip
		}
	}
	g := &Gateway{cfg: cfg, rt: rt, client: &http.Client{Transport: tr}, log: o.Logger, reg: o.Registry, now: o.Now, prof: prof,
		jitter: rand.New(rand.NewPCG(cfg.Seed, 99))}
	g.lim = newLimiter(cfg.MaxConcurrency, cfg.MaxQueue, cfg.QueueTimeout.D())
	g.met = newMetrics(o.Registry, rt)
	g.registerLimiterMetrics(o.Registry)
	g.fleet = fleet.New(rt, &http.Client{Transport: tr}, fleet.Config{
		ScrapeInterval: cfg.ScrapeInterval.D(), HealthInterval: cfg.HealthInterval.D(),
		EjectAfter: cfg.EjectAfter, EjectCooldown: cfg.EjectCooldown.D(), APIKeys: keys, Logger: o.Logger, Now: o.Now,
		OnEject: func(i int) { g.met.ejections.WithLabelValues(rt.URL(i)).Inc() },
	})
	if cfg.Tokenizer == "remote" {
		g.tok = newRemoteTokenizer(g, 8192)
	}
	g.routes()
	return g, nil
}

// Router is the gateway's router (tests, embedding).
func (g *Gateway) Router() *router.Router { return g.rt }

// Fleet is the gateway's replica watcher.
func (g *Gateway) Fleet() *fleet.Fleet { return g.fleet }

// Handler serves the API.
func (g *Gateway) Handler() http.Handler { return g.mux }

// Run watches the replicas (scrapes, health checks, KV events) until ctx ends.
func (g *Gateway) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); g.fleet.Run(ctx) }()
	if g.cfg.Precise() {
		wg.Add(1)
		go func() { defer wg.Done(); g.runKVEvents(ctx) }()
	}
	wg.Wait()
}

func (g *Gateway) routes() {
	m := http.NewServeMux()
	m.HandleFunc("/v1/completions", func(w http.ResponseWriter, r *http.Request) { g.proxy(w, r, prompt.Completion) })
	m.HandleFunc("/v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { g.proxy(w, r, prompt.Chat) })
	m.HandleFunc("/v1/models", g.models)
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
	m.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { writeError(w, errNotFound) })
	g.mux = m
}

func (g *Gateway) ready(w http.ResponseWriter, r *http.Request) {
	for i := range g.rt.Replicas() {
		if g.rt.Healthy(i) {
			w.Header().Set("Content-Type", "text/plain")
			_, _ = io.WriteString(w, "ready\n")
			return
		}
	}
	writeError(w, errNoReplica)
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

// authorized checks the client's API key when keys are configured.
func (g *Gateway) authorized(r *http.Request) bool {
	if len(g.cfg.APIKeys) == 0 {
		return true
	}
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
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

// readBody reads at most MaxBodyBytes.
func (g *Gateway) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(ct, "application/json") {
		return nil, errContentType
	}
	// A slow client gets bodyReadTimeout to send its body, then the deadline
	// is lifted so that the client's disconnect is still noticed during a stream.
	rc := http.NewResponseController(w)
	_ = rc.SetReadDeadline(time.Now().Add(g.cfg.BodyReadTimeout.D()))
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, g.cfg.MaxBodyBytes))
	_ = rc.SetReadDeadline(time.Time{})
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return nil, errTooLarge.with(fmt.Sprintf("request body larger than %d bytes", g.cfg.MaxBodyBytes))
	}
	if err != nil {
		return nil, &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Message: "reading the request body: " + err.Error()}
	}
	return body, nil
}

// prepare parses a request body into a routing key.
func (g *Gateway) prepare(ctx context.Context, kind prompt.Kind, body []byte, session string) (*prompt.Parsed, *policy.Request, error) {
	p, err := prompt.Parse(kind, body)
	if err != nil {
		return nil, nil, err
	}
	if !g.knownModel(p.Model) {
		return nil, nil, errModel.with(fmt.Sprintf("the model `%s` does not exist (served: %s)", p.Model, strings.Join(g.fleet.Models(), ", ")))
	}
	if g.tok != nil && p.TokenIDs == nil {
		ids, err := g.tok.tokenize(ctx, kind, p, body)
		if err != nil {
			g.log.Warn("remote tokenizer failed; routing on the approximate tokenizer", "err", err)
		} else {
			p.TokenIDs = ids
		}
	}
	return p, g.rt.Prepare(p, session, ""), nil
}

func (g *Gateway) knownModel(model string) bool {
	models := g.fleet.Models()
	if len(models) == 0 {
		return true // not listed yet: let the replica judge
	}
	_, found := slices.BinarySearch(models, model)
	return found
}

// hop-by-hop headers (RFC 9110 §7.6.1) are never forwarded.
var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate",
	"Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

func copyHeaders(dst, src http.Header) {
	for k, vs := range src {
		dst[k] = append([]string(nil), vs...)
	}
	for _, f := range src.Values("Connection") {
		for _, name := range strings.Split(f, ",") {
			dst.Del(strings.TrimSpace(name))
		}
	}
	for _, h := range hopHeaders {
		dst.Del(h)
	}
}

// backoff is the wait before retry attempt n (1-based): exponential, capped,
// with full jitter.
func (g *Gateway) backoff(n int) time.Duration {
	base := g.cfg.RetryBackoff.D()
	if base <= 0 {
		return 0
	}
	d := base << min(n-1, 16)
	if c := g.cfg.RetryBackoffMax.D(); c > 0 && d > c {
		d = c
	}
	g.jmu.Lock()
	defer g.jmu.Unlock()
	return time.Duration(g.jitter.Int64N(int64(d) + 1))
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// proxy handles one completions or chat request.
func (g *Gateway) proxy(w http.ResponseWriter, r *http.Request, kind prompt.Kind) {
	start := g.now()
	rid := requestID(r)
	w.Header().Set("X-Request-Id", rid)
	log := g.log.With("request_id", rid)
	fail := func(err error, kind string) {
		ae := writeError(w, err)
		g.met.errors.WithLabelValues(kind).Inc()
		log.Info("request failed", "status", ae.Status, "err", ae.Message)
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		fail(errMethod.with("use POST"), "method")
		return
	}
	if !g.authorized(r) {
		fail(errUnauth, "auth")
		return
	}
	body, err := g.readBody(w, r)
	if err != nil {
		fail(err, "body")
		return
	}
	ctx := r.Context()
	if d := g.cfg.RequestTimeout.D(); d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	t0 := time.Now()
	parsed, req, err := g.prepare(ctx, kind, body, r.Header.Get("X-Session-Id"))
	if err != nil {
		fail(err, "invalid")
		return
	}
	if err := g.lim.acquire(ctx); err != nil {
		if r.Context().Err() != nil {
			return // the client left while queued
		}
		fail(err, "overload")
		return
	}
	defer g.lim.release()
	var exclude []int
	var last *bufferedResponse
	skips := 0
	for attempt := 0; attempt <= g.cfg.Retries; attempt++ {
		if attempt > 0 && skips == 0 {
			g.met.retries.Inc()
			if err := sleepCtx(ctx, g.backoff(attempt)); err != nil {
				break
			}
		}
		tk, err := g.rt.Route(req, exclude...)
		if attempt == 0 {
			g.met.decision.Observe(time.Since(t0).Seconds())
		}
		if err != nil {
			if last != nil {
				break // every replica tried: pass the last refusal on
			}
			fail(err, "no_replica")
			return
		}
		if n := len(req.Blocks); n > 0 {
			g.met.matchRatio.Observe(float64(tk.Decision.Matched) / float64(n))
		}
		res := g.attempt(ctx, w, r, tk, body, parsed, start, log)
		skips = 0
		switch {
		case res.done:
			return
		case res.skip && len(exclude) < g.rt.Replicas():
			exclude = append(exclude, tk.Replica)
			attempt--
			skips++
			continue
		case res.retry:
			exclude = append(exclude, tk.Replica)
			if res.resp != nil {
				last = res.resp
			}
			log.Info("retrying on another replica", "replica", g.rt.URL(tk.Replica), "err", res.err)
			continue
		default:
			fail(res.err, "upstream")
			return
		}
	}
	if last != nil {
		last.write(w)
		g.met.errors.WithLabelValues("exhausted").Inc()
		return
	}
	if ctx.Err() != nil {
		fail(ctx.Err(), "timeout")
		return
	}
	fail(errUpstream.with("every replica tried failed"), "exhausted")
}

// prefillBound is how long a request's prefill may take on its replica:
// twice the policy's TTFT estimate, or twice the cost model's prefill time
// of its uncached tokens behind the queued ones (at least 10 ms).
func (g *Gateway) prefillBound(tk *router.Ticket) time.Duration {
	est := tk.Decision.EstTTFT
	if est <= 0 {
		v := g.rt.Pending(tk.Replica)
		est = g.prof.PrefillTime(tk.UncachedTokens()+v, 0, g.cfg.MaxBatchTokens)
	}
	return max(2*est, 10*time.Millisecond)
}

type attemptResult struct {
	done  bool
	retry bool
	skip  bool // the replica's breaker refused it: route again, no attempt spent
	err   error
	resp  *bufferedResponse
}

// bufferedResponse is an upstream refusal kept to pass on if no retry works.
type bufferedResponse struct {
	status  int
	header  http.Header
	body    []byte
	replica string
}

func (b *bufferedResponse) write(w http.ResponseWriter) {
	copyHeaders(w.Header(), b.header)
	w.Header().Set("X-Kvgate-Replica", b.replica)
	if w.Header().Get("Retry-After") == "" {
		w.Header().Set("Retry-After", "1") // a refusal the client may retry: say when
	}
	w.WriteHeader(b.status)
	_, _ = w.Write(b.body)
}

// attempt sends the request to the ticket's replica. Before the first
// response byte it may ask for a retry; after it, never.
func (g *Gateway) attempt(ctx context.Context, w http.ResponseWriter, r *http.Request, tk *router.Ticket, body []byte,
	parsed *prompt.Parsed, start time.Time, log *slog.Logger) attemptResult {
	i := tk.Replica
	url := g.rt.URL(i)
	if !g.fleet.Allow(i) {
		// Its breaker is half-open with a trial in flight: not this one.
		tk.Done(g.now(), router.Outcome{CachedTokens: -1, Err: errBreaker})
		return attemptResult{skip: true, err: errBreaker}
	}
	up, err := http.NewRequestWithContext(ctx, http.MethodPost, url+r.URL.Path, bytes.NewReader(body))
	if err != nil {
		g.fleet.Neutral(i)
		tk.Done(g.now(), router.Outcome{CachedTokens: -1, Err: err})
		return attemptResult{err: err}
	}
	up.URL.RawQuery = r.URL.RawQuery
	copyHeaders(up.Header, r.Header)
	up.Header.Del("Authorization")
	if k := g.cfg.Replicas[i].APIKey; k != "" {
		up.Header.Set("Authorization", "Bearer "+k)
	} else if len(g.cfg.APIKeys) == 0 && r.Header.Get("Authorization") != "" {
		// No gateway keys: the client's key is meant for the replicas.
		up.Header.Set("Authorization", r.Header.Get("Authorization"))
	}
	up.Header.Del("Accept-Encoding")
	up.ContentLength = int64(len(body))
	if !parsed.Stream {
		// A non-streamed response shows no first token: count the prefill as
		// done once the replica has surely run it, so that the queue the
		// policies see does not keep it for the whole generation.
		timer := time.AfterFunc(g.prefillBound(tk), tk.PrefillDone)
		defer timer.Stop()
	}
	resp, err := g.client.Do(up)
	if err != nil {
		tk.Done(g.now(), router.Outcome{CachedTokens: -1, Err: err})
		if r.Context().Err() != nil {
			g.fleet.Neutral(i)
			return attemptResult{done: true} // the client went away
		}
		g.fleet.Failure(i) // refused, reset, or no answer in time
		if ctx.Err() != nil {
			return attemptResult{err: ctx.Err()}
		}
		return attemptResult{retry: true, err: err}
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusTooManyRequests {
		// Refused before any work: safe to send elsewhere.
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		if resp.StatusCode == http.StatusServiceUnavailable {
			g.fleet.Failure(i)
		} else {
			g.fleet.Neutral(i) // 429: busy, not broken
		}
		tk.Done(g.now(), router.Outcome{CachedTokens: -1, Err: fmt.Errorf("replica answered %s", resp.Status)})
		g.met.requests.WithLabelValues(g.cfg.Policy, url, codeLabel(resp.StatusCode)).Inc()
		return attemptResult{retry: true, err: fmt.Errorf("replica answered %s", resp.Status),
			resp: &bufferedResponse{status: resp.StatusCode, header: resp.Header.Clone(), body: b, replica: url}}
	}
	copyHeaders(w.Header(), resp.Header)
	w.Header().Set("X-Kvgate-Replica", url)
	w.WriteHeader(resp.StatusCode)
	g.met.requests.WithLabelValues(g.cfg.Policy, url, codeLabel(resp.StatusCode)).Inc()

	var out outcome
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		out = g.copyStream(w, resp.Body, tk)
	} else {
		out = g.copyBody(w, resp.Body)
	}
	tk.PrefillDone() // a non-streamed answer: its prefill is over by now at the latest
	end := g.now()
	switch {
	case resp.StatusCode >= 500 || out.upstreamFault:
		g.fleet.Failure(i)
	case out.err != nil:
		g.fleet.Neutral(i) // the client went away mid-response
	default:
		g.fleet.Success(i)
	}
	if out.err == nil && resp.StatusCode >= 400 {
		out.err = fmt.Errorf("replica answered %s", resp.Status)
	}
	tk.Done(end, router.Outcome{CachedTokens: out.cached, OutputTokens: out.completion, Err: out.err})
	g.met.e2e.WithLabelValues(g.cfg.Policy).Observe(end.Sub(start).Seconds())
	if out.firstAt != (time.Time{}) {
		g.met.ttft.WithLabelValues(g.cfg.Policy).Observe(out.firstAt.Sub(start).Seconds())
	}
	log.Debug("proxied", "replica", url, "status", resp.StatusCode, "matched_blocks", tk.Decision.Matched,
		"blocks", len(tk.Request().Blocks), "reason", tk.Decision.Reason, "cached_tokens", out.cached,
		"e2e", end.Sub(start), "err", out.err)
	return attemptResult{done: true}
}

// Server is the http.Server the gateway runs in: bounded header size and
// header-read time (slow clients), idle connections reaped. No write
// timeout: streams last as long as generation does. The body's read time is
// bounded per request in readBody.
func (g *Gateway) Server() *http.Server {
	return &http.Server{
		Handler:           g.mux,
		ReadHeaderTimeout: g.cfg.ReadHeaderTimeout.D(),
		IdleTimeout:       120 * time.Second,
		MaxHeaderBytes:    64 << 10,
	}
}
