package router

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// Several gateways in front of one fleet each route on their own Router.
// What one learns the others are told (internal/sharedstate carries it
// through Redis, the replay after a virtual delay): the routing decisions,
// applied to their approximate indexes and to their policies as remote
// Routed events, and each gateway's own load counts, added to theirs. A
// router's own counts stay exact; the remote ones are an addition it holds
// per replica, replaced whole by each update.

// Learned is a routing decision as it is shared: the request's whole
// prompt (its blocks) on the replica. Held is how many of its leading
// blocks the sender's index already held there.
//
// Whole prompts are shared, not only the blocks new to the replica: a
// receiver that hears only the new part never sees the prefix used again,
// so its LRU lets the prefix age out while the sender's keeps it (measured
// on the conversation trace, 4 gateways at 10 ms: the hit rate fell from
// 16.6 % to 15.2 % with the compact form, for 16 % fewer bytes). The wire
// format (and ApplyRemote's offset) still takes a compact decision.
type Learned struct {
	Replica int // the slot in the sender's router; shared by name
	Model   string
	Held    int
	Blocks  []uint64 // not to be kept: the request's own slice
	Tokens  int
	// Program is the request's program (policy.Program.ID; 0: none): the
	// others learn that its context lives on the replica (its home) and
	// how large it is (Tokens), so that several gateways keep a program
	// together (ApplyRemoteProgram). In precise mode no decision is shared:
	// every gateway sees the program's context on its replica through the
	// KV events, only its reservation stays each gateway's own.
	Program uint64
}

// Load is a gateway's own counts for one replica.
type Load struct {
	InFlight       int64 `json:"in_flight"`
	InFlightTokens int64 `json:"in_flight_tokens"`
	PendingPrefill int64 `json:"pending_prefill"`
	PendingCount   int64 `json:"pending_count"`
}

// What another gateway reports comes from outside the process (anyone who
// can write to the shared Redis): each value is clamped where it is
// applied, so that a policy never sees a negative queue or a sum that
// wraps around, whatever a peer sends.
const (
	// remoteMaxRequests bounds the requests (in flight, pending) the other
	// gateways may report on one replica: 2^20, a thousand times what a
	// vLLM replica runs at once (max_num_seqs, 256 to 1,024), and more than
	// any fleet of gateways queues on one replica.
	remoteMaxRequests = 1 << 20
	// remoteMaxTokens bounds the tokens (in flight, pending prefill) they
	// may report on one replica: 2^40, about a million times the KV a
	// replica holds (a few million tokens); policies clamp what they
	// compute with at the same bound, far below where a product of two
	// counts leaves float64's exact range or a sum of a few int64's.
	remoteMaxTokens = 1 << 40
	// remoteMaxPrompt bounds a shared decision's prompt (tokens, and the
	// block offset plus blocks at the router's block size): a prompt
	// longer than any served context (prompt.MaxTokensLimit, 2^24 tokens).
	remoteMaxPrompt = prompt.MaxTokensLimit
)

// clamped is l with each field within [0, its bound].
func (l Load) clamped() Load {
	return Load{
		InFlight:       min(max(l.InFlight, 0), remoteMaxRequests),
		InFlightTokens: min(max(l.InFlightTokens, 0), remoteMaxTokens),
		PendingPrefill: min(max(l.PendingPrefill, 0), remoteMaxTokens),
		PendingCount:   min(max(l.PendingCount, 0), remoteMaxRequests),
	}
}

// Add is the sum of two loads.
func (l Load) Add(o Load) Load {
	return Load{l.InFlight + o.InFlight, l.InFlightTokens + o.InFlightTokens,
		l.PendingPrefill + o.PendingPrefill, l.PendingCount + o.PendingCount}
}

// ErrRemoteProgram is what ApplyRemoteProgram returns for a program record
// it refuses (as a *RemoteProgramError, which names the reason).
var ErrRemoteProgram = errors.New("router: another gateway's program refused")

// RemoteProgramError is a refused program record; Reason is "oversize" (a
// context beyond any served prompt), "unbacked" (a context larger than the
// blocks sent with it: a reservation nobody's prompt backs, which would
// steer new programs off the replica) or "full" (the table holds only
// programs with a live reservation, which a peer's record never evicts).
type RemoteProgramError struct {
	Reason string
	Tokens int
}

func (e *RemoteProgramError) Error() string {
	return fmt.Sprintf("%v: %s (%d tokens)", ErrRemoteProgram, e.Reason, e.Tokens)
}

