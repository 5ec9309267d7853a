package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// exchange is one client request in flight through the gateway: what it
// asked, where it has been tried, and the context every attempt runs in.
type exchange struct {
	w  http.ResponseWriter
	r  *http.Request
	rc http.ResponseController // by value: one allocation less per request
	id string
	// base is the gateway's logger; lg is base with the request's id, made
	// by logger on first use: most requests log nothing, and With formats
	// its attributes at once.
	base   *slog.Logger
	lg     atomic.Pointer[slog.Logger]
	start  time.Time
	kind   prompt.Kind
	body   []byte
	parsed *prompt.Parsed
	// model is the request's model as the router resolved it, once, when
	// it was parsed: its pool, listing and partition (checks, remote
	// tokenization, the routing key, which carries it to routing).
	model router.Resolved
	req   *policy.Request
	// ctx ends when the client leaves, request_timeout passes, or a drain
	// cuts the request (context.Cause says which).
	ctx context.Context
	// cut cuts the client's writes when request_timeout or the drain ends
	// ctx while an answer is relayed (relay.go).
	cut     writeCut
	exclude []int
	refusal *bufferedResponse // the last 503/429, passed on if no replica takes it
	// prefillBody is the body of the request's prefill steps (pd.go),
	// made at the first one.
	prefillBody []byte
	// held is a completed prefill step's KV that a refused decode step did
	// not pull: the next decode step's (pd.go; nil: none).
	held *heldKV
	// pol, when set, decides instead of the router's policy (passthrough.go:
	// by load without a prompt, pinned to the replica holding a response).
	pol policy.Policy
	// upload is a streamed non-JSON body (nil: body is the whole body).
	upload *upload
	// lookup: the request names a response the gateway has not seen; a 404
	// means "not on this replica" and the next replica is asked. notHere
	// counts the replicas that answered so, and missed says the last 404
	// was the answer: no replica took the request.
	lookup  bool
	notHere int
	missed  bool
	// waited is how long the request last waited in the router's queue
	// (the route receipt's queue wait).
	waited time.Duration
	// tenant is the client's tenant (nil: none, or no tenants); band and
	// deadline are its request's (tenants.go).
	tenant   *tenant
	band     int
	deadline time.Time
	// charge is what its tenant's quota was charged (nil: none), usage
	// what the replicas reported, to correct it (quota.go).
	charge *quotaCharge
	usage  exchangeUsage
	// hideUsage: the gateway asked the replica for a stream's usage chunk
	// the client did not ask for (askUsage); the relay keeps it back.
	hideUsage bool
	// created, when set, is told the response a Responses stream creates
	// once its id comes, before the client reads it (relayEvent): the
	// passthrough remembers its home and owner (passthrough.go).
	created func(a *attempt)
}

// exchangeUsage is what an exchange's attempts told of its tokens: sent,
// some attempt went to a replica; known, the answering one reported usage.
type exchangeUsage struct {
	sent, known    bool
	prompt, output int
}

// serveInference handles POST /v1/completions and /v1/chat/completions:
// admit, then route and attempt until one attempt is final. A
// prefill/decode fleet routes each try to a pair (routePDAttempt).
func (g *Gateway) serveInference(w http.ResponseWriter, r *http.Request, kind prompt.Kind) {
	x, release, err := g.admit(w, r, kind)
	if err == nil {
		err = g.askUsage(x)
	}
	if err != nil {
		if release != nil {
			release()
		}
		g.fail(w, r, err)
		return
	}
	defer release()
	route := g.routeAttempt
	if g.ctl.Disaggregated() {
		route = g.routePDAttempt
	}
	g.run(x, route)
	g.releaseHeld(x)
}

// run routes and attempts an admitted exchange until one attempt is final:
// another replica is tried after a refusal (within retries, after a
// backoff) or, for a lookup, after a 404 (each replica once).
func (g *Gateway) run(x *exchange, route func(*exchange, bool) (*attempt, error)) {
	for tries := 0; ; {
		a, err := route(x, tries >= g.conf().Retries)
		if err != nil {
			g.endUnrouted(x, err)
			return
		}
		if a.abort {
			panic(http.ErrAbortHandler) // after settle; the caller's release runs as the panic unwinds
		}
		if !a.retryable() {
			return
		}
		x.exclude = append(x.exclude, a.tk.Replica)
		if a.notHere {
			x.notHere++
		}
		if a.v == skipped || a.notHere {
			continue // no attempt spent
		}
		if !x.replayable() {
			// Part of a streamed upload went to the replica: it cannot be sent again.
			g.endUnrouted(x, errUpstream.with("the replica refused the upload after it had started reading it"))
			return
		}
		if tries++; tries > g.conf().Retries {
			g.endUnrouted(x, errUpstream.with("every replica tried refused the request"))
			return
		}
		g.met.retries.Inc()
		x.logger().Info("retrying on another replica", "replica", g.rt.Name(a.tk.Replica), "step", a.step,
			"verdict", a.v.String(), "err", a.err)
		if !clock.Sleep(g.clock, g.backoff(tries), x.ctx.Done()) {
			g.endUnrouted(x, context.Cause(x.ctx))
			return
		}
	}
}

