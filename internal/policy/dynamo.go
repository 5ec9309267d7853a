// NVIDIA Dynamo's KV router as users run it: ai-dynamo/dynamo main, v1.x
// after overlap_score_weight was split into overlap_score_credit and
// prefill_load_scale (no release tag pinned), launched as `python -m
// dynamo.frontend --router-mode kv` with the defaults of its KV-router flags
// (components/src/dynamo/common/configuration/groups/kv_router_args.py:
// --router-kv-overlap-score-credit 1.0, --router-prefill-load-scale 1.0,
// --router-temperature 0, --router-kv-events on, --router-track-active-blocks
// on, --router-assume-kv-reuse on, --router-track-output-blocks off,
// --router-track-prefill-tokens on, --router-queue-threshold 16.0,
// --router-queue-policy fcfs); the cost is lib/kv-router/src/scheduling/selector/default.rs
// (worker_logit), the active blocks lib/kv-router's ActiveSequences
// (new_blocks, potential_blocks_and_tokens), the queue
// lib/kv-router/src/scheduling/queue.rs (all_workers_busy). (The Rust
// KvRouterConfig::default() leaves the queue off; the launch path turns it
// on at 16.)

package policy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"strings"
	"sync"
)

// dynamoQueueThreshold is --router-queue-threshold's default.
const dynamoQueueThreshold = 16.0

func init() {
	register("dynamo", func(o Options) (Policy, error) {
		params := dynamoParams{
			OverlapScoreCredit:             1,
			HostCacheHitWeight:             dynamoHostCacheHitWeight,
			PrefillLoadScale:               1,
			QueueThreshold:                 nullableFloat{V: dynamoQueueThreshold, Set: true},
			ConditionalPrefillMaxNewTokens: dynamoConditionalPrefillMaxNewTokens,
		}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if w := params.OverlapScoreWeight; w != nil {
			// Upstream's legacy mapping: a nonzero weight is the prefill
			// load scale; 0 turns overlap off altogether.
			if !(*w >= 0) {
				return nil, fmt.Errorf("%w: overlap_score_weight must be ≥ 0", ErrParam)
			}
			params.PrefillLoadScale = *w
			if *w == 0 {
				params.OverlapScoreCredit = 0
			}
		}
		q := params.QueueThreshold
		if !(params.OverlapScoreCredit >= 0 && params.PrefillLoadScale >= 0 && params.Temperature >= 0 && params.HostCacheHitWeight >= 0) ||
			math.IsInf(params.OverlapScoreCredit+params.PrefillLoadScale+params.Temperature+params.HostCacheHitWeight, 0) ||
			(q.Set && !(q.V >= 0 && !math.IsInf(q.V, 0))) || params.ConditionalPrefillMaxNewTokens < 0 {
			return nil, fmt.Errorf("%w: overlap_score_credit, host_cache_hit_weight, prefill_load_scale, temperature and "+
				"router_queue_threshold must be finite and ≥ 0, conditional_prefill_max_new_tokens ≥ 0", ErrParam)
		}
		return &Dynamo{
			params:    params,
			blockSize: float64(o.BlockSize),
			maxBatch:  float64(o.MaxBatchTokens),
			g:         newRNG(o.Seed),
			active:    map[uint64]dynamoActive{},
			blocks:    map[int]map[uint64]int32{},
			total:     map[int]int{},
		}, nil
	})
}

