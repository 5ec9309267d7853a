package gateway

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/fleet"
	"github.com/kvgate/kvgate/internal/router"
)

// upstream is how the gateway calls its replicas besides the fleet's
// probes: every request it sends them is built by fleet.NewRequest and goes
// through one transport. Proxied requests and prefill steps call it
// directly (proxy): a replica's redirect is passed on to the client, as a
// reverse proxy does, never followed to a host no one configured, and
// http.Client's per-request copy of the header is not made. Remote
// tokenization goes through client. tok is the remote tokenizer (nil
// unless tokenizer: remote).
type upstream struct {
	proxy  http.RoundTripper
	client *http.Client
	tok    *remoteTokenizer
}

// allow asks the breaker of a's replica for the attempt (its ticket keeps
// the pass, and reports the verdict's health when settle ends it); false
// (verdict skipped) when it is half-open with its trial in flight.
func (g *Gateway) allow(a *attempt) bool {
	if !a.tk.Allow() {
		a.v, a.err = skipped, errBreaker
		return false
	}
	return true
}

// try sends the exchange (a.body, or the client's body) to the attempt's
// replica, which allow admitted, and relays the answer. It sets the
// attempt's verdict: for a final verdict the client has its answer (the
// replica's, or the gateway's error), for a retryable one nothing was
// written to the client.
func (g *Gateway) try(x *exchange, a *attempt) {
	tk := a.tk
	ctx, cancel := context.WithCancelCause(x.ctx)
	defer cancel(context.Canceled)
	ctx = g.traceAttempt(ctx, x, a) // its span ends in settle (the tracing sink)
	up, call := g.upstreamRequest(ctx, x, a)
	if !x.parsed.Stream {
		defer g.watchPrefill(tk).Stop()
	} else if d := g.conf().FirstByteTimeout.D(); d > 0 {
		// Streamed answers start at once (vLLM sends the header when it
		// admits the request): a replica silent this long is stuck.
		call.firstByte = g.clock.AfterFunc(d, func() { cancel(errFirstByteTimeout) })
		defer call.firstByte.Stop()
	}
	resp, err := g.proxy.RoundTrip(up)
	if x.upload != nil {
		_ = x.rc.SetReadDeadline(time.Time{}) // the replica answered: the upload's time bound is over
	}
	if err != nil {
		g.transportFailure(x, a, ctx, call.wrote.Load(), err)
		return
	}
	g.answered(x, a, ctx, cancel, resp)
}

// watchPrefill ends a non-streamed request's prefill in the ticket once it
// has surely run: such an answer shows no first token, so the request
// leaves the queue the policies see after prefillBound, and the replica
// has taken it (vLLM rejects at once). Stop the timer when the attempt ends.
func (g *Gateway) watchPrefill(tk *router.Ticket) clock.Timer {
	return g.clock.AfterFunc(g.prefillBound(tk), func() { tk.PrefillDone(); tk.Accept() })
}

// answered reads the replica's answer to attempt a, whichever proxy made
// the call (try here; the proxy an endpoint picker serves, handoff.go): a
// refusal is kept to pass on, anything else is relayed; it sets the verdict.
func (g *Gateway) answered(x *exchange, a *attempt, ctx context.Context, cancel context.CancelCauseFunc, resp *http.Response) {
	defer resp.Body.Close()
	a.status = resp.StatusCode
	if resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusTooManyRequests ||
		(x.lookup && resp.StatusCode == http.StatusNotFound) {
		g.refusal(x, a, cancel, resp)
		return
	}
	if resp.StatusCode < 400 {
		a.tk.Accept()
	}
	g.relay(x, a, ctx, cancel, resp)
	if a.v == failed && resp.StatusCode == http.StatusLoopDetected {
		// A hop (another kvgate, or any proxy that detects loops) found
		// that the request's path loops: a configuration's fault, not the
		// replica's, which did no work. Passed on; counts against none.
		a.v = rejected
	}
}

// upstreamCall is what the transport's hooks tell of one request to a
// replica (httptrace), made in one allocation with the request: wrote
// turns true once the whole request has been written (and the ticket's
// blocks are credited to its replica then), and firstByte (nil:
// none) is stopped when the response's first byte arrives.
type upstreamCall struct {
	trace     httptrace.ClientTrace
	wrote     atomic.Bool
	firstByte clock.Timer
	tk        *router.Ticket // credited once the request is written (Ticket.Credit)
}

