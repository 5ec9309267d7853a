package router

import (
	"fmt"
	"slices"

	"github.com/kvgate/kvgate/internal/policy"
)

// Prefill/decode disaggregation, routed as vLLM's disaggregation proxies
// and llm-d's pd-profile-handler route it: a request goes first to a
// prefill replica (max_tokens 1, kv_transfer_params do_remote_decode),
// which computes the prompt and holds its KV; then to a decode replica
// (do_remote_prefill), which pulls the part of the prompt it lacks and
// streams the answer. RoutePD picks both replicas at once and commits a
// ticket for each step.

// PD is a request routed to a prefill and a decode replica.
type PD struct {
	// Prefill is the prefill step's ticket, nil when the step is skipped.
	// Its Request is a copy of the request with an ID of its own and
	// MaxTokens 1. It counts like any ticket on its replica: in flight, its
	// uncached prompt pending, until the caller ends it with Done when the
	// prefill response arrives (Accept it first under ConfirmOnAccept).
	Prefill *Ticket
	// Decode is the decode step's ticket, in flight on its replica until
	// the stream ends (FirstToken, Done as for Route's tickets). With a
	// prefill step (PhaseDecode) its pending prefill is the last prompt
	// token (the one the decode replica recomputes) and the part of the
	// prompt it lacks is pending transfer (ReplicaView.PendingTransfer);
	// without one (PhaseNone) it is an ordinary ticket: its replica
	// computes what it lacks.
	Decode *Ticket
	// Decision is the pair the policy chose (Decision.Decode.EstTTFT: the
	// whole path's, for ttft).
	Decision policy.PairDecision
}

// RoutePD decides a prefill and a decode replica for req and commits both
// steps: each replica's counters go up, the approximate index learns the
// prompt on both (the prefill replica's cache keeps its blocks; the blocks
// the decode replica pulls enter its cache), OnLearn fires for both, and
// observers hear Routed for each (policy.Event.Phase), prefill first.
//
// Candidates are the healthy replicas serving req's model, less exclude
// (both sides: a prefill replica that failed before the decode step
// started is excluded when the caller routes the request again):
// prefill-side those of role prefill or both, decode-side decode or both.
// A policy implementing policy.PairPicker picks the pair; any other picks
// the decode replica by its Pick over the decode side's views (the others
// Healthy false), skips the prefill step when that replica lacks fewer
// than Config.NonCachedTokens tokens of the prompt, and else picks the
// prefill replica by its Pick over the prefill side's views. The same
// replica (of role both) on both sides serves the request aggregated:
// no prefill step, reason "aggregated". With no prefill candidate the
// request goes to the decode replica alone; with no decode candidate,
// policy.ErrNoReplica. RoutePD never defers (the policies are asked with
// Request.NoDefer) and sets req.SkipPrefillBelow; SubmitPD routes a pair
// through its pool's queue and flow controller.
//
// A prefill step that fails before the decode step starts: Reject the
// decode ticket (its replica never got the blocks), end both with Done and
// the error, and route again with the prefill replica excluded.
func (rt *Router) RoutePD(req *policy.Request, exclude ...int) (PD, error) {
	var out PD
	_, err := rt.routePair(req, exclude, nil, &out)
	return out, err
}

// routePair is RoutePD into out, through the flow controller of q when q
// has one (q's mutex held), as routeWith is RouteWith: the pool is held
// while the replicas that would compute the prompt are saturated
// (pickPairGated), a pair whose estimated first token (the decode step's
// EstTTFT: the whole path's) comes after the request's deadline is shed,
// and the request's GPU work is charged to its tenant on the decode
// ticket, which lives until the stream ends. It returns out.Decode.
func (rt *Router) routePair(req *policy.Request, exclude []int, q *queue, out *PD) (*Ticket, error) {
	vb := rt.getBuf()
	defer rt.putBuf(vb)
	views, approx := rt.views(req, vb)
	pl, err := rt.candidates(req, views, exclude)
	if err != nil {
		return nil, err
	}
	var fl *flow
	if q != nil {
		fl = q.fl
	}
	pol := pl.pol.Load().pol
	var pd policy.PairDecision
	if fl != nil && !req.NoDefer {
		pd, err = rt.pickPairGated(pl, fl, pol, req, views)
	} else {
		pd, err = rt.pickPair(pol, req, views)
	}
	if err != nil {
		return nil, err
	}
	if fl != nil {
		if err := fl.feasible(req, pd.Decode); err != nil {
			return nil, err
		}
	}
	*out = PD{Decision: pd}
	phase := policy.PhaseNone
	if !pd.SkipPrefill {
		preq := *req
		preq.ID, preq.MaxTokens = rt.nextID.Add(1), 1
		out.Prefill = rt.commitView(pol, &preq, pd.Prefill, views, approx, policy.PhasePrefill)
		phase = policy.PhaseDecode
	}
	out.Decode = rt.commitView(pol, req, pd.Decode, views, approx, phase)
	if fl != nil {
		computed := out.Decode // the replica that computes the prompt
		if out.Prefill != nil {
			computed = out.Prefill
		}
		out.Decode.fq = q
		fl.charge(out.Decode, fl.tenant(req.Tenant), computed.uncached)
	}
	return out.Decode, nil
}

