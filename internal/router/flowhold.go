package router

import (
	"errors"

	"github.com/kvgate/kvgate/internal/policy"
)

// Why flow control would hold a request now (FlowHold).
const (
	// HoldSaturated: the replicas that would compute its prompt (a pair's
	// prefill side) are saturated for its band.
	HoldSaturated = "saturated"
	// HoldOwnSaturated: its own candidates are saturated while another
	// replica of its pool has room (errHeldAlone).
	HoldOwnSaturated = "own_replicas_saturated"
	// HoldQueued: requests wait in its pool's queue that it could not pass.
	HoldQueued = "queued_behind"
)

// FlowHold says whether flow control would hold req now rather than route
// it — as Submit, or SubmitPD on a prefill/decode fleet, would decide at
// this instant — and why ("" : routed at once, or no flow control for its
// pool). Nothing is routed, learnt or charged: /debug/route shows it.
func (rt *Router) FlowHold(req *policy.Request) string {
	pl := rt.poolOfRequest(req)
	if pl == nil || pl.q.fl == nil {
		return ""
	}
	views := rt.Views(req)
	if _, err := rt.candidates(req, views, nil); err != nil {
		return ""
	}
	q := pl.q
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.n != q.alone {
		return HoldQueued
	}
	var err error
	pol := pl.pol.Load().pol
	if rt.Disaggregated() {
		_, err = rt.pickPairGated(pl, q.fl, pol, req, views)
	} else {
		err = rt.gate(pl, q.fl, pol, req, views)
	}
	switch {
	case errors.Is(err, errHeldAlone):
		return HoldOwnSaturated
	case errors.Is(err, policy.ErrDefer):
		return HoldSaturated
	}
	return ""
}