func (c *upstreamCall) wroteRequest(info httptrace.WroteRequestInfo) {
	if info.Err == nil {
		c.wrote.Store(true)
		c.tk.Credit() // on the transport's writer, off the request's path
	}
}

func (c *upstreamCall) gotFirstByte() {
	if c.firstByte != nil {
		c.firstByte.Stop()
	}
}

// upstreamRequest builds the request of attempt a (to its replica, its
// payload), and the call that hears how its sending goes (set the call's
// firstByte before sending).
func (g *Gateway) upstreamRequest(ctx context.Context, x *exchange, a *attempt) (*http.Request, *upstreamCall) {
	call := &upstreamCall{tk: a.tk}
	call.trace.WroteRequest, call.trace.GotFirstResponseByte = call.wroteRequest, call.gotFirstByte
	ctx = httptrace.WithClientTrace(ctx, &call.trace)
	rep, body := g.rt.Replica(a.tk.Replica), a.payload(x)
	var rd io.Reader = http.NoBody
	length := int64(len(body))
	switch {
	case x.upload != nil:
		rd, length = x.upload, x.upload.length
	case len(body) > 0:
		rd = bytes.NewReader(body)
	}
	key := rep.APIKey()
	// The client's decoded path, set as a path (checkPath refused the
	// characters that would change its meaning); the replica's URL was
	// checked at config, so it parses.
	up, _ := fleet.NewRequest(ctx, x.r.Method, rep.URL(), key, x.r.URL.Path, rd, func(h http.Header) {
		g.upstreamHeader(h, x, rep, key)
		if a.kvID != "" {
			h.Set("X-Request-Id", a.kvID) // a KV transfer's own id (kvTransferID)
		}
	})
	up.URL.RawQuery = x.r.URL.RawQuery
	g.injectTrace(ctx, up.Header)
	up.ContentLength = length
	return up, call
}

// upstreamHeader writes into h the header of x's request to replica rep
// (its key key): the client's, less hop-by-hop headers and those only the
// gateway sets (dropGatewayHeaders), with the Via hop, the client's key
// when the replica has none and the gateway checks none, the data-parallel
// rank, the request id and X-Forwarded-*. No Accept-Encoding: SSE must
// not be compressed.
func (g *Gateway) upstreamHeader(h http.Header, x *exchange, rep *router.Replica, key string) {
	copyHeaders(h, x.r.Header)
	dropGatewayHeaders(h)
	vals := make(headerValues, 0, 4)
	// After the client's: loop detection (loop.go).
	if via := viaEntry(x.r, g.via); len(h["Via"]) == 0 {
		vals.set(h, "Via", via)
	} else {
		h.Add("Via", via)
	}
	if key == "" && len(g.cfg.APIKeys) == 0 && len(g.cfg.Tenants) == 0 && x.r.Header.Get("Authorization") != "" {
		// No gateway keys: the client's key is meant for the replicas (its
		// scheme spelt as vLLM's --api-key check compares it).
		h.Set("Authorization", x.r.Header.Get("Authorization"))
		if tok, ok := bearer(x.r.Header); ok {
			h.Set("Authorization", "Bearer "+tok)
		}
	}
	if key == "" && len(g.cfg.APIKeys) == 0 && len(g.cfg.Tenants) == 0 && x.r.Header.Get("X-Api-Key") != "" {
		h.Set("X-Api-Key", x.r.Header.Get("X-Api-Key")) // likewise
	}
	delete(h, "Accept-Encoding")
	if k, ranked := rep.Rank(); ranked {
		h.Set(headerDataParallelRank, strconv.Itoa(k))
	}
	vals.set(h, "X-Request-Id", x.id)
	setForwarded(h, x.r, &vals)
}

// headerValues hands out one-value slices of a header's fields from one
// allocation, where Set would allocate one per field: the header of each
// request sent upstream, of each answer. Each slice's capacity is its
// length, so an Add to its field copies it instead of writing over the next.
type headerValues []string

// set sets field k (canonical) of h to v.
func (vs *headerValues) set(h http.Header, k, v string) {
	*vs = append(*vs, v)
	n := len(*vs)
	h[k] = (*vs)[n-1 : n : n]
}

