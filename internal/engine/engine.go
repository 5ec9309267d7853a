// Package engine is kvgate's simulated replica: the model of one vLLM-like
// inference engine that both `kvgate sim` (wall clock, HTTP) and `kvgate
// replay` (discrete events, virtual time) drive, so that a replay figure
// describes what the simulated replicas do.
//
// It models the three parts of vLLM v1 that decide time to first token under
// prefix-aware routing:
//
//   - an iteration-level scheduler (Orca-style continuous batching with
//     Sarathi-style chunked prefill): each step gives every decoding sequence
//     one token, then continues partial prefills and admits waiting requests
//     first come first served, chunking prefills to the remaining token budget,
//     with at most MaxSeqs sequences running;
//   - a paged KV cache (PagedAttention blocks) with automatic prefix caching:
//     full prompt blocks are known by their chained hash, a new request takes
//     the blocks of its longest cached prefix, free blocks keep their hash in
//     an LRU queue until reused (see blockPool);
//   - preemption by recompute when a running sequence cannot get a block;
//   - prefill/decode disaggregation as vLLM's NixlConnector does it (see
//     Role and transfer.go): a prefill instance holds a finished request's
//     blocks for the decode instance, which pulls the part of the prompt its
//     own cache lacks, in a transfer timed by the profile, and then decodes;
//   - a host (CPU) tier as vLLM's OffloadingConnector keeps it (tier.go):
//     write-through LRU, a hit continuing from the GPU into it loaded over
//     the host link; and peer pulls (Request.PullBlocks, llm-d's
//     remote_kv_source) over the KV link.
//
// Step durations come from a costmodel.Profile. The engine owns no clock: the
// driver passes the current time to Add and Step and advances its clock to
// StepResult.End; when there is no work (HasWork), or a step scheduled
// nothing, it steps again at NextEvent (a transfer ending, a hold expiring)
// or at the next arrival, whichever comes first. It never sleeps, starts no goroutines and draws randomness
// only from a generator seeded by Config.Seed, so the same calls give the same
// results. It is not safe for concurrent use; a driver serialises its calls.
package engine

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
)

// Errors returned by New and Add; test with errors.Is.
var (
	ErrInvalidConfig  = errors.New("engine: invalid config")
	ErrInvalidRequest = errors.New("engine: invalid request")
	// ErrTooLong: the prompt plus its output can never fit the KV cache, even
	// alone; vLLM rejects such a request up front rather than preempting forever.
	ErrTooLong     = errors.New("engine: request can never fit the KV cache")
	ErrDuplicateID = errors.New("engine: duplicate request id")
	// ErrWrongRole: a request's KV transfer does not fit the engine's role
	// (a remote decode on a decode instance, a remote prefill on a
	// prefill instance).
	ErrWrongRole = errors.New("engine: KV transfer not served by this role")
)

// Config sizes the engine. The zero value is valid: WithDefaults fills it.
type Config struct {
	Profile        costmodel.Profile // default costmodel.MustLookup(costmodel.Default)
	NumBlocks      int               // KV cache blocks, default 30000
	BlockSize      int               // tokens per block, default 16
	MaxBatchTokens int               // token budget per step, default 8192; must be ≥ MaxSeqs
	MaxSeqs        int               // running sequence cap, default 256
	Seed           uint64            // seeds the step-time jitter
	Jitter         float64           // relative step-time noise in [0, 1): each step × U(1−J, 1+J); default 0
	// DisableKVEvents skips building KVEvents (vLLM's enable_kv_cache_events
	// off), for drivers with no subscriber; the cache itself is unchanged.
	DisableKVEvents bool
	// Role is the instance's part in prefill/decode disaggregation
	// (default RoleBoth): which KV transfers its requests may carry.
	Role Role
	// KVHoldTimeout is how long a prefill instance holds a finished
	// request's blocks for its remote decode before freeing them (vLLM's
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT), in engine time; default
	// DefaultKVHoldTimeout.
	KVHoldTimeout time.Duration
	// PriorityScheduling is vLLM's --scheduling-policy priority: the
	// waiting queue is ordered by Request.Priority (lower first), then
	// arrival, and a preemption takes the running request of the largest
	// (priority, arrival) (vLLM v1's scheduler). Off: first come first
	// served, Priority ignored.
	PriorityScheduling bool
	// HostBlocks is the host (CPU) tier's size in blocks, vLLM's
	// OffloadingConnector's num_cpu_blocks (see tier.go); 0: no host tier.
	HostBlocks int
}

// Defaults of Config.
const (
	DefaultNumBlocks      = 30000
	DefaultBlockSize      = 16
	DefaultMaxBatchTokens = 8192
	DefaultMaxSeqs        = 256
	// DefaultKVHoldTimeout is vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT
	// default, 480 s (vllm/envs.py).
	DefaultKVHoldTimeout = 480 * time.Second
)

// WithDefaults fills the zero fields.
func (c Config) WithDefaults() Config {
	if c.Profile == (costmodel.Profile{}) {
		c.Profile = costmodel.MustLookup(costmodel.Default)
	}
	if c.NumBlocks == 0 {
		c.NumBlocks = DefaultNumBlocks
	}
	if c.BlockSize == 0 {
		c.BlockSize = DefaultBlockSize
	}
	if c.MaxBatchTokens == 0 {
		c.MaxBatchTokens = DefaultMaxBatchTokens
	}
	if c.MaxSeqs == 0 {
		c.MaxSeqs = DefaultMaxSeqs
	}
	if c.KVHoldTimeout == 0 {
		c.KVHoldTimeout = DefaultKVHoldTimeout
	}
	return c
}

