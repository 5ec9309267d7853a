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
			OverlapScoreCredit: 1,
			PrefillLoadScale:   1,
			QueueThreshold:     nullableFloat{V: dynamoQueueThreshold, Set: true},
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
		if !(params.OverlapScoreCredit >= 0 && params.PrefillLoadScale >= 0 && params.Temperature >= 0) ||
			math.IsInf(params.OverlapScoreCredit+params.PrefillLoadScale+params.Temperature, 0) ||
			(q.Set && !(q.V >= 0 && !math.IsInf(q.V, 0))) {
			return nil, fmt.Errorf("%w: overlap_score_credit, prefill_load_scale, temperature and "+
				"router_queue_threshold must be finite and ≥ 0", ErrParam)
		}
		return &Dynamo{
			params:    params,
			blockSize: float64(o.BlockSize),
			maxBatch:  float64(o.MaxBatchTokens),
			g:         newRNG(o.Seed),
			active:    map[uint64]dynamoActive{},
			blocks:    map[int]map[uint64]int32{},
		}, nil
	})
}

type dynamoParams struct {
	// OverlapScoreCredit credits each matched (device-local) block against
	// the prefill blocks (--router-kv-overlap-score-credit).
	OverlapScoreCredit float64 `json:"overlap_score_credit"`
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
}

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
	prefill := float64(v.PendingPrefill+req.Tokens) / p.blockSize
	credit := p.params.OverlapScoreCredit * float64(v.Match)
	decode := len(set) + len(req.Blocks) - activePrefix(req.Blocks, set)
	return p.params.PrefillLoadScale*max(prefill-credit, 0) + float64(decode)
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
	costs := make([]float64, len(rs))
	lo, hi := math.Inf(1), math.Inf(-1)
	p.mu.RLock()
	for _, i := range c {
		costs[i] = p.cost(req, &rs[i], p.blocks[rs[i].Index])
		lo, hi = min(lo, costs[i]), max(hi, costs[i])
	}
	p.mu.RUnlock()
	var i int
	reason := "lowest prefill + decode cost"
	if p.params.Temperature > 0 {
		i, reason = p.sample(c, costs, lo, hi), "sampled by cost (softmax)"
	} else {
		i = argBest(c, func(i int) float64 { return costs[i] }, true, p.g)
	}
	d := decide(rs, i, reason, rs[i].Match, costs[i])
	d.Scores = costs
	return d, nil
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
func (p *Dynamo) Observe(ev Event) {
	if ev.Req == nil || ev.Remote || (ev.Kind != Routed && ev.Kind != Done) {
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
	p.active[ev.Req.ID] = dynamoActive{slot: ev.Replica, blocks: ev.Req.Blocks}
}

// release takes a's blocks out of its replica's multiset.
func (p *Dynamo) release(a dynamoActive) {
	set := p.blocks[a.slot]
	for _, h := range a.blocks {
		if set[h] <= 1 {
			delete(set, h)
		} else {
			set[h]--
		}
	}
}
