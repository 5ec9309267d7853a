package gateway

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// The endpoint-picker front. When a proxy makes the upstream call itself —
// an Envoy (or kgateway, GKE's, Istio's gateway) that asks kvgate over
// ext_proc which replica should serve each request (internal/epp) — the
// request still goes through this package's request path, less the call:
// admission (keys, drain, body bounds, the concurrency limit), the parse
// and routing key, the router (pools, the queue, the policy), the ticket,
// and the settle of one attempt with its sinks (metrics, access log,
// tracing, recording). The proxy reports the replica's answer as it
// passes (Respond, Body, End) and answered/relay read it as they read a
// replica's own answer: first token, usage, completion, verdict. A Handoff
// is one such request; a Picker makes them.

// Picker routes requests for a proxy that calls the replicas itself.
type Picker struct {
	g         *Gateway
	fallbacks int
}

// NewPicker is g's endpoint-picker front: each pick names the chosen
// replica and up to fallbacks more, tried in order if it refuses. A
// prefill/decode fleet cannot be served so: the proxy calls one replica.
func (g *Gateway) NewPicker(fallbacks int) (*Picker, error) {
	if g.ctl.Disaggregated() {
		return nil, errors.New("a prefill/decode fleet cannot be served as an endpoint picker: " +
			"the proxy calls one replica per request; serve it with kvgate serve")
	}
	return &Picker{g: g, fallbacks: max(fallbacks, 0)}, nil
}

// PickRequest is a request as the proxy saw it.
type PickRequest struct {
	// Context ends when the proxy's stream for the request ends.
	Context context.Context
	Method  string
	// Target is the request's path and query (":path").
	Target string
	Header http.Header
	Body   []byte
	// Overflow: the body was longer than max_body_bytes, and Body holds
	// only its start: the request is refused (413).
	Overflow bool
	// EditsAnswer: the proxy sends the answer's body through the picker and
	// relays what the picker answers (ext_proc response body mode
	// FULL_DUPLEX_STREAMED, STREAMED or BUFFERED): a stream may then be
	// asked for the usage its tenant's quota needs (askUsage), the usage
	// chunk taken out of what the client gets (Body).
	EditsAnswer bool
	// RemoteAddr is the client's address (host:port or host; "": unknown):
	// the body memory share it is charged to.
	RemoteAddr string
	// Subset, when not nil, lists the endpoints (host:port) the proxy
	// allows for this request: the pick is among them only.
	Subset []string
}

// Pick is a routing decision for the proxy: the endpoint (host:port) of
// the chosen replica, the fallbacks in order, the changes to the
// request's header and, when the gateway changed the body, the body (what
// the gateway would send the replica).
type Pick struct {
	Endpoint  string
	Fallbacks []string
	Set       http.Header
	Remove    []string
	// Body, when not nil, is what the replica must get instead of the
	// client's body (its tenant's cache_salt and priority, without the
	// client's kv_transfer_params: clientBody); Set carries its length.
	Body []byte
}

// Reply is the gateway's own answer to the client (an error in OpenAI's
// shape), for the proxy to send as a local reply.
type Reply struct {
	Status int
	Header http.Header
	Body   []byte
}

// LocalReply is an answer of the endpoint picker's own to a request for
// target (its :path; "": unknown) the proxy sent wrong: an error with its
// status, in the Messages API's shape on its paths (apiError.bodyFor),
// else OpenAI's.
func LocalReply(target string, status int, code, msg string) *Reply {
	e := &apiError{Status: status, Type: "invalid_request_error", Code: code, Message: msg}
	if status >= 500 {
		e.Type = "server_error"
	}
	path, _, _ := strings.Cut(target, "?")
	return &Reply{Status: status, Header: http.Header{"Content-Type": {"application/json"}}, Body: append(e.bodyFor(path, ""), '\n')}
}

// Handoff is one request picked for a proxy, until its answer ends.
type Handoff struct {
	g       *Gateway
	p       *Picker
	x       *exchange
	a       *attempt
	w       *pickWriter
	aw      *accessWriter // nil: access log off
	r       *http.Request
	gone    context.CancelFunc // ends r's context: the client is gone
	release func()
	start   time.Time
	cands   []int // the pick's replicas: the chosen one, then the fallbacks
	prefill clock.Timer
	strip   *usageStrip // the usage chunk the client did not ask for (nil: none; Respond drops it under mu)

	mu        sync.Mutex
	responded bool
	body      *io.PipeWriter
	done      chan struct{}
	finished  bool
}

