package gateway

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync"

	"github.com/kvgate/kvgate/internal/discovery"
)

// A pool's own source of replicas: replicas_file: or discovery: in the
// pool's entry, read and watched as the top-level ones are
// (discovery.go). Each source gives its pool's whole list; the gateway
// keeps every source's last good list (Gateway.found) and reconciles the
// router with all of them at once, so a change from one source never
// touches another pool's replicas. A list the router refuses (a replica
// already in another pool) is logged and the source's previous list kept.

// initialFound is every source's list at start: the top-level one (key
// "") and each pool's replicas file (which must then be good); DNS and
// Kubernetes fill theirs in once Run starts.
func initialFound(cfg Config) (map[string][]ReplicaConfig, error) {
	top, err := initialReplicas(cfg)
	if err != nil {
		return nil, err
	}
	found := map[string][]ReplicaConfig{"": top}
	for _, p := range cfg.Pools {
		if p.ReplicasFile == "" {
			continue
		}
		list, err := discovery.NewFile(p.ReplicasFile, 0, ParseReplicasFile, nil, nil).Load()
		if err != nil {
			return nil, fmt.Errorf("pool %s: replicas_file: %w", p.Name, err)
		}
		found[p.Name] = list
	}
	return found, nil
}

// newPoolSources builds the pools' own sources.
func (g *Gateway) newPoolSources() error {
	for _, p := range g.cfg.Pools {
		if !p.sourced() {
			continue
		}
		src, err := g.sourceOf(p.ReplicasFile, p.Discovery)
		if err != nil {
			return fmt.Errorf("pool %s: %w", p.Name, err)
		}
		if g.poolSources == nil {
			g.poolSources = map[string]discovery.Source{}
		}
		g.poolSources[p.Name] = src
	}
	return nil
}

// poolSourceList is the pools' sources.
func (g *Gateway) poolSourceList() []discovery.Source {
	return slices.Collect(maps.Values(g.poolSources))
}

// runPoolSources runs each pool's source until ctx ends, applying each
// list to its pool.
func (g *Gateway) runPoolSources(ctx context.Context) {
	var wg sync.WaitGroup
	for pool, src := range g.poolSources {
		wg.Go(func() {
			g.log.Info("discovery: watching", "pool", pool, "source", src.Name())
			src.Run(ctx, func(list []ReplicaConfig) {
				if err := g.applyFrom(pool, list, src.Name()); err != nil {
					g.log.Error("discovery: the pool's replica list is refused; keeping the previous one",
						"pool", pool, "source", src.Name(), "err", err)
				}
			})
		})
	}
	wg.Wait()
}

// foundWith is every source's last list with pool's replaced by list
// (memMu held).
func (g *Gateway) foundWith(pool string, list []ReplicaConfig) map[string][]ReplicaConfig {
	out := maps.Clone(g.found)
	if out == nil {
		out = map[string][]ReplicaConfig{}
	}
	out[pool] = list
	return out
}