type dynamoParams struct {
	// OverlapScoreCredit credits each matched (device-local) block against
	// the prefill blocks (--router-kv-overlap-score-credit).
	OverlapScoreCredit float64 `json:"overlap_score_credit"`
	// HostCacheHitWeight credits each block the worker's host tier holds
	// past its device match (--router-host-cache-hit-weight, default 0.75;
	// lib/kv-router/src/scheduling/selector.rs: overlap_credit_blocks =
	// credit × device + host_cache_hit_weight × host_pinned + disk …).
	HostCacheHitWeight float64 `json:"host_cache_hit_weight"`
	// PrefillLoadScale scales the credited prefill blocks before the
	// decode blocks are added (--router-prefill-load-scale).
	PrefillLoadScale float64 `json:"prefill_load_scale"`
	// OverlapScoreWeight is the deprecated --router-kv-overlap-score-weight,
	// mapped as upstream maps it: nonzero → prefill_load_scale, 0 → both
	// prefill_load_scale and overlap_score_credit 0.
	OverlapScoreWeight *float64 `json:"overlap_score_weight"`
	// Temperature 0 takes the cheapest replica; T > 0 samples a softmax
	// (--router-temperature).
	Temperature float64 `json:"temperature"`
	// QueueThreshold is --router-queue-threshold: Pick defers while every
	// healthy replica's active prefill tokens exceed threshold ×
	// max_num_batched_tokens; null or "None" turns the queue off.
	QueueThreshold nullableFloat `json:"router_queue_threshold"`
	// ConditionalPrefill (P/D, --router-conditional-prefill, off by
	// default): a request whose decode worker (as the decode router would
	// pick it with the aggregated cost) lacks at most
	// ConditionalPrefillMaxNewTokens of its prompt skips the remote
	// prefill and is prefilled there
	// (--router-conditional-prefill-max-new-tokens, default 5000).
	ConditionalPrefill             bool `json:"conditional_prefill"`
	ConditionalPrefillMaxNewTokens int  `json:"conditional_prefill_max_new_tokens"`
}

// dynamoHostCacheHitWeight is --router-host-cache-hit-weight's default
// (lib/kv-router's config: default_host_cache_hit_weight; disk's is 0.25,
// a tier kvgate's engine model does not have).
const dynamoHostCacheHitWeight = 0.75

// dynamoConditionalPrefillMaxNewTokens is
// --router-conditional-prefill-max-new-tokens' default.
const dynamoConditionalPrefillMaxNewTokens = 5000

// nullableFloat is a number, or off: JSON null or the string "None" (as
// upstream's nullable_float flag takes it; "none", "off" too).
type nullableFloat struct {
	V   float64
	Set bool
}

func (f *nullableFloat) UnmarshalJSON(b []byte) error {
	if bytes.Equal(bytes.TrimSpace(b), []byte("null")) {
		*f = nullableFloat{}
		return nil
	}
	var s string
	if json.Unmarshal(b, &s) == nil {
		switch strings.ToLower(s) {
		case "none", "off", "null":
			*f = nullableFloat{}
			return nil
		}
		return fmt.Errorf("router_queue_threshold: %q is neither a number nor None", s)
	}
	var v float64
	if err := json.Unmarshal(b, &v); err != nil {
		return fmt.Errorf("router_queue_threshold: %w", err)
	}
	*f = nullableFloat{V: v, Set: true}
	return nil
}

// Dynamo is NVIDIA Dynamo's KV router. Per replica, in blocks of
// Options.BlockSize tokens:
//
//	prefill = (active prefill tokens + this prompt's tokens) / block size
//	credit  = overlap_score_credit × matched blocks
//	decode  = distinct prompt blocks of the replica's active requests
//	          + this request's blocks not among them
//	cost    = prefill_load_scale × max(prefill − credit, 0) + decode
//
// Active prefill tokens are the uncached prompt tokens of the replica's
// requests without a first token yet (ReplicaView.PendingPrefill, as
// Dynamo's ActiveSequences count isl − overlap × block size until the
// prefill completes). The decode term is Dynamo's potential blocks with
// router_assume_kv_reuse on and output blocks untracked: the policy keeps,
// per replica, a multiset of the full-block hashes of its active requests
// (added when Routed, removed when Done), so a prefix shared by several
// active requests counts once; output tokens never count.
//
// The cheapest replica wins (ties at random). With temperature T > 0 the
// choice is sampled with p ∝ exp(−(cost − min) / ((max − min) · T)), a
// softmax over min-max normalised costs (uniform when all costs are equal).
//
// Router queue: while every healthy replica's active prefill tokens exceed
// router_queue_threshold × max_num_batched_tokens (Options.MaxBatchTokens;
// strictly, as all_workers_busy), Pick returns ErrDefer and the router
// holds the request, first come first served, until prefill work shrinks
// (unless Request.NoDefer: nothing in flight would release it).
//
// The match is the router's index (ReplicaView.Match): Dynamo follows the
// engines' KV events by default (--router-kv-events), so the policy asks
// for them (WantsKVEvents); without events kvgate's approximate index
// stands in for Dynamo's routing-predicted tree with its 120 s TTL.
type Dynamo struct {
	params    dynamoParams
	blockSize float64
	maxBatch  float64 // max_num_batched_tokens
	g         *rng

	mu     sync.RWMutex
	active map[uint64]dynamoActive  // request ID → where its blocks count
	blocks map[int]map[uint64]int32 // slot → block hash → active requests holding it
	total  map[int]int              // slot → blocks of its active requests, shared ones counted each time
}