func (c Config) validate() error {
	switch {
	case c.NumBlocks < 1 || c.NumBlocks >= math.MaxInt32:
		return fmt.Errorf("%w: num_blocks %d out of [1, %d)", ErrInvalidConfig, c.NumBlocks, math.MaxInt32)
	case c.BlockSize < 1 || c.BlockSize > math.MaxInt32:
		return fmt.Errorf("%w: block_size %d out of [1, %d]", ErrInvalidConfig, c.BlockSize, math.MaxInt32)
	case c.MaxSeqs < 1:
		return fmt.Errorf("%w: max_seqs %d < 1", ErrInvalidConfig, c.MaxSeqs)
	case c.MaxBatchTokens < c.MaxSeqs:
		// As vLLM requires: otherwise decodes beyond the budget would starve.
		return fmt.Errorf("%w: max_batch_tokens %d < max_seqs %d", ErrInvalidConfig, c.MaxBatchTokens, c.MaxSeqs)
	case !(c.Jitter >= 0 && c.Jitter < 1):
		return fmt.Errorf("%w: jitter %v out of [0, 1)", ErrInvalidConfig, c.Jitter)
	case c.Role > RoleDecode:
		return fmt.Errorf("%w: role %v", ErrInvalidConfig, c.Role)
	case c.KVHoldTimeout < 0:
		return fmt.Errorf("%w: kv hold timeout %v < 0", ErrInvalidConfig, c.KVHoldTimeout)
	case c.HostBlocks < 0 || c.HostBlocks >= math.MaxInt32:
		return fmt.Errorf("%w: host blocks %d out of [0, %d)", ErrInvalidConfig, c.HostBlocks, math.MaxInt32)
	}
	if err := c.Profile.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return nil
}

// Request is one generation request as the engine sees it.
type Request struct {
	ID           uint64 // caller-assigned, unique while live
	PromptTokens int
	// BlockHashes are the chained hashes of the prompt's full blocks, in
	// order; normally len == PromptTokens/BlockSize. Fewer is allowed: blocks
	// past the last hash are computed but never cached. The engine keeps the
	// slice (no copy) while the request is live: do not modify it.
	BlockHashes []uint64
	// TokenIDs, optional, are the prompt's token ids (len == PromptTokens),
	// used only to fill Stored events; kept without a copy like BlockHashes.
	TokenIDs  []uint32
	MaxTokens int    // output tokens to generate (≥ 1); the engine generates exactly this many
	LoraName  string // optional, echoed in KV events

	// RemoteDecode (vLLM's do_remote_decode; RolePrefill or RoleBoth): when
	// the request finishes, its blocks stay held, not evictable, for a
	// decode instance to pull, until Release or KVHoldTimeout. Its
	// Finished output says so (Output.Held, Output.BlockIDs).
	RemoteDecode bool
	// RemotePrefill (vLLM's do_remote_prefill; RoleDecode or RoleBoth): a
	// prefill instance holds the prompt's KV. When admitted, the request
	// takes its own cached prefix and pulls the rest of the prompt in a
	// transfer (StepResult.Pulls) that computes nothing, then recomputes
	// only the last prompt token, which samples its first output token.
	RemotePrefill bool
	// AssumedCached (the replay's oracle bound, never a real replica) is
	// how many leading prompt tokens the engine treats as cached whether or
	// not it holds them, as if the whole fleet shared one cache: at
	// admission the request takes the longer of its own hit and this, in
	// whole blocks and at most the prompt less its last token. The assumed
	// blocks are allocated, counted as hit and cached like computed ones.
	AssumedCached int
	// Priority is vLLM's request priority (lower is earlier), honoured
	// with Config.PriorityScheduling.
	Priority int
	// PullBlocks (a peer pull, vLLM's kv_transfer_params.remote_kv_source)
	// is how many leading prompt blocks the named peer holds, as the driver
	// asked it (Servable) when the request came: when admitted, the request
	// pulls those of them its own GPU and host tiers lack over the KV link
	// (tier.go), and computes the rest. 0: no pull; a peer that holds no
	// more than the request's own hit makes it compute, no error. At most
	// len(BlockHashes); not with RemotePrefill.
	PullBlocks int
}

// Output reports one request's progress in one step.
type Output struct {
	ReqID     uint64
	NewTokens int  // output tokens emitted for this request by this step (always 1 here)
	First     bool // this step emitted the first output token
	Finished  bool // this was the last output token; the request is gone
	// CachedTokens is the request's prefix-cache hit in tokens, as vLLM
	// reports it in usage.prompt_tokens_details.cached_tokens: the hit when it
	// was first scheduled. Set on the First output. For a request that
	// pulled its prompt (Request.RemotePrefill) it counts the pulled tokens
	// too, as vLLM's num_cached_tokens does: PromptTokens − 1.
	CachedTokens int
	// ExternalTokens are the prompt tokens a RemotePrefill request pulled
	// (vLLM's num_external_computed_tokens); its own cache held the
	// PromptTokens − ExternalTokens before them. For a request that loaded
	// from the host tier or pulled from a peer, those tokens
	// (HostTokens + PulledTokens). Set on the First output.
	ExternalTokens int
	// HostTokens and PulledTokens are the prompt tokens a request loaded
	// from its host tier and pulled from a peer. Set on the First output.
	HostTokens, PulledTokens int
	// Held (on the Finished output of a RemoteDecode request): its blocks
	// are held for the remote decode; HeldBlocks gives their ids, what the
	// decode side reads (vLLM's remote_block_ids).
	Held bool
}