// Pick admits and routes a request. On success the Handoff must be ended
// (End) whatever happens next; on failure the Reply is the client's answer.
func (p *Picker) Pick(req PickRequest) (*Handoff, Pick, *Reply) {
	g := p.g
	h := &Handoff{g: g, p: p, w: &pickWriter{header: http.Header{}}, start: g.clock.Now(), release: func() {}}
	var w http.ResponseWriter = h.w
	if g.cfg.AccessLog {
		h.aw = &accessWriter{ResponseWriter: h.w, ttft: -1, cached: -1}
		w = h.aw
	}
	r, err := req.httpRequest()
	if err != nil {
		return nil, Pick{}, h.refuse(w, badTarget(req.Target), err)
	}
	ctx, gone := context.WithCancel(req.Context)
	h.r, h.gone = r.WithContext(ctx), gone
	if err := h.admit(w, req.EditsAnswer); err != nil {
		return nil, Pick{}, h.refuse(w, h.r, err)
	}
	if err := h.exclude(req.Subset); err != nil {
		return nil, Pick{}, h.refuse(w, h.r, err)
	}
	if h.x.lookup { // a stored response the gateway does not know: ask the replicas first
		if err := h.find(statefulID(h.x)); err != nil {
			return nil, Pick{}, h.refuse(w, h.r, err)
		}
	}
	pick, err := h.route()
	if err != nil {
		g.endUnrouted(h.x, err)
		return nil, Pick{}, h.finish()
	}
	if b := h.x.body; b != nil && !bytes.Equal(b, req.Body) {
		pick.Body = b
		pick.Set["Content-Length"] = []string{strconv.Itoa(len(b))}
	}
	return h, pick, nil
}

// Sent records that the pick has gone to the proxy, which sends the
// request on: the index credits it to the chosen replica until the answer
// confirms it (Ticket.Credit), off the pick's path, as the gateway's own
// proxy credits a request once written.
func (h *Handoff) Sent() { h.a.tk.Credit() }

// httpRequest is the request as the HTTP front would have read it.
func (req PickRequest) httpRequest() (*http.Request, error) {
	u, err := url.ParseRequestURI(req.Target)
	if err != nil || u.Host != "" {
		return nil, errBadPath.with("the request's :path is not an absolute path")
	}
	r := &http.Request{Method: req.Method, URL: u, RequestURI: req.Target, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: req.Header, Body: http.NoBody, ContentLength: int64(len(req.Body)), RemoteAddr: req.RemoteAddr, Host: req.Header.Get("Host")}
	if req.Overflow {
		r.ContentLength = -1 // read up to max_body_bytes and past it: 413
	}
	if len(req.Body) > 0 {
		r.Body = io.NopCloser(bytes.NewReader(req.Body))
	}
	return r.WithContext(req.Context), nil
}

// badTarget is a request to log a refused target with.
func badTarget(target string) *http.Request {
	return &http.Request{Method: http.MethodGet, URL: &url.URL{Path: strings.ToValidUTF8(target, "?")}, Header: http.Header{}}
}

// refuse answers a request the gateway refused before routing.
func (h *Handoff) refuse(w http.ResponseWriter, r *http.Request, err error) *Reply {
	if h.r == nil {
		h.r = r
	}
	h.g.fail(w, r, err)
	return h.finish()
}

// admit checks and parses the request as the HTTP front's guard and
// handlers do: completions and chat by the policy, the passthrough
// allow-list's paths as the HTTP front chooses (passthrough.choose: by the
// policy when they carry a prompt, else by load; a stored response named,
// to its holder and for its owner only).
func (h *Handoff) admit(w http.ResponseWriter, editsAnswer bool) error {
	g, r := h.g, h.r
	if looped(r.Header, g.via) {
		return errLoop
	}
	if err := checkPath(r.URL); err != nil {
		return err
	}
	var err error
	switch kind, ok := h.kind(); {
	case !ok:
		return errUnknownPath
	case kind == prompt.Completion || kind == prompt.Chat:
		h.x, h.release, err = g.admit(w, r, kind)
		if err == nil && editsAnswer {
			err = g.askUsage(h.x)
		}
		if err == nil && h.x.hideUsage {
			h.strip = &usageStrip{maxLine: g.cfg.MaxStreamLineBytes}
		}
	default:
		if ct := r.Header.Get("Content-Type"); !isJSON(ct) {
			return errContentType // a multipart upload is a replica's, unrouted by an endpoint picker
		}
		h.x, h.release, err = g.admitPassthrough(w, r, kind)
		if err == nil { // by load without a prompt; a stored response's by its holder and owner
			err = g.pt.choose(h.x)
		}
	}
	if err != nil && h.release == nil {
		h.release = func() {}
	}
	return err
}

