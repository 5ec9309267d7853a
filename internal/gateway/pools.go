package gateway

import (
	"fmt"
	"reflect"
	"slices"

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
			Profile: prof, MaxBatchTokens: cfg.MaxBatchTokens, Params: params})
		if err != nil {
			return nil, fmt.Errorf("pool %s: %w", p.Name, err)
		}
		out = append(out, router.Pool{Name: p.Name, Models: p.Models, Policy: pol})
	}
	return out, nil
}

// policyFor is the name of the policy routing model, and its pool ("":
// no pools; false: no pool routes it).
func (g *Gateway) policyFor(model string) (pol, pool string, ok bool) {
	if pool, ok = g.rt.PoolFor(model); !ok {
		return g.cfg.Policy, "", false
	}
	if p, ok := g.rt.PoolPolicy(pool); ok && pool != "" {
		return p.Name(), pool, true
	}
	return g.cfg.Policy, pool, true
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

// withPoolParams is cur's pools with next's policy parameters, when the
// pools are otherwise the same (names, models, policies, replicas, in
// order): a configuration reload changes a pool's parameters at once, and
// any other change of pools: only at a restart.
func withPoolParams(cur, next []PoolConfig) []PoolConfig {
	if len(cur) != len(next) {
		return cur
	}
	out := slices.Clone(cur)
	for i := range out {
		a, b := cur[i], next[i]
		a.PolicyParams, b.PolicyParams = nil, nil
		if !reflect.DeepEqual(a, b) {
			return cur
		}
		out[i].PolicyParams = next[i].PolicyParams
	}
	return out
}

// reloadPools rebuilds the policy of every pool whose parameters differ
// between cur and next (its own, or the top-level ones it inherits), and
// returns the swap to make once the whole reload is known to be good.
func (g *Gateway) reloadPools(cur, next Config) (func(), error) {
	fresh := map[string]policy.Policy{}
	for i, p := range next.Pools {
		name, params := p.policyOf(&next)
		if _, old := cur.Pools[i].policyOf(&cur); reflect.DeepEqual(params, old) {
			continue
		}
		pol, err := policy.New(name, policy.Options{Seed: g.policySeed + uint64(i+1)*poolSeedStep, BlockSize: next.BlockSize,
			Profile: g.prof, MaxBatchTokens: next.MaxBatchTokens, Params: params})
		if err != nil {
			return nil, fmt.Errorf("pool %s: %w", p.Name, err)
		}
		fresh[p.Name] = pol
	}
	return func() {
		for name, pol := range fresh {
			_ = g.rt.SetPoolPolicy(name, pol) // the pools are the router's
		}
	}, nil
}

// poolParams is each pool's policy parameters by name, as a reload logs
// them.
func poolParams(pools []PoolConfig) map[string]map[string]any {
	out := make(map[string]map[string]any, len(pools))
	for _, p := range pools {
		out[p.Name] = p.PolicyParams
	}
	return out
}
