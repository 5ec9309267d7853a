package policy

import "fmt"

func init() {
	register("chwbl", func(o Options) (Policy, error) {
		params := chwblParams{LoadFactor: 1.25, PrefixChars: 100, VNodes: defaultVNodes, CountRequest: true}
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
	// LoadFactor is c in the bound (total load + 1) / replicas × c (KubeAI's
	// prefixHash.meanLoadPercentage 125 / 100).
	LoadFactor float64 `json:"load_factor"`
	// PrefixChars is how much of the first user message keys the ring
	// (KubeAI's prefixHash.prefixCharLength: 100).
	PrefixChars int `json:"prefix_chars"`
	// VNodes is the points per replica on the ring (KubeAI's
	// prefixHash.replication: 256).
	VNodes int `json:"vnodes"`
	// CountRequest counts the request being routed in the replica's load,
	// as KubeAI's chwblLoadOK does: a replica is within the bound when
	// load + 1 ≤ bound, and every replica is while the total load is 0.
	// On by default, as KubeAI runs; off is the textbook rule, load ≤ bound.
	CountRequest bool `json:"count_request"`
}

// CHWBL is KubeAI's PrefixHash load balancing (substratusai/kubeai,
// internal/loadbalancer/balance_chwbl.go, with the Model CRD's defaults):
// consistent hashing with bounded loads (Mirrokni, Thorup and
// Zadimoghaddam, 2018). The key (the head of the first user message, or of
// the prompt, plus the LoRA adapter) picks a point on a ring of vnodes
// points per replica; walking clockwise, the first healthy replica whose
// load (the gateway's in-flight count) is within the bound
//
//	bound = (total load + 1) / healthy replicas × load_factor
//
// takes the request, so a hot prefix spills to its ring successors instead of
// queueing on one replica; if every replica is over the bound, the first
// one met takes it.
//
// KubeAI tests load + 1 ≤ bound (the "+1" for the request being routed;
// any replica while the total is 0), as kvgate does by default
// (count_request; off, the textbook load ≤ bound spills to an idle
// successor at low load, where KubeAI keeps the ring owner). One difference
// from KubeAI's code: KubeAI hashes adapter + prefix over points named after
// its pods, kvgate prefix + adapter over points named after the URLs: another
// but equally uniform ring.
//
// On the Mooncake conversation trace every request's first 100 characters
// are identical (all its prompts begin with the same block), so every
// request has the same key and CHWBL degenerates to bounded-load filling of
// one fixed replica order, with no prefix affinity left.
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
	within := func(pos int) bool { return float64(rs[pos].InFlight) <= bound }
	if p.params.CountRequest {
		within = func(pos int) bool { return total == 0 || float64(rs[pos].InFlight+1) <= bound }
	}
	first, i := p.ring.get(rs).walk(hashKey(headRunes(req.KeyText, p.params.PrefixChars), req.Adapter), rs, within)
	reason := "ring successor within the load bound"
	switch {
	case i == first:
		reason = "ring owner of the key, within the load bound"
	case i < 0:
		i, reason = first, "all replicas over the load bound: ring owner"
	}
	return decide(rs, i, reason, 0, float64(rs[i].InFlight)), nil
}
