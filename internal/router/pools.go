package router

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync/atomic"

	"github.com/kvgate/kvgate/internal/policy"
)

// Pools: several models on one gateway, each model's replicas routed by a
// policy of their own. The router keeps one replica table (one home for a
// replica's counters, scrapes, health, index row and KV-event state) and
// partitions it: each replica belongs to one pool (Spec.Pool), each pool
// matches model names (Pool.Models) and has its own policy instance (its
// parameters, its seed, its learnt state) and its own late-binding queue.
// A request goes to the first pool, in configuration order, that matches
// its model (or, for a LoRA adapter, its base model); its candidates are
// that pool's replicas only (the others are unhealthy in the views the
// policy sees), and the pool's policy decides. A policy's observer hears
// the outcomes of its pool's replicas only: a ticket's, a remote gateway's
// decision, by the pool of the replica. Without Config.Pools there is one
// pool of every replica, the router's policy and queue: routing is as
// before, at the cost of one pointer per decision.
//
// A replica in two pools is refused: both policies would count its load
// (each hears half of its traffic) and the index's row would be one
// replica's cache answering for two partitions of traffic. Two models
// served by the same replicas are one pool with two patterns.

// Pool configures one pool of Config.Pools.
type Pool struct {
	Name string
	// Models are exact model names and patterns where * stands for any
	// run of characters ("Qwen/*", "llama-*"); a request matches on its
	// model, or on its adapter's base model (the replicas' parent).
	Models []string
	Policy policy.Policy
}

// ErrPool is wrapped by the errors of a pool configuration or of a
// replica naming a pool that does not exist.
var ErrPool = errors.New("router: pools")

// pool is one pool: its matcher, its policy and its queue. The default
// pool (no Config.Pools) shares the router's own policy and queue.
type pool struct {
	name  string
	exact map[string]bool
	globs []string
	all   bool // the default pool: every model, every replica
	pol   *atomic.Pointer[policies]
	q     *queue
	// idleCtx is the EWMA of the contexts of the pool's programs gone idle
	// past IdleTTL (float64 bits; 0: none yet), read by admission without
	// a lock (ProgramConfig.AdmissionMinContext).
	idleCtx atomic.Uint64
}

// noteIdle adds a context gone idle to idleCtx's EWMA (weight 0.1). The
// program table's mutex serialises the calls.
func (p *pool) noteIdle(tokens int) {
	x := float64(max(tokens, 0))
	old := math.Float64frombits(p.idleCtx.Load())
	if old > 0 {
		x = old + 0.1*(x-old)
	}
	p.idleCtx.Store(math.Float64bits(x))
}

// newPools builds cfg's pools (the default pool when none are configured).
func (rt *Router) newPools(cfg []Pool) error {
	if len(cfg) == 0 {
		rt.pools = []*pool{{all: true, pol: &rt.pol, q: newQueue(&rt.flow)}}
		return nil
	}
	seen := map[string]bool{}
	for i, c := range cfg {
		switch {
		case c.Name == "":
			return fmt.Errorf("%w: pool %d has no name", ErrPool, i)
		case seen[c.Name]:
			return fmt.Errorf("%w: pool %q is configured twice", ErrPool, c.Name)
		case len(c.Models) == 0:
			return fmt.Errorf("%w: pool %q matches no model (give models: names or patterns)", ErrPool, c.Name)
		case c.Policy == nil:
			return fmt.Errorf("%w: pool %q has no policy", ErrPool, c.Name)
		}
		seen[c.Name] = true
		p := &pool{name: c.Name, exact: map[string]bool{}, pol: &atomic.Pointer[policies]{}, q: newQueue(&rt.flow)}
		for _, m := range c.Models {
			if m == "" {
				return fmt.Errorf("%w: pool %q lists an empty model name", ErrPool, c.Name)
			}
			if strings.Contains(m, "*") {
				p.globs = append(p.globs, m)
			} else {
				p.exact[m] = true
			}
		}
		p.pol.Store(newPolicies(c.Policy))
		rt.pools = append(rt.pools, p)
	}
	return nil
}

func newPolicies(p policy.Policy) *policies {
	ps := &policies{pol: p}
	ps.obs, _ = p.(policy.Observer)
	return ps
}

// matches reports whether the pool routes model.
func (p *pool) matches(model string) bool {
	if p.all || p.exact[model] {
		return true
	}
	for _, g := range p.globs {
		if glob(g, model) {
			return true
		}
	}
	return false
}