// kind is the request's kind by its path (false: a path the gateway does
// not serve).
func (h *Handoff) kind() (prompt.Kind, bool) {
	switch p := h.r.URL.Path; {
	case p == "/v1/completions":
		return prompt.Completion, true
	case p == "/v1/chat/completions":
		return prompt.Chat, true
	case slices.Contains(h.g.cfg.Passthrough, p):
		return prompt.Other, true
	default:
		if k, ok := passthroughPaths[p]; ok && !strings.Contains(p, "{") {
			return k, true
		}
		// A stored response's own paths (passthroughPaths' templates):
		// GET or DELETE /v1/responses/{id}, POST …/{id}/cancel.
		if id, ok := responsePathID(p); ok {
			rest := strings.TrimPrefix(p, "/v1/responses/"+id)
			return prompt.Other, rest == "" || rest == "/cancel"
		}
		return 0, false
	}
}

// exclude keeps the pick among subset (the proxy's allowed endpoints;
// nil: any): the other replicas are excluded as a retry's are. A subset
// naming no replica is a request no replica can take (503).
func (h *Handoff) exclude(subset []string) error {
	if subset == nil {
		return nil
	}
	allowed := make(map[string]bool, len(subset))
	for _, s := range subset {
		allowed[s] = true
	}
	any := false
	for i := range h.g.rt.Replicas() {
		if ep, err := Endpoint(h.g.rt.Replica(i).URL()); err == nil && allowed[ep] {
			any = true
			continue
		}
		h.x.exclude = append(h.x.exclude, i)
	}
	if !any {
		return errNoReplica.with("none of the endpoints the proxy allows for this request is a replica of this gateway")
	}
	return nil
}

// route routes the exchange and takes the chosen replica's breaker pass
// (a replica half-open with its trial in flight is skipped, as the HTTP
// front's run skips it), then names the fallbacks.
func (h *Handoff) route() (Pick, error) {
	g, x := h.g, h.x
	for range g.rt.Replicas() + 1 {
		tk, err := g.route(x)
		if err != nil {
			return Pick{}, err
		}
		a := &attempt{tk: tk, cached: -1}
		if g.allow(a) {
			h.attempt(a)
			return h.pick()
		}
		g.settle(x, a)
		x.exclude = append(x.exclude, tk.Replica)
	}
	return Pick{}, policy.ErrNoReplica
}

// attempt makes a the exchange's attempt: its span, and for a
// non-streamed request the prefill's end in the ticket (try's timers).
func (h *Handoff) attempt(a *attempt) {
	h.a = a
	h.x.ctx = h.g.traceAttempt(h.x.ctx, h.x, a)
	if !h.x.parsed.Stream {
		h.prefill = h.g.watchPrefill(a.tk)
	}
}

// pick is the decision for the proxy: the chosen replica, its fallbacks,
// and the header the gateway would send the replica (upstreamHeader) as
// changes to the client's.
func (h *Handoff) pick() (Pick, error) {
	g, x := h.g, h.x
	rep := g.rt.Replica(h.a.tk.Replica)
	ep, err := Endpoint(rep.URL())
	if err != nil {
		return Pick{}, err
	}
	p := Pick{Endpoint: ep, Set: http.Header{}}
	h.cands = append(h.cands[:0], rep.Index())
	for _, i := range h.fallbacks() {
		if fe, err := Endpoint(g.rt.Replica(i).URL()); err == nil && fe != ep && !slices.Contains(p.Fallbacks, fe) {
			p.Fallbacks = append(p.Fallbacks, fe)
			h.cands = append(h.cands, i)
		}
	}
	up := http.Header{}
	g.upstreamHeader(up, x, rep, rep.APIKey())
	for k, vs := range up {
		if !slices.Equal(vs, x.r.Header[k]) {
			p.Set[k] = vs
		}
	}
	g.pickPull(x, h.a, p.Set)
	for k := range x.r.Header {
		if _, kept := p.Set[k]; kept {
			continue
		}
		if _, kept := up[k]; !kept && !hopHeader(k) && k != "Host" && k != "Content-Length" {
			p.Remove = append(p.Remove, k)
		}
	}
	slices.Sort(p.Remove)
	return p, nil
}