type dynamoActive struct {
	slot   int
	blocks []uint64
}

var _ Policy = (*Dynamo)(nil)
var _ Observer = (*Dynamo)(nil)
var _ KVEventsPolicy = (*Dynamo)(nil)

func (*Dynamo) Name() string { return "dynamo" }

// WantsKVEvents: Dynamo's router follows the engines' KV events by default.
func (*Dynamo) WantsKVEvents() bool { return true }

// cost is the Dynamo cost of sending req to v, in blocks; set is v's
// active blocks (read-locked by the caller).
func (p *Dynamo) cost(req *Request, v *ReplicaView, set map[uint64]int32) float64 {
	decode := len(set) + len(req.Blocks) - activePrefix(req.Blocks, set)
	return p.prefillCost(req, v) + float64(decode)
}

// prefillCost is the prefill term of v's cost: prefill_load_scale ×
// max(prefill blocks − credit × matched blocks, 0), counts clamped (count:
// a sum of two impossible counts must not wrap around).
func (p *Dynamo) prefillCost(req *Request, v *ReplicaView) float64 {
	prefill := float64(count(v.PendingPrefill)+count(req.Tokens)) / p.blockSize
	credit := p.params.OverlapScoreCredit*float64(count(v.Match)) + p.params.HostCacheHitWeight*float64(v.HostBeyond())
	return p.params.PrefillLoadScale * max(prefill-credit, 0)
}

