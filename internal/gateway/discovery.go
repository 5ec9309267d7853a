package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"sigs.k8s.io/yaml"

	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/policy"
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

// DiscoveryConfig is the config's discovery: exactly one of DNS and
// Kubernetes.
type DiscoveryConfig struct {
	// DNS is NAME:PORT (A/AAAA records, each address a replica) or a SRV
	// name _SERVICE._PROTO.DOMAIN (each target HOST:PORT a replica).
	DNS string `json:"dns,omitempty"`
	// Scheme of the discovered replicas' URLs: http (default) or https.
	Scheme string `json:"scheme,omitempty"`
	// Interval between DNS lookups (default 5s).
	Interval Duration `json:"interval,omitempty"`
	// RemoveAfter: DNS answers in a row without a replica before it is
	// removed (default 2: one answer missing it is a flap).
	RemoveAfter int `json:"remove_after,omitempty"`
	// Role of every replica DNS finds (one role per discovery entry);
	// Kubernetes reads each pod's role label instead.
	Role string `json:"role,omitempty"`
	// APIKey and DataParallelSize apply to every replica found.
	APIKey           string `json:"api_key,omitempty"`
	DataParallelSize int    `json:"data_parallel_size,omitempty"`

	Kubernetes *KubernetesConfig `json:"kubernetes,omitempty"`
}

// dynamic reports whether the replicas come from a source that changes
// while the gateway runs.
func (c *Config) dynamic() bool { return c.ReplicasFile != "" || c.Discovery != nil || c.poolSourced() }

// validateSources checks that the replicas come from exactly one source.
func (c *Config) validateSources() []error {
	n := 0
	for _, set := range []bool{len(c.Replicas) > 0, c.ReplicasFile != "", c.Discovery != nil} {
		if set {
			n++
		}
	}
	switch {
	case n == 0:
		return []error{errors.New("no replicas: give --replicas URL,URL,... or --replicas-file FILE, or replicas:, " +
			"replicas_file: or discovery: in the config file")}
	case n > 1:
		return []error{errors.New("replicas come from one source: give only one of replicas: (--replicas), " +
			"replicas_file: (--replicas-file) and discovery:")}
	case c.Discovery != nil:
		return c.Discovery.validate()
	}
	return nil
}

func (d *DiscoveryConfig) validate() []error {
	var errs []error
	switch {
	case d.DNS == "" && d.Kubernetes == nil:
		return []error{errors.New("discovery: give dns: NAME:PORT or kubernetes: {namespace, selector, port}")}
	case d.DNS != "" && d.Kubernetes != nil:
		return []error{errors.New("discovery: give one of dns: and kubernetes:, not both")}
	case d.DNS != "":
		if _, _, _, err := discovery.ParseDNSName(d.DNS); err != nil {
			errs = append(errs, fmt.Errorf("discovery: %w", err))
		}
	default:
		errs = append(errs, d.Kubernetes.validate()...)
		if d.Role != "" {
			errs = append(errs, errors.New("discovery.role: with kubernetes each pod's role comes from its "+
				"role label (kubernetes.role_label, default "+DefaultRoleLabel+")"))
		}
	}
	if d.Scheme != "" && d.Scheme != "http" && d.Scheme != "https" {
		errs = append(errs, fmt.Errorf("discovery.scheme %q: want http or https", d.Scheme))
	}
	if _, err := policy.ParseRole(d.Role); err != nil {
		errs = append(errs, fmt.Errorf("discovery.role: %w", err))
	}
	if d.RemoveAfter < 0 || d.DataParallelSize < 0 || d.DataParallelSize > maxDataParallel {
		errs = append(errs, fmt.Errorf("discovery: remove_after ≥ 0 and data_parallel_size from 0 to %d", maxDataParallel))
	}
	return errs
}

// template is every discovered replica's settings but its URL.
func (d *DiscoveryConfig) template() ReplicaConfig {
	return ReplicaConfig{Role: d.Role, APIKey: d.APIKey, DataParallelSize: d.DataParallelSize}
}

// ParseReplicasFile parses a replicas file: the YAML list of the config's
// replicas: (a bare list, or a map with replicas:), checked as the config
// checks it. kv_events endpoints are refused (static configuration only;
// use kv_events_listen), and so is an empty list: a file caught half
// written would otherwise remove every replica.
func ParseReplicasFile(data []byte) ([]ReplicaConfig, error) {
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("not valid YAML: %w", err)
	}
	js = bytes.TrimSpace(js)
	if len(js) > 0 && js[0] == '{' {
		var wrap struct {
			Replicas json.RawMessage `json:"replicas"`
		}
		dec := json.NewDecoder(bytes.NewReader(js))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&wrap); err != nil {
			return nil, fmt.Errorf("want a list of replicas, or replicas: with one: %w", err)
		}
		js = wrap.Replicas
	}
	var list []ReplicaConfig
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&list); err != nil {
		return nil, fmt.Errorf("want a list of replicas ({url: ..., role: ...}): %w", err)
	}
	if len(list) == 0 {
		return nil, errors.New("no replicas listed (an empty file is refused: the previous list is kept)")
	}
	errs := validateReplicas("replicas", list)
	for i, r := range list {
		if r.KVEvents != "" || r.KVEventsReplay != "" {
			errs = append(errs, fmt.Errorf("replicas[%d]: kv_events and kv_events_replay come from the config file only; "+
				"replicas from a replicas file reach precise mode through kv_events_listen", i))
		}
	}
	return list, errors.Join(errs...)
}

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
