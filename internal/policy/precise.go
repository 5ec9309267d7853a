package policy

func init() {
	register("precise", func(o Options) (Policy, error) {
		w := defaultScorerWeights
		if err := decodeParams(o.Params, &w); err != nil {
			return nil, err
		}
		if err := w.validate(); err != nil {
			return nil, err
		}
		return &Precise{w: w, g: newRNG(o.Seed)}, nil
	})
}

// Precise is llm-d's precise prefix-cache scoring (and Dynamo with KV
// events): the queue and kv-cache-utilization scorers of llmd with the same
// weights, and a prefix score read from the router's index, which KV events
// from the replicas keep exact (blocks reported stored, removed ones
// dropped): prefix = ReplicaView.Match / prompt blocks.
type Precise struct {
	w scorerWeights
	g *rng
}

var _ Policy = (*Precise)(nil)

func (*Precise) Name() string { return "precise" }

// WantsKVEvents: the scorer is defined on the replicas' KV events.
func (*Precise) WantsKVEvents() bool { return true }

func (p *Precise) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	var pbuf [scratchLen]float64
	prefix := scratch(&pbuf, len(rs))
	if n := len(req.Blocks); n > 0 {
		for _, i := range c {
			prefix[i] = float64(min(rs[i].Match, n)) / float64(n)
		}
	}
	scores := make([]float64, len(rs))
	i := p.w.weightedScores(rs, c, prefix, scores, p.g)
	d := decide(rs, i, "max weighted queue + kv-cache + precise prefix score", rs[i].Match, float64(rs[i].InFlight))
	d.Scores = scores
	return d, nil
}
