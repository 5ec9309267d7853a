package replay

import (
	"fmt"
	"time"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// Prefill/decode fleets (Config.PrefillReplicas, DecodeReplicas), played
// as the gateway plays them (internal/gateway/pd.go) and as vLLM's
// NixlConnector serves them (internal/engine/transfer.go):
//
//  1. the router picks a pair with router.RoutePD, the gateway's code;
//  2. the prefill step: the request with max_tokens 1 and remote decode on
//     the prefill engine, which computes the prompt and holds its blocks;
//  3. when it finishes (the prefill answer reaches the gateway), the decode
//     step: the request on the decode engine with remote prefill, which
//     pulls the blocks its own cache lacks over its link (the profile's
//     bandwidth and latency), recomputes the last prompt token and
//     generates; each pull releases the prefill engine's hold, as NIXL's
//     notification does;
//  4. when RoutePD skips the prefill step (the decode replica lacks fewer
//     than NonCachedTokens of the prompt, or an aggregated replica serves
//     the request), the decode engine computes what it lacks itself.
//
// A request's TTFT runs from its arrival to the decode step's first token;
// its cached tokens are the prompt tokens no engine computed: the prefill
// engine's hit when there was a prefill step (the decode engine's usage,
// which counts pulled tokens as cached, would make every request a hit),
// else the decode engine's.

// Request stages.
const (
	stageOne     uint8 = iota // the only step, or the decode step
	stagePrefill              // the prefill step
)

// pdStats is what a run's prefill/decode steps did.
type pdStats struct {
	steps    int            // prefill steps
	skipped  map[string]int // requests without one, by router.SkipReason
	pulls    int
	pulled   int64         // prompt tokens pulled
	wire     time.Duration // summed transfer times (posting to done)
	fallback int           // prefill steps whose KV was not held: computed again
	expired  int           // holds ended by the engines' timeout, not a pull
}

// policyRole is an engine role as the router knows it.
func policyRole(r engine.Role) policy.Role {
	switch r {
	case engine.RolePrefill:
		return policy.RolePrefill
	case engine.RoleDecode:
		return policy.RoleDecode
	}
	return policy.RoleBoth
}

// dispatchPD hands request i, routed to a pair, to its first engine: the
// prefill engine, or the decode engine when there is no prefill step.
func (vr *virtualRun) dispatchPD(i int, text string, pd router.PD, err error) error {
	if err != nil {
		return vr.unrouted(i, err)
	}
	if pd.Prefill == nil {
		if vr.pd.skipped == nil {
			vr.pd.skipped = map[string]int{}
		}
		vr.pd.skipped[router.SkipReason(pd.Decision)]++
		return vr.dispatch(i, text, pd.Decode, nil)
	}
	vr.pd.steps++
	st := vr.requests[i]
	st.ticket, st.prefill = pd.Decode, pd.Prefill
	st.prefillAt, st.stage = int32(pd.Prefill.Replica), stagePrefill
	vr.loadsChanged(st.gw)
	er := vr.engineRequest(i, text)
	er.MaxTokens, er.RemoteDecode = 1, true
	return vr.submit(i, pd.Prefill.Replica, &er)
}

// prefillOutput is an output of request i's prefill step: when it
// finishes, the prefill answer reaches the gateway, which sends the decode
// step at once.
func (vr *virtualRun) prefillOutput(i int, o engine.Output, at time.Time) error {
	st := vr.requests[i]
	if o.First {
		st.prefillHit = o.CachedTokens
		st.prefill.FirstToken(at)
	}
	if !o.Finished {
		return nil
	}
	st.prefill.Done(at, router.Outcome{CachedTokens: st.prefillHit, OutputTokens: 1})
	st.stage = stageOne
	vr.loadsChanged(st.gw)
	er := engine.Request{
		ID:            o.ReqID,
		PromptTokens:  st.tokens,
		BlockHashes:   st.hashes,
		MaxTokens:     max(vr.plan.reqs[i].MaxTokens, 1),
		RemotePrefill: o.Held,
	}
	if !o.Held {
		// No KV to pull (vLLM's proxies then let the decode replica
		// compute the prompt): counted, not expected of the engine model.
		vr.pd.fallback++
		st.prefill = nil
	}
	er.TokenIDs = st.ids
	if err := vr.submit(i, st.ticket.Replica, &er); err != nil {
		return fmt.Errorf("decode step: %w", err)
	}
	return nil
}

// pulled handles the transfers that ended: each releases the hold of its
// request's prefill engine (the blocks stay cached there), which may let
// that engine admit a waiting request.
func (vr *virtualRun) pulled(pulls []engine.Pull) {
	for _, p := range pulls {
		st := vr.requests[p.ReqID-1]
		st.transferred = p.Tokens
		vr.pd.pulls++
		vr.pd.pulled += int64(p.Tokens)
		vr.pd.wire += p.End - p.Start
		if st.prefill == nil {
			continue
		}
		e := int(st.prefillAt)
		if vr.replicas[e].engine.Release(p.ReqID) && !vr.replicas[e].stepping && vr.replicas[e].engine.HasWork() {
			vr.queueStep(e)
		}
	}
}

// computedHit is a finished request's cached tokens for the report: the
// prompt tokens no engine computed.
func (vr *virtualRun) computedHit(st *liveRequest) int {
	if st.prefill != nil {
		return st.prefillHit
	}
	return st.cached
}

// pdSummary adds the prefill/decode figures to a run's extras.
func (vr *virtualRun) pdSummary(extra map[string]float64) {
	if !vr.cfg.disaggregated() {
		return
	}
	s := &vr.pd
	extra["pd_prefill_steps"] = float64(s.steps)
	for why, n := range s.skipped {
		extra["pd_skipped_"+why] = float64(n)
	}
	if s.pulls > 0 {
		extra["pd_pulled_tokens_mean"] = float64(s.pulled) / float64(s.pulls)
		extra["pd_transfer_ms_mean"] = s.wire.Seconds() * 1000 / float64(s.pulls)
	}
	if s.fallback > 0 {
		extra["pd_fallbacks"] = float64(s.fallback)
	}
	if s.expired > 0 {
		extra["pd_holds_expired"] = float64(s.expired)
	}
}
