package gateway

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/fleet"
	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// The membership: a fleet that changes while the gateway runs. The
// replicas come from the config (static), a replicas file, DNS or
// Kubernetes (control_sources.go). Each source gives the whole desired
// list; Apply reconciles the router with it (new replicas cold, removed
// ones draining, see router.SetReplicas), then the fleet's probes, the
// KV-event topics and the prefill/decode mode follow. Per-replica
// kv_events endpoints come from static configuration only: discovered
// replicas reach precise mode through kv_events_listen, whose topic names
// them. A replica removed long ago is forgotten (router/membership.go).

// initialMembers is every source's list at start (initialFound) and the
// router's targets for them, each replica's ranks counted.
func initialMembers(cfg Config, client *http.Client, log *slog.Logger) (map[string][]ReplicaConfig, []router.Spec, error) {
	found, err := initialFound(cfg)
	if err != nil {
		return nil, nil, err
	}
	for pool, l := range found { // the config's own replicas were checked by Validate
		found[pool] = dropSelf(cfg.Listen, l, log, "replicas_file")
	}
	list, pools := cfg.withPools(found)
	return found, poolTargets(list, dataParallelSizes(list, client, log), pools), nil
}

// Apply makes list what the source of pool ("": the top-level source)
// gives, with the other sources' last lists.
func (c *control) Apply(pool string, list []ReplicaConfig, source string) error {
	list = dropSelf(c.cfg.Listen, list, c.log, source) // a replica that is this gateway would loop (loop.go)
	if errs := validateReplicas("replicas", list); len(errs) > 0 {
		return errors.Join(errs...)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	full, pools := c.cfg.withPools(c.foundWith(pool, list)) // with pools:, every pool's replicas
	specs := poolTargets(full, c.ranksFor(full), pools)
	ch, err := c.rt.SetReplicas(specs)
	if err == nil {
		c.found[pool] = list
	}
	c.forgot(ch.Forgotten) // before their slots' new replicas start
	if err != nil || ch.Empty() {
		return err
	}
	now := c.clock.Now()
	for _, i := range ch.Added {
		if c.kvFollowAll() {
			c.rt.Replica(i).KVStart(now)
		}
		c.log.Info("replica added", "replica", c.rt.Name(i), "role", c.rt.Replica(i).Role().String(), "source", source)
	}
	for _, i := range ch.Revived {
		c.log.Info("replica added again: revived with its state", "replica", c.rt.Name(i), "source", source)
	}
	for _, i := range ch.Updated {
		c.log.Info("replica updated (key, role or KV-event endpoint)", "replica", c.rt.Name(i), "role", c.rt.Replica(i).Role().String(), "source", source)
	}
	for _, i := range ch.Removed {
		if slices.Contains(ch.Drained, i) {
			c.log.Info("replica removed: nothing in flight, drained", "replica", c.rt.Name(i), "source", source)
			continue
		}
		c.log.Info("replica removed: draining (no new requests; those in flight finish)", "replica", c.rt.Name(i),
			"in_flight", c.rt.InFlight(i), "source", source)
	}
	c.pd.Store(c.rt.Disaggregated())
	c.fleet.Sync()
	c.kv.topics.Store(c.newKVTopics())
	return nil
}

// foundWith is every source's last list with pool's replaced by list (mu
// held).
func (c *control) foundWith(pool string, list []ReplicaConfig) map[string][]ReplicaConfig {
	out := maps.Clone(c.found)
	if out == nil {
		out = map[string][]ReplicaConfig{}
	}
	out[pool] = list
	return out
}

// kvFollowAll: every replica's KV events are followed (kv_events_listen),
// so one that joins starts out of sync until its stream is followed.
func (c *control) kvFollowAll() bool { return c.cfg.KVEventsListen != "" }

// ranksFor is each listed replica's data-parallel ranks: configured, as
// many as the router already routes it as, or counted from its metrics.
func (c *control) ranksFor(list []ReplicaConfig) []int {
	known := map[string]int{}
	for i := range c.rt.Replicas() {
		r := c.rt.Replica(i)
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
	counted := dataParallelSizes(count, c.client, c.log)
	for i, k := 0, 0; i < len(out); i++ {
		if out[i] < 0 {
			out[i], k = counted[k], k+1
		}
	}
	return out
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

// probeTimeout bounds counting the replicas' data-parallel engines at start.
const probeTimeout = 2 * time.Second

// dataParallelSizes is each replica's data-parallel ranks: configured, or
// counted from its metrics at start (1 when it cannot be reached: the
// fleet warns if it later shows more engines).
func dataParallelSizes(list []ReplicaConfig, client *http.Client, log *slog.Logger) []int {
	out := make([]int, len(list))
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	var wg sync.WaitGroup
	for i, r := range list {
		out[i] = r.DataParallelSize
		if out[i] > 0 {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := fleet.CountEngines(ctx, client, strings.TrimRight(r.URL, "/"), r.APIKey)
			if err != nil {
				log.Debug("cannot count the replica's data-parallel engines; routing it as one", "replica", r.URL, "err", err)
				n = 1
			}
			out[i] = min(n, maxDataParallel)
		}()
	}
	wg.Wait()
	return out
}

// targets are the router's targets: one per replica, or one per rank of a
// data-parallel replica (its KV events on the endpoint's port + rank, as
// vLLM publishes them).
func targets(list []ReplicaConfig, ranks []int) []router.Spec {
	var specs []router.Spec
	for i, r := range list {
		role, _ := policy.ParseRole(r.Role) // checked by Validate
		sp := router.Spec{URL: strings.TrimRight(r.URL, "/"), APIKey: r.APIKey, KVEvents: r.KVEvents, KVReplay: r.KVEventsReplay, Role: role}
		if ranks[i] <= 1 {
			specs = append(specs, sp)
			continue
		}
		for k := range ranks[i] {
			rs := sp
			rs.Ranked, rs.Rank = true, k
			rs.KVEvents, rs.KVReplay = kvevents.OffsetPort(sp.KVEvents, k), kvevents.OffsetPort(sp.KVReplay, k)
			specs = append(specs, rs)
		}
	}
	return specs
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

// forgetLoop forgets the replicas due while no source changes the fleet
// (SetReplicas forgets at each change too), until ctx ends.
func (c *control) forgetLoop(ctx context.Context) {
	tick := c.clock.NewTicker(forgetSweep(c.cfg.ForgetAfter.D()))
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
		}
		c.mu.Lock()
		c.forgot(c.rt.Forget())
		c.mu.Unlock()
	}
}

// forgetSweep is how often forgetLoop looks: a quarter of forget_after,
// between a second and a minute (a replica is forgotten at most that late).
func forgetSweep(after time.Duration) time.Duration {
	return min(max(after/4, time.Second), time.Minute)
}

// forgot frees what is kept of the replicas the router forgot (mu held:
// before their slots are given again): the control plane's own (its
// KV-event series, logged-once causes and topic models, the fleet's probe
// bookkeeping), then the request path's (onForget: its series, the live
// view's tally, the responses homed on the slot).
func (c *control) forgot(list []router.Forgotten) {
	for _, f := range list {
		c.met.forgetReplica(f.Name)
		c.kv.forget(f)
		c.fleet.Forget(f.Slot, f.URL)
		c.onForget(f)
		c.log.Info("replica forgotten: drained and removed for forget_after; its slot is free and its state freed",
			"replica", f.Name, "slot", f.Slot)
	}
}
