package policy

import "fmt"

func init() {
	register("score", func(o Options) (Policy, error) {
		params := scoreParams{CacheWeight: 1, LoadWeight: 1}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if !(params.CacheWeight >= 0 && params.LoadWeight >= 0) {
			return nil, fmt.Errorf("%w: cache_weight and load_weight must be ≥ 0", ErrParam)
		}
		return &Score{params: params, g: newRNG(o.Seed)}, nil
	})
}

type scoreParams struct {
	CacheWeight float64 `json:"cache_weight"`
	LoadWeight  float64 `json:"load_weight"`
}

// Score is seed 003's weighted score: per replica
//
//	cache = matched blocks / prompt blocks            (0 for a prompt without a full block)
//	load  = 1 − in flight / max in flight              (1 when nothing is in flight)
//	score = cache_weight × cache + load_weight × load
//
// the highest score wins, ties at random. Both terms lie in [0,1], so the
// weights say directly how many points of load a full cache hit outweighs.
type Score struct {
	params scoreParams
	g      *rng
}

var _ Policy = (*Score)(nil)

func (*Score) Name() string { return "score" }

func (p *Score) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	maxLoad := 0
	for _, i := range c {
		maxLoad = max(maxLoad, rs[i].InFlight)
	}
	n := len(req.Blocks)
	scores := make([]float64, len(rs))
	for _, i := range c {
		cache, load := 0.0, 1.0
		if n > 0 {
			cache = float64(min(count(rs[i].Match), n)) / float64(n)
		}
		if maxLoad > 0 {
			load = 1 - float64(rs[i].InFlight)/float64(maxLoad)
		}
		scores[i] = p.params.CacheWeight*cache + p.params.LoadWeight*load
	}
	i := argBest(c, func(i int) float64 { return scores[i] }, false, p.g)
	d := decide(rs, i, "max weighted cache + load score", min(count(rs[i].Match), n), float64(rs[i].InFlight))
	d.Scores = scores
	return d, nil
}
