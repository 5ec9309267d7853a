package router

import "github.com/kvgate/kvgate/internal/policy"

// Candidates is the router's view of every replica for req, as Route's
// policy would see it: Healthy only for the replicas that may take it
// (its pool's, serving its model, in rotation), less exclude. The
// endpoint picker names its fallbacks from it.
func (rt *Router) Candidates(req *policy.Request, exclude ...int) ([]policy.ReplicaView, error) {
	views, _ := rt.views(req, new(viewBuf)) // returned: memory of its own, not the pool's
	if _, err := rt.candidates(req, views, exclude); err != nil {
		return nil, err
	}
	return views, nil
}

// Predicted is the prompt tokens the decision counted on the chosen
// replica holding: its match (Held, by the index the router trusts) as the
// engine can report it — whole blocks, at most the prompt less one token
// (vLLM computes at least the last one). 0 for a decode step, whose
// replica pulls the prompt it lacks.
func (t *Ticket) Predicted() int {
	if t.phase == policy.PhaseDecode {
		return 0
	}
	bs := t.rt.cfg.BlockSize
	return min(t.Held*bs, max(t.req.Tokens-1, 0)/bs*bs)
}

// WrongRoute checks the decision against what the replica reported it
// hit (usage.prompt_tokens_details.cached_tokens; negative: not reported):
// true when the engine had fewer cached prompt tokens than the decision
// predicted by more than a block — the request was sent for a prefix the
// replica no longer (or never) held. It generalises Underpredicted's check
// of the precise index, the other way round, to every policy and index;
// ok is false when there is nothing to check (no report, a decode step).
func (t *Ticket) WrongRoute(cached int) (wrong, ok bool) {
	if cached < 0 || t.phase == policy.PhaseDecode {
		return false, false
	}
	return t.Predicted()-cached > t.rt.cfg.BlockSize, true
}
