package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// Prefill/decode disaggregation, on vLLM's wire as its disaggregation
// proxies speak it (vLLM's toy_proxy_server.py for the NixlConnector,
// llm-d's routing sidecar):
//
//  1. the prefill step: the client's request, not streamed, with max_tokens
//     1 and kv_transfer_params asking for a remote decode, to a prefill
//     replica, which computes the prompt, holds its KV and answers with the
//     kv_transfer_params naming it;
//  2. the decode step: the client's request as it came, with those
//     kv_transfer_params, to a decode replica, which pulls the KV it lacks
//     and generates; its answer is relayed as any other (relay.go).
//
// router.RoutePD picks both replicas, or only the decode replica when it
// lacks fewer than non_cached_tokens of the prompt (llm-d's rule), when a
// replica of role both serves the request whole, or when no prefill
// replica can take it.
//
// Failures. A prefill step that fails before the decode step starts (a
// refusal, a 5xx, a broken connection, a timeout) is retried on another
// prefill replica within retries and retry_backoff, as any refusal is;
// when no retry is left the decode replica computes the prompt itself, as
// it does when no prefill replica is healthy, so that a prefill pool in
// trouble degrades to aggregated serving instead of failing requests.
// (vLLM's toy proxy and llm-d's sidecar do neither: the client gets the
// prefill replica's error.) A prefill step answered without
// kv_transfer_params (a replica that is not a KV producer) counts against
// its replica and the decode replica computes the prompt, as llm-d's
// sidecar does. A 4xx of the prefill step is the client's fault: it is the
// client's answer and counts against no replica. Once the decode step has
// started nothing is retried; a decode step refused before it started
// (503, 429, connection refused) goes to another decode replica with the
// completed prefill's kv_transfer_params (exchange.held): the prefill
// replica still holds the prompt's KV, since no decode replica pulled it,
// and computing it again would cost a second prefill. When no decode
// replica can take it, the held KV is released (forgotten: vLLM has no
// call to free it sooner; the prefill replica frees it after its
// VLLM_NIXL_ABORT_REQUEST_TIMEOUT) and the request routed again, both
// steps. A decode step routed without a prefill step that is refused
// routes the request again, both steps.

// routePDAttempt routes the exchange to a prefill/decode pair (less the
// replicas already tried) and runs its steps: the prefill step when there
// is one, then the decode step, which answers the client. It returns the
// attempt that ends this try: a prefill step that failed (retryable: the
// next try goes to another prefill replica) or answered the client (a
// 4xx), or the decode step. last: no retry is left, so that a failed
// prefill step makes the decode replica compute the prompt instead.
func (g *Gateway) routePDAttempt(x *exchange, last bool) (*attempt, error) {
	if x.held != nil {
		if a, err := g.heldDecodeAttempt(x); a != nil || err != nil {
			return a, err
		}
	}
	pd, err := g.routePD(x)
	if err != nil {
		return nil, err
	}
	dec := &attempt{tk: pd.Decode, cached: -1, step: stepDecode, prefillCached: -1}
	if !g.allow(dec) {
		// Asked first: a prefill step for a decode replica that cannot take it would be wasted.
		if pd.Prefill != nil {
			endUnsent(g, pd.Prefill, errBreaker)
		}
		g.settle(x, dec)
		return dec, nil
	}
	var held *heldKV
	if pd.Prefill != nil {
		p, err := g.prefillStep(x, pd.Prefill)
		if err != nil {
			endUnsent(g, dec.tk, err)
			return nil, err
		}
		kv, end := g.afterPrefill(x, p, last)
		if end {
			endUnsent(g, dec.tk, p.err)
			return p, nil
		}
		if kv != nil {
			dec.prefill, dec.prefillCached = p.prefill, p.cached
			held = &heldKV{kv: kv, id: p.kvID, slot: pd.Prefill.Replica, replica: p.prefill, cached: p.cached}
		}
	}
	return g.decodeStep(x, dec, held)
}