// KVKind is the kind of a KV cache event.
type KVKind uint8

// KV event kinds, mirroring vLLM's BlockStored, BlockRemoved, AllBlocksCleared.
const (
	Stored KVKind = iota + 1
	Removed
	Cleared
)

func (k KVKind) String() string {
	switch k {
	case Stored:
		return "BlockStored"
	case Removed:
		return "BlockRemoved"
	case Cleared:
		return "AllBlocksCleared"
	}
	return fmt.Sprintf("KVKind(%d)", uint8(k))
}

// Medium is where a KV event's blocks are: vLLM's event medium.
type Medium uint8

// Media.
const (
	MediumGPU Medium = iota // the engine's GPU KV cache
	MediumCPU               // its host tier (tier.go)
)

// String is vLLM's name of the medium (MEDIUM_GPU, MEDIUM_CPU in
// vllm/distributed/kv_events.py).
func (m Medium) String() string {
	if m == MediumCPU {
		return "CPU"
	}
	return "GPU"
}

// KVEvent mirrors one vLLM KV cache event. Replaying a replica's events in
// order into a set per medium (add on Stored, delete on Removed, empty all
// on Cleared) gives exactly the hashes each tier holds: a hash is never
// stored twice in one medium without a Removed in between. Events of the
// host tier (Medium CPU) carry the hashes only, as vLLM's
// OffloadingConnector sends them by default.
type KVEvent struct {
	Kind        KVKind
	Medium      Medium
	BlockHashes []uint64 // Stored: a subslice of the request's BlockHashes, do not modify
	ParentHash  uint64   // Stored: hash of the block before the first stored one
	HasParent   bool     // Stored: false when the first stored block is the prompt's first
	TokenIDs    []uint32 // Stored: tokens of the stored blocks (nil if the request had none)
	BlockSize   int
	LoraName    string
}

// StepResult is what one iteration did.
type StepResult struct {
	Start, End time.Duration // the step ran on [Start, End); its outputs are visible at End
	// Outputs, one per request that emitted a token, in scheduling order. The
	// slice is reused by the next Step: consume or copy it before calling Step
	// again. KV is freshly allocated and may be kept.
	Outputs []Output
	KV      []KVEvent
	Tokens  int // tokens processed: prefill chunk tokens + one per decode
	Seqs    int // sequences scheduled
	// Pulls are the transfers of RemotePrefill requests that ended at or
	// before Start (their requests could take part in this step): the
	// moment to release the prefill side's hold. Expired are the
	// RemoteDecode requests whose hold timed out at or before Start. Both
	// are reused by the next Step like Outputs, and are set even when the
	// step scheduled nothing.
	Pulls   []Pull
	Expired []uint64
}

// Stats is a snapshot of the engine's gauges and cumulative counters, named
// after vLLM's metrics.
type Stats struct {
	Running, Waiting int
	// KVUsage is vLLM's kv_cache_usage_perc: the fraction of blocks held by
	// running requests, 0..1. Cached free blocks do not count.
	KVUsage      float64
	CachedBlocks int // blocks carrying a hash, held or free (hittable now)

	PrefixQueries    int64 // prompt tokens looked up, once per request when first scheduled
	PrefixHits       int64 // of which cached
	PromptTokens     int64 // prompt tokens of requests that emitted their first token
	GenerationTokens int64
	RequestsFinished int64
	RequestsAborted  int64
	Preemptions      int64
	EvictedBlocks    int64 // cached blocks whose hash was evicted for reuse (Removed events)

	// Prefill/decode disaggregation. Pulling requests (waiting for remote
	// KV) are counted in Waiting too, as vLLM counts them; Held are the
	// finished RemoteDecode requests whose blocks are held (in KVUsage).
	Pulling, Held int
	// ExternalQueries and ExternalHits are vLLM's external prefix cache
	// counters (vllm:external_prefix_cache_*): the prompt tokens a
	// RemotePrefill request's own cache lacked, and of those the ones
	// pulled (all of them); for the other requests, the prompt tokens
	// their GPU cache lacked, and of those the ones loaded from the host
	// tier or pulled from a peer.
	ExternalQueries, ExternalHits int64

	// The host tier (tier.go): its blocks now and its size; blocks stored
	// and evicted; loads and their tokens. Peer pulls (Request.PullBlocks):
	// done, their tokens, and those that found nothing to pull.
	HostBlocks, HostCapacity    int
	HostStored, HostEvicted     int64
	HostLoads, HostLoadTokens   int64
	PeerPulls, PeerPullTokens   int64
	PeerPullMisses              int64
	Transfers                   int64 // pulls completed
	TransferTokens              int64 // tokens pulled
	HoldsReleased, HoldsExpired int64 // holds ended by Release, by KVHoldTimeout
	// Prompt tokens of requests that emitted their first token, by source
	// as vLLM's vllm:prompt_tokens_by_source: computed here, hit in the
	// local prefix cache, pulled from a remote prefill.
	PromptComputed, PromptLocalHit, PromptExternal int64

	NumBlocks, BlockSize int
}

