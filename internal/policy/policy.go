// Package policy holds kvgate's routing policies behind one small interface.
//
// A Policy picks a replica for one request from a snapshot of what the
// router knows (ReplicaView); it does no I/O and does not change state, so
// a dry run (/debug/route) is a plain Pick. Policies that learn (their own
// prefix trees, windows, TTFT corrections) implement Observer and change
// state only on events: Routed when the request is actually sent, then
// FirstToken and Done. The live gateway and the offline replay call the same
// code through internal/router.
package policy

import (
	"errors"
	"time"
)

// ErrNoReplica is returned when no replica can take the request.
var ErrNoReplica = errors.New("policy: no healthy replica")

// ErrDefer is returned by Pick when the request should wait in the router
// rather than join any replica's queue now (late binding, as Dynamo's
// router queue does): the router holds it, first come first served, and
// asks again whenever a replica's prefill work shrinks.
var ErrDefer = errors.New("policy: wait in the router")

// ErrParam is wrapped by every error of a policy's factory about its
// parameters: an unknown name, a value of the wrong type, or one out of its
// range.
var ErrParam = errors.New("invalid parameter")

// Policy picks a replica for one request.
type Policy interface {
	Name() string
	// Pick chooses among replicas (all configured ones, unhealthy included
	// with Healthy false, in a stable order). It must not modify req or
	// replicas, nor keep replicas once it returns (the router reuses their
	// memory for the next decision), and returns ErrNoReplica when none is
	// healthy.
	Pick(req *Request, replicas []ReplicaView) (Decision, error)
}

// Observer is implemented by policies that learn from outcomes.
type Observer interface {
	Observe(ev Event)
}

// Request is the routing key of one request.
type Request struct {
	ID      uint64
	Now     time.Time // the router's clock (wall or virtual) at routing time
	Model   string
	Adapter string
	Salt    string
	Text    string // routing text: prompt, or chat rendered with roles ("" for token-id prompts)
	KeyText string // the first user message (chat) or the prompt: prefix-key policies
	System  string // the chat's system prompt, if any
	// Session is the request's program id when it names one (Program.ID
	// set: prompt_cache_key, else a session header, else its Responses
	// chain; see router.Prepare), else the body's "user".
	Session string
	// Program is the request's program and what the router knows of it
	// (zero: the request names none).
	Program Program
	Blocks  []uint64 // kvgate's chained block hashes of the prompt's full blocks
	// BlockOffset is the prompt's block Blocks[0] is: 0, but for a remote
	// decision (Event.Remote), which carries only the blocks from there on.
	BlockOffset int
	Tokens      int // prompt tokens
	MaxTokens   int // requested output tokens (0: unknown)
	// NoDefer: the policy must not answer ErrDefer (the router overrules a
	// deferral that nothing in flight would ever release; RoutePD never
	// defers).
	NoDefer bool
	// Explain: the decision is explained (a dry run, /debug/route), so a
	// policy computes every replica's score, even those it could skip
	// because they cannot win (ttft's pruning): the choice is the same.
	Explain bool
	// SkipPrefillBelow (prefill/decode disaggregation, set by the router's
	// RoutePD from its Config.NonCachedTokens): a decode replica whose
	// uncached part of the prompt is below this many tokens computes it
	// itself, without a prefill step (0: never). A PairPicker reads it as
	// the operator's bound on the prefill work a decode replica may take.
	SkipPrefillBelow int
	// Pool is the router's: the pool routing the request, resolved once
	// from Model when the router prepared it (1 + the pool's index; -1: no
	// pool routes the model; 0: not resolved, resolved when routed).
	// Policies ignore it.
	Pool int
	// Flow control (the router's flow controller, router/flow.go; policies
	// ignore them): the tenant the request counts against, its priority
	// band (vLLM's priority: lower is earlier), the time its first token
	// is due by (zero: none; EDF within the tenant) and its rank among the
	// tenant's requests of its band (lower first, before the deadline: a
	// caller's own order, e.g. a program's turn; 0 by default).
	Tenant   string
	Priority int
	Deadline time.Time
	Rank     int64
}

// Program is a request's program: an agent's session, a conversation, a
// rollout: requests that follow one another over one growing context. The
// router fills it (internal/router, programs.go); policies read it.
type Program struct {
	// ID names the program within its partition (model, adapter,
	// cache_salt): a hash of the client's id; 0: the request names none.
	ID uint64
	// Continues: the router knows the program from an earlier turn. Home
	// is then the replica slot it last went to (its context is there),
	// Tokens that context (its last turn's prompt and output), Turns the
	// turns routed so far.
	Continues bool
	Home      int
	Tokens    int
	Turns     int
}