// routeAttempt routes the exchange (less the replicas already tried),
// attempts the chosen replica and settles the attempt.
func (g *Gateway) routeAttempt(x *exchange, _ bool) (*attempt, error) {
	tk, err := g.route(x)
	if err != nil {
		return nil, err
	}
	a := &attempt{tk: tk, cached: -1}
	g.preparePull(x, a)
	if g.allow(a) {
		g.try(x, a)
	}
	g.settle(x, a)
	if a.refusal != nil {
		x.refusal = a.refusal
	}
	return a, nil
}

// route routes the exchange (less the replicas already tried), with x.pol
// when set: through the router's queue when the policy defers or the flow
// controller holds it, a pinned or by-load request too (it waits its turn
// like any other). The ticket is the chosen replica's; nothing is sent yet.
func (g *Gateway) route(x *exchange) (*router.Ticket, error) {
	t0 := g.clock.Now()
	x.req.Now = t0
	span := g.startSpan(x.ctx, "kvgate.route")
	tk, w, err := g.rt.SubmitWith(x.pol, x.req, x.exclude...)
	if len(x.exclude) == 0 {
		g.met.decision.Observe(g.clock.Since(t0).Seconds())
	}
	if w != nil {
		tk, err = g.waitInQueue(x, w)
	}
	g.traceRoute(span, x, tk, nil, err)
	if err != nil {
		if g.ten != nil {
			g.ten.noteShed(x, err)
		}
		return nil, err
	}
	if n := len(x.req.Blocks); n > 0 && len(x.exclude) == 0 {
		g.met.matchRatio.Observe(float64(tk.Decision.Matched) / float64(n))
	}
	return tk, nil
}

// waitInQueue waits while the request is held in the router's queue (a
// policy that defers: late binding; flow control), for at most
// queue_timeout, or with flow control until its deadline or its band's
// TTL: past it the request leaves the queue and is routed at once,
// wherever the policy prefers, or, with flow control, shed (429). A
// client that leaves takes it out of the queue.
func (g *Gateway) waitInQueue(x *exchange, w *router.Waiting) (*router.Ticket, error) {
	g.met.routerQueued.Inc()
	defer g.met.routerQueued.Dec()
	t0 := g.clock.Now()
	defer func() { x.waited = g.clock.Since(t0); g.met.routerWait.Observe(x.waited.Seconds()) }()
	if g.ten != nil {
		defer g.ten.waited(x, t0, g.clock.Now)
	}
	wait := g.conf().QueueTimeout.D()
	if exp := w.Expires(); !exp.IsZero() {
		wait = exp.Sub(t0)
	}
	timer := g.clock.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-w.Done():
		return w.Result()
	case <-x.ctx.Done():
		if !g.rt.Cancel(w) {
			<-w.Done()
			g.dropRouted(w, context.Cause(x.ctx))
		}
		return nil, context.Cause(x.ctx)
	case <-timer.C():
		return g.queueTimedOut(x, w)
	}
}

// dropRouted ends what w was routed to as its client left: nothing was
// sent. A pair's steps (router.SubmitPD) end as pd.go ends steps never
// sent (endUnsent: the index forgets what it learnt of them).
func (g *Gateway) dropRouted(w *router.Waiting, cause error) {
	tk, err := w.Result()
	if err != nil {
		return
	}
	if pd, _ := w.PD(); pd.Decode != nil {
		if pd.Prefill != nil {
			endUnsent(g, pd.Prefill, cause)
		}
		endUnsent(g, pd.Decode, cause)
		return
	}
	tk.Done(g.clock.Now(), router.Outcome{CachedTokens: -1, Err: cause})
}

// queueTimedOut ends a wait in the router's queue at its timer: with flow
// control the request is shed (its expiry); without, routed at once (a
// pair waits only under flow control: router.SubmitPD).
func (g *Gateway) queueTimedOut(x *exchange, w *router.Waiting) (*router.Ticket, error) {
	if !w.Expires().IsZero() {
		if err := g.rt.Expire(w); err != nil {
			return nil, err
		}
		<-w.Done()
		return w.Result()
	}
	if !g.rt.Cancel(w) {
		<-w.Done()
		return w.Result()
	}
	x.req.NoDefer, x.req.Now = true, g.clock.Now()
	return g.rt.Route(x.req, x.exclude...)
}