type seqState uint8

const (
	stWaiting seqState = iota
	stRunning
	stDone
	stPulling // pulling its prompt's KV from a remote prefill: blocks held, no compute
	stHeld    // finished, blocks held for a remote decode
)

// seq is the engine's state of one request.
type seq struct {
	id        uint64
	prompt    int
	maxTokens int
	hashes    []uint64
	tokenIDs  []uint32
	lora      string
	arrival   time.Duration
	priority  int

	blocks   []int32 // block table: block i holds tokens [i·bs, (i+1)·bs)
	computed int     // tokens whose KV is computed (or scheduled in the current step)
	outputs  int     // output tokens emitted
	nHashed  int     // leading blocks already matched or offered to the cache
	cached   int     // prefix hit in tokens at first scheduling; −1 before
	assumed  int     // Request.AssumedCached

	state     seqState
	preempted bool   // waiting after a preemption: keeps its place at the head
	lastStep  uint64 // step number it was last scheduled in

	// Prefill/decode disaggregation (transfer.go).
	remoteDecode  bool          // hold the blocks when finished
	remotePrefill bool          // pull the prompt when first admitted (cleared then)
	pulled        bool          // waiting with its pulled blocks: computed = prompt − 1
	external      int           // prompt tokens pulled
	pullStart     time.Duration // the transfer: admitted at pullStart, done at pullDone
	pullDone      time.Duration
	holdUntil     time.Duration // stHeld: freed at this time unless released

	// Host tier and peer pulls (tier.go, transfer.go).
	nOffered   int  // leading blocks offered to the host tier
	pullBlocks int  // Request.PullBlocks until admitted
	tierLoad   bool // stPulling for a host load or a peer pull, not a remote prefill
	loadTo     int  // tokens computed when the transfer is done
	hostTokens int  // prompt tokens loaded from the host tier
	pullTokens int  // prompt tokens pulled from a peer
}

// target is the sequence length whose KV must exist before the next token can
// be sampled: the prompt plus the outputs so far. A decode has target−computed
// = 1; a recompute after preemption re-prefills prompt and outputs, as vLLM v1.
func (s *seq) target() int { return s.prompt + s.outputs }

// Engine is one simulated replica.
type Engine struct {
	cfg  Config
	bs   int
	pool *blockPool
	rng  *rand.Rand // nil without jitter

	seqs    map[uint64]*seq
	waiting seqDeque
	running []*seq // admission order; between steps every entry is stRunning
	live    int    // stRunning entries of running
	spare   []*seq // finished seq structs, reused with their block tables

	// Prefill/decode disaggregation (transfer.go).
	pulling  []*seq        // stPulling, in order of pullDone
	holds    []hold        // holds in order of deadline; ended ones are skipped
	held     int           // stHeld requests
	linkFree time.Duration // when the KV link finishes the wire time of the transfers posted

	host     *hostTier     // nil: no host tier
	hostFree time.Duration // when the host link finishes the wire time of the loads posted

	// Per-step scratch.
	stepNo       uint64
	lastEnd      time.Duration
	budget       int
	work         costmodel.Step
	sched        []*seq
	preemptedNow bool
	now          time.Duration // the step's start
	outs         []Output
	events       []KVEvent
	pulls        []Pull
	expired      []uint64

	st Stats
}

// New builds an engine; the config's zero fields take their defaults.
func New(cfg Config) (*Engine, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	e := &Engine{
		cfg:  cfg,
		bs:   cfg.BlockSize,
		pool: newBlockPool(cfg.NumBlocks, !cfg.DisableKVEvents),
		seqs: make(map[uint64]*seq),
	}
	if cfg.Jitter > 0 {
		e.rng = rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))
	}
	if cfg.HostBlocks > 0 {
		e.host = newHostTier(cfg.HostBlocks, !cfg.DisableKVEvents)
	}
	e.st.NumBlocks, e.st.BlockSize = cfg.NumBlocks, cfg.BlockSize
	return e, nil
}

// Config is the engine's effective configuration (defaults filled).
func (e *Engine) Config() Config { return e.cfg }

func (e *Engine) blocksFor(tokens int) int { return (tokens + e.bs - 1) / e.bs }

