package gateway

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// Configuration reload (SIGHUP): what the request path reads per request
// (timeouts, retries, the concurrency limit), the breaker's thresholds
// and the policy's parameters take their new values at once; the rest is
// fixed at start (sockets, the index and its tokenizer, the policy's
// name, the replicas' source and the shared state) and a change to it is
// logged as ignored until a restart.

// conf is the configuration of the moment.
func (g *Gateway) conf() *Config { return g.live.Load() }

// reloadable are the keys ReloadConfig applies (the JSON names, for logs).
var reloadable = []string{"policy_params", "eject_after", "eject_cooldown", "retries", "retry_backoff",
	"retry_backoff_max", "first_byte_timeout", "stream_idle_timeout", "write_timeout", "request_timeout",
	"queue_timeout", "tokenize_timeout", "max_concurrency", "max_queue", "pools"} // pools: their policy_params (pools.go)

// withReloadable is cur with next's reloadable settings.
func withReloadable(cur, next Config) Config {
	out := cur
	out.PolicyParams, out.EjectAfter, out.EjectCooldown = next.PolicyParams, next.EjectAfter, next.EjectCooldown
	out.Retries, out.RetryBackoff, out.RetryBackoffMax = next.Retries, next.RetryBackoff, next.RetryBackoffMax
	out.FirstByteTimeout, out.StreamIdleTimeout, out.WriteTimeout = next.FirstByteTimeout, next.StreamIdleTimeout, next.WriteTimeout
	out.RequestTimeout, out.QueueTimeout, out.TokenizeTimeout = next.RequestTimeout, next.QueueTimeout, next.TokenizeTimeout
	out.MaxConcurrency, out.MaxQueue = next.MaxConcurrency, next.MaxQueue
	out.Pools = withPoolParams(cur.Pools, next.Pools)
	return out
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
	g.reloadMu.Lock()
	defer g.reloadMu.Unlock()
	cur := g.conf()
	merged := withReloadable(*cur, next)
	applied = changedKeys(*cur, merged)
	ignored = changedKeys(merged, next)
	swapPools, err := g.reloadPools(*cur, merged)
	if err != nil {
		return nil, nil, fmt.Errorf("config reload: %w", err)
	}
	if slices.Contains(applied, "policy_params") {
		p, err := policy.New(cur.Policy, policy.Options{Seed: g.policySeed, BlockSize: cur.BlockSize, Profile: g.prof,
			MaxBatchTokens: cur.MaxBatchTokens, Params: next.PolicyParams})
		if err != nil {
			return nil, nil, fmt.Errorf("config reload: %w", err)
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
		g.lim.Store(newLimiter(next.MaxConcurrency, next.MaxQueue, next.QueueTimeout.D()))
	}
	g.live.Store(&merged)
	for _, k := range applied {
		g.log.Info("config reloaded: setting changed", "key", k, "old", jsonValue(*cur, k), "new", jsonValue(merged, k))
	}
	for _, k := range ignored {
		g.log.Warn("config reload: setting ignored until a restart", "key", k)
	}
	if len(applied)+len(ignored) == 0 {
		g.log.Info("config reloaded: nothing changed")
	}
	return applied, ignored, nil
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

// jsonValue is key's value in c as the config file writes it (secrets
// are never among the reloadable keys).
func jsonValue(c Config, key string) any {
	if key == "pools" {
		return poolParams(c.Pools) // their parameters only: replicas may carry keys
	}
	return configMap(c)[key]
}