// endUnrouted answers a request no attempt answered: the last replica's
// refusal if there was one, else the error.
func (g *Gateway) endUnrouted(x *exchange, err error) {
	if x.r.Context().Err() != nil {
		return // the client is gone: nobody to answer
	}
	if x.refusal != nil && (errors.Is(err, policy.ErrNoReplica) || isAPIError(err, errUpstream)) {
		x.refusal.write(x.w)
		if x.refusal.status != http.StatusNotFound { // a lookup's last "not here" is an answer
			g.met.errors.WithLabelValues("exhausted").Inc()
		} else {
			x.missed = true
		}
		return
	}
	if c := context.Cause(x.ctx); c != nil {
		err = c
	}
	g.fail(x.w, x.r, err)
}

// fail answers an error the gateway decided (never a replica's answer);
// a client already gone gets nothing and is counted as such.
func (g *Gateway) fail(w http.ResponseWriter, r *http.Request, err error) {
	// (A body cut by its read deadline ends the request's context too, as
	// any read error on the connection does: that client still gets its 408.)
	if r.Context().Err() != nil && !isAPIError(err, errBodyTimeout) {
		g.met.errors.WithLabelValues("client_gone").Inc()
		return
	}
	ae := writeErrorFor(w, r, err)
	g.met.errors.WithLabelValues(ae.Code).Inc()
	g.log.Info("request failed", "request_id", w.Header().Get("X-Request-Id"), "path", r.URL.Path,
		"status", ae.Status, "code", ae.Code, "err", ae.Message)
}

// admit checks, reads and parses a request and gives it a slot. The
// returned release frees what admission took; it runs when the exchange ends.
func (g *Gateway) admit(w http.ResponseWriter, r *http.Request, kind prompt.Kind) (*exchange, func(), error) {
	x, err := g.begin(w, r, kind, http.MethodPost)
	if err != nil {
		return nil, nil, err
	}
	body, releaseBody, err := g.readBody(w, r)
	if err != nil {
		return nil, nil, err
	}
	x.body = body
	release, err := g.enter(x, releaseBody, func() (*prompt.Parsed, router.Resolved, error) { return g.parse(kind, body) })
	return x, release, err
}

// begin makes the exchange of a request and checks its method (one of
// methods), its key and that the gateway is not past its drain.
func (g *Gateway) begin(w http.ResponseWriter, r *http.Request, kind prompt.Kind, methods ...string) (*exchange, error) {
	x := &exchange{w: w, r: r, rc: *http.NewResponseController(w), id: requestID(r), start: g.clock.Now(), kind: kind, base: g.log}
	w.Header().Set("X-Request-Id", x.id)
	if !slices.Contains(methods, r.Method) {
		w.Header().Set("Allow", strings.Join(methods, ", "))
		return nil, errMethod.with("use " + strings.Join(methods, " or "))
	}
	t, ok := g.identify(r)
	if !ok {
		return nil, errUnauth
	}
	if x.tenant = t; t != nil {
		if aw, ok := w.(*accessWriter); ok {
			aw.tenant = t.name
		}
	}
	if g.cut.Err() != nil {
		return nil, errDraining // past the drain: the process is stopping
	}
	return x, nil
}

// enter admits an exchange whose body is read (releaseBody gives its room
// back): its context, its parse, a slot of the concurrency limit and its
// routing key. The returned release frees all of it.
func (g *Gateway) enter(x *exchange, releaseBody func(), parse func() (*prompt.Parsed, router.Resolved, error)) (func(), error) {
	ctx, endCtx := g.requestContext(x.r.Context(), x.cut.fire)
	releaseAll := func() { endCtx(); releaseBody() }
	x.ctx = ctx
	span := g.startSpan(ctx, "kvgate.parse")
	var err error
	if x.parsed, x.model, err = parse(); err == nil {
		if err = g.applyTenant(x); err == nil {
			err = g.clientBody(x)
		}
	}
	if err != nil {
		endSpan(span, err)
		releaseAll()
		return nil, err
	}
	lim := g.live.lim.Load() // the one released: a reload may swap it meanwhile
	if err := lim.acquire(ctx, g.clock); err != nil {
		endSpan(span, err)
		releaseAll()
		return nil, err
	}
	// Remote tokenization costs the replicas work: only admitted requests.
	x.req, err = g.routingKey(ctx, x.kind, x.parsed, x.model, x.body, x.r.Header)
	if err == nil {
		g.tagRequest(x)
		err = g.admitQuota(x)
	}
	endSpan(span, err)
	if err != nil {
		lim.release()
		releaseAll()
		return nil, err
	}
	g.inFlight.Add(1)
	return func() { g.settleQuota(x); lim.release(); releaseAll(); g.inFlight.Add(-1) }, nil
}