// Add queues a request that arrived at now. Requests are served in order of
// arrival; a request added with an earlier now than those queued goes before
// them, but never before a preempted request. The engine keeps r's slices,
// not r.
func (e *Engine) Add(r *Request, now time.Duration) error {
	if r == nil {
		return fmt.Errorf("%w: nil", ErrInvalidRequest)
	}
	switch {
	case r.PromptTokens < 1:
		return fmt.Errorf("%w: id %d: prompt_tokens %d < 1", ErrInvalidRequest, r.ID, r.PromptTokens)
	case r.MaxTokens < 1:
		return fmt.Errorf("%w: id %d: max_tokens %d < 1", ErrInvalidRequest, r.ID, r.MaxTokens)
	case len(r.BlockHashes) > r.PromptTokens/e.bs:
		return fmt.Errorf("%w: id %d: %d block hashes for %d full blocks", ErrInvalidRequest,
			r.ID, len(r.BlockHashes), r.PromptTokens/e.bs)
	case len(r.TokenIDs) != 0 && len(r.TokenIDs) != r.PromptTokens:
		return fmt.Errorf("%w: id %d: %d token ids for %d prompt tokens", ErrInvalidRequest,
			r.ID, len(r.TokenIDs), r.PromptTokens)
	case r.PullBlocks < 0 || r.PullBlocks > len(r.BlockHashes):
		return fmt.Errorf("%w: id %d: pull of %d blocks out of [0, %d]", ErrInvalidRequest,
			r.ID, r.PullBlocks, len(r.BlockHashes))
	case r.PullBlocks > 0 && r.RemotePrefill:
		return fmt.Errorf("%w: id %d: a peer pull on a remote prefill", ErrInvalidRequest, r.ID)
	}
	if err := e.checkTransfer(r); err != nil {
		return err
	}
	// KV slots needed at the end: the prompt and every output but the last,
	// which is sampled and never fed back. Compared against the room the
	// prompt leaves, so that no caller's number is added to another: a
	// max_tokens near MaxInt must not wrap around.
	if capacity := e.cfg.NumBlocks * e.bs; r.PromptTokens > capacity || r.MaxTokens-1 > capacity-r.PromptTokens {
		return fmt.Errorf("%w: id %d: prompt %d + max_tokens %d exceed the cache's %d tokens (%d blocks)",
			ErrTooLong, r.ID, r.PromptTokens, r.MaxTokens, capacity, e.cfg.NumBlocks)
	}
	if _, dup := e.seqs[r.ID]; dup {
		return fmt.Errorf("%w: %d", ErrDuplicateID, r.ID)
	}
	var s *seq
	if n := len(e.spare); n > 0 {
		s = e.spare[n-1]
		e.spare = e.spare[:n-1]
		*s = seq{blocks: s.blocks[:0]}
	} else {
		s = &seq{}
	}
	s.id, s.prompt, s.maxTokens = r.ID, r.PromptTokens, r.MaxTokens
	s.hashes, s.tokenIDs, s.lora = r.BlockHashes, r.TokenIDs, r.LoraName
	s.arrival, s.cached, s.state = now, -1, stWaiting
	s.remoteDecode, s.remotePrefill = r.RemoteDecode, r.RemotePrefill
	s.assumed = max(r.AssumedCached, 0)
	if e.cfg.PriorityScheduling {
		s.priority = r.Priority
	}
	s.pullBlocks = r.PullBlocks
	// Size the block table for the request's whole life once, so that
	// decode steps never allocate.
	if need := e.blocksFor(r.PromptTokens + r.MaxTokens - 1); cap(s.blocks) < need {
		s.blocks = make([]int32, 0, need)
	}
	e.seqs[r.ID] = s

	i := e.waiting.len()
	for i > 0 {
		p := e.waiting.at(i - 1)
		// A preempted request keeps its place at the head, but under
		// priority scheduling, where it waits by its priority as vLLM's
		// heap holds it.
		if p.preempted && !e.cfg.PriorityScheduling || p.pulled || !later(p.priority, p.arrival, s.priority, now) {
			break
		}
		i--
	}
	if i == e.waiting.len() {
		e.waiting.pushBack(s)
	} else {
		e.waiting.insert(i, s)
	}
	return nil
}

// Abort drops a live request (the client went away) and frees its blocks;
// they stay cached. It reports whether the id was live. A request whose
// transfer is under way stops pulling (the blocks it had not received are
// not cached); a held one is released as Release does, and is not counted
// as aborted.
func (e *Engine) Abort(id uint64) bool {
	s, ok := e.seqs[id]
	if !ok {
		return false
	}
	switch s.state {
	case stHeld:
		return e.Release(id)
	case stPulling:
		e.pool.release(s.blocks)
		e.removePulling(s)
	case stWaiting:
		e.waiting.remove(e.waiting.index(s))
		e.pool.release(s.blocks) // a pulled request waits with its blocks
	case stRunning:
		e.pool.release(s.blocks)
		i := slices.Index(e.running, s)
		e.running = slices.Delete(e.running, i, i+1)
		e.live--
	}
	e.st.RequestsAborted++
	e.retire(s)
	return true
}

// retire forgets a finished or aborted request and keeps its struct for reuse.
func (e *Engine) retire(s *seq) {
	delete(e.seqs, s.id)
	s.state = stDone
	s.blocks = s.blocks[:0]
	s.hashes, s.tokenIDs = nil, nil
	e.spare = append(e.spare, s)
}

// HasWork reports whether a Step would schedule anything now. Transfers
// under way and holds are not work: NextEvent says when they end.
func (e *Engine) HasWork() bool { return e.live > 0 || e.waiting.len() > 0 }

// Stats is a snapshot of gauges and counters.
func (e *Engine) Stats() Stats {
	s := e.st
	s.Running = e.live
	s.Waiting = e.waiting.len() + len(e.pulling)
	s.Pulling, s.Held = len(e.pulling), e.held
	s.KVUsage = float64(e.pool.used()) / float64(e.cfg.NumBlocks)
	s.CachedBlocks = e.pool.cache.Len()
	s.EvictedBlocks = e.pool.evicted
	if e.host != nil {
		s.HostBlocks, s.HostCapacity = e.host.len(), e.host.n
		s.HostStored, s.HostEvicted = e.host.storedN, e.host.evicted
	}
	return s
}