// heldKV is a completed prefill step's KV, held by its replica for a
// decode replica to pull: the kv_transfer_params of its answer.
type heldKV struct {
	kv      []byte
	id      string          // the prefill step's request id (kvTransferID): the decode step's too
	slot    int             // the prefill replica's slot
	replica *router.Replica // the prefill replica (X-Kvgate-Prefill)
	cached  int             // the prompt tokens the prefill replica reported cached (-1: none)
}

// heldDecodeAttempt routes and sends the decode step of a request whose
// prefill step completed and whose last decode step was refused before it
// started: to another decode replica, pulling the same held KV. nil, nil:
// no decode replica can take it; the held KV is released, and the caller
// routes both steps again.
func (g *Gateway) heldDecodeAttempt(x *exchange) (*attempt, error) {
	x.req.Now = g.clock.Now()
	span := g.startSpan(x.ctx, "kvgate.route")
	tk, err := g.rt.RouteDecode(x.req, x.held.slot, x.exclude...)
	g.traceRoute(span, x, tk, nil, err)
	if errors.Is(err, policy.ErrNoReplica) {
		g.releaseHeld(x)
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	g.met.prefillHeldKV.WithLabelValues("reused").Inc()
	x.logger().Debug("decode step routed again with the completed prefill's KV", "decode", g.rt.Name(tk.Replica),
		"prefill", x.held.replica.Name())
	dec := &attempt{tk: tk, cached: -1, step: stepDecode, prefill: x.held.replica, prefillCached: x.held.cached}
	if !g.allow(dec) {
		g.settle(x, dec)
		return dec, nil
	}
	return g.decodeStep(x, dec, x.held)
}

// decodeStep sends the decode step dec, pulling held's KV (nil: the
// decode replica computes the prompt), and settles it. The held KV is kept
// for the next try when dec was refused before it started, and else
// dropped (taken, or the exchange ends).
func (g *Gateway) decodeStep(x *exchange, dec *attempt, held *heldKV) (*attempt, error) {
	var kv []byte
	if held != nil {
		kv, dec.kvID = held.kv, held.id
	}
	var err error
	if dec.body, err = decodeBody(x.body, kv); err != nil {
		endUnsent(g, dec.tk, err)
		return nil, &prompt.RequestError{Msg: err.Error()}
	}
	g.try(x, dec)
	g.settle(x, dec)
	if dec.refusal != nil {
		x.refusal = dec.refusal
	}
	x.held = nil
	if held != nil && dec.retryable() {
		x.held = held
	}
	return dec, nil
}

// releaseHeld forgets the exchange's held KV that no decode replica took
// (every retry refused, none left, the client gone): the gateway cannot
// free it on the prefill replica (vLLM has no call for it), which frees
// it after its hold timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s by
// default); counted, so that an operator sees prefill capacity held.
func (g *Gateway) releaseHeld(x *exchange) {
	if x.held == nil {
		return
	}
	g.met.prefillHeldKV.WithLabelValues("released").Inc()
	x.logger().Debug("no decode replica took a completed prefill's KV: released", "prefill", x.held.replica.Name())
	x.held = nil
}

// routePD routes the exchange to a pair, with the routing metrics: through
// its pool's queue with flow control on (router.SubmitPD: held while the
// replicas computing prompts are saturated, released in the queue's
// order, or shed: 429), as route does an aggregated request.
func (g *Gateway) routePD(x *exchange) (router.PD, error) {
	t0 := g.clock.Now()
	x.req.Now = t0
	span := g.startSpan(x.ctx, "kvgate.route")
	pd, w, err := g.rt.SubmitPD(x.req, x.exclude...)
	first := len(x.exclude) == 0
	if first {
		g.met.decision.Observe(g.clock.Since(t0).Seconds())
	}
	if w != nil {
		if _, err = g.waitInQueue(x, w); err == nil {
			pd, err = w.PD()
		}
	}
	g.traceRoute(span, x, pd.Decode, pd.Prefill, err)
	if err != nil {
		if g.ten != nil {
			g.ten.noteShed(x, err)
		}
		return pd, err
	}
	// The match that counts is the one of the replica computing the prompt.
	tk := pd.Decode
	if pd.Prefill != nil {
		tk = pd.Prefill
	}
	if n := len(x.req.Blocks); n > 0 && first {
		g.met.matchRatio.Observe(float64(tk.Decision.Matched) / float64(n))
	}
	if why := router.SkipReason(pd.Decision); why != "" {
		g.met.prefillSkipped.WithLabelValues(why).Inc()
	}
	if pd.Prefill != nil {
		x.logger().Debug("routed to a prefill/decode pair", "prefill", g.rt.Name(pd.Prefill.Replica),
			"decode", g.rt.Name(pd.Decode.Replica), "reason", pd.Decision.Reason)
	} else {
		x.logger().Debug("routed to a decode replica alone", "decode", g.rt.Name(pd.Decode.Replica), "reason", pd.Decision.Reason)
	}
	return pd, nil
}

// endUnsent ends a ticket whose step was never sent: its replica never
// took the request, and its breaker hears nothing of it (a decode step's
// pass, already taken, is given back: HealthNeutral).
func endUnsent(g *Gateway, tk *router.Ticket, err error) {
	if err == nil {
		err = errors.New("the request's other step failed")
	}
	tk.Reject()
	tk.Done(g.clock.Now(), router.Outcome{CachedTokens: -1, Err: err})
}

// afterPrefill decides what follows prefill step p: the decode step
// pulling its KV (kv), the decode step computing the prompt itself (kv
// nil: a fallback), or nothing (end): p ends this try, final or retried.
func (g *Gateway) afterPrefill(x *exchange, p *attempt, last bool) (kv []byte, end bool) {
	var why string
	switch {
	case p.v == served && p.kv != nil:
		return p.kv, false
	case p.v == served:
		why = "prefill_stopped"
	case p.noKV:
		why = "no_kv_transfer_params"
	case p.retryable() && last && p.v != skipped:
		why = "prefill_failed"
		x.logger().Info("prefill step failed and no retry is left: the decode replica computes the prompt",
			"replica", g.rt.Name(p.tk.Replica), "verdict", p.v.String(), "err", p.err)
	default:
		return nil, true
	}
	g.met.prefillFallback.WithLabelValues(why).Inc()
	return nil, false
}

// prefillStep sends the prefill step to tk's replica and settles it. The
// attempt's verdict: served (its kv_transfer_params in attempt.kv, or none
// when generation stopped at the first token), failed (attempt.noKV: it
// answered 2xx without kv_transfer_params), refused, busy, failed or
// skipped (the step may go elsewhere), or final for the exchange: rejected
// (a 4xx, relayed as the client's answer), clientGone, gatewayLimit (the
// client has its error). An error: the body could not be rewritten.
func (g *Gateway) prefillStep(x *exchange, tk *router.Ticket) (*attempt, error) {
	a := &attempt{tk: tk, cached: -1, step: stepPrefill, prefill: g.rt.Replica(tk.Replica), kvID: kvTransferID(x)}
	if x.prefillBody == nil {
		body, err := prefillBody(x.body)
		if err != nil {
			endUnsent(g, tk, err)
			return nil, &prompt.RequestError{Msg: err.Error()}
		}
		x.prefillBody = body
	}
	if g.allow(a) {
		a.body = x.prefillBody
		g.sendPrefill(x, a)
	}
	if a.v == gatewayLimit && !a.started {
		g.fail(x.w, x.r, upstreamError(a.err))
	}
	g.settle(x, a)
	if a.v == served || a.noKV {
		g.met.prefillStep.Observe(a.took.Seconds())
	}
	if a.noKV {
		g.logOnce(tk.Replica, "no_kv_transfer_params", slog.LevelWarn, "a prefill replica answered without "+
			"kv_transfer_params: it is not a KV producer (start vLLM with --kv-transfer-config "+
			`'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}', or kv_both), or give it role both; `+
			"meanwhile the decode replicas compute the prompts themselves (logged once per replica)")
	}
	if a.refusal != nil {
		x.refusal = a.refusal
	}
	return a, nil
}

// sendPrefill sends a prefill step and reads its answer, within
// first_byte_timeout: the prefill's answer is what the decode step, and
// so the client's first byte, waits for, and a replica that hangs must
// not hold the request until request_timeout (it counts as failed, and
// the step is retried elsewhere).
func (g *Gateway) sendPrefill(x *exchange, a *attempt) {
	ctx, cancel := context.WithCancelCause(x.ctx)
	defer cancel(context.Canceled)
	ctx = g.traceAttempt(ctx, x, a) // its span ends in settle (the tracing sink)
	t0 := g.clock.Now()
	defer func() { a.took = g.clock.Since(t0) }()
	if d := g.conf().FirstByteTimeout.D(); d > 0 {
		t := g.clock.AfterFunc(d, func() { cancel(errFirstByteTimeout) })
		defer t.Stop()
	}
	up, call := g.upstreamRequest(ctx, x, a)
	resp, err := g.proxy.RoundTrip(up)
	if err != nil {
		a.v, a.err = transportVerdict(x, ctx, call.wrote.Load(), err)
		return
	}
	defer resp.Body.Close()
	a.status = resp.StatusCode
	switch s := resp.StatusCode; {
	case s == http.StatusServiceUnavailable || s == http.StatusTooManyRequests:
		g.refusal(x, a, cancel, resp)
	case s >= 400 && s < 500:
		g.relay(x, a, ctx, cancel, resp) // the client's fault: its answer
	case s < 200 || s >= 300:
		a.v, a.err = failed, fmt.Errorf("the prefill replica answered %s", resp.Status)
	default:
		g.readPrefill(x, a, ctx, resp.Body)
	}
}

// errNoKVParams: a prefill step answered without kv_transfer_params.
var errNoKVParams = errors.New("the prefill replica answered without kv_transfer_params: it is not a KV producer")

// prefillAnswer is what the gateway reads of a prefill step's answer.
type prefillAnswer struct {
	KV      json.RawMessage `json:"kv_transfer_params"`
	Choices []struct {
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *openai.Usage `json:"usage"`
}

// stopped reports whether generation ended at the first token for another
// reason than max_tokens (an end-of-sequence token, a stop string): vLLM's
// NixlConnector then holds nothing for a decode replica (its
// request_finished sends kv_transfer_params only for a request capped by
// its length).
func (p *prefillAnswer) stopped() bool {
	return len(p.Choices) > 0 && p.Choices[0].FinishReason != nil && *p.Choices[0].FinishReason != "length"
}

// readPrefill reads a prefill step's 2xx answer (bounded) and sets the
// attempt's verdict, usage and kv_transfer_params.
func (g *Gateway) readPrefill(x *exchange, a *attempt, ctx context.Context, body io.Reader) {
	limit := 4 * g.cfg.MaxBodyBytes
	data, err := io.ReadAll(io.LimitReader(body, limit+1))
	var ans prefillAnswer
	switch {
	case err != nil && x.r.Context().Err() != nil:
		a.v, a.err = clientGone, x.r.Context().Err()
		return
	case err != nil:
		a.v, a.err = g.brokenVerdict(ctx, err)
		return
	case int64(len(data)) > limit:
		a.v, a.err = failed, fmt.Errorf("the prefill replica's answer is longer than %d bytes", limit)
		return
	case json.Unmarshal(data, &ans) != nil:
		a.v, a.err = failed, errors.New("the prefill replica's answer is not a JSON object")
		return
	}
	a.tk.Accept()
	if ans.Usage != nil {
		a.cached, _, a.output = boundedUsage(ans.Usage)
	}
	switch kv := bytes.TrimSpace(ans.KV); {
	case len(kv) > 0 && kv[0] == '{':
		a.v, a.kv = served, kv
	case ans.stopped():
		a.v = served
	default:
		a.v, a.noKV, a.err = failed, true, errNoKVParams
	}
}