// hopHeader reports whether k is a hop-by-hop header, the proxy's own.
func hopHeader(k string) bool { return slices.Contains(hopHeaders, k) || k == "Connection" }

// fallbacks are the candidates the proxy may try after the chosen one,
// best first: the replicas that hold most of the prompt, then the least
// loaded (pending prefill, then requests in flight); at most the
// picker's fallbacks. A call pinned to the replica holding its stored
// response has none: another replica would answer that the response does
// not exist.
func (h *Handoff) fallbacks() []int {
	if _, held := h.x.pol.(pinned); held || h.p.fallbacks == 0 {
		return nil
	}
	views, err := h.g.rt.Candidates(h.x.req, append(slices.Clone(h.x.exclude), h.a.tk.Replica)...)
	if err != nil {
		return nil
	}
	var out []int
	for i, v := range views {
		if v.Healthy {
			out = append(out, i)
		}
	}
	slices.SortStableFunc(out, func(i, j int) int {
		a, b := views[i], views[j]
		return cmp.Or(cmp.Compare(b.Match, a.Match), cmp.Compare(a.PendingPrefill, b.PendingPrefill), cmp.Compare(a.InFlight, b.InFlight))
	})
	return out[:min(len(out), h.p.fallbacks)]
}

// Endpoint is a replica URL's host:port, as the endpoint-picker protocol
// names endpoints (the scheme's default port when the URL has none).
func Endpoint(replicaURL string) (string, error) {
	u, err := url.Parse(replicaURL)
	if err != nil || u.Host == "" {
		return "", fmt.Errorf("replica %q: not a URL with a host", replicaURL)
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	return net.JoinHostPort(u.Hostname(), port), nil
}

// Respond hands the replica's answer to the gateway: its status and
// header, and the endpoint that served it ("" : the chosen one; a
// fallback's when the proxy moved on). The body follows (Body), then End.
// It returns the changes to the client's answer: the headers to set (the
// replica served and, when on, the route receipt) and the replica's own
// X-Kvgate-* headers to remove (only the gateway names the route, as the
// HTTP front's relay drops them).
func (h *Handoff) Respond(status int, header http.Header, served string) (set http.Header, remove []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.responded || h.finished {
		return nil, nil
	}
	h.responded, h.w.relayed = true, true
	if enc := header.Get("Content-Encoding"); enc != "" && !strings.EqualFold(enc, "identity") {
		h.strip = nil // an encoded body (gzip) has no events to read: it passes as it comes, its usage chunk too
	}
	if served != "" {
		h.switchTo(served)
	}
	pr, pw := io.Pipe()
	h.body, h.done = pw, make(chan struct{})
	resp := &http.Response{StatusCode: status, Status: strconv.Itoa(status) + " " + http.StatusText(status), Header: header.Clone(), Body: pr}
	ctx, cancel := context.WithCancelCause(h.x.ctx)
	stop := context.AfterFunc(ctx, func() { pr.CloseWithError(context.Cause(ctx)) })
	go func() { // owned by the handoff: ends when End closes the body
		defer close(h.done)
		h.g.answered(h.x, h.a, ctx, cancel, resp)
		stop()
		cancel(context.Canceled)
		h.settle()
	}()
	add := http.Header{}
	setTarget(add, h.g.rt.Replica(h.a.tk.Replica), nil)
	add.Set("X-Request-Id", h.x.id)
	if h.a.pullFrom != nil {
		add.Set(headerPullFrom, h.a.pullFrom.URL())
	}
	h.g.addReceipt(add, h.x, h.a)
	for k := range header {
		if isKvgateHeader(k) && add.Get(k) == "" {
			remove = append(remove, k)
		}
	}
	slices.Sort(remove)
	return add, remove
}

// switchTo makes the replica at endpoint served the attempt's when the
// proxy moved on to a fallback: the chosen replica refused before any
// work (the proxy retries only then) and is settled so; the fallback's
// ticket is routed pinned to it.
func (h *Handoff) switchTo(served string) {
	g, x := h.g, h.x
	k := -1
	for _, i := range h.cands[1:] {
		if ep, _ := Endpoint(g.rt.Replica(i).URL()); ep == served {
			k = i
			break
		}
	}
	if k < 0 {
		return // the chosen one (or an endpoint not offered: nothing to learn from)
	}
	x.req.Now = g.clock.Now()
	tk, err := g.rt.RouteWith(pinned(k), x.req, append(slices.Clone(x.exclude), h.a.tk.Replica)...)
	if err != nil {
		return // the fallback left rotation meanwhile: its answer is read against the first choice's ticket
	}
	h.stopPrefill()
	h.a.v, h.a.err = refused, errors.New("the proxy moved on to a fallback endpoint")
	g.settle(x, h.a)
	x.exclude = append(x.exclude, h.a.tk.Replica)
	a := &attempt{tk: tk, cached: -1}
	a.tk.Allow() // the proxy has sent it already: the pass only reports the verdict's health
	h.attempt(a)
}

// Body hands the next chunk of the replica's answer to the gateway (eos:
// the last), and returns what the client gets of it: the chunk, less the
// usage chunk the gateway asked for and the client did not (askUsage).
func (h *Handoff) Body(chunk []byte, eos bool) []byte {
	h.mu.Lock()
	pw, strip := h.body, h.strip
	h.mu.Unlock()
	if pw != nil && len(chunk) > 0 {
		_, _ = pw.Write(chunk) // an error: the relay ended early (a stream overran its bounds), nothing more to read
	}
	if strip == nil {
		return chunk
	}
	return strip.pass(chunk, eos)
}

// End ends the request: complete when the answer's end of stream came
// through the proxy, else the proxy's stream ended first (the client
// left, or the proxy gave up). It settles the attempt, once, and returns
// when all is done.
func (h *Handoff) End(complete bool) {
	h.mu.Lock()
	if h.finished {
		h.mu.Unlock()
		return
	}
	pw, done := h.body, h.done
	if pw == nil {
		h.finished = true // nothing was answered: settle here
		h.mu.Unlock()
		h.gone()
		h.a.v, h.a.err = clientGone, errors.New("the proxy's stream ended before the replica's answer")
		h.settle()
		return
	}
	h.mu.Unlock()
	if complete {
		_ = pw.Close()
	} else {
		h.gone()
		_ = pw.CloseWithError(context.Canceled)
	}
	<-done
}

// settle settles the attempt and ends the exchange.
func (h *Handoff) settle() {
	h.stopPrefill()
	h.g.settle(h.x, h.a)
	if h.a.v == served {
		h.g.pt.settled(h.x, h.a) // a stored response created or found
	}
	h.mu.Lock()
	h.finished = true
	h.mu.Unlock()
	h.finish()
}

func (h *Handoff) stopPrefill() {
	if h.prefill != nil {
		h.prefill.Stop()
	}
}

// finish frees what admission took and writes the access log's line; it
// returns the gateway's own answer, if it wrote one.
func (h *Handoff) finish() *Reply {
	h.release()
	if h.gone != nil {
		defer h.gone()
	}
	if h.aw != nil {
		h.g.logAccess(h.aw, h.r, h.start)
	}
	if h.w.status == 0 {
		return nil
	}
	return &Reply{Status: h.w.status, Header: h.w.header, Body: h.w.buf.Bytes()}
}

// ID is the request's id (X-Request-Id).
func (h *Handoff) ID() string { return h.x.id }

// pickWriter is the ResponseWriter of a handoff: what the gateway writes
// to the client, which the proxy sends when it is the gateway's own
// answer (an error). The relayed answer's bytes are not kept: the proxy
// sends the replica's own.
type pickWriter struct {
	header  http.Header
	status  int
	relayed bool
	buf     bytes.Buffer
}

func (w *pickWriter) Header() http.Header { return w.header }

func (w *pickWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
}

// Write keeps the gateway's own answers, bounded (an error body is small).
func (w *pickWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	if !w.relayed && w.buf.Len()+len(p) <= 64<<10 {
		w.buf.Write(p)
	}
	return len(p), nil
}

// FlushError lets the relay flush, as it does a client's connection.
func (w *pickWriter) FlushError() error { return nil }
