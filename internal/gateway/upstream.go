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
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/router"
)

// try sends the exchange to the ticket's replica and relays the answer. It
// returns the attempt with its verdict; for a final verdict the client has
// its answer (the replica's, or the gateway's error), for a retryable one
// nothing was written to the client.
func (g *Gateway) try(x *exchange, tk *router.Ticket) *attempt {
	a := &attempt{tk: tk, cached: -1}
	ok, pass := g.fleet.Allow(tk.Replica)
	if !ok {
		a.v, a.err = skipped, errBreaker
		return a
	}
	a.pass = pass
	ctx, cancel := context.WithCancelCause(x.ctx)
	defer cancel(context.Canceled)
	var firstByte clock.Timer
	up, wrote := g.upstreamRequest(ctx, x, tk.Replica, func() {
		if firstByte != nil {
			firstByte.Stop()
		}
	})
	if !x.parsed.Stream {
		// A non-streamed answer shows no first token: once the replica has
		// surely run the prefill, it leaves the queue the policies see, and
		// the replica has taken the request (vLLM rejects at once).
		t := g.clock.AfterFunc(g.prefillBound(tk), func() { tk.PrefillDone(); tk.Accept() })
		defer t.Stop()
	} else if d := g.cfg.FirstByteTimeout.D(); d > 0 {
		// Streamed answers start at once (vLLM sends the header when it
		// admits the request): a replica silent this long is stuck.
		firstByte = g.clock.AfterFunc(d, func() { cancel(errFirstByteTimeout) })
		defer firstByte.Stop()
	}
	resp, err := g.client.Do(up)
	if err != nil {
		g.transportFailure(x, a, ctx, wrote.Load(), err)
		return a
	}
	defer resp.Body.Close()
	a.status = resp.StatusCode
	if resp.StatusCode == http.StatusServiceUnavailable || resp.StatusCode == http.StatusTooManyRequests {
		// Refused before any work: safe to send elsewhere. Its body is read
		// within a short bound, so a stalled refusal cannot hold the request.
		t := g.clock.AfterFunc(refusalReadTimeout, func() { cancel(errIdleTimeout) })
		g.refusal(x, a, resp)
		t.Stop()
		return a
	}
	if resp.StatusCode < 400 {
		tk.Accept()
	}
	g.relay(x, a, ctx, cancel, resp)
	return a
}

// upstreamRequest builds the request to replica i; wrote turns true once
// the whole request has been written to the replica, and gotHeader runs
// when the response's first byte arrives.
func (g *Gateway) upstreamRequest(ctx context.Context, x *exchange, i int, gotHeader func()) (*http.Request, *atomic.Bool) {
	wrote := new(atomic.Bool)
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		WroteRequest: func(info httptrace.WroteRequestInfo) {
			if info.Err == nil {
				wrote.Store(true)
			}
		},
		GotFirstResponseByte: gotHeader,
	})
	rep := g.rt.Replica(i)
	up, _ := http.NewRequestWithContext(ctx, http.MethodPost, rep.URL()+x.r.URL.Path, bytes.NewReader(x.body))
	up.URL.RawQuery = x.r.URL.RawQuery
	copyHeaders(up.Header, x.r.Header)
	up.Header.Del("Authorization")
	if k := rep.APIKey(); k != "" {
		up.Header.Set("Authorization", "Bearer "+k)
	} else if len(g.cfg.APIKeys) == 0 && x.r.Header.Get("Authorization") != "" {
		// No gateway keys: the client's key is meant for the replicas.
		up.Header.Set("Authorization", x.r.Header.Get("Authorization"))
	}
	up.Header.Del("Accept-Encoding")
	// The gateway picks the rank: a client's pin would bypass its accounting.
	up.Header.Del(headerDataParallelRank)
	if k, ranked := rep.Rank(); ranked {
		up.Header.Set(headerDataParallelRank, strconv.Itoa(k))
	}
	up.Header.Set("X-Request-Id", x.id)
	setForwarded(up.Header, x.r)
	up.ContentLength = int64(len(x.body))
	return up, wrote
}

// headerDataParallelRank pins a request to one data-parallel engine of a
// vLLM or SGLang server.
const headerDataParallelRank = "X-Data-Parallel-Rank"

// setTarget names the target that answered: X-Kvgate-Replica (its URL)
// and, for a data-parallel rank, X-Kvgate-Rank.
func setTarget(h http.Header, r *router.Replica) {
	h.Set("X-Kvgate-Replica", r.URL())
	if k, ranked := r.Rank(); ranked {
		h.Set("X-Kvgate-Rank", strconv.Itoa(k))
	}
}

// setForwarded appends the client's address to X-Forwarded-For (as
// net/http/httputil's ReverseProxy does) and sets X-Forwarded-Proto.
func setForwarded(h http.Header, r *http.Request) {
	ip, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return
	}
	if prior := h.Values("X-Forwarded-For"); len(prior) > 0 {
		ip = strings.Join(prior, ", ") + ", " + ip
	}
	h.Set("X-Forwarded-For", ip)
	if h.Get("X-Forwarded-Proto") == "" {
		proto := "http"
		if r.TLS != nil {
			proto = "https"
		}
		h.Set("X-Forwarded-Proto", proto)
	}
}

// transportFailure classifies an attempt that got no response: the client
// left, the gateway's limit, a refusal before the request was written
// (retryable), or a failure after it (never retried: the replica may have
// started, or the input may be what breaks it).
func (g *Gateway) transportFailure(x *exchange, a *attempt, ctx context.Context, wrote bool, err error) {
	cause := context.Cause(ctx)
	switch {
	case x.r.Context().Err() != nil:
		a.v, a.err = clientGone, x.r.Context().Err()
		return
	case errors.Is(cause, errRequestTimeout), errors.Is(cause, errDrained):
		a.v, a.err = gatewayLimit, cause
	case errors.Is(cause, errFirstByteTimeout):
		a.v, a.err = failed, cause
	case !wrote:
		a.v, a.err = refused, err
		return
	default:
		a.v, a.err = failed, err
	}
	g.fail(x.w, x.r, upstreamError(a.err))
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

// refusal reads a 503 or 429 (bounded) to pass on if no other replica
// takes the request.
func (g *Gateway) refusal(x *exchange, a *attempt, resp *http.Response) {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	a.v = busy
	if resp.StatusCode == http.StatusServiceUnavailable {
		a.v = refused
	}
	a.err = fmt.Errorf("replica answered %s", resp.Status)
	a.refusal = &bufferedResponse{status: resp.StatusCode, header: resp.Header.Clone(), body: b,
		replica: g.rt.Replica(a.tk.Replica), id: x.id}
}

// bufferedResponse is an upstream refusal kept to pass on if no retry works.
type bufferedResponse struct {
	status  int
	header  http.Header
	body    []byte
	replica *router.Replica
	id      string
}

func (b *bufferedResponse) write(w http.ResponseWriter) {
	copyHeaders(w.Header(), b.header)
	setTarget(w.Header(), b.replica)
	w.Header().Set("X-Request-Id", b.id)
	w.Header().Del("Content-Length")
	if w.Header().Get("Retry-After") == "" {
		w.Header().Set("Retry-After", "1") // a refusal the client may retry: say when
	}
	w.WriteHeader(b.status)
	_, _ = w.Write(b.body)
}