// Backlog is the exact work an engine holds, what a router with perfect
// knowledge would weigh (the replay's oracle bound; replicas report only
// Stats' gauges).
type Backlog struct {
	// Prefill is the prompt tokens still to compute, of the waiting
	// requests (less the hits they were promised: AssumedCached, or what
	// they computed before a preemption) and of the running ones that have
	// not sampled their first token.
	Prefill int
	// Pending counts the requests without a first token yet; Live every
	// request waiting or running.
	Pending, Live int
	// Footprint is the prompt plus max output tokens of the live requests.
	Footprint int
	// KV is the tokens of KV they hold or will: the blocks running
	// requests hold (shared ones once), the tokens they have still to add,
	// and the waiting requests' uncomputed prompt and output.
	KV int
}

// Backlog sums the engine's queued and running work (O(live requests)).
func (e *Engine) Backlog() Backlog {
	b := Backlog{KV: e.pool.used() * e.bs}
	add := func(s *seq, computed int) {
		b.Live++
		b.Footprint += s.prompt + s.maxTokens
		b.KV += max(s.prompt+s.maxTokens-1-computed, 0)
		if s.outputs == 0 {
			b.Pending++
			b.Prefill += max(s.prompt-computed, 0)
		}
	}
	for _, s := range e.running {
		if s.state == stRunning {
			add(s, s.computed)
		}
	}
	for i := range e.waiting.len() {
		s := e.waiting.at(i)
		add(s, max(s.computed, min(s.assumed, s.prompt-1)/e.bs*e.bs))
	}
	return b
}

// LoraRequests counts the live requests of each LoRA adapter, running and
// waiting (preempted ones wait), as vLLM's scheduler stats report them for
// vllm:lora_requests_info. Requests without an adapter are not counted.
func (e *Engine) LoraRequests() (running, waiting map[string]int) {
	running, waiting = map[string]int{}, map[string]int{}
	for _, s := range e.running {
		if s.state == stRunning && s.lora != "" {
			running[s.lora]++
		}
	}
	for i := range e.waiting.len() {
		if s := e.waiting.at(i); s.lora != "" {
			waiting[s.lora]++
		}
	}
	for _, s := range e.pulling {
		if s.lora != "" {
			waiting[s.lora]++
		}
	}
	return running, waiting
}

// PeekCached is the prefix-cache hit, in tokens, that a request with these
// block hashes and prompt length would get if it were scheduled now: the
// longest run of its leading blocks cached, block-aligned and at most
// promptTokens − 1 (vLLM v1 recomputes at least the last prompt token, and
// since hits are whole blocks, a fully cached prompt recomputes its last
// block). No side effects.
func (e *Engine) PeekCached(hashes []uint64, promptTokens int) int {
	if promptTokens < 1 {
		return 0
	}
	return e.pool.matchLen(hashes, (promptTokens-1)/e.bs) * e.bs
}

// ResetPrefixCache drops every cached hash, as vLLM's /reset_prefix_cache,
// and returns the Cleared event to publish. Like vLLM it refuses (false)
// while any block is held by a running request.
func (e *Engine) ResetPrefixCache() (KVEvent, bool) {
	if e.pool.used() != 0 {
		return KVEvent{}, false
	}
	e.pool.clearHashes()
	if e.host != nil {
		e.host.clear()
	}
	return KVEvent{Kind: Cleared, BlockSize: e.bs}, true
}

// Step plans and runs one iteration starting at now (or at the end of the
// previous step, if later: steps never overlap). Its outputs are visible at
// End. With no work it returns an empty result with End == Start (which
// may still report transfers ended, holds expired and KV events).
//
// First, holds whose deadline passed are freed and transfers that ended by
// the start are done: their requests wait at the head of the queue.
//
// Planning follows vLLM v1's scheduler with decodes first:
//  1. every running sequence that finished its prefill gets one decode token;
//  2. running partial prefills (and recomputes) continue, in admission order,
//     each chunk capped by the remaining token budget;
//  3. if no request was preempted in this step, waiting requests are admitted
//     in FCFS order while budget, the MaxSeqs cap and free blocks allow; each
//     takes its cached prefix and prefills the rest, chunked to the budget.
//
// When a running sequence needs a block and none is free, the most recently
// admitted running sequence not yet scheduled in this step is preempted by
// recompute (its blocks freed, cached, and it goes back to the head of the
// waiting queue); if there is none, the sequence preempts itself.
func (e *Engine) Step(now time.Duration) StepResult {
	start := max(now, e.lastEnd)
	e.stepNo++
	e.outs = e.outs[:0]
	e.events = nil
	e.sched = e.sched[:0]
	e.budget = e.cfg.MaxBatchTokens
	e.work = costmodel.Step{}
	e.preemptedNow = false
	e.now = start
	e.pulls, e.expired = e.pulls[:0], e.expired[:0]
	if len(e.holds) > 0 || len(e.pulling) > 0 {
		e.advance(start)
	}

	// 1. Decodes.
	for i := 0; i < len(e.running) && e.budget > 0; i++ {
		s := e.running[i]
		if s.state == stRunning && s.outputs > 0 && s.target()-s.computed == 1 {
			e.extend(s, 1)
		}
	}
	// 2. Partial prefills and recomputes.
	for i := 0; i < len(e.running) && e.budget > 0; i++ {
		s := e.running[i]
		if s.state == stRunning && s.lastStep != e.stepNo {
			e.extend(s, min(s.target()-s.computed, e.budget))
		}
	}
	// 3. Admissions, unless this step preempted: the cache is short, and
	// admitting would only take blocks the preempted request needs (vLLM).
	// Requests whose transfers are done are admitted all the same, within
	// the blocks they hold (they need none: see admitPulled). So a step
	// that preempted always schedules something: the first running
	// sequence only preempts itself once every other one is gone, and then
	// the whole cache is free but its own blocks and those of requests
	// holding blocks outside the running list: those transferring (which
	// end at NextEvent), held (likewise) and pulled (admitted here).
	// What is free then fits it (Add rejects what cannot fit alone).
	e.admit(e.preemptedNow)
	e.flushRemoved()
	if e.host != nil {
		e.events = e.host.flush(e.events, e.bs)
	}

	if len(e.sched) == 0 {
		// Nothing computed; a transfer may still have started or ended,
		// a hold expired, and a sequence preempted itself.
		e.compactRunning()
		return StepResult{Start: start, End: start, KV: e.events, Pulls: e.pulls, Expired: e.expired}
	}
	var dur time.Duration
	if e.rng == nil {
		dur = e.cfg.Profile.StepTime(e.work)
	} else {
		ms := e.cfg.Profile.StepMs(e.work) * (1 + e.cfg.Jitter*(2*e.rng.Float64()-1))
		dur = time.Duration(ms * float64(time.Millisecond))
	}
	end := start + dur
	e.lastEnd = end
	e.emit()
	e.compactRunning()
	return StepResult{
		Start: start, End: end,
		Outputs: e.outs, KV: e.events,
		Tokens: e.work.Tokens, Seqs: len(e.sched),
		Pulls: e.pulls, Expired: e.expired,
	}
}

