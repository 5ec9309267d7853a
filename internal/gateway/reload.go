package gateway

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// Configuration reload (SIGHUP): the settings of Reloadable
// (config_reload.go) take their new values at once, and what is built of
// them follows (the policy, the pools' policies, the breaker, the
// limiter); the rest is fixed at start (sockets, the index and its
// tokenizer, the policy's name, the replicas' sources and the shared
// state) and a change to it is logged as ignored until a restart.

// liveSettings are the reloadable settings of the moment, and what a
// reload rebuilds of them.
type liveSettings struct {
	mu sync.Mutex // serialises ReloadConfig
	// cur is what the request path reads (Gateway.conf); a reload swaps it
	// whole.
	cur atomic.Pointer[Reloadable]
	// pools are the pools of the moment: as given, with every reload's
	// reloadable keys (under mu).
	pools []PoolConfig
	// lim bounds the requests proxied at once, rebuilt when its settings
	// change.
	lim atomic.Pointer[limiter]
	// seed is the policy's seed: the configured one, mixed with the
	// gateway's id when sharing (shared.go).
	seed uint64
}

// newLiveSettings holds cfg's reloadable settings, the policy's seed being
// seed.
func newLiveSettings(cfg Config, seed uint64) *liveSettings {
	l := &liveSettings{pools: cfg.Pools, seed: seed}
	r := cfg.Reloadable
	l.cur.Store(&r)
	l.lim.Store(newLimiter(r.MaxConcurrency, r.MaxQueue, r.QueueTimeout.D()))
	return l
}

// conf is the reloadable settings of the moment: the one accessor the
// request path reads them through.
func (g *Gateway) conf() *Reloadable { return g.live.cur.Load() }

// configNow is the configuration of the moment: as given at start, with
// the reloadable settings of the moment (live.mu held).
func (g *Gateway) configNow() Config {
	c := g.cfg.Config
	c.Reloadable = *g.conf()
	c.Pools = g.live.pools
	return c
}

// ReloadConfig applies next (the --config file read again, the flags on
// top): the reloadable settings change at once and are logged at info
// with their old and new values; the others, changed, are logged as
// ignored until a restart. An invalid next, or policy parameters the
// policy refuses, change nothing. It returns the keys applied and ignored.
func (g *Gateway) ReloadConfig(next Config) (applied, ignored []string, err error) {
	if err := next.Validate(); err != nil {
		return nil, nil, fmt.Errorf("config reload: %w", err)
	}
	g.live.mu.Lock()
	defer g.live.mu.Unlock()
	cur := g.configNow()
	merged := withReloadable(cur, next)
	applied = changedKeys(cur, merged)
	ignored = changedKeys(merged, next)
	if err := g.rebuild(cur, merged); err != nil {
		return nil, nil, fmt.Errorf("config reload: %w", err)
	}
	r := merged.Reloadable
	g.live.pools = merged.Pools
	g.live.cur.Store(&r)
	for _, k := range applied {
		g.log.Info("config reloaded: setting changed", "key", k, "old", jsonValue(cur, k), "new", jsonValue(merged, k))
	}
	for _, k := range ignored {
		g.log.Warn("config reload: setting ignored until a restart", "key", k)
	}
	if len(applied)+len(ignored) == 0 {
		g.log.Info("config reloaded: nothing changed")
	}
	return applied, ignored, nil
}

// rebuild makes what is built of the reloadable settings follow them from
// cur to next: the policies first (a parameter refused changes nothing),
// then the breaker and the limiter.
func (g *Gateway) rebuild(cur, next Config) error {
	swapPools, err := g.reloadPools(cur, next)
	if err != nil {
		return err
	}
	if !reflect.DeepEqual(cur.PolicyParams, next.PolicyParams) {
		p, err := policy.New(cur.Policy, policy.Options{Seed: g.live.seed, BlockSize: cur.BlockSize, Profile: g.prof,
			MaxBatchTokens: cur.MaxBatchTokens, Params: next.PolicyParams, Pulls: cur.KVPulls.Enabled,
			OffloadBlocks: cur.OffloadBlocks})
		if err != nil {
			return err
		}
		g.rt.SetPolicy(p)
	}
	swapPools()
	if cur.EjectAfter != next.EjectAfter || cur.EjectCooldown != next.EjectCooldown {
		g.rt.SetBreaker(router.BreakerConfig{EjectAfter: next.EjectAfter, Cooldown: next.EjectCooldown.D()})
	}
	if cur.MaxConcurrency != next.MaxConcurrency || cur.MaxQueue != next.MaxQueue || cur.QueueTimeout != next.QueueTimeout {
		// Requests holding a slot release it to the limiter they took it
		// from; the new one counts from zero (briefly admitting up to
		// both limits' worth while the old requests finish).
		g.live.lim.Store(newLimiter(next.MaxConcurrency, next.MaxQueue, next.QueueTimeout.D()))
	}
	return nil
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
		pol, err := policy.New(name, policy.Options{Seed: g.live.seed + uint64(i+1)*poolSeedStep, BlockSize: next.BlockSize,
			Profile: g.prof, MaxBatchTokens: next.MaxBatchTokens, Params: params, Pulls: cur.KVPulls.Enabled,
			OffloadBlocks: cur.OffloadBlocks})
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

// poolReloadableValues is each pool's reloadable keys by name, as a
// reload logs them.
func poolReloadableValues(pools []PoolConfig) map[string]map[string]any {
	out := make(map[string]map[string]any, len(pools))
	for _, p := range pools {
		v := reflect.ValueOf(p)
		keys := map[string]any{}
		for _, k := range poolReloadable() {
			name, _, _ := strings.Cut(v.Type().Field(k).Tag.Get("json"), ",")
			keys[name] = v.Field(k).Interface()
		}
		out[p.Name] = keys
	}
	return out
}

// changedKeys are the top-level configuration keys whose values differ.
func changedKeys(a, b Config) []string {
	ma, mb := configMap(a), configMap(b)
	var out []string
	for k, v := range mb {
		if !reflect.DeepEqual(ma[k], v) {
			out = append(out, k)
		}
	}
	for k := range ma {
		if _, ok := mb[k]; !ok {
			out = append(out, k)
		}
	}
	slices.Sort(out)
	return out
}

func configMap(c Config) map[string]any {
	b, _ := json.Marshal(c)
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	return m
}

// jsonValue is key's value in c as the config file writes it (secrets are
// never among the reloadable keys; of pools, only their reloadable keys:
// replicas may carry keys).
func jsonValue(c Config, key string) any {
	if key == "pools" {
		return poolReloadableValues(c.Pools)
	}
	return configMap(c)[key]
}
