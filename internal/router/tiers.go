package router

import (
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prefixindex"
)

// KV tiers (#28): a replica's host (CPU) tier, as vLLM's OffloadingConnector
// keeps it, has an index of its own beside the GPU's, so that a request's
// match is counted per tier (ReplicaView.Match, MatchHost).
//
//   - Approximate (Config.OffloadBlocks > 0): the connector stores every
//     block the GPU computes (write-through), so a routed request's blocks
//     go into both indexes, each an LRU of its tier's size: a block the
//     GPU's LRU forgets is still in the host's while it is among its most
//     recent, the way the engine ages it from GPU to host. llm-d's
//     approximate producer sized to the GPU alone forgets it (llm-d-router
//     #1650).
//   - Precise: events of medium "CPU" feed the host index (the
//     connector's stores carry hashes only, resolved through the GPU's
//     events: prefixindex.Precise); other media (disk, remote) are not
//     indexed.

// hostMatch is the host tier's match per replica slot, by index.
type hostMatch struct {
	approx, precise []int // nil when there is no such index
}

// hostMatches matches req's blocks against the host indexes.
func (rt *Router) hostMatches(blocks []uint64) hostMatch {
	var h hostMatch
	if rt.approxHost != nil {
		h.approx = rt.approxHost.Match(blocks, nil)
	}
	if rt.precise != nil && rt.precise.HostIndex() != nil {
		h.precise = rt.precise.HostIndex().Match(blocks, nil)
	}
	return h
}

// of is replica i's host match: the precise index's when trusted (what
// its events did not report, it does not hold), else the larger of the two
// (what events reported is true at once, as for the GPU's match).
func (h hostMatch) of(i int, trusted bool) int {
	get := func(m []int) int {
		if i < len(m) {
			return m[i]
		}
		return 0
	}
	if trusted && h.precise != nil {
		return get(h.precise)
	}
	return max(get(h.approx), get(h.precise))
}

// newHostIndexes makes the host tier's indexes: the approximate one when
// the configuration says how large the tiers are, the precise one beside
// the precise GPU index.
func (rt *Router) newHostIndexes() error {
	n := len(rt.cfg.Specs)
	if rt.cfg.OffloadBlocks > 0 {
		ix, err := prefixindex.New(prefixindex.Config{Replicas: n, BlocksPerReplica: rt.cfg.OffloadBlocks, MaxEntries: rt.cfg.MaxEntries})
		if err != nil {
			return err
		}
		rt.approxHost = ix
	}
	if rt.precise != nil {
		ix, err := prefixindex.New(prefixindex.Config{Replicas: n, MaxEntries: rt.cfg.MaxEntries})
		if err != nil {
			return err
		}
		rt.precise.SetHost(ix)
	}
	return nil
}

// HostIndex is the approximate index of the host tiers (nil without
// Config.OffloadBlocks).
func (rt *Router) HostIndex() *prefixindex.Index { return rt.approxHost }

// hostIndexes are the host tier's indexes there are.
func (rt *Router) hostIndexes() []*prefixindex.Index {
	var out []*prefixindex.Index
	if rt.approxHost != nil {
		out = append(out, rt.approxHost)
	}
	if rt.precise != nil && rt.precise.HostIndex() != nil {
		out = append(out, rt.precise.HostIndex())
	}
	return out
}

// tierOf is the tier an event's medium names: vLLM's "GPU" (or none
// reported: an engine without tiers) and "CPU"; false for other media.
func tierOf(medium string) (prefixindex.Tier, bool) {
	switch medium {
	case "", "GPU":
		return prefixindex.TierGPU, true
	case "CPU":
		return prefixindex.TierHost, true
	}
	return 0, false
}

// cachedAt is the prompt tokens a replica of view v computes nothing for:
// its GPU hit continued in its host tier, and the blocks of a pull from a
// peer past them, at most the prompt less its last token (the engine's
// rule).
func cachedAt(v *policy.ReplicaView, pull *policy.Pull, tokens, bs int) (cached, pulled int) {
	local := v.Local()
	blocks := local
	if pull != nil {
		blocks = max(blocks, pull.Blocks)
	}
	limit := max(tokens-1, 0)
	cached = min(blocks*bs, limit)
	return cached, max(cached-min(local*bs, limit), 0)
}

// pullFor settles d's pull: none without Config.Pulls; a policy's own kept
// only when it names another healthy replica (blocks clamped to the
// prompt's); for a policy that does not plan pulls, llm-d's rule after the
// choice (policy.P2PSource).
func (rt *Router) pullFor(pol policy.Policy, req *policy.Request, views []policy.ReplicaView, d *policy.Decision) {
	switch {
	case !rt.cfg.Pulls:
		d.Pull = nil
	case d.Pull != nil:
		s := d.Pull.Replica
		if s < 0 || s >= len(views) || s == d.Replica || !views[s].Healthy || d.Pull.Blocks < 1 {
			d.Pull = nil
			return
		}
		p := *d.Pull
		p.URL, p.Blocks = views[s].URL, min(p.Blocks, len(req.Blocks))
		d.Pull = &p
	case !policy.PlansPulls(pol):
		d.Pull = policy.P2PSource(req, views, d.Replica, policy.P2PMinCachedTokenDelta, rt.cfg.BlockSize)
	}
}
