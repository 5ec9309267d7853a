// llm-d's precise prefix-cache routing as users run it: the
// "precise-prefix-cache-aware" guide (llm-d/llm-d
// guides/precise-prefix-cache-aware/scheduler/precise-prefix-cache-aware.values.yaml):
// precise-prefix-cache-scorer weight 2, kv-cache-utilization-scorer 1,
// queue-scorer 1, max-score picker, speculativeIndexing true; the scorer as
// llm-d ≥ v0.9 ships it (llm-d-router
// pkg/epp/framework/plugins/scheduling/scorer/preciseprefixcache:
// precise_prefix_cache.go, utils.go absoluteScoredPods, defaultSpeculativeTTL
// 2 s); metrics every 50 ms as llm-d's scheduler refreshes them. The
// guide's image of v0.8 (llm-d-inference-scheduler
// pkg/plugins/scorer/precise_prefix_cache.go, utils.go) min-max normalised
// the prefix score and kept speculative entries 30 s: prefix_score "min-max",
// speculative_ttl_secs 30. (Later guides replace this profile by a
// prefix-cache-affinity filter and a token-load scorer, not modelled here.)

package policy

import (
	"fmt"
	"sync"
	"time"
)

const (
	preciseMinMax = "min-max"
	preciseRatio  = "ratio"
	// preciseSpeculativeTTL is the scorer's defaultSpeculativeTTL (llm-d ≥ v0.9).
	preciseSpeculativeTTL = 2.0
)

// preciseWeights is the guide's scheduling profile.
var preciseWeights = scorerWeights{Queue: 1, KV: 1, Prefix: 2}

func init() {
	register("precise", func(o Options) (Policy, error) {
		params := preciseParams{
			scorerWeights:       preciseWeights,
			PrefixScore:         preciseRatio,
			SpeculativeIndexing: true,
			SpeculativeTTLSecs:  preciseSpeculativeTTL,
			CPUWeight:           preciseCPUWeight,
		}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if !(params.CPUWeight >= 0 && params.CPUWeight <= 1) {
			return nil, fmt.Errorf("%w: cpu_weight must be in [0, 1]", ErrParam)
		}
		if err := params.scorerWeights.validate(); err != nil {
			return nil, err
		}
		if params.PrefixScore != preciseMinMax && params.PrefixScore != preciseRatio {
			return nil, fmt.Errorf("%w: prefix_score must be %q or %q", ErrParam, preciseMinMax, preciseRatio)
		}
		if !(params.SpeculativeTTLSecs > 0) {
			return nil, fmt.Errorf("%w: speculative_ttl_secs must be > 0", ErrParam)
		}
		ttl := time.Duration(params.SpeculativeTTLSecs * float64(time.Second))
		return &Precise{params: params, ttl: ttl, g: newRNG(o.Seed)}, nil
	})
}

type preciseParams struct {
	scorerWeights
	// PrefixScore is "ratio" (matched / prompt blocks, llm-d ≥ v0.9) or
	// "min-max" (matched blocks normalised over the candidates holding any,
	// llm-d-inference-scheduler ≤ v0.8).
	PrefixScore string `json:"prefix_score"`
	// SpeculativeIndexing credits the replica a request was routed to with
	// the request's blocks for SpeculativeTTLSecs, until its KV events
	// arrive (the guide's speculativeIndexing: true; TTL 2 s upstream).
	SpeculativeIndexing bool    `json:"speculative_indexing"`
	SpeculativeTTLSecs  float64 `json:"speculative_ttl_secs"`
	// CPUWeight weighs each block of the prefix a replica holds in its host
	// tier past its GPU match (medium CPU events), a GPU block weighing 1:
	// llm-d-kv-cache's LongestPrefixScorer's backend weights (gpu 1.0, cpu
	// 0.8 by default, kvCacheBackendConfigs). The weight ranks; the count
	// (Decision.Matched) is the blocks held, unweighted (the fix of
	// llm-d-router #1047, where the weighted score was read as a count).
	CPUWeight float64 `json:"cpu_weight"`
}

// preciseCPUWeight is llm-d-kv-cache's default weight of the cpu tier.
const preciseCPUWeight = 0.8