// requestContext derives a request's context: cancelled when the client
// leaves, when request_timeout passes (on the gateway's clock), and when a
// drain cuts in-flight requests; context.Cause tells which. The gateway's
// two limits call cut after cancelling.
func (g *Gateway) requestContext(parent context.Context, cut func()) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(parent)
	var timer clock.Timer
	if d := g.conf().RequestTimeout.D(); d > 0 {
		timer = g.clock.AfterFunc(d, func() { cancel(errRequestTimeout); cut() })
	}
	stop := context.AfterFunc(g.cut, func() { cancel(errDrained); cut() })
	return ctx, func() {
		if timer != nil {
			timer.Stop()
		}
		stop()
		cancel(context.Canceled)
	}
}

// prepare parses a request body into a routing key (/debug/route), its
// model resolved, as a request of tenant t would be keyed (its cache salt).
func (g *Gateway) prepare(ctx context.Context, kind prompt.Kind, body []byte, h http.Header, t *tenant) (router.Resolved, *policy.Request, error) {
	p, model, err := g.parse(kind, body)
	if err != nil {
		return model, nil, err
	}
	if g.ten != nil {
		p.CacheSalt, _ = g.ten.salt(t, p.CacheSalt)
	}
	req, err := g.routingKey(ctx, kind, p, model, body, h)
	if err == nil {
		tenantProgram(req, t)
	}
	return model, req, err
}

// parse reads a request body, resolves its model (once: the resolution
// goes with the request) and checks it against what the replicas serve.
func (g *Gateway) parse(kind prompt.Kind, body []byte) (*prompt.Parsed, router.Resolved, error) {
	p, err := prompt.Parse(kind, body)
	if err != nil {
		return nil, router.Resolved{}, err
	}
	model := g.rt.Resolve(p.Model)
	if !model.Served() {
		return nil, model, errModel.with(fmt.Sprintf("The model `%s` does not exist.", p.Model))
	}
	return p, model, checkLength(p, model, 0)
}

// routingKey tokenizes (remotely when configured) and hashes the prompt
// of p, whose model resolved as model.
func (g *Gateway) routingKey(ctx context.Context, kind prompt.Kind, p *prompt.Parsed, model router.Resolved, body []byte,
	h http.Header) (*policy.Request, error) {
	// A client's own /tokenize, and a request without a prompt, need no
	// remote tokenization to be routed.
	if g.tok != nil && p.TokenIDs == nil && p.Text != "" && kind != prompt.Tokenize {
		if ids, ok := g.tok.tokenize(ctx, kind, p, model, body); ok {
			p.TokenIDs = ids
		}
	}
	req := g.rt.PrepareIn(model, p, programSession(h, p))
	if p.TokenIDs != nil {
		// Token counts are exact: check the whole request against the context.
		if err := checkLength(p, model, req.Tokens); err != nil {
			return nil, err
		}
	}
	return req, nil
}

// checkLength rejects a request the model's context cannot hold, when the
// replicas list the model's max_model_len: max_tokens alone, or with the
// prompt's tokens when they are known exactly (promptTokens > 0).
func checkLength(p *prompt.Parsed, model router.Resolved, promptTokens int) error {
	m, ok := model.Info()
	if !ok || m.MaxModelLen <= 0 {
		return nil
	}
	switch {
	case p.MaxTokens > m.MaxModelLen:
		return &prompt.RequestError{Param: "max_tokens", Msg: fmt.Sprintf(
			"%d is more than the model's context of %d tokens", p.MaxTokens, m.MaxModelLen)}
	case promptTokens > 0 && promptTokens+p.MaxTokens > m.MaxModelLen:
		return &prompt.RequestError{Param: "messages", Msg: fmt.Sprintf(
			"the model's context is %d tokens; this request has %d in the prompt and asks for %d more",
			m.MaxModelLen, promptTokens, p.MaxTokens)}
	}
	return nil
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

// logger is the exchange's logger, with its request id (made on first use;
// safe from the attempt's timers too).
func (x *exchange) logger() *slog.Logger {
	if l := x.lg.Load(); l != nil {
		return l
	}
	l := x.base.With("request_id", x.id)
	if !x.lg.CompareAndSwap(nil, l) {
		return x.lg.Load()
	}
	return l
}
