package gateway

import (
	"errors"
	"fmt"
	"reflect"
	"slices"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// Pools (the config's pools:): several models on one gateway, each
// model's replicas routed by a policy of their own (router/pools.go keeps
// one replica table partitioned by pool). A pool lists its model names
// and patterns, its policy and parameters (default: the top-level ones,
// a policy instance of its own with a seed of its own), and its
// replicas (listed, or found by its own replicas_file: or discovery:). At
// most one pool may have none: the top-level replicas_file: or
// discovery: then feeds it, the others' replicas staying as they are.
// Without pools:, one pool of every replica, routed as before.

// PoolConfig is one entry of the config's pools:.
type PoolConfig struct {
	Name string `json:"name"`
	// Models are exact model names and patterns (* is any run of
	// characters: "Qwen/*"); a request's model, or its adapter's base
	// model, picks the first pool matching it, in the config's order.
	Models []string `json:"models"`
	// Policy and PolicyParams default to the top-level policy: and, when
	// the pool names no policy, policy_params:.
	Policy       string         `json:"policy,omitempty"`
	PolicyParams map[string]any `json:"policy_params,omitempty"`
	// Replicas are the pool's (the same entries as the top-level
	// replicas:); or ReplicasFile or Discovery find them (as the
	// top-level ones do, pools_sources.go). None of the three: the pool
	// takes what the top-level replicas_file: or discovery: finds.
	Replicas     []ReplicaConfig  `json:"replicas,omitempty"`
	ReplicasFile string           `json:"replicas_file,omitempty"`
	Discovery    *DiscoveryConfig `json:"discovery,omitempty"`
}

// policyOf is the pool's policy name and parameters, the top-level ones
// by default.
func (p PoolConfig) policyOf(c *Config) (string, map[string]any) {
	if p.Policy == "" {
		return c.Policy, c.PolicyParams
	}
	return p.Policy, p.PolicyParams
}

// validatePools checks pools: and where their replicas come from (it
// replaces validateSources when pools are configured).
func (c *Config) validatePools() []error {
	var errs []error
	if len(c.Replicas) > 0 {
		errs = append(errs, errors.New("pools: each pool lists its replicas; the top-level replicas: (--replicas) "+
			"cannot be given with pools"))
	}
	dynamic := c.ReplicasFile != "" || c.Discovery != nil
	if c.ReplicasFile != "" && c.Discovery != nil {
		errs = append(errs, errors.New("replicas come from one source: give only one of replicas_file: and discovery:"))
	}
	if c.Discovery != nil {
		errs = append(errs, c.Discovery.validate()...)
	}
	names, owner := map[string]bool{}, map[string]string{}
	var open []string // pools without replicas
	for i, p := range c.Pools {
		where := fmt.Sprintf("pools[%d]", i)
		switch {
		case p.Name == "":
			errs = append(errs, fmt.Errorf("%s: give the pool a name", where))
		case names[p.Name]:
			errs = append(errs, fmt.Errorf("%s: pool %q is configured twice", where, p.Name))
		}
		names[p.Name] = true
		if len(p.Models) == 0 {
			errs = append(errs, fmt.Errorf("%s (%s): models: is empty; list the model names or patterns (\"Qwen/*\") it routes", where, p.Name))
		}
		for j, m := range p.Models {
			if m == "" {
				errs = append(errs, fmt.Errorf("%s.models[%d]: an empty model name", where, j))
			}
		}
		errs = append(errs, c.validatePoolPolicy(where, p)...)
		errs = append(errs, validateReplicas(where+".replicas", p.Replicas)...)
		errs = append(errs, p.validateSource(where)...)
		for _, r := range p.Replicas {
			if o, dup := owner[r.URL]; dup && o != p.Name {
				errs = append(errs, fmt.Errorf("%s: replica %q is also in pool %q: a replica belongs to one pool "+
					"(list both models in one pool instead)", where, r.URL, o))
			}
			owner[r.URL] = p.Name
		}
		if len(p.Replicas) == 0 && !p.sourced() {
			open = append(open, p.Name)
		}
	}
	switch {
	case len(open) > 1:
		errs = append(errs, fmt.Errorf("pools %q have no replicas: at most one pool may take its replicas from "+
			"the top-level replicas_file: or discovery:; give the others replicas:, replicas_file: or discovery:", open))
	case len(open) == 1 && !dynamic:
		errs = append(errs, fmt.Errorf("pool %q has no replicas: give it replicas:, replicas_file: or discovery:, "+
			"or give replicas_file: or discovery: at the top level to feed it", open[0]))
	case len(open) == 0 && dynamic:
		errs = append(errs, errors.New("the top-level replicas_file: or discovery: with pools feeds the one pool "+
			"without replicas of its own, and every pool has its own"))
	}
	return errs
}

// validatePoolPolicy checks a pool's policy and its parameters as the
// gateway builds them.
func (c *Config) validatePoolPolicy(where string, p PoolConfig) []error {
	if p.Policy == "" && len(p.PolicyParams) > 0 {
		return []error{fmt.Errorf("%s (%s): policy_params without policy: name the policy they are for", where, p.Name)}
	}
	name, params := p.policyOf(c)
	prof, err := costmodel.Lookup(c.Profile)
	if err != nil {
		return nil // Validate names the profile
	}
	if _, err := policy.New(name, policy.Options{Seed: c.Seed, BlockSize: c.BlockSize, Profile: prof,
		MaxBatchTokens: c.MaxBatchTokens, Params: params}); err != nil {
		return []error{fmt.Errorf("%s (%s): %w", where, p.Name, err)}
	}
	return nil
}

// allReplicas is every replica listed in the config: the top-level ones
// and the pools'.
func (c *Config) allReplicas() []ReplicaConfig {
	out := c.Replicas
	for _, p := range c.Pools {
		out = append(out[:len(out):len(out)], p.Replicas...)
	}
	return out
}

// withPools is the gateway's whole replica list from what the sources
// found (by pool; "": the top-level replicas, or the top-level replicas
// file's or discovery's list) and the pool of each entry: with pools,
// every pool's own replicas (listed, or its source's), and the top-level
// source's in the pool without either.
func (c *Config) withPools(found map[string][]ReplicaConfig) ([]ReplicaConfig, []string) {
	if len(c.Pools) == 0 {
		return found[""], make([]string, len(found[""]))
	}
	var list []ReplicaConfig
	var pools []string
	for _, p := range c.Pools {
		reps := p.Replicas
		switch {
		case p.sourced():
			reps = found[p.Name]
		case len(reps) == 0:
			reps = found[""]
		}
		for _, r := range reps {
			list, pools = append(list, r), append(pools, p.Name)
		}
	}
	return list, pools
}

// poolTargets are targets(list, ranks), each in its entry's pool.
func poolTargets(list []ReplicaConfig, ranks []int, pools []string) []router.Spec {
	var specs []router.Spec
	for i := range list {
		for _, sp := range targets(list[i:i+1], ranks[i:i+1]) {
			sp.Pool = pools[i]
			specs = append(specs, sp)
		}
	}
	return specs
}

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

// poolInfo exposes kvgate_pool_info{pool,replica} 1 for every replica not
// removed, so that any per-replica series can be grouped by pool (a join,
// rather than a pool label on every series).
type poolInfo struct {
	rt   *router.Router
	desc *prometheus.Desc
}

func registerPoolInfo(reg prometheus.Registerer, rt *router.Router) {
	reg.MustRegister(&poolInfo{rt: rt, desc: prometheus.NewDesc("kvgate_pool_info",
		"Each replica's pool (pools: in the config): 1 per replica not removed by discovery.", []string{"pool", "replica"}, nil)})
}

func (p *poolInfo) Describe(ch chan<- *prometheus.Desc) { ch <- p.desc }

func (p *poolInfo) Collect(ch chan<- prometheus.Metric) {
	for i := range p.rt.Replicas() {
		if r := p.rt.Replica(i); !r.Removed() {
			ch <- prometheus.MustNewConstMetric(p.desc, prometheus.GaugeValue, 1, r.Pool(), p.rt.Name(i))
		}
	}
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
