package policy

import "fmt"

func init() {
	register("prefix_key", func(o Options) (Policy, error) {
		params := prefixKeyParams{PrefixChars: 20, Key: "prompt", VNodes: defaultVNodes}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if params.PrefixChars < 1 || params.VNodes < 1 {
			return nil, fmt.Errorf("%w: prefix_chars and vnodes must be at least 1", ErrParam)
		}
		if params.Key != "prompt" && params.Key != "system" {
			return nil, fmt.Errorf("%w: key must be \"prompt\" or \"system\", not %q", ErrParam, params.Key)
		}
		return &PrefixKey{params: params, ring: ringCache{vnodes: params.VNodes}}, nil
	})
}

type prefixKeyParams struct {
	// PrefixChars is K: the key is the prompt's first K characters (seed 001: 20).
	PrefixChars int `json:"prefix_chars"`
	// Key is "prompt" (the first K characters of the routing text) or
	// "system" (seed 003's variant: the whole system prompt, falling back to
	// the prompt's first K characters when the request has none).
	Key    string `json:"key"`
	VNodes int    `json:"vnodes"`
}

// PrefixKey sends requests whose prompts begin alike to the same replica: a
// consistent hash of the prompt's first K characters (or of the system
// prompt). It is the cheapest prefix affinity there is, and blind to load: a
// hot prefix stays on one replica whatever its queue.
type PrefixKey struct {
	params prefixKeyParams
	ring   ringCache
}

var _ Policy = (*PrefixKey)(nil)

func (*PrefixKey) Name() string { return "prefix_key" }

func (p *PrefixKey) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	key, reason := headRunes(req.Text, p.params.PrefixChars), "consistent hash of the prompt's head"
	if p.params.Key == "system" && req.System != "" {
		key, reason = req.System, "consistent hash of the system prompt"
	}
	_, i := p.ring.get(rs).walk(hashKey(key), rs, nil)
	if i < 0 {
		return Decision{}, ErrNoReplica
	}
	return decide(rs, i, reason, 0, float64(rs[i].InFlight)), nil
}
