package policy

import "sync/atomic"

func init() {
	register("round_robin", func(o Options) (Policy, error) {
		return &RoundRobin{bs: o.BlockSize}, decodeParams(o.Params, &struct{}{})
	})
	register("random", func(o Options) (Policy, error) {
		return &Random{g: newRNG(o.Seed)}, decodeParams(o.Params, &struct{}{})
	})
	register("least_load", func(o Options) (Policy, error) {
		return &LeastLoad{g: newRNG(o.Seed)}, decodeParams(o.Params, &struct{}{})
	})
	register("p2c", func(o Options) (Policy, error) { return &P2C{g: newRNG(o.Seed)}, decodeParams(o.Params, &struct{}{}) })
}

// RoundRobin cycles through the healthy replicas.
type RoundRobin struct {
	next    atomic.Uint64 // Pick's cursor, and the decode side's
	nextPre atomic.Uint64 // the prefill side's cursor (PickPair)
	bs      int           // tokens per block
}

var _ Policy = (*RoundRobin)(nil)
var _ PairPicker = (*RoundRobin)(nil)

func (*RoundRobin) Name() string { return "round_robin" }

// Pick takes the next healthy replica after the previous pick. Pick advances
// the cursor (the one stateful Pick): a round robin that a dry run did not
// advance would be indistinguishable, and an Observer hop would race.
func (p *RoundRobin) Pick(_ *Request, rs []ReplicaView) (Decision, error) {
	n := len(rs)
	if n == 0 {
		return Decision{}, ErrNoReplica
	}
	start := int(p.next.Add(1)-1) % n
	for k := range n {
		i := (start + k) % n
		if rs[i].Healthy {
			return decide(rs, i, "round robin", 0, float64(rs[i].InFlight)), nil
		}
	}
	return Decision{}, ErrNoReplica
}

// PickPair is the router's per-side rule (decode first, the prefill step
// skipped when the decode replica lacks fewer than req.SkipPrefillBelow
// tokens) with a cursor per side over that side's candidates, as vLLM's
// disaggregation proxy cycles its prefill and its decode instances: Pick's
// one cursor over every position would advance by two per request and
// favour the replicas after the other side's.
func (p *RoundRobin) PickPair(req *Request, prefill, decode []ReplicaView) (PairDecision, error) {
	j, err := p.cycle(&p.next, decode)
	if err != nil {
		return PairDecision{}, err
	}
	d := decide(decode, j, "round robin", 0, float64(decode[j].InFlight))
	if uncachedOn(req, &decode[j], p.bs) < req.SkipPrefillBelow {
		return SkipPair(d, "the decode replica lacks fewer than non_cached_tokens of the prompt"), nil
	}
	i, err := p.cycle(&p.nextPre, prefill)
	if err != nil {
		return PairDecision{}, err
	}
	return Pair(decide(prefill, i, "round robin", 0, float64(prefill[i].InFlight)), d, "round robin on each side"), nil
}

// cycle is the position of the next of rs's healthy replicas on cursor next.
func (*RoundRobin) cycle(next *atomic.Uint64, rs []ReplicaView) (int, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return 0, ErrNoReplica
	}
	return c[int((next.Add(1)-1)%uint64(len(c)))], nil
}

// Random picks uniformly among healthy replicas.
type Random struct{ g *rng }

var _ Policy = (*Random)(nil)

func (*Random) Name() string { return "random" }

func (p *Random) Pick(_ *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	i := c[p.g.IntN(len(c))]
	return decide(rs, i, "uniform random", 0, float64(rs[i].InFlight)), nil
}

// LeastLoad joins the shortest queue: fewest requests in flight, ties at random.
type LeastLoad struct{ g *rng }

var _ Policy = (*LeastLoad)(nil)

func (*LeastLoad) Name() string { return "least_load" }

func (p *LeastLoad) Pick(_ *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	i := argBest(c, func(i int) float64 { return float64(rs[i].InFlight) }, true, p.g)
	return decide(rs, i, "fewest in flight", 0, float64(rs[i].InFlight)), nil
}

// P2C is the power of two choices: two distinct healthy replicas at random,
// the less loaded wins (ties at random).
type P2C struct{ g *rng }

var _ Policy = (*P2C)(nil)

func (*P2C) Name() string { return "p2c" }

func (p *P2C) Pick(_ *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	switch len(c) {
	case 0:
		return Decision{}, ErrNoReplica
	case 1:
		return decide(rs, c[0], "only healthy replica", 0, float64(rs[c[0]].InFlight)), nil
	}
	a := p.g.IntN(len(c))
	b := p.g.IntN(len(c) - 1)
	if b >= a {
		b++
	}
	i, j := c[a], c[b]
	if rs[j].InFlight < rs[i].InFlight || (rs[j].InFlight == rs[i].InFlight && p.g.IntN(2) == 0) {
		i = j
	}
	return decide(rs, i, "less loaded of two sampled", 0, float64(rs[i].InFlight)), nil
}