// ReplicaView is what the router knows of one replica now.
type ReplicaView struct {
	Index   int    // the replica's slot: stable, Decision.Replica refers to it
	URL     string // as configured
	Healthy bool
	// Role is the replica's part in prefill/decode disaggregation
	// (RoleBoth, the zero value, in an aggregated fleet).
	Role Role

	// The gateway's own counts (exact for this gateway).
	InFlight       int // requests sent and not finished
	InFlightTokens int // prompt + max output tokens of those requests (their contexts)
	// InFlightKV is the KV those requests add to the replica's cache beyond
	// the prefixes they were credited at routing: uncached prompt (and a
	// decode step's pulled prompt) + max output tokens. Requests sharing a
	// cached prefix hold its blocks once, not once each as InFlightTokens
	// counts them.
	InFlightKV     int
	PendingPrefill int // uncached prompt tokens of requests without a first token yet
	PendingCount   int // requests without a first token yet
	// PendingTransfer is the prompt tokens the decode steps sent to the
	// replica will pull from their prefill replicas, of those without a
	// first token yet (0 but on decode replicas of a P/D fleet): its KV
	// link's backlog. Their own compute, the last prompt token each, is
	// in PendingPrefill.
	PendingTransfer int
	// BurstPending is the requests among PendingCount that follow a burst
	// of identical prompts to the replica (router, bursts.go): their
	// prompt is held or being computed there, so they decode from the
	// step after it, in the batch a new request would join.
	BurstPending int

	// Scraped from the replica's /metrics (HaveMetrics false until the first scrape).
	HaveMetrics bool
	MetricsAge  time.Duration
	Waiting     int
	// WaitingUnseen is the part of Waiting the counts above do not hold:
	// the scraped waiting requests beyond those the gateways had sent and
	// not seen a first token of when the scrape arrived (requests others
	// send the replica). Read against PendingCount now instead, a scrape
	// a few hundred ms old counts requests that have had their first
	// token since as a queue that is not there.
	WaitingUnseen int
	Running       int
	KVUsage       float64 // 0..1
	NumBlocks     int     // the replica's KV capacity in blocks: scraped, else the router's assumption (0: unknown)

	// Programs and ProgramTokens are the live programs whose home is the
	// replica (a turn in flight, or idle less than the programs' TTL) and
	// the contexts they reserve there, in tokens: the KV their next turns
	// expect to find (router, programs.go).
	Programs      int
	ProgramTokens int

	// Match is the number of leading blocks of the request the router's
	// index (approximate, or precise when KV events feed it) believes the
	// replica holds in its GPU cache.
	Match int
	// Cached is the number of blocks the same index believes the replica
	// holds in all.
	Cached int
	// MatchHost is the number of leading blocks of the request the index
	// believes the replica's host (CPU) tier holds, counted from the
	// prompt's start like Match (0: no host tier known). A request's hit
	// continues there where its GPU hit stops: the blocks from Match to
	// MatchHost are loaded, not computed (HostBeyond). A count, apart from
	// any tier's weight.
	MatchHost int
}

// HostBeyond is the blocks of the request v's host tier holds past its GPU
// match: what the engine loads from host memory instead of computing.
func (v *ReplicaView) HostBeyond() int { return max(count(v.MatchHost)-count(v.Match), 0) }

// Local is the leading blocks of the request v holds in any tier: its GPU
// match, continued in its host tier.
func (v *ReplicaView) Local() int { return max(count(v.Match), count(v.MatchHost)) }

// Decision is a policy's choice and why.
type Decision struct {
	Replica int    `json:"replica"` // ReplicaView.Index
	Reason  string `json:"reason"`
	// Matched is the prefix the policy credited to the chosen replica, in
	// blocks (character-based policies convert).
	Matched int `json:"matched_blocks"`
	// Load is the chosen replica's load as the policy counted it.
	Load float64 `json:"load"`
	// EstTTFT is the estimated time to first token on the chosen replica
	// (ttft policy; 0 for others).
	EstTTFT time.Duration `json:"est_ttft_ns"`
	// Scores holds the policy's per-replica score or cost, indexed like the
	// replicas passed to Pick (nil if the policy has none).
	Scores []float64 `json:"scores,omitempty"`
	// Pull, when set, is a peer the chosen replica pulls the request's
	// cached prefix from (vLLM's kv_transfer_params.remote_kv_source)
	// instead of computing it: "replica B, pulling from A".
	Pull *Pull `json:"pull,omitempty"`
}

// Pull names a peer replica to pull a prefix from.
type Pull struct {
	Replica int    `json:"replica"` // ReplicaView.Index of the source
	URL     string `json:"url"`
	// Blocks is the leading blocks of the request the router believes the
	// source holds (GPU or host tier); the chosen replica pulls those past
	// its own.
	Blocks int `json:"blocks"`
}