// RouteDecode routes only the decode step of req, whose prefill step has
// completed on replica slot prefill, which holds the prompt's KV (vLLM's
// NixlConnector frees it once a decode replica has pulled it, or after its
// VLLM_NIXL_ABORT_REQUEST_TIMEOUT): a decode step refused before it started
// goes to another decode replica with the same kv_transfer_params, instead
// of running the prefill again on a new pair. Candidates are the decode
// side's, less exclude and the prefill replica itself (a replica of role
// both would be asked to pull from itself); each acts as a decode replica
// (the policy's Pick over them, as RoutePD picks a decode replica with no
// prefill candidate). The ticket is a decode step's (PhaseDecode: it pulls
// what it lacks). policy.ErrNoReplica: no decode replica can take the KV.
func (rt *Router) RouteDecode(req *policy.Request, prefill int, exclude ...int) (*Ticket, error) {
	vb := rt.getBuf()
	defer rt.putBuf(vb)
	views, approx := rt.views(req, vb)
	pl, err := rt.candidates(req, views, append(slices.Clone(exclude), prefill))
	if err != nil {
		return nil, err
	}
	for i := range views {
		v := &views[i]
		v.Healthy = v.Healthy && v.Role.Decodes()
		v.Role = policy.RoleDecode // this step only decodes: no prefill side
	}
	pol := pl.pol.Load().pol
	pd, err := rt.pickPair(pol, req, views)
	if err != nil {
		return nil, err
	}
	pd.Decode.Reason = "decode step only, pulling a completed prefill's KV: " + pd.Decode.Reason
	return rt.commitView(pol, req, pd.Decode, views, approx, policy.PhaseDecode), nil
}

// DryRunPD is RoutePD's decision for req without sending anything or
// learning, and the views it was made on.
func (rt *Router) DryRunPD(req *policy.Request) (policy.PairDecision, []policy.ReplicaView, error) {
	views := rt.Views(req)
	pl, err := rt.candidates(req, views, nil)
	if err != nil {
		return policy.PairDecision{}, views, err
	}
	pd, err := rt.pickPair(pl.pol.Load().pol, req, views)
	return pd, views, err
}

// Disaggregated reports whether some replica has a role other than both:
// a fleet to route with RoutePD.
func (rt *Router) Disaggregated() bool {
	for _, r := range rt.reps() {
		if !r.removed.Load() && r.sp().Role != policy.RoleBoth {
			return true
		}
	}
	return false
}

// Why a request has no prefill step (SkipReason).
const (
	// SkipThreshold: the decode replica lacks fewer prompt tokens than the
	// threshold (Config.NonCachedTokens, or the policy's own rule).
	SkipThreshold = "threshold"
	// SkipAggregated: one replica of role both serves the whole request.
	SkipAggregated = "aggregated"
	// SkipNoPrefill: no prefill replica was a candidate (none healthy, or
	// all excluded after failures).
	SkipNoPrefill = "no_prefill_replica"
)

const reasonNoPrefill = "no prefill replica available: the decode replica computes the prompt"

// SkipReason says why pd has no prefill step: SkipThreshold,
// SkipAggregated or SkipNoPrefill; "" when it has one.
func SkipReason(pd policy.PairDecision) string {
	switch {
	case !pd.SkipPrefill:
		return ""
	case pd.Reason == reasonNoPrefill:
		return SkipNoPrefill
	case pd.Reason == "aggregated": // policy.Pair's and the ttft policy's reason
		return SkipAggregated
	}
	return SkipThreshold
}

// pickPair asks pol (the policy of the request's pool) for a pair among
// views (the candidates Healthy) and checks it.
func (rt *Router) pickPair(pol policy.Policy, req *policy.Request, views []policy.ReplicaView) (policy.PairDecision, error) {
	pre, nPre := side(views, policy.Role.Prefills)
	dec, nDec := side(views, policy.Role.Decodes)
	return rt.pickSides(pol, req, pre, nPre, dec, nDec)
}