// extend schedules n more tokens of running sequence s, allocating the blocks
// they need and preempting others (or s itself) when the cache is full. It
// reports whether s was scheduled.
func (e *Engine) extend(s *seq, n int) bool {
	need := e.blocksFor(s.computed+n) - len(s.blocks)
	for need > e.pool.free {
		v := e.victim(s)
		e.preempt(v)
		if v == s {
			return false
		}
	}
	e.allocate(s, need)
	e.schedule(s, n)
	return true
}

// later reports whether a request of priority p arriving at a comes after
// one of priority q arriving at b: (priority, arrival) order, the waiting
// queue's (every priority 0 without priority scheduling: arrival order).
func later(p int, a time.Duration, q int, b time.Duration) bool {
	return p > q || p == q && a > b
}

// victim is the most recently admitted running sequence other than s that
// has not been scheduled in this step, or s itself if there is none (vLLM v1
// pops the tail of its running list, which is never already scheduled);
// with priority scheduling, the one of the largest (priority, arrival), s
// itself when it is the largest (vLLM v1: max(running, key=(priority,
// arrival_time))).
func (e *Engine) victim(s *seq) *seq {
	if e.cfg.PriorityScheduling {
		v := s
		for _, r := range e.running {
			if r != s && r.state == stRunning && r.lastStep != e.stepNo && later(r.priority, r.arrival, v.priority, v.arrival) {
				v = r
			}
		}
		return v
	}
	for j := len(e.running) - 1; j >= 0; j-- {
		r := e.running[j]
		if r != s && r.state == stRunning && r.lastStep != e.stepNo {
			return r
		}
	}
	return s
}

// preempt frees v's blocks (they stay cached, so the recompute hits them if
// they survive) and puts it back at the head of the waiting queue (behind
// the pulled requests). Its entry
// in running becomes a tombstone removed by compactRunning.
func (e *Engine) preempt(v *seq) {
	e.pool.release(v.blocks)
	v.blocks = v.blocks[:0]
	v.computed, v.nHashed = 0, 0
	v.state = stWaiting
	v.preempted = true
	e.live--
	// At the head of the queue (or its priority's place), but behind the
	// requests whose transfers are done: they hold their prompts' blocks
	// and need none to start, and a preempted request needing blocks must
	// not block them.
	i := e.priorityPlace(v)
	for i < e.waiting.len() && e.waiting.at(i).pulled {
		i++
	}
	e.waiting.insert(i, v)
	e.st.Preemptions++
	e.preemptedNow = true
}

// priorityPlace is where preempted v goes back into the waiting queue
// under priority scheduling: before the first request later than it (0
// without priority scheduling: the head).
func (e *Engine) priorityPlace(v *seq) int {
	if !e.cfg.PriorityScheduling {
		return 0
	}
	for i := range e.waiting.len() {
		if w := e.waiting.at(i); !w.pulled && later(w.priority, w.arrival, v.priority, v.arrival) {
			return i
		}
	}
	return e.waiting.len()
}

func (e *Engine) compactRunning() {
	e.running = slices.DeleteFunc(e.running, func(s *seq) bool { return s.state != stRunning })
}