// activePrefix is the number of blocks (hashes) in set. A chained hash
// names its whole prefix and set holds whole prompts' blocks, so the
// blocks in set are a prefix of blocks, found by binary search: Dynamo's
// new_blocks count with O(log n) look-ups instead of n.
func activePrefix(blocks []uint64, set map[uint64]int32) int {
	if len(set) == 0 {
		return 0
	}
	lo, hi := 0, len(blocks) // blocks[:lo] in set, blocks[hi:] not
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if set[blocks[mid]] > 0 {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return lo
}

// busy reports whether every candidate's active prefill tokens exceed the
// queue threshold.
func (p *Dynamo) busy(rs []ReplicaView, c []int) bool {
	q := p.params.QueueThreshold
	if !q.Set {
		return false
	}
	limit := q.V * p.maxBatch
	for _, i := range c {
		if float64(rs[i].PendingPrefill) <= limit {
			return false
		}
	}
	return true
}

// Pick fills Scores with the costs (0 at unhealthy positions).
func (p *Dynamo) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	if !req.NoDefer && p.busy(rs, c) {
		return Decision{}, ErrDefer
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	d, _ := p.pickBy(rs, c, func(v *ReplicaView) float64 { return p.cost(req, v, p.blocks[v.Index]) },
		"lowest prefill + decode cost")
	return d, nil
}

// pickBy picks among the candidates c of rs by cost: the cheapest (ties at
// random), or sampled with temperature; it returns the decision and the
// position chosen. p.mu must be read-locked.
func (p *Dynamo) pickBy(rs []ReplicaView, c []int, cost func(*ReplicaView) float64, reason string) (Decision, int) {
	costs := make([]float64, len(rs))
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, i := range c {
		costs[i] = cost(&rs[i])
		lo, hi = min(lo, costs[i]), max(hi, costs[i])
	}
	var i int
	if p.params.Temperature > 0 {
		i, reason = p.sample(c, costs, lo, hi), "sampled by cost (softmax)"
	} else {
		i = argBest(c, func(i int) float64 { return costs[i] }, true, p.g)
	}
	d := decide(rs, i, reason, count(rs[i].Match), costs[i])
	d.Scores = costs
	return d, i
}

// sample draws a candidate with probability ∝ exp(−(cost − lo)/((hi − lo)·T)).
func (p *Dynamo) sample(c []int, costs []float64, lo, hi float64) int {
	if hi == lo {
		return c[p.g.IntN(len(c))]
	}
	scale := (hi - lo) * p.params.Temperature
	sum := 0.0
	for _, i := range c {
		sum += math.Exp(-(costs[i] - lo) / scale)
	}
	u := p.g.Float64() * sum
	for _, i := range c {
		u -= math.Exp(-(costs[i] - lo) / scale)
		if u < 0 {
			return i
		}
	}
	return c[len(c)-1] // rounding left u ≥ 0 after the last
}

// Observe keeps the active requests' blocks: Routed adds the request's
// blocks to its replica's multiset, Done takes them out.
//
// A remote decision (another gateway's) is not kept: no Done would take it
// out; its load arrives as the other gateways' counts.
//
// A prefill step (PhasePrefill) is not kept either: Dynamo's prefill
// router runs with router_track_active_blocks off.
func (p *Dynamo) Observe(ev Event) {
	if ev.Req == nil || ev.Remote || ev.Phase == PhasePrefill || (ev.Kind != Routed && ev.Kind != Done) {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	// A request routed again (a retry) leaves its first replica first.
	if a, ok := p.active[ev.Req.ID]; ok {
		p.release(a)
		delete(p.active, ev.Req.ID)
	}
	if ev.Kind != Routed || ev.Replica < 0 {
		return
	}
	set := p.blocks[ev.Replica]
	if set == nil {
		set = map[uint64]int32{}
		p.blocks[ev.Replica] = set
	}
	for _, h := range ev.Req.Blocks {
		set[h]++
	}
	p.total[ev.Replica] += len(ev.Req.Blocks)
	p.active[ev.Req.ID] = dynamoActive{slot: ev.Replica, blocks: ev.Req.Blocks}
}

// release takes a's blocks out of its replica's multiset.
func (p *Dynamo) release(a dynamoActive) {
	p.total[a.slot] -= len(a.blocks)
	set := p.blocks[a.slot]
	for _, h := range a.blocks {
		if set[h] <= 1 {
			delete(set, h)
		} else {
			set[h]--
		}
	}
}

var _ PairPicker = (*Dynamo)(nil)

// PickPair is Dynamo's disaggregated routing as dynamo.frontend runs it
// when prefill workers are registered (docs: components/router
// disaggregated-serving; lib/llm/src/kv_router/prefill_router): the
// prefill router, a KV router with router_track_active_blocks off, picks
// the prefill worker by prefill_load_scale × max(prefill blocks − credit ×
// matched, 0); then the decode router picks the decode worker with its
// override (prefill_router build_decode_router_override:
// overlap_score_weight 0, assume_kv_reuse false, track_prefill_tokens
// false): by the blocks of its active requests, each request's counted in
// full, and the request's own. The prefill step is never skipped, unless
// conditional_prefill is on (prefill_router conditional_bypass.rs,
// TokenCapConditionalPrefillPolicy): the decode router's aggregated pick is
// peeked first, and when that worker lacks at most
// conditional_prefill_max_new_tokens of the prompt the request is
// prefilled there. The router queue does not apply (RoutePD never defers).
func (p *Dynamo) PickPair(req *Request, prefill, decode []ReplicaView) (PairDecision, error) {
	var pbuf, dbuf [scratchLen]int
	pc, dc := healthy(prefill, &pbuf), healthy(decode, &dbuf)
	if len(pc) == 0 || len(dc) == 0 {
		return PairDecision{}, ErrNoReplica
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	if p.params.ConditionalPrefill {
		d, j := p.pickBy(decode, dc, func(v *ReplicaView) float64 { return p.cost(req, v, p.blocks[v.Index]) },
			"lowest prefill + decode cost")
		if n := uncachedOn(req, &decode[j], int(p.blockSize)); n <= p.params.ConditionalPrefillMaxNewTokens {
			return SkipPair(d, fmt.Sprintf("conditional prefill: the decode worker lacks %d ≤ %d prompt tokens",
				n, p.params.ConditionalPrefillMaxNewTokens)), nil
		}
	}
	pd, _ := p.pickBy(prefill, pc, func(v *ReplicaView) float64 { return p.prefillCost(req, v) },
		"prefill router: lowest prefill cost")
	dd, _ := p.pickBy(decode, dc, func(v *ReplicaView) float64 {
		return float64(p.total[v.Index] + len(req.Blocks))
	}, "decode router: fewest active blocks (overlap off)")
	return Pair(pd, dd, "Dynamo disaggregated: prefill router, then decode router"), nil
}