// headerDataParallelRank pins a request to one data-parallel engine of a
// vLLM or SGLang server.
const headerDataParallelRank = "X-Data-Parallel-Rank"

// dropGatewayHeaders removes from a client's headers, copied upstream,
// the ones only the gateway may set there: X-Kvgate-* (its own, which a
// replica or a gateway behind it may read), Authorization (the replica's
// key, or the client's own below), X-Data-Parallel-Rank (the gateway
// picks the rank: a client's pin would bypass its accounting) and the
// headers llm-d's routing sidecar acts on (sidecarHeaders).
// X-Request-Id is set over the client's; Via is appended to.
func dropGatewayHeaders(h http.Header) {
	dropKvgateHeaders(h)
	delete(h, "Authorization") // canonical names: Del would canonicalize them again
	delete(h, "X-Api-Key")     // the Anthropic SDK's key header: a credential as Authorization is
	delete(h, headerDataParallelRank)
	for _, k := range sidecarHeaders {
		delete(h, k)
	}
}

// sidecarHeaders are the request headers llm-d's routing sidecar, in front
// of a replica, acts on (llm-d-router pkg/common/routing; its x-llm-d-
// aliases too): a host to send the prompt's prefill to, encoders, a
// data-parallel rank's host, a peer to pull the prompt's KV from and its
// P2P port. Behind kvgate only kvgate may set them: a client's would point
// a replica at any host (an SSRF through the sidecar) or bypass the
// gateway's accounting. Canonical names.
var sidecarHeaders = []string{
	"X-Prefiller-Host-Port", "X-Llm-D-Prefiller-Host-Port", "X-Prefiller-Url",
	"X-Encoder-Hosts-Ports", "X-Llm-D-Encoder-Hosts-Ports", "X-Data-Parallel-Host-Port",
	headerKVSource, "X-Llm-D-Kv-Cache-Source-Host-Port", headerKVSourcePort,
}

// dropKvgateHeaders removes the X-Kvgate-* headers from h: from a client's
// headers on their way upstream, and from a replica's response on its way
// to the client, where only this gateway names the route it took (a
// replica, or a gateway behind it, must not make a client believe another
// replica answered).
func dropKvgateHeaders(h http.Header) {
	for k := range h {
		if isKvgateHeader(k) {
			delete(h, k)
		}
	}
}

// isKvgateHeader: k is one of the headers only the gateway writes. (A
// name shorter than the prefix, or not starting with an x, is none
// whatever its case: canonicalizing keeps the length and the letter, and
// costs a scan of every name of every request and answer.)
func isKvgateHeader(k string) bool {
	if len(k) < len("X-Kvgate-") || k[0] != 'X' && k[0] != 'x' {
		return false
	}
	return strings.HasPrefix(textproto.CanonicalMIMEHeaderKey(k), "X-Kvgate-")
}

// setTarget names the target that answered: X-Kvgate-Replica (its URL)
// and, for a data-parallel rank, X-Kvgate-Rank; and the prefill replica
// whose KV it pulled, when not nil: X-Kvgate-Prefill (and
// X-Kvgate-Prefill-Rank).
func setTarget(h http.Header, r, prefill *router.Replica) {
	h.Set("X-Kvgate-Replica", r.URL())
	if k, ranked := r.Rank(); ranked {
		h.Set("X-Kvgate-Rank", strconv.Itoa(k))
	}
	if prefill == nil {
		return
	}
	h.Set(headerPrefill, prefill.URL())
	if k, ranked := prefill.Rank(); ranked {
		h.Set(headerPrefill+"-Rank", strconv.Itoa(k))
	}
}

// headerPrefill names the prefill replica of a disaggregated request.
const headerPrefill = "X-Kvgate-Prefill"

// setForwarded appends the client's address to X-Forwarded-For (as
// net/http/httputil's ReverseProxy does) and sets X-Forwarded-Proto.
func setForwarded(h http.Header, r *http.Request, vals *headerValues) {
	ip, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return
	}
	if prior := h.Values("X-Forwarded-For"); len(prior) > 0 {
		ip = strings.Join(prior, ", ") + ", " + ip
	}
	vals.set(h, "X-Forwarded-For", ip)
	if h.Get("X-Forwarded-Proto") == "" {
		proto := "http"
		if r.TLS != nil {
			proto = "https"
		}
		vals.set(h, "X-Forwarded-Proto", proto)
	}
}

