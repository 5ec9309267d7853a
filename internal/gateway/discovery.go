package gateway

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/router"
)

// A fleet that changes while the gateway runs: the replicas come from the
// config (static), a replicas file, DNS or Kubernetes (internal/discovery).
// Each source gives the whole desired list; applyReplicas reconciles the
// router with it (new replicas cold, removed ones draining, see
// router.SetReplicas), then the fleet's probes, the KV-event topics and
// the prefill/decode mode follow. Per-replica kv_events endpoints come
// from static configuration only: discovered replicas reach precise mode
// through kv_events_listen, whose topic names them.

// newSources is the configured source of replicas (nil: static).
func (g *Gateway) newSource() (discovery.Source, error) {
	return g.sourceOf(g.cfg.ReplicasFile, g.cfg.Discovery)
}

// sourceOf is the source of a replicas file or a discovery entry (the
// top-level one, or a pool's; nil: neither).
func (g *Gateway) sourceOf(file string, d *DiscoveryConfig) (discovery.Source, error) {
	switch {
	case file != "":
		return discovery.NewFile(file, 0, ParseReplicasFile, g.clock, g.log), nil
	case d != nil && d.DNS != "":
		return discovery.NewDNS(discovery.DNSConfig{Name: d.DNS, Scheme: d.Scheme, Interval: d.Interval.D(),
			RemoveAfter: d.RemoveAfter, Template: d.template(), Resolver: g.resolver, Clock: g.clock, Log: g.log})
	case d != nil:
		return g.newKubernetesSource(d)
	}
	return nil, nil
}

// initialReplicas is the list the gateway starts with: the config's, the
// replicas file's (which must then be good), or none (DNS and Kubernetes
// fill it in once Run starts).
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

// runDiscovery runs the source until ctx ends, applying each list, and,
// with any source (a pool's too), forgets the replicas removed long ago.
func (g *Gateway) runDiscovery(ctx context.Context) {
	if !g.cfg.dynamic() {
		return
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { g.forgetLoop(ctx) })
	if g.source == nil {
		return
	}
	g.log.Info("discovery: watching", "source", g.source.Name())
	g.source.Run(ctx, func(list []ReplicaConfig) {
		if err := g.applyReplicas(list, g.source.Name()); err != nil {
			g.log.Error("discovery: the replica list is refused; keeping the previous one", "source", g.source.Name(), "err", err)
		}
	})
}

// Reload re-reads the replicas file at once (SIGHUP); a no-op with any
// other source (DNS and Kubernetes follow their own intervals and watch).
func (g *Gateway) Reload() {
	for _, s := range append([]discovery.Source{g.source}, g.poolSourceList()...) {
		if f, ok := s.(*discovery.File); ok {
			f.Reload()
		}
	}
}

// applyReplicas makes list the gateway's replicas.
func (g *Gateway) applyReplicas(list []ReplicaConfig, source string) error {
	return g.applyFrom("", list, source)
}

// applyFrom makes list what the source of pool ("": the top-level
// source) gives, with the other sources' last lists (pools_sources.go).
func (g *Gateway) applyFrom(pool string, list []ReplicaConfig, source string) error {
	list = dropSelf(g.cfg.Listen, list, g.log, source) // a replica that is this gateway would loop (loop.go)
	if errs := validateReplicas("replicas", list); len(errs) > 0 {
		return errors.Join(errs...)
	}
	g.memMu.Lock()
	defer g.memMu.Unlock()
	full, pools := g.cfg.withPools(g.foundWith(pool, list)) // with pools:, every pool's replicas
	specs := poolTargets(full, g.ranksFor(full), pools)
	ch, err := g.rt.SetReplicas(specs)
	if err == nil {
		g.found[pool] = list
	}
	g.forgot(ch.Forgotten) // before their slots' new replicas start
	if err != nil || ch.Empty() {
		return err
	}
	now := g.clock.Now()
	for _, i := range ch.Added {
		if g.kvFollowAll() {
			g.rt.Replica(i).KVStart(now)
		}
		g.log.Info("replica added", "replica", g.rt.Name(i), "role", g.rt.Replica(i).Role().String(), "source", source)
	}
	for _, i := range ch.Revived {
		g.log.Info("replica added again: revived with its state", "replica", g.rt.Name(i), "source", source)
	}
	for _, i := range ch.Updated {
		g.log.Info("replica updated (key, role or KV-event endpoint)", "replica", g.rt.Name(i), "role", g.rt.Replica(i).Role().String(), "source", source)
	}
	for _, i := range ch.Removed {
		if slices.Contains(ch.Drained, i) {
			g.log.Info("replica removed: nothing in flight, drained", "replica", g.rt.Name(i), "source", source)
			continue
		}
		g.log.Info("replica removed: draining (no new requests; those in flight finish)", "replica", g.rt.Name(i),
			"in_flight", g.rt.InFlight(i), "source", source)
	}
	g.pd.Store(g.rt.Disaggregated())
	g.fleet.Sync()
	g.topics.Store(g.newKVTopics())
	return nil
}

// kvFollowAll: every replica's KV events are followed (kv_events_listen),
// so one that joins starts out of sync until its stream is followed.
func (g *Gateway) kvFollowAll() bool { return g.cfg.KVEventsListen != "" }

// ranksFor is each listed replica's data-parallel ranks: configured, as
// many as the router already routes it as, or counted from its metrics.
func (g *Gateway) ranksFor(list []ReplicaConfig) []int {
	known := map[string]int{}
	for i := range g.rt.Replicas() {
		r := g.rt.Replica(i)
		if !r.Removed() {
			known[r.URL()]++
		}
	}
	var count []ReplicaConfig
	out := make([]int, len(list))
	for i, r := range list {
		switch n := known[strings.TrimRight(r.URL, "/")]; {
		case r.DataParallelSize > 0:
			out[i] = r.DataParallelSize
		case n > 0:
			out[i] = n
		default:
			out[i] = -1
			count = append(count, r)
		}
	}
	if len(count) == 0 {
		return out
	}
	counted := dataParallelSizes(count, g.client, g.log)
	for i, k := 0, 0; i < len(out); i++ {
		if out[i] < 0 {
			out[i], k = counted[k], k+1
		}
	}
	return out
}

// drainLog is the router's OnDrained: a removed replica's last request ended.
func drainLog(g **Gateway) func(int) {
	return func(i int) {
		if gw := *g; gw != nil {
			gw.log.Info("replica drained: no request in flight left", "replica", gw.rt.Name(i))
		}
	}
}

// replicaState is a replica's membership for listings: active, draining
// (removed, requests in flight), removed (kept for a revival until
// forget_after) or free (a forgotten replica's slot, for the next added).
func replicaState(r *router.Replica) string {
	switch {
	case r.Vacant():
		return "free"
	case !r.Removed():
		return "active"
	case r.Draining():
		return "draining"
	}
	return "removed"
}

// newKubernetesSource asks the registry for the Kubernetes source (the
// plugin internal/discovery/kubernetes, linked from cmd/kvgate).
func (g *Gateway) newKubernetesSource(d *DiscoveryConfig) (discovery.Source, error) {
	spec := d.Kubernetes.spec(d)
	spec.Clock, spec.Log = g.clock, g.log
	return discovery.Kubernetes.New(spec)
}
