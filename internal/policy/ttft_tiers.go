package policy

import "fmt"

// KV tiers in ttft's estimate (#28). A candidate's TTFT is
//
//	queue + (GPU-hit tokens: free) + (host-tier tokens: load time)
//	      + (tokens pullable from a peer: pull time over the link) + (the rest: prefill)
//
// in the engine model's terms (internal/engine, tier.go): the request's hit
// continues from its GPU match into the replica's host tier, whose blocks
// load over the host's PCIe link (the profile's HostLoadMs); with pulls
// (Options.Pulls), the blocks a peer holds past those come over the KV link
// (TransferMs, behind the link's backlog, PendingTransfer). The two
// transfers run at once, so the slower one is waited for, and both end
// before the request computes the rest of its prompt; loads never cover the
// prompt's last token. A pull is planned only where it lowers the estimate
// (score): a short one costs its latency and saves little compute, which
// is where pulls stop paying. The choice may then be "replica B, pulling
// from A" (Decision.Pull): an idle replica pulling a busy holder's prefix
// beats both waiting for the holder and recomputing.
//
// What the estimate leaves out, measured (#28; conversation trace, 3,000
// requests, 8 replicas, host tier 120,000 blocks, pulls, capacity 4.52×):
//
//   - the engine, as vLLM's scheduler, runs its running requests before
//     its waiting ones, so a request whose transfer is under way is passed
//     by the requests admitted meanwhile: near capacity pulled requests
//     come 230–300 ms later than estimated on average (computed ones 180 ms
//     earlier). It decides no capacity: in an engine that gave pulled
//     requests their place back, capacity stayed 4.52×;
//   - the tail that decides capacity is not one pulls can shorten. At
//     4.56× (354 of 3,000 requests over 2 s, 300 allowed) 101 compute over
//     1.8 s of new tokens whatever the choice, 205 of the other 253 waited
//     in the router (defer_ms: every replica's queue over 1 s), and 158 of
//     the 354 came in one 15 s burst of 222 prompts, 160 of them new past
//     their first 512 tokens (the late ones 14k tokens long on average),
//     which no cache holds. The chosen replicas
//     computed under 0.01 % of the prompt tokens some replica held at
//     dispatch; what the fleet had evicted (1.4 %) was in 4 late requests.
//
// host_hits is the tier-blind estimates, for measuring what tiers are
// worth: "gpu" counts host-tier blocks as GPU hits (no load time), "miss"
// as misses (computed).

// How host-tier hits are priced (host_hits).
const (
	hostHitsLoad = "load"
	hostHitsGPU  = "gpu"
	hostHitsMiss = "miss"
)

// ttftTierParams are ttft's parameters for KV tiers.
type ttftTierParams struct {
	// HostHits is how host-tier hits are priced: "load" (the default),
	// "gpu" or "miss" (tier-blind, see above).
	HostHits string `json:"host_hits"`
}

func (p ttftTierParams) validate() error {
	switch p.HostHits {
	case hostHitsLoad, hostHitsGPU, hostHitsMiss:
		return nil
	}
	return fmt.Errorf("%w: host_hits must be %q, %q or %q", ErrParam, hostHitsLoad, hostHitsGPU, hostHitsMiss)
}

// tierPlan is what a candidate's estimate credits past its GPU match.
type tierPlan struct {
	blocks int     // blocks credited past the GPU match (host and pulled)
	ms     float64 // the transfers before its prefill: the slower of the host load and the pull, ms
	host   int     // blocks loaded from its host tier
	pull   int     // blocks pulled from the source
	source int     // position in the views of the pull's source (when pull > 0)
	// sourceBlocks is the leading blocks the source holds, at most the
	// prompt's loadable ones.
	sourceBlocks int
}

// written is the tokens the plan's transfers write into the GPU cache.
func (p tierPlan) written(bs int) int { return (p.host + p.pull) * bs }

// loadLimit is the request's blocks a transfer may cover: its full blocks
// short of its last prompt token, which is always computed.
func loadLimit(req *Request, bs int) int {
	return min(len(req.Blocks), max(count(req.Tokens)-1, 0)/bs)
}

// hostPlan is v's host tier's part: the blocks it holds past v's GPU match.
func (t *TTFT) hostPlan(req *Request, v *ReplicaView) tierPlan {
	limit := loadLimit(req, t.o.BlockSize)
	h := max(min(count(v.MatchHost), limit)-min(count(v.Match), limit), 0)
	switch {
	case h == 0 || t.params.HostHits == hostHitsMiss:
		return tierPlan{}
	case t.params.HostHits == hostHitsGPU:
		return tierPlan{blocks: h}
	}
	return tierPlan{blocks: h, host: h, ms: t.o.Profile.HostLoadMs(h * t.o.BlockSize)}
}

// sources are the positions of the two healthy replicas holding the most
// of the request (in any tier), the first best; -1 when none holds any.
type sources [2]int

