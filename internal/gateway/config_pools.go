package gateway

import (
	"fmt"
	"strings"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/policy"
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
	// top-level ones do, config_sources.go). None of the three: the pool
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
		errs = append(errs, keyErr("replicas", "each pool lists its replicas; the top-level replicas: (--replicas) "+
			"cannot be given with pools:"))
	}
	dynamic := c.ReplicasFile != "" || c.Discovery != nil
	if c.ReplicasFile != "" && c.Discovery != nil {
		errs = append(errs, keyErr("discovery", "replicas come from one source: give only one of replicas_file: and discovery:"))
	}
	if c.Discovery != nil {
		errs = append(errs, c.Discovery.validate("discovery")...)
	}
	names, owner := map[string]bool{}, map[string]string{}
	var open []string // pools without replicas
	for i, p := range c.Pools {
		where := fmt.Sprintf("pools[%d]", i)
		switch {
		case p.Name == "":
			errs = append(errs, keyErr(where+".name", "give the pool a name"))
		case names[p.Name]:
			errs = append(errs, keyErr(where+".name", "pool %q is configured twice", p.Name))
		}
		names[p.Name] = true
		if len(p.Models) == 0 {
			errs = append(errs, keyErr(where+".models", "empty: list the model names or patterns (\"Qwen/*\") pool %s routes", p.Name))
		}
		for j, m := range p.Models {
			if m == "" {
				errs = append(errs, keyErr(indexKey(where+".models", j), "an empty model name"))
			}
		}
		errs = append(errs, c.validatePoolPolicy(where, p)...)
		errs = append(errs, validateReplicas(where+".replicas", p.Replicas)...)
		errs = append(errs, p.validateSource(where)...)
		for j, r := range p.Replicas {
			if o, dup := owner[r.URL]; dup && o != p.Name {
				errs = append(errs, keyErr(indexKey(where+".replicas", j)+".url", "replica %q is also in pool %q: a replica "+
					"belongs to one pool (list both models in one pool instead)", r.URL, o))
			}
			owner[r.URL] = p.Name
		}
		if len(p.Replicas) == 0 && !p.sourced() {
			open = append(open, p.Name)
		}
	}
	switch {
	case len(open) > 1:
		errs = append(errs, keyErr("pools", "pools %q have no replicas: at most one pool may take its replicas from "+
			"the top-level replicas_file: or discovery:; give the others replicas:, replicas_file: or discovery:", open))
	case len(open) == 1 && !dynamic:
		errs = append(errs, keyErr("pools", "pool %q has no replicas: give it replicas:, replicas_file: or discovery:, "+
			"or give replicas_file: or discovery: at the top level to feed it", open[0]))
	case len(open) == 0 && dynamic:
		errs = append(errs, keyErr("pools", "the top-level replicas_file: or discovery: with pools feeds the one pool "+
			"without replicas of its own, and every pool has its own"))
	}
	return errs
}

// validatePoolPolicy checks a pool's policy and its parameters as the
// gateway builds them.
func (c *Config) validatePoolPolicy(where string, p PoolConfig) []error {
	if p.Policy == "" && len(p.PolicyParams) > 0 {
		return []error{keyErr(where+".policy_params", "given without policy: name the policy they are for (pool %s)", p.Name)}
	}
	name, params := p.policyOf(c)
	prof, err := costmodel.Lookup(c.Profile)
	if err != nil {
		return nil // Validate names the profile
	}
	if _, err := policy.New(name, policy.Options{Seed: c.Seed, BlockSize: c.BlockSize, Profile: prof,
		MaxBatchTokens: c.MaxBatchTokens, Params: params}); err != nil {
		return []error{keyErr(where+".policy", "%s (pool %s)", strings.TrimPrefix(err.Error(), "policy: "), p.Name)}
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

// sourced reports whether the pool has a source of its own.
func (p PoolConfig) sourced() bool { return p.ReplicasFile != "" || p.Discovery != nil }

// poolSourced reports whether some pool has a source of its own.
func (c *Config) poolSourced() bool {
	for _, p := range c.Pools {
		if p.sourced() {
			return true
		}
	}
	return false
}

// validateSource checks that a pool's replicas come from one place.
func (p PoolConfig) validateSource(where string) []error {
	n := 0
	for _, set := range []bool{len(p.Replicas) > 0, p.ReplicasFile != "", p.Discovery != nil} {
		if set {
			n++
		}
	}
	if n > 1 {
		return []error{keyErr(where, "(%s) a pool's replicas come from one source: give only one of replicas:, "+
			"replicas_file: and discovery:", p.Name)}
	}
	if p.Discovery != nil {
		return p.Discovery.validate(where + ".discovery")
	}
	return nil
}