// transportFailure sets the verdict of an attempt that got no response
// (transportVerdict) and answers the client when it is final.
func (g *Gateway) transportFailure(x *exchange, a *attempt, ctx context.Context, wrote bool, err error) {
	if x.upload != nil {
		if cerr := x.upload.clientErr(); cerr != nil {
			// The client's upload broke or overran max_body_bytes: its fault,
			// not the replica's.
			a.v, a.err = rejected, cerr
			g.fail(x.w, x.r, bodyError(nil, cerr))
			return
		}
	}
	a.v, a.err = transportVerdict(x, ctx, wrote, err)
	if a.v == failed || a.v == gatewayLimit {
		g.fail(x.w, x.r, upstreamError(a.err))
	}
}

// transportVerdict classifies an attempt that got no response: the client
// left, the gateway's limit, a refusal before the request was written
// (retryable), or a failure after it (never retried: the replica may have
// started, or the input may be what breaks it).
func transportVerdict(x *exchange, ctx context.Context, wrote bool, err error) (verdict, error) {
	cause := context.Cause(ctx)
	switch {
	case x.r.Context().Err() != nil:
		return clientGone, x.r.Context().Err()
	case errors.Is(cause, errRequestTimeout), errors.Is(cause, errDrained):
		return gatewayLimit, cause
	case errors.Is(cause, errFirstByteTimeout):
		return failed, cause
	case !wrote:
		return refused, err
	}
	return failed, err
}

// upstreamError is the client's error for a failed attempt: a timeout is a
// 504, anything else a 502, without the replica's address.
func upstreamError(err error) error {
	var ne net.Error
	switch {
	case errors.Is(err, errRequestTimeout):
		return errTimeout.with("the request took longer than the gateway's request_timeout")
	case errors.Is(err, errDrained):
		return errDraining
	case errors.Is(err, errFirstByteTimeout):
		return errUpstreamTO.with("the replica did not start answering in time")
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return errUpstreamTO.with("the replica did not answer in time")
	}
	return errUpstream.with("the replica failed before answering")
}

// refusalReadTimeout bounds the read of a 503 or 429 body.
const refusalReadTimeout = 2 * time.Second

// refusal reads a 503 or 429 to pass on if no other replica takes the
// request. Refused before any work: safe to send elsewhere. Its body is
// read within a short bound, so a stalled refusal cannot hold the request.
func (g *Gateway) refusal(x *exchange, a *attempt, cancel context.CancelCauseFunc, resp *http.Response) {
	t := g.clock.AfterFunc(refusalReadTimeout, func() { cancel(errIdleTimeout) })
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	t.Stop()
	switch resp.StatusCode {
	case http.StatusServiceUnavailable:
		a.v = refused
	case http.StatusNotFound:
		a.v, a.notHere = rejected, true // a lookup: the replica does not hold the response
	default:
		a.v = busy
	}
	a.err = fmt.Errorf("replica answered %s", resp.Status)
	a.refusal = &bufferedResponse{status: resp.StatusCode, header: resp.Header.Clone(), body: b,
		replica: g.rt.Replica(a.tk.Replica), prefill: a.prefill, id: x.id}
}

// bufferedResponse is an upstream refusal (or a lookup's 404) kept to pass
// on if no retry works.
type bufferedResponse struct {
	status  int
	header  http.Header
	body    []byte
	replica *router.Replica
	prefill *router.Replica // X-Kvgate-Prefill, when not nil
	id      string
}

func (b *bufferedResponse) write(w http.ResponseWriter) {
	dropKvgateHeaders(b.header)
	copyHeaders(w.Header(), b.header)
	setTarget(w.Header(), b.replica, b.prefill)
	w.Header().Set("X-Request-Id", b.id)
	w.Header().Del("Content-Length")
	if w.Header().Get("Retry-After") == "" && b.status != http.StatusNotFound {
		w.Header().Set("Retry-After", "1") // a refusal the client may retry: say when
	}
	w.WriteHeader(b.status)
	_, _ = w.Write(b.body)
}
