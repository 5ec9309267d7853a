package gateway

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/fleet"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sharedstate"
)

// The control plane: which replicas exist and what they hold, on another
// clock than the request path (seconds, SIGHUP). It runs the sources of
// replicas and keeps their last lists (control_sources.go), reconciles
// them into the router and the fleet, counting data-parallel ranks and
// forgetting replicas removed long ago (control_members.go), follows the
// replicas' KV events, subscribed or on the listening socket
// (control_kv.go, control_kvlisten.go), shares the routing state with the
// other gateways, and keeps the flags the membership decides (prefill/
// decode on, every replica probed once). Like Caddy's UpstreamSource and
// llm-d's EndpointDiscovery it has a Ready contract, which /ready asks.
//
// The request path and the admin endpoints reach it only through
// controlPlane; its files touch nothing of Gateway (the onForget hook is
// how it tells the request path's sinks; a breaker's opening reaches them
// from the router's OnEject).

// controlPlane is what the rest of the gateway asks of the control plane.
type controlPlane interface {
	// Run runs the fleet's probes, the sources, the KV-event subscriptions
	// and the shared state until ctx ends.
	Run(ctx context.Context)
	// Reload re-reads the replicas files (SIGHUP).
	Reload()
	// Ready is nil once the gateway may take traffic as far as the
	// control plane knows: the shared state loaded (else errWarming) and
	// every replica's first health check ended (else errProbing).
	Ready() error
	// Disaggregated reports whether some replica has a role other than
	// both: requests are then routed to prefill/decode pairs (pd.go).
	Disaggregated() bool
	// Fleet is the replicas' watcher (models served, breaker states).
	Fleet() *fleet.Fleet
	// LogOnce logs one message per replica and cause (a replica's
	// misconfiguration, seen by the request path or the KV events); a
	// forgotten replica's causes are forgotten with it.
	LogOnce(replica int, cause string, level slog.Level, msg string, args ...any)
}

var _ controlPlane = (*control)(nil)

// Ready's answers before the gateway may take traffic (errors.go maps
// them to 503s).
var (
	// errWarming: the shared state (the peers' index) is still loading, so
	// that the gateway routes like its peers from the first request;
	// bounded by the syncer's warm-up timeout.
	errWarming = errors.New("the shared routing state is loading")
	// errProbing: some replica's first health check has not ended.
	errProbing = errors.New("the replicas' first health checks have not all ended")
)

// control is the control plane.
type control struct {
	cfg      startConfig // as given at start: the control plane reloads none of it
	rt       *router.Router
	fleet    *fleet.Fleet
	client   *http.Client // rank counting
	log      *slog.Logger
	clock    clock.Clock
	reg      prometheus.Registerer
	resolver discovery.Resolver
	met      *kvMetrics
	shared   *sharedstate.Syncer // nil when shared_state is off
	onForget func(router.Forgotten)

	// mu serialises applying the sources' lists; sources are by pool (""
	// the top-level one), found the last good list of each, under mu.
	mu      sync.Mutex
	sources map[string]discovery.Source
	found   map[string][]ReplicaConfig
	// pd: some replica has a role other than both (it changes with the
	// membership); probed: every replica's first health check has ended.
	pd, probed atomic.Bool
	kv         kvState
}

// controlOptions are the control plane's parts beside the configuration.
type controlOptions struct {
	Router   *router.Router
	Client   *http.Client
	Logger   *slog.Logger
	Clock    clock.Clock
	Registry prometheus.Registerer
	Resolver discovery.Resolver
	Shared   *sharedstate.Syncer
	// Found is every source's list at start (initialFound), the router's
	// replicas.
	Found map[string][]ReplicaConfig
	// OnForget frees the request path's state of a forgotten replica.
	OnForget func(router.Forgotten)
}

// newControl builds the control plane of a router built from o.Found.
func newControl(cfg Config, o controlOptions) (*control, error) {
	c := &control{cfg: startConfig{Config: cfg}, rt: o.Router, client: o.Client, log: o.Logger, clock: o.Clock, reg: o.Registry,
		resolver: o.Resolver, shared: o.Shared, found: o.Found, onForget: o.OnForget}
	if err := c.newSources(); err != nil {
		return nil, err
	}
	c.pd.Store(c.rt.Disaggregated())
	c.met = newKVMetrics(o.Registry)
	o.Registry.MustRegister(newReplicaCollector(c.rt, c.clock)) // per-replica gauges follow the membership
	if len(cfg.Pools) > 0 {
		registerPoolInfo(o.Registry, c.rt)
	}
	c.fleet = fleet.New(c.rt, o.Client, fleet.Config{
		ScrapeInterval: scrapeInterval(cfg.ScrapeInterval.D(), c.rt), HealthInterval: cfg.HealthInterval.D(),
		StaleAfter: cfg.ScrapeStaleAfter.D(), Logger: o.Logger, Clock: o.Clock,
	})
	return c, nil
}

// minScrapeInterval bounds how often a policy may have the replicas
// scraped: a page of metrics per replica every 10 ms is already a hundred
// requests a second per replica.
const minScrapeInterval = 10 * time.Millisecond

// scrapeInterval is the replicas' scrape period: scrape_interval, or the
// period of the fastest policy that routes (the top-level one or a pool's)
// when it refreshes its metrics faster (policy.MetricsRefresher: llm-d's
// scheduler reads them every 50 ms, and llmd and precise decide on
// numbers that old as llm-d does), but never below minScrapeInterval.
func scrapeInterval(configured time.Duration, rt *router.Router) time.Duration {
	d := configured
	pols := []policy.Policy{rt.Policy()}
	for _, name := range rt.Pools() {
		if p, ok := rt.PoolPolicy(name); ok {
			pols = append(pols, p)
		}
	}
	for _, p := range pols {
		if own := policy.MetricsRefresh(p); own > 0 && own < d {
			d = own
		}
	}
	return max(d, min(configured, minScrapeInterval))
}

// Run runs the control plane until ctx ends.
func (c *control) Run(ctx context.Context) {
	var wg sync.WaitGroup
	wg.Go(func() { c.fleet.Run(ctx) })
	wg.Go(func() { c.runSources(ctx) })
	if c.cfg.Precise() {
		wg.Go(func() { c.runKVEvents(ctx) })
	}
	if c.shared != nil {
		wg.Go(func() { c.runShared(ctx) })
	}
	wg.Wait()
}

func (c *control) Ready() error {
	switch {
	case c.shared != nil && !c.shared.Ready():
		return errWarming
	case !c.fleetProbed():
		return errProbing
	}
	return nil
}

func (c *control) Disaggregated() bool { return c.pd.Load() }

func (c *control) Fleet() *fleet.Fleet { return c.fleet }

// fleetProbed reports whether every replica's first health check has
// ended; once true it stays true (a replica added later by discovery does
// not take the gateway out of its load balancer while it is probed).
func (c *control) fleetProbed() bool {
	if c.probed.Load() {
		return true
	}
	for i := range c.rt.Replicas() {
		if r := c.rt.Replica(i); !r.Removed() && !r.Probed() {
			return false
		}
	}
	c.probed.Store(true)
	return true
}

// runShared runs the syncer until ctx ends: the warm load first (Ready
// turns true when it is done or given up), then its loops.
func (c *control) runShared(ctx context.Context) {
	if err := c.shared.Start(ctx, c.rt); err != nil && !errors.Is(err, context.Canceled) {
		c.log.Warn("shared state: cannot start; routing on this gateway's own view", "err", err)
	}
	<-ctx.Done()
	if err := c.shared.Close(); err != nil {
		c.log.Warn("shared state: close", "err", err)
	}
}
