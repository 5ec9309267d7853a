package gateway

import (
	"context"
	"fmt"
	"sync"

	"github.com/kvgate/kvgate/internal/discovery"
)

// The control plane's sources of replicas (Caddy's UpstreamSource, llm-d's
// EndpointDiscovery): the top-level replicas_file: or discovery: (key
// "") and each pool's own, read and watched alike. Each source gives its
// pool's whole list; the control plane keeps every source's last good
// list (control.found) and reconciles the router with all of them at once
// (control_members.go), so a change from one source never touches another
// pool's replicas. A list the router refuses (a replica already in another
// pool) is logged and the source's previous list kept.

// initialFound is every source's list at start: the top-level one (key
// "": the config's replicas, or its replicas file's, which must then be
// good) and each pool's replicas file (likewise); DNS and Kubernetes fill
// theirs in once Run starts.
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

// initialReplicas is the top-level list the gateway starts with: the
// config's, the replicas file's (which must then be good), or none (DNS
// and Kubernetes fill it in once Run starts).
func initialReplicas(cfg Config) ([]ReplicaConfig, error) {
	if cfg.ReplicasFile == "" {
		return cfg.Replicas, nil
	}
	list, err := discovery.NewFile(cfg.ReplicasFile, 0, ParseReplicasFile, nil, nil).Load()
	if err != nil {
		return nil, fmt.Errorf("replicas_file: %w", err)
	}
	return list, nil
}

// newSources builds the configured sources by pool ("": the top-level
// one); a static list has none.
func (c *control) newSources() error {
	c.sources = map[string]discovery.Source{}
	if src, err := c.sourceOf(c.cfg.ReplicasFile, c.cfg.Discovery); err != nil || src != nil {
		c.sources[""] = src
		if err != nil {
			return err
		}
	}
	for _, p := range c.cfg.Pools {
		if !p.sourced() {
			continue
		}
		src, err := c.sourceOf(p.ReplicasFile, p.Discovery)
		if err != nil {
			return fmt.Errorf("pool %s: %w", p.Name, err)
		}
		c.sources[p.Name] = src
	}
	return nil
}

// sourceOf is the source of a replicas file or a discovery entry (the
// top-level one, or a pool's; nil: neither).
func (c *control) sourceOf(file string, d *DiscoveryConfig) (discovery.Source, error) {
	switch {
	case file != "":
		return discovery.NewFile(file, 0, ParseReplicasFile, c.clock, c.log), nil
	case d != nil && d.DNS != "":
		return discovery.NewDNS(discovery.DNSConfig{Name: d.DNS, Scheme: d.Scheme, Interval: d.Interval.D(),
			RemoveAfter: d.RemoveAfter, Template: d.template(), Resolver: c.resolver, Clock: c.clock, Log: c.log})
	case d != nil:
		// The registry's Kubernetes source (the plugin
		// internal/discovery/kubernetes, linked from cmd/kvgate).
		spec := d.Kubernetes.spec(d)
		spec.Clock, spec.Log = c.clock, c.log
		return discovery.Kubernetes.New(spec)
	}
	return nil, nil
}

// runSources runs every source until ctx ends, applying each list to its
// pool, and, with any source, forgets the replicas removed long ago.
func (c *control) runSources(ctx context.Context) {
	if !c.cfg.dynamic() {
		return
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { c.forgetLoop(ctx) })
	for pool, src := range c.sources {
		wg.Go(func() {
			args := []any{"source", src.Name()}
			if pool != "" {
				args = append([]any{"pool", pool}, args...)
			}
			c.log.Info("discovery: watching", args...)
			src.Run(ctx, func(list []ReplicaConfig) {
				if err := c.Apply(pool, list, src.Name()); err != nil {
					c.log.Error("discovery: the replica list is refused; keeping the previous one", append(args, "err", err)...)
				}
			})
		})
	}
}

// Reload re-reads the replicas files at once (SIGHUP); a no-op with any
// other source (DNS and Kubernetes follow their own intervals and watch).
func (c *control) Reload() {
	for _, s := range c.sources {
		if f, ok := s.(*discovery.File); ok {
			f.Reload()
		}
	}
}
