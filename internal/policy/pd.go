package policy

import "fmt"

// Prefill/decode disaggregation. A P/D fleet has prefill replicas, which
// compute prompts and hold their KV, decode replicas, which pull the KV they
// lack from a prefill replica and generate, and possibly replicas that do
// both. The router's RoutePD asks for a pair: a policy implementing
// PairPicker chooses it whole; any other policy chooses each side by its own
// Pick, decode side first, over that side's replicas (see router.RoutePD).

// Role is a replica's part in prefill/decode disaggregation, as the engine
// model's (internal/engine) and vLLM's kv_role.
type Role uint8

// Roles.
const (
	RoleBoth    Role = iota // prefills and decodes: an aggregated replica (default)
	RolePrefill             // computes prompts for decode replicas to pull
	RoleDecode              // pulls prompts' KV from prefill replicas and generates
)

func (r Role) String() string {
	switch r {
	case RoleBoth:
		return "both"
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	}
	return fmt.Sprintf("Role(%d)", uint8(r))
}

// ParseRole reads "both", "prefill" or "decode"; "" is RoleBoth (a replica
// configured without a role).
func ParseRole(s string) (Role, error) {
	if s == "" {
		return RoleBoth, nil
	}
	for _, r := range []Role{RoleBoth, RolePrefill, RoleDecode} {
		if s == r.String() {
			return r, nil
		}
	}
	return 0, fmt.Errorf("role %q: want both, prefill or decode", s)
}

// Prefills reports whether a replica of role r takes prefill steps.
func (r Role) Prefills() bool { return r == RoleBoth || r == RolePrefill }

// Decodes reports whether a replica of role r takes decode steps.
func (r Role) Decodes() bool { return r == RoleBoth || r == RoleDecode }

// Phase is the step of a request an Event is about.
type Phase string

// Phases.
const (
	PhaseNone    Phase = ""        // the whole request on one replica
	PhasePrefill Phase = "prefill" // the prefill step of a disaggregated request
	PhaseDecode  Phase = "decode"  // the decode step, pulling the prefill's KV
)

// PairDecision is the choice of a prefill and a decode replica for one
// request.
type PairDecision struct {
	// Prefill is the prefill replica's decision; with SkipPrefill its
	// Replica is -1.
	Prefill Decision `json:"prefill"`
	// Decode is the decode replica's decision: the replica that streams
	// the answer. Its EstTTFT is the estimated time to first token of the
	// whole path (ttft).
	Decode Decision `json:"decode"`
	// SkipPrefill: no prefill step; the decode replica computes what it
	// lacks of the prompt itself (it holds almost all of it, or it is a
	// replica of role both serving the request aggregated).
	SkipPrefill bool   `json:"skip_prefill"`
	Reason      string `json:"reason"`
}

// PairPicker is implemented by policies that choose the prefill and the
// decode replica together.
type PairPicker interface {
	// PickPair chooses among prefill (the prefill candidates Healthy) and
	// decode (the decode candidates Healthy): both list every replica, in
	// the same stable order, as Pick's replicas do; a replica of role both
	// may be a candidate on both sides. It must not modify req or the views;
	// ErrNoReplica when no pair fits. With SkipPrefill, Prefill.Replica is
	// -1; a pair whose two sides are the same replica is served aggregated.
	PickPair(req *Request, prefill, decode []ReplicaView) (PairDecision, error)
}

// SkipPair is the pair decision serving the request on d's replica alone:
// no prefill step.
func SkipPair(d Decision, reason string) PairDecision {
	return PairDecision{Prefill: Decision{Replica: -1}, Decode: d, SkipPrefill: true, Reason: reason}
}

// Pair is the pair decision of prefill p and decode d: served aggregated
// (SkipPrefill, reason "aggregated") when both are the same replica.
func Pair(p, d Decision, reason string) PairDecision {
	if p.Replica == d.Replica {
		return SkipPair(d, "aggregated")
	}
	return PairDecision{Prefill: p, Decode: d, Reason: reason}
}

// uncachedOn is the prompt tokens v lacks of req: the prompt less its
// matched blocks, at least the last token (as the engines recompute it),
// 0 for an empty prompt.
func uncachedOn(req *Request, v *ReplicaView, blockSize int) int {
	tokens := count(req.Tokens)
	cached := min(min(count(v.Match), len(req.Blocks))*blockSize, max(tokens-1, 0))
	return tokens - cached
}