// pickPairGated is pickPair through flow control's saturation gate
// (flow.saturated), applied to the replicas that would compute req's
// prompt: the prefill side (role prefill or both), or the decode side when
// it has no candidate (the decode replica computes the prompt). While they
// are all saturated the request is held (rt.held: errHeldAlone when other
// replicas of pl that compute prompts have room); else the saturated ones
// leave the prefill side (a replica of role both may still decode). A pair
// that skips the prefill step by the threshold (SkipThreshold) has its
// decode replica compute what it lacks: held while that replica is
// saturated. The decode side is not gated otherwise: a decode step
// computes one token.
func (rt *Router) pickPairGated(pl *pool, fl *flow, pol policy.Policy, req *policy.Request, views []policy.ReplicaView) (policy.PairDecision, error) {
	pre, nPre := side(views, policy.Role.Prefills)
	dec, nDec := side(views, policy.Role.Decodes)
	computes, ok := pre, policy.Role.Prefills
	switch {
	case nDec == 0:
		return rt.pickSides(pol, req, pre, nPre, dec, nDec) // policy.ErrNoReplica, never held
	case nPre == 0:
		computes, ok = dec, policy.Role.Decodes
	}
	if fl.saturated(computes, req.Priority, -1) {
		return policy.PairDecision{}, rt.heldOn(pl, fl, computes, ok)
	}
	pd, err := rt.pickSides(pol, req, pre, nPre, dec, nDec)
	if err != nil || SkipReason(pd) != SkipThreshold || !fl.replicaSaturated(&dec[pd.Decode.Replica]) {
		return pd, err
	}
	only := slices.Clone(dec)
	for i := range only {
		only[i].Healthy = i == pd.Decode.Replica
	}
	return policy.PairDecision{}, rt.heldOn(pl, fl, only, policy.Role.Decodes)
}

// pickSides asks pol for a pair of a prefill replica among pre and a
// decode replica among dec (nPre and nDec candidates) and checks it.
func (rt *Router) pickSides(pol policy.Policy, req *policy.Request, pre []policy.ReplicaView, nPre int, dec []policy.ReplicaView, nDec int) (policy.PairDecision, error) {
	if nDec == 0 {
		return policy.PairDecision{}, policy.ErrNoReplica
	}
	req.SkipPrefillBelow = max(rt.cfg.NonCachedTokens, 0)
	noDefer := req.NoDefer
	req.NoDefer = true
	defer func() { req.NoDefer = noDefer }()
	var pd policy.PairDecision
	var err error
	pp, ok := pol.(policy.PairPicker)
	switch {
	case nPre == 0:
		var d policy.Decision
		if d, err = rt.pick(pol, req, dec); err == nil {
			pd = policy.SkipPair(d, reasonNoPrefill)
		}
	case ok:
		pd, err = rt.pickPairBy(pol, pp, req, pre, dec)
	default:
		pd, err = rt.pickPerSide(pol, req, pre, dec)
	}
	if err != nil {
		return policy.PairDecision{}, err
	}
	return rt.checkPair(pd, pre, dec)
}

// pickPerSide is the pair of a policy that picks one replica: decode side
// first, then, unless the decode replica lacks fewer than
// req.SkipPrefillBelow tokens, the prefill side (llm-d's pd-profile-handler
// order).
func (rt *Router) pickPerSide(pol policy.Policy, req *policy.Request, pre, dec []policy.ReplicaView) (policy.PairDecision, error) {
	d, err := rt.pick(pol, req, dec)
	if err != nil {
		return policy.PairDecision{}, err
	}
	if d.Replica < 0 || d.Replica >= len(dec) {
		return policy.PairDecision{}, rt.badReplica(d.Replica)
	}
	if n := rt.uncached(req, dec[d.Replica].Match); n < req.SkipPrefillBelow {
		return policy.SkipPair(d, fmt.Sprintf("the decode replica lacks %d prompt tokens, fewer than %d (non_cached_tokens)",
			n, req.SkipPrefillBelow)), nil
	}
	p, err := rt.pick(pol, req, pre)
	if err != nil {
		return policy.PairDecision{}, err
	}
	return policy.Pair(p, d, "each side by the policy's pick, decode first"), nil
}

// checkPair checks that pd's replicas are candidates of their sides, and
// makes a pair of one replica aggregated.
func (rt *Router) checkPair(pd policy.PairDecision, pre, dec []policy.ReplicaView) (policy.PairDecision, error) {
	if d := pd.Decode.Replica; d < 0 || d >= len(dec) || !dec[d].Healthy {
		return policy.PairDecision{}, rt.badReplica(d)
	}
	if pd.SkipPrefill {
		pd.Prefill = policy.Decision{Replica: -1}
		return pd, nil
	}
	if p := pd.Prefill.Replica; p < 0 || p >= len(pre) || !pre[p].Healthy {
		return policy.PairDecision{}, rt.badReplica(p)
	}
	if pd.Prefill.Replica == pd.Decode.Replica {
		return policy.SkipPair(pd.Decode, "aggregated"), nil
	}
	return pd, nil
}

func (rt *Router) badReplica(i int) error {
	return fmt.Errorf("router: the policy chose replica %d of %d, not a candidate", i, len(rt.reps()))
}

// uncached is the prompt tokens of req a replica holding match blocks of
// it lacks, as commit counts them.
func (rt *Router) uncached(req *policy.Request, match int) int {
	return req.Tokens - min(match*rt.cfg.BlockSize, max(req.Tokens-1, 0))
}

// side is views with the replicas whose role has no part on a side (ok
// false) out (Healthy false), and the number of candidates left.
func side(views []policy.ReplicaView, ok func(policy.Role) bool) ([]policy.ReplicaView, int) {
	out := slices.Clone(views)
	n := 0
	for i := range out {
		out[i].Healthy = out[i].Healthy && ok(out[i].Role)
		if out[i].Healthy {
			n++
		}
	}
	return out, n
}