// Precise is llm-d's precise prefix-cache scoring: the queue and
// kv-cache-utilization scorers of llmd and a prefix scorer over the match
// the replicas' own KV events give (the router's precise index:
// ReplicaView.Match, blocks reported stored, removed ones dropped), weights
// 2 (prefix) : 1 (kv-cache) : 1 (queue), the highest sum wins, ties at
// random.
//
// The prefix score is each candidate's longest prefix match over the
// prompt's blocks (at most 1). prefix_score "min-max" gives v0.8's instead:
// the matches min-max normalised over the candidates that match at least
// one block, (m − min)/(max − min), 1 for all of them when they match
// equally, 0 for a candidate matching none — a lone holder of one block
// scores as a lone holder of the whole prompt, which on a trace whose
// prompts all share a system prompt sends everything to one replica.
//
// Speculative indexing: when a request is Routed, its blocks are credited
// to that replica until speculative_ttl_secs later (an entry lives that
// long after its latest routing; upstream evicts each request's entries
// TTL after that request), as the scorer adds them to its index at once to
// close the gap before the engine's KV events arrive. A replica's match is
// then the longer of the two: the events' prefix and the speculative one.
type Precise struct {
	params preciseParams
	ttl    time.Duration
	g      *rng

	mu        sync.RWMutex
	spec      map[int]map[uint64]time.Time // slot → block → expiry
	lastSweep time.Time
}

var _ Policy = (*Precise)(nil)
var _ Observer = (*Precise)(nil)
var _ MetricsRefresher = (*Precise)(nil)

func (*Precise) Name() string { return "precise" }

// WantsKVEvents: the scorer is defined on the replicas' KV events.
func (*Precise) WantsKVEvents() bool { return true }

// MetricsRefresh is llm-d's scheduler's metrics period.
func (*Precise) MetricsRefresh() time.Duration { return llmdMetricsRefresh }

func (p *Precise) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	n := len(req.Blocks)
	var mbuf [scratchLen]int
	match := scratch(&mbuf, len(rs))
	lo, hi := n+1, 0
	p.mu.RLock()
	for _, i := range c {
		m := min(max(rs[i].Match, 0), n)
		if set := p.spec[rs[i].Index]; set != nil {
			// Speculative blocks are closed under prefixes (a block's
			// expiry is at most its parent's), so they extend the events'
			// prefix exactly when they hold its next block.
			for m < n {
				if exp, ok := set[req.Blocks[m]]; !ok || !req.Now.Before(exp) {
					break
				}
				m++
			}
		}
		match[i] = m
		if m > 0 {
			lo, hi = min(lo, m), max(hi, m)
		}
	}
	p.mu.RUnlock()
	var pbuf [scratchLen]float64
	prefix := scratch(&pbuf, len(rs))
	// The host tier's blocks past the GPU's match, weighted (cpu_weight).
	host := func(i int) float64 {
		return p.params.CPUWeight * float64(max(min(count(rs[i].MatchHost), n)-match[i], 0))
	}
	for _, i := range c {
		switch m := match[i]; {
		case m == 0 && host(i) == 0:
		case p.params.PrefixScore == preciseRatio:
			prefix[i] = (float64(m) + host(i)) / float64(n)
		case hi == lo:
			prefix[i] = 1
		default:
			prefix[i] = max(float64(m-lo)+host(i), 0) / float64(hi-lo)
		}
	}
	scores := make([]float64, len(rs))
	p.params.fill(rs, c, prefix, scores)
	i := argBest(c, func(i int) float64 { return scores[i] }, false, p.g)
	held := max(rs[i].Match, match[i], min(count(rs[i].MatchHost), n))
	d := decide(rs, i, "max weighted queue + kv-cache + precise prefix score", held, float64(rs[i].InFlight))
	d.Scores = scores
	return d, nil
}

// Observe credits a routed request's blocks to its replica speculatively.
func (p *Precise) Observe(ev Event) {
	if !p.params.SpeculativeIndexing || ev.Kind != Routed || ev.Req == nil || ev.Replica < 0 || len(ev.Req.Blocks) == 0 {
		return
	}
	exp := ev.At.Add(p.ttl)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.spec == nil {
		p.spec = map[int]map[uint64]time.Time{}
	}
	set := p.spec[ev.Replica]
	if set == nil {
		set = map[uint64]time.Time{}
		p.spec[ev.Replica] = set
	}
	for _, h := range ev.Req.Blocks {
		if old, ok := set[h]; !ok || old.Before(exp) {
			set[h] = exp
		}
	}
	// Drop expired entries once per TTL: memory stays bounded by a TTL's
	// worth of routed blocks.
	if ev.At.Sub(p.lastSweep) >= p.ttl {
		p.lastSweep = ev.At
		for _, s := range p.spec {
			for h, e := range s {
				if !ev.At.Before(e) {
					delete(s, h)
				}
			}
		}
	}
}
