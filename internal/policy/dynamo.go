package policy

import (
	"fmt"
	"math"
)

func init() {
	register("dynamo", func(o Options) (Policy, error) {
		params := dynamoParams{OverlapWeight: 1}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if params.OverlapWeight < 0 || params.Temperature < 0 || math.IsNaN(params.OverlapWeight+params.Temperature) {
			return nil, fmt.Errorf("%w: overlap_score_weight and temperature must be ≥ 0", ErrParam)
		}
		return &Dynamo{params: params, blockSize: float64(o.BlockSize), g: newRNG(o.Seed)}, nil
	})
}

type dynamoParams struct {
	// OverlapWeight scales the credit of cached blocks against prefill blocks.
	OverlapWeight float64 `json:"overlap_score_weight"`
	// Temperature 0 takes the cheapest replica; T > 0 samples a softmax.
	Temperature float64 `json:"temperature"`
}

// Dynamo is NVIDIA Dynamo's KV router cost function. Per replica, in blocks:
//
//	prefill = (prompt tokens of its prefills in progress + this prompt's tokens) / block size
//	credit  = matched blocks × overlap_score_weight
//	decode  = (KV tokens of its active requests + this prompt's tokens) / block size
//	cost    = max(prefill − credit, 0) + decode
//
// The cheapest replica wins (ties at random). With temperature T > 0 the
// choice is sampled with p ∝ exp(−(cost − min) / ((max − min) · T)), a
// softmax over min-max normalised costs (uniform when all costs are equal).
//
// Dynamo without KV events predicts each worker's cache from its own routing
// decisions with a 120 s TTL; kvgate's version reads the router's shared
// prefix index instead (ReplicaView.Match: approximate from routing, or
// precise when KV events feed it), so that every policy sees the same index.
type Dynamo struct {
	params    dynamoParams
	blockSize float64
	g         *rng
}

var _ Policy = (*Dynamo)(nil)

func (*Dynamo) Name() string { return "dynamo" }

// cost is the Dynamo cost of sending req to v, in blocks.
func (p *Dynamo) cost(req *Request, v *ReplicaView) float64 {
	prefill := float64(v.PendingPrefill+req.Tokens) / p.blockSize
	credit := float64(v.Match) * p.params.OverlapWeight
	decode := float64(v.InFlightTokens+req.Tokens) / p.blockSize
	return max(prefill-credit, 0) + decode
}

// Pick fills Scores with the costs (0 at unhealthy positions).
func (p *Dynamo) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	costs := make([]float64, len(rs))
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, i := range c {
		costs[i] = p.cost(req, &rs[i])
		lo, hi = min(lo, costs[i]), max(hi, costs[i])
	}
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