// Is makes errors.Is(err, ErrRemoteProgram) hold.
func (e *RemoteProgramError) Is(target error) bool { return target == ErrRemoteProgram }

// ApplyRemoteProgram records a turn of program id (0: none, nothing
// recorded) another gateway sent to replica slot i at `at` with a prompt of
// tokens, blocks of it sent (the decision's offset and blocks): its home and
// context, reserved on the replica as a turn this gateway routed would be
// (with nothing in flight: it stays live ProgramConfig.IdleTTL from at). A
// record about a replica this router does not have is skipped (nil). A
// peer's records are bounded where they enter: the context within [0,
// remoteMaxPrompt] and backed by its blocks (at most one partial block
// more), and a new program takes an entry of the capped table only from an
// idle one: a flood of forged ids costs idle programs their affinity,
// never a live program its reservation.
func (rt *Router) ApplyRemoteProgram(i int, id uint64, blocks, tokens int, at time.Time) error {
	if id == 0 || i < 0 || i >= len(rt.reps()) || rt.reps()[i].removed.Load() {
		return nil
	}
	switch {
	case tokens < 0 || tokens > remoteMaxPrompt:
		return &RemoteProgramError{Reason: "oversize", Tokens: tokens}
	case blocks < 0 || tokens/rt.cfg.BlockSize > blocks:
		return &RemoteProgramError{Reason: "unbacked", Tokens: tokens}
	}
	if !rt.progs.remote(id, i, rt.reps()[i].serial, tokens, at) {
		return &RemoteProgramError{Reason: "full", Tokens: tokens}
	}
	return nil
}

// Lookup is the slot of the replica named name (Name: URL, or URL#k).
func (rt *Router) Lookup(name string) (int, bool) {
	i, ok := rt.mem.Load().byName[name]
	return i, ok
}

// LocalLoad is this router's own counts for replica i (without the
// remote load).
func (rt *Router) LocalLoad(i int) Load {
	r := rt.reps()[i]
	return Load{r.inFlight.Load(), r.inFlightTokens.Load(), r.pendingPrefill.Load(), r.pendingCount.Load()}
}

// SetRemoteLoad sets the load the other gateways report for replica i (the
// sum of their live heartbeats; the zero Load when none): the policies see
// it added to this router's own counts. Each field is clamped to [0, its
// bound] (remoteMaxRequests, remoteMaxTokens).
func (rt *Router) SetRemoteLoad(i int, l Load) {
	l = l.clamped()
	r := rt.reps()[i]
	if old := r.remote.Load(); old != nil && *old == l {
		return
	}
	if l == (Load{}) {
		r.remote.Store(nil)
	} else {
		r.remote.Store(&l)
	}
	rt.releaseIfQueued()
}

// RemoteLoad is the other gateways' load on replica i as last set.
func (rt *Router) RemoteLoad(i int) Load {
	if l := rt.reps()[i].remote.Load(); l != nil {
		return *l
	}
	return Load{}
}

// ApplyRemote applies a decision another gateway made at `at`: the
// approximate index learns blocks (the prompt's from offset on) on replica
// i, and an Observer policy hears a remote Routed event (policy.Event.Remote).
// blocks is not kept. The prompt is bounded as a request's is: tokens
// within [0, remoteMaxPrompt], offset at least 0, and the blocks past that
// many tokens at the router's block size dropped.
func (rt *Router) ApplyRemote(i int, model string, offset int, blocks []uint64, tokens int, at time.Time) {
	if i < 0 || i >= len(rt.reps()) {
		return
	}
	maxBlocks := remoteMaxPrompt / rt.cfg.BlockSize
	tokens, offset = min(max(tokens, 0), remoteMaxPrompt), min(max(offset, 0), maxBlocks)
	blocks = blocks[:min(len(blocks), maxBlocks-offset)]
	if len(blocks) > 0 {
		_ = rt.approx.Insert(i, blocks)
		if rt.approxHost != nil {
			_ = rt.approxHost.Insert(i, blocks)
		}
	}
	obs := rt.observer(i) // the policy of the replica's pool
	if obs == nil {
		return
	}
	req := &policy.Request{Now: at, Model: model, Blocks: blocks, BlockOffset: offset, Tokens: tokens}
	obs.Observe(policy.Event{Kind: policy.Routed, Remote: true, At: at, Req: req, Replica: i,
		Decision: policy.Decision{Replica: i, Matched: offset, Reason: "another gateway"}})
}
