package gateway

import (
	"fmt"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// poolSeedStep sets each pool's policy seed apart from the gateway's (the
// golden ratio's 64-bit fraction: the seeds of pools i and j never meet).
const poolSeedStep = 0x9e3779b97f4a7c15

// routerPools are the router's pools, each with a policy instance of its
// own, seeded apart (a pool's random ties never follow another's).
func routerPools(cfg Config, prof costmodel.Profile) ([]router.Pool, error) {
	var out []router.Pool
	for i, p := range cfg.Pools {
		name, params := p.policyOf(&cfg)
		pol, err := policy.New(name, policy.Options{Seed: cfg.Seed + uint64(i+1)*poolSeedStep, BlockSize: cfg.BlockSize,
			Profile: prof, MaxBatchTokens: cfg.MaxBatchTokens, Params: params, Pulls: cfg.KVPulls.Enabled,
			OffloadBlocks: cfg.OffloadBlocks})
		if err != nil {
			return nil, fmt.Errorf("pool %s: %w", p.Name, err)
		}
		out = append(out, router.Pool{Name: p.Name, Models: p.Models, Policy: pol})
	}
	return out, nil
}

// servedModels keeps of ms (every model the replicas list) those a pool
// routes to a replica listing it: a model listed only by another pool's
// replicas is not served. Without pools, all.
func (g *Gateway) servedModels(ms []router.Model) []router.Model {
	if len(g.cfg.Pools) == 0 {
		return ms
	}
	out := ms[:0:0]
	for _, m := range ms {
		if g.rt.Lists(m.ID) {
			out = append(out, m)
		}
	}
	return out
}