// EventKind is the kind of an outcome event.
type EventKind int

const (
	Routed     EventKind = iota // the request was sent to Replica
	FirstToken                  // its first token arrived
	Done                        // it finished (Err set when it failed)
)

// Event is an outcome reported to Observers.
type Event struct {
	Kind     EventKind
	At       time.Time
	Req      *Request
	Decision Decision
	Replica  int
	// Phase is the step of a disaggregated request the event is about:
	// PhasePrefill (the prefill step, its own Request with MaxTokens 1 and
	// an ID of its own), PhaseDecode (the decode step, which pulls the KV
	// from the prefill replica), or PhaseNone for a request served whole by
	// one replica (aggregated, or a decode replica computing the rest of
	// its prompt itself).
	Phase Phase
	// Remote: a decision another gateway made, shared (several gateways,
	// internal/sharedstate). Only Routed; Req carries Model, Tokens and the
	// Blocks from Req.BlockOffset on, no text, no ID; Decision.Matched is
	// the sender's match. No FirstToken or Done follows: the sender's load
	// reaches the router as counts.
	Remote bool
	// FirstToken and Done:
	TTFT time.Duration
	// Done: the replica's own counts (usage), when it reported them.
	CachedTokens int
	OutputTokens int
	Err          error
}

// KVEventsPolicy is implemented by a policy defined on the replicas' KV
// events (llm-d's precise prefix scorer): the replay follows the events for
// its runs unless told otherwise, and the gateway warns when it runs
// without them.
type KVEventsPolicy interface {
	WantsKVEvents() bool
}

// WantsKVEvents reports whether p is defined on KV events.
func WantsKVEvents(p Policy) bool {
	k, ok := p.(KVEventsPolicy)
	return ok && k.WantsKVEvents()
}

// MetricsRefresher is implemented by a policy whose upstream refreshes the
// replicas' metrics at its own period (llm-d's scheduler every 50 ms): the
// replay scrapes at that period for its runs unless told otherwise.
type MetricsRefresher interface {
	MetricsRefresh() time.Duration
}

// MetricsRefresh is p's own metrics period (0: the configured one).
func MetricsRefresh(p Policy) time.Duration {
	if m, ok := p.(MetricsRefresher); ok {
		return m.MetricsRefresh()
	}
	return 0
}

// ProgramPlacer is implemented by a policy that wants the router to place
// programs (router, programs.go): KV admission of new programs and the
// co-location of bursts of identical prompts. kvgate's ttft does unless its
// parameter programs is false; the peers' rules do not, as their upstreams
// (as launched) have neither.
type ProgramPlacer interface {
	PlacesPrograms() bool
}

// PlacesPrograms reports whether p wants the router to place programs.
func PlacesPrograms(p Policy) bool {
	pp, ok := p.(ProgramPlacer)
	return ok && pp.PlacesPrograms()
}

// Pinner is implemented by a policy that sends every request to one
// replica, the one holding its state (the gateway's stored responses). The
// router's flow controller holds such a request while its whole pool is
// saturated, as any other, but leaves its replica among the candidates
// when only some are: taking it out, as it does for the rest, would leave
// the request nowhere to go (an error to a client whose request is valid)
// or, held for that one replica, in front of the pool's queue.
type Pinner interface {
	PinnedTo() int
}

// PinnedTo is the replica p pins its requests to, -1 when p is not a
// Pinner.
func PinnedTo(p Policy) int {
	if pn, ok := p.(Pinner); ok {
		return pn.PinnedTo()
	}
	return -1
}

// QueueOrderer is implemented by a policy whose deferred requests the
// router's queue releases by when their first token could come at the
// earliest: their arrival plus QueuePrefillMs of their uncached prompt
// tokens (router, queue.go). kvgate's ttft does (its profile's prefill
// cost); the peers' queues are first come first served, as their
// upstreams' defaults (Dynamo's router_queue_policy fcfs).
type QueueOrderer interface {
	QueuePrefillMs(uncached int) float64
}

// QueuePrefillMs is p's QueuePrefillMs of uncached tokens, bounded to
// [0, maxQueuePrefillMs] (NaN: 0); 0 when p orders its queue by arrival
// alone.
func QueuePrefillMs(p Policy, uncached int) float64 {
	q, ok := p.(QueueOrderer)
	if !ok {
		return 0
	}
	ms := q.QueuePrefillMs(uncached)
	if !(ms > 0) {
		return 0
	}
	return min(ms, maxQueuePrefillMs)
}

// maxQueuePrefillMs bounds QueuePrefillMs: a day, far past any queue's
// TTL, so that an absurd estimate cannot overflow a time.
const maxQueuePrefillMs = 86_400_000.0