// glob matches s against pattern, where * is any run of characters ('/'
// included: "Qwen/*" matches every Qwen model, unlike path.Match).
func glob(pattern, s string) bool {
	parts := strings.Split(pattern, "*")
	if len(parts) == 1 {
		return pattern == s
	}
	first, last := parts[0], parts[len(parts)-1]
	if !strings.HasPrefix(s, first) || !strings.HasSuffix(s[len(first):], last) {
		return false
	}
	s = s[len(first) : len(s)-len(last)]
	for _, mid := range parts[1 : len(parts)-1] {
		i := strings.Index(s, mid)
		if i < 0 {
			return false
		}
		s = s[i+len(mid):]
	}
	return true
}

// has reports whether replica r belongs to the pool.
func (p *pool) has(r *Replica) bool { return p.all || r.sp().Pool == p.name }

// poolFor is the pool routing model: the first that matches it, else the
// first that matches its base model (an adapter's parent, an alias's
// root, as the replicas list them). A request without a model goes to the
// first pool. nil: no pool routes it.
func (rt *Router) poolFor(model string) *pool {
	i := rt.poolIndex(model, model, "")
	if i < 0 { // no pool matches the model itself: its base model's?
		base, adapter := rt.keyOf(model)
		i = rt.poolIndex(model, base, adapter)
	}
	if i < 0 {
		return nil
	}
	return rt.pools[i]
}

// poolIndex is the index of poolFor(model) (-1: none), given model's
// partition (keyOf: base, adapter).
func (rt *Router) poolIndex(model, base, adapter string) int {
	if len(rt.pools) == 1 && rt.pools[0].all || model == "" {
		return 0
	}
	for i, p := range rt.pools {
		if p.matches(model) {
			return i
		}
	}
	if adapter != "" || base != model {
		for i, p := range rt.pools {
			if p.matches(base) {
				return i
			}
		}
	}
	return -1
}

// poolOf is the pool replica r belongs to (nil: none, which New and
// SetReplicas refuse).
func (rt *Router) poolOf(r *Replica) *pool {
	for _, p := range rt.pools {
		if p.has(r) {
			return p
		}
	}
	return nil
}

// checkPool refuses a spec naming a pool that is not configured (or any
// pool when none is).
func (rt *Router) checkPool(sp Spec) error {
	for _, p := range rt.pools {
		if p.all && sp.Pool == "" || !p.all && sp.Pool == p.name {
			return nil
		}
	}
	if sp.Pool == "" {
		return fmt.Errorf("%w: replica %s belongs to no pool", ErrPool, sp.Name())
	}
	return fmt.Errorf("%w: replica %s names pool %q, which is not configured", ErrPool, sp.Name(), sp.Pool)
}

// observer is the observer of the policy of replica i's pool (nil: it
// learns nothing).
func (rt *Router) observer(i int) policy.Observer {
	if p := rt.poolOf(rt.reps()[i]); p != nil {
		return p.pol.Load().obs
	}
	return nil
}

// Pools are the configured pools' names, in order (none: one pool of
// every replica).
func (rt *Router) Pools() []string {
	var out []string
	for _, p := range rt.pools {
		if !p.all {
			out = append(out, p.name)
		}
	}
	return out
}

// PoolFor is the name of the pool that routes model ("" with no pools
// configured), and false when no pool routes it.
func (rt *Router) PoolFor(model string) (string, bool) {
	p := rt.poolFor(model)
	if p == nil {
		return "", false
	}
	return p.name, true
}

// PoolPolicy is the policy of the pool named name ("": the router's).
func (rt *Router) PoolPolicy(name string) (policy.Policy, bool) {
	for _, p := range rt.pools {
		if p.name == name {
			return p.pol.Load().pol, true
		}
	}
	return nil, false
}

// SetPoolPolicy makes pol the policy of the pool named name from the next
// decision on, as SetPolicy does for the router's ("": the router's own).
func (rt *Router) SetPoolPolicy(name string, pol policy.Policy) error {
	for _, p := range rt.pools {
		if p.name == name {
			p.pol.Store(newPolicies(pol))
			return nil
		}
	}
	return fmt.Errorf("%w: no pool %q", ErrPool, name)
}

// Lists reports whether a replica of the pool routing model (not
// removed) lists it: what /v1/models shows with pools.
func (rt *Router) Lists(model string) bool {
	pl := rt.poolFor(model)
	if pl == nil {
		return false
	}
	for _, r := range rt.reps() {
		if s := r.served.Load(); s != nil && !r.removed.Load() && pl.has(r) && s.Has(model) {
			return true
		}
	}
	return false
}

// Pool is the name of the pool the replica belongs to ("" with no pools).
func (r *Replica) Pool() string { return r.sp().Pool }

// restrict takes the replicas outside pl out of views (Healthy false).
func restrict(pl *pool, reps []*Replica, views []policy.ReplicaView) {
	if pl.all {
		return
	}
	for i, r := range reps {
		if !pl.has(r) {
			views[i].Healthy = false
		}
	}
}