// peerSources finds the pull sources (with Options.Pulls): the replicas
// holding the longest local prefix, fewer requests in flight first (the
// source's own link is not modelled: any holder serves as fast). The
// engine times a pull on the puller's link alone; the sources carry
// little: at the conversation trace's capacity with pulls, 2.4M pulled
// tokens in 218 s, 1.4 GB/s over the fleet and at most 7.2 GB/s from one
// source in any second, against 50 GB/s per link (llama3-8b-h100).
func (t *TTFT) peerSources(req *Request, rs []ReplicaView) sources {
	s := sources{-1, -1}
	if !t.o.Pulls {
		return s
	}
	limit := loadLimit(req, t.o.BlockSize)
	better := func(i, j int) bool {
		li, lj := min(rs[i].Local(), limit), min(rs[j].Local(), limit)
		return li > lj || (li == lj && count(rs[i].InFlight) < count(rs[j].InFlight))
	}
	for i := range rs {
		switch {
		case !rs[i].Healthy || min(rs[i].Local(), limit) == 0:
		case s[0] < 0 || better(i, s[0]):
			s[0], s[1] = i, s[0]
		case s[1] < 0 || better(i, s[1]):
			s[1] = i
		}
	}
	return s
}

// estimateTiers is candidate i's estimate (into e) with its host tier, and
// with a pull from the best source other than itself when that lowers the
// score (its plan into plan).
func (t *TTFT) estimateTiers(e *ttftEstimate, plan *tierPlan, req *Request, rs []ReplicaView, i int, meanPrompt, out float64, src sources) {
	v := &rs[i]
	*plan = t.hostPlan(req, v)
	t.estimate(e, req, v, meanPrompt, out, plan)
	s := src[0]
	if s == i {
		s = src[1]
	}
	if s < 0 {
		return
	}
	limit := loadLimit(req, t.o.BlockSize)
	have := min(v.Local(), limit)
	if t.params.HostHits != hostHitsLoad {
		have = min(count(v.Match)+plan.blocks, limit) // what the blind estimate believes it holds
	}
	p := min(rs[s].Local(), limit) - have
	if p <= 0 {
		return
	}
	prof := t.o.Profile
	pp := *plan
	pp.blocks += p
	pp.pull, pp.source, pp.sourceBlocks = p, s, min(rs[s].Local(), limit)
	pp.ms = max(plan.ms, prof.TransferWireMs(count(v.PendingTransfer))+prof.TransferMs(p*t.o.BlockSize))
	var ep ttftEstimate
	if t.estimate(&ep, req, v, meanPrompt, out, &pp); ep.ms+ep.cost < e.ms+e.cost {
		*e, *plan = ep, pp
	}
}

// decision is the plan's pull for the chosen replica's decision, nil when
// it pulls nothing.
func (p tierPlan) decision(rs []ReplicaView) *Pull {
	if p.pull <= 0 {
		return nil
	}
	return &Pull{Replica: rs[p.source].Index, URL: rs[p.source].URL, Blocks: p.sourceBlocks}
}

// reuseMs is what reusing w tokens evicted from a replica's GPU costs: their
// prefill (computeMs), or, with host tiers (Options.OffloadBlocks), their
// load from the host tier, where write-through keeps a copy of what the GPU
// evicts while it is among the tier's most recent blocks.
func (t *TTFT) reuseMs(computeMs float64, w int) float64 {
	if t.o.OffloadBlocks <= 0 || t.params.HostHits != hostHitsLoad {
		return computeMs
	}
	return min(computeMs, t.o.Profile.HostLoadMs(w))
}

// hostWriteMs is what the blocks a choice writes into a replica's host
// tier cost: the connector writes every block new to the replica through
// to it, computed or pulled (not those loaded from it), and a
// write-through tier is full once warm, so each evicts a block of another
// prefix there, which then costs its prefill when used again, not a load.
// The GPU's eviction term prices what the GPU pushes down to the host tier
// (reuseMs); this one what falls out of it. Without it, an idle replica
// pulling a conversation looked free while the copies crowded the host
// tiers out: multiturn on 8 replicas of 3,000 GPU and 12,000 host blocks,
// 1,526 pulls for 2,400 requests, host tiers evicting 274k blocks (8k under
// llm-d's rule), hit rate 71 % against 80 % without pulls. It is charged
// while a tier still has room too: it keeps a prefix with its holders from
// the start, before copies crowd the tiers. Scaled by how full the tier is
// (the host index's count), the conversation trace's capacity with pulls
// fell from 4.52× to 4.45×; the pulled tokens' part weighed 0, 0.5, 1.5 or
// 2 gave 4.46×, 4.47×, 4.47×, 4.41× (4.51× at 1 in that build).
func (t *TTFT) hostWriteMs(own int, tp *tierPlan, l *ttftLoad) float64 {
	if t.o.OffloadBlocks <= 0 || t.params.HostHits != hostHitsLoad {
		return 0
	}
	return t.prefillMs(own+tp.pull*t.o.BlockSize, 0, l)
}
