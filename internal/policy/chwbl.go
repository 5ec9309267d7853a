package policy

import "fmt"

func init() {
	register("chwbl", func(o Options) (Policy, error) {
		params := chwblParams{LoadFactor: 1.25, PrefixChars: 100, VNodes: defaultVNodes}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if params.LoadFactor < 1 || params.PrefixChars < 1 || params.VNodes < 1 {
			return nil, fmt.Errorf("%w: need load_factor ≥ 1, prefix_chars ≥ 1, vnodes ≥ 1", ErrParam)
		}
		return &CHWBL{params: params, ring: ringCache{vnodes: params.VNodes}}, nil
	})
}

type chwblParams struct {
	// LoadFactor is c in the bound ⌈c × mean load⌉ (KubeAI: 1.25).
	LoadFactor float64 `json:"load_factor"`
	// PrefixChars is how much of the first user message keys the ring (KubeAI: 100).
	PrefixChars int `json:"prefix_chars"`
	VNodes      int `json:"vnodes"`
}

// CHWBL is KubeAI's prefix hashing: consistent hashing with bounded loads
// (Mirrokni, Thorup and Zadimoghaddam, 2018). The key (the head of the first
// user message plus the LoRA adapter) picks a point on the ring; walking
// clockwise, the first replica whose load is within the bound
//
//	bound = (total load + 1) / replicas × load_factor
//
// takes the request, so a hot prefix spills to its ring successors instead of
// queueing on one replica; if every replica is over the bound, the first
// one met takes it.
type CHWBL struct {
	params chwblParams
	ring   ringCache
}

var _ Policy = (*CHWBL)(nil)

func (*CHWBL) Name() string { return "chwbl" }

func (p *CHWBL) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	total, n := 0, 0
	for i := range rs {
		if rs[i].Healthy {
			total += rs[i].InFlight
			n++
		}
	}
	if n == 0 {
		return Decision{}, ErrNoReplica
	}
	bound := float64(total+1) / float64(n) * p.params.LoadFactor
	first, i := p.ring.get(rs).walk(hashKey(headRunes(req.KeyText, p.params.PrefixChars), req.Adapter), rs,
		func(pos int) bool { return float64(rs[pos].InFlight) <= bound })
	reason := "ring successor within the load bound"
	switch {
	case i == first:
		reason = "ring owner of the key, within the load bound"
	case i < 0:
		i, reason = first, "all replicas over the load bound: ring owner"
	}
	return decide(rs, i, reason, 0, float64(rs[i].InFlight)), nil
}