// admit moves waiting requests into running, FCFS, stopping at the first one
// that cannot start (no budget, sequence cap, or not enough free blocks for
// its first chunk once its cached prefix is taken); pulledOnly, only the
// requests at the head whose transfers are done, within their own blocks.
func (e *Engine) admit(pulledOnly bool) {
	for e.budget > 0 && e.live < e.cfg.MaxSeqs && e.waiting.len() > 0 {
		s := e.waiting.front()
		if s.pulled {
			if !e.admitPulled(s, !pulledOnly) {
				return
			}
			continue
		}
		if pulledOnly {
			return
		}
		limit := min(len(s.hashes), (s.target()-1)/e.bs)
		s.blocks = s.blocks[:0]
		evictable := 0 // hit blocks sitting in the free queue: taking them shrinks it
		for i := range limit {
			bp := e.pool.cache.Get(s.hashes[i])
			if bp == nil {
				break
			}
			b := *bp
			if e.pool.ref[b] == 0 {
				evictable++
			}
			s.blocks = append(s.blocks, b)
		}
		hit := len(s.blocks)
		computed := max(hit, min(s.assumed/e.bs, limit)) * e.bs
		if s.remotePrefill {
			if !e.admitPull(s, hit, evictable) {
				return
			}
			continue
		}
		if computed == hit*e.bs {
			if host, pull := e.loadable(s, hit, limit); host+pull > 0 {
				if !e.admitLoad(s, hit, host, pull, evictable) {
					return
				}
				continue
			}
		}
		n := min(s.target()-computed, e.budget)
		need := e.blocksFor(computed+n) - hit
		if need > e.pool.free-evictable {
			s.blocks = s.blocks[:0]
			return
		}
		e.waiting.popFront()
		for _, b := range s.blocks {
			e.pool.touch(b)
		}
		e.lookedUp(s, limit)
		s.computed, s.nHashed = computed, hit
		if s.cached < 0 {
			s.cached = computed
			e.st.PrefixQueries += int64(s.prompt)
			e.st.PrefixHits += int64(computed)
		}
		s.state, s.preempted = stRunning, false
		e.running = append(e.running, s)
		e.live++
		e.allocate(s, need)
		e.schedule(s, n)
	}
}

func (e *Engine) allocate(s *seq, need int) {
	for range need {
		s.blocks = append(s.blocks, e.pool.alloc())
	}
}

// schedule books n tokens of s into this step: budget, cost terms, and the
// hashes of the blocks that become full (vLLM v1 caches a block when it is
// scheduled, so a request admitted later in the same step can already hit it).
func (e *Engine) schedule(s *seq, n int) {
	decode := n == 1 && s.outputs > 0 && s.target()-s.computed == 1
	s.computed += n
	if decode {
		e.work.DecodeCtx += float64(s.computed)
	} else {
		e.work.PrefillCtx += float64(n) * float64(s.computed)
	}
	e.work.Tokens += n
	e.budget -= n
	s.lastStep = e.stepNo
	e.sched = append(e.sched, s)
	e.registerComputed(s)
}

// registerComputed gives the full blocks of s's computed tokens not yet
// offered to the cache their hashes, emitting Stored events for the runs
// newly cached.
func (e *Engine) registerComputed(s *seq) {
	hi := min(len(s.hashes), s.computed/e.bs)
	run := -1 // first block of the current run of newly stored blocks
	for i := s.nHashed; i < hi; i++ {
		if e.pool.register(s.blocks[i], s.hashes[i]) {
			if run < 0 {
				run = i
			}
			continue
		}
		if run >= 0 {
			e.stored(s, run, i)
			run = -1
		}
	}
	if run >= 0 {
		e.stored(s, run, hi)
	}
	s.nHashed = max(s.nHashed, hi)
	e.offload(s, hi)
}

// stored emits the Stored event of blocks [lo, hi) of s, after any pending
// Removed event so that a consumer sees evictions before the stores that
// caused them.
func (e *Engine) stored(s *seq, lo, hi int) {
	if e.cfg.DisableKVEvents {
		return
	}
	e.flushRemoved()
	ev := KVEvent{
		Kind:        Stored,
		BlockHashes: s.hashes[lo:hi:hi],
		BlockSize:   e.bs,
		LoraName:    s.lora,
	}
	if lo > 0 {
		ev.ParentHash, ev.HasParent = s.hashes[lo-1], true
	}
	if len(s.tokenIDs) >= hi*e.bs {
		ev.TokenIDs = s.tokenIDs[lo*e.bs : hi*e.bs : hi*e.bs]
	}
	e.events = append(e.events, ev)
}

func (e *Engine) flushRemoved() {
	if len(e.pool.removed) == 0 {
		return
	}
	e.events = append(e.events, KVEvent{
		Kind:        Removed,
		BlockHashes: slices.Clone(e.pool.removed),
		BlockSize:   e.bs,
	})
	e.pool.removed = e.pool.removed[:0]
}

// emit produces the outputs of the planned step: every scheduled sequence
// whose KV now covers its whole target samples one token; those at MaxTokens
// finish and free their blocks.
func (e *Engine) emit() {
	for _, s := range e.sched {
		if s.computed < s.target() {
			continue // a partial prefill chunk: no token yet
		}
		s.outputs++
		e.st.GenerationTokens++
		o := Output{ReqID: s.id, NewTokens: 1}
		if s.outputs == 1 {
			o.First, o.CachedTokens, o.ExternalTokens = true, s.cached, s.external
			o.HostTokens, o.PulledTokens = s.hostTokens, s.pullTokens
			e.st.PromptTokens += int64(s.prompt)
			e.countSources(s)
		}
		if s.outputs == s.maxTokens {
			o.Finished = true
			e.live--
			e.st.RequestsFinished++
			if s.remoteDecode {
				o.Held = true
				e.hold(s)
			} else {
				e.pool.release(s.blocks)
				e.retire(s)
			}
		}
		e.outs = append(e.outs, o)
	}
}
