package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/workload"
)

// EmbeddedConfig describes an in-process fleet: simulated replicas and a
// gateway in front of them, built fresh (cold caches) for every policy.
type EmbeddedConfig struct {
	Sim     sim.Config     // Replicas, Profile, KVBlocks, TimeScale, Seed, ...
	Gateway gateway.Config // policy parameters, intervals; replicas and listen are set here
	Load    Config         // concurrency, timeouts (Target, Replicas, TimeScale set here)
	// Gateways in front of the fleet (default 1), each with its own
	// router; requests go to them in turn. With Gateway.SharedState they
	// share their state through that Redis (a namespace of the run's own).
	Gateways int
	// wrapGateway, when set, wraps each gateway's handler (tests: a gateway
	// made slower).
	wrapGateway func(http.Handler) http.Handler
}

// DefaultElastic is the embedded fleet's elastic slack (sim.Config.Elastic,
// model time) unless EmbeddedConfig.Sim sets one: model time waits for an
// engine core more than this behind, and the load generator with it, so
// that a host too slow for the time scale slows the run instead of
// distorting it. It bounds how much earlier than its arrival a request may
// join a step: well below a step (10 ms and more with the default profile).
const DefaultElastic = time.Millisecond

// ExtraTimeScale is the Run.Extra key of an embedded run's effective time
// scale: model time over real time. Below the time scale asked for, the
// host could not keep up and model time waited (sim.Timeline): the run took
// longer, its figures are the same.
const ExtraTimeScale = "time_scale_effective"

// EmbeddedResult is one policy's run.
type EmbeddedResult struct {
	Run     report.Run
	Records []report.Record
	// HitRate from the replicas' own counters (vllm:prefix_cache_hits_total /
	// vllm:prefix_cache_queries_total over the run); on a disaggregated
	// fleet, from the records: each request's prefill step's hit, as its
	// route receipt names it.
	HitRate float64
}

// RunEmbedded runs reqs through policy on a fresh simulated fleet.
func RunEmbedded(ctx context.Context, e EmbeddedConfig, policy string, reqs []workload.Request) (EmbeddedResult, error) {
	simCfg := e.Sim
	simCfg.Port = 0
	if simCfg.Elastic == 0 {
		simCfg.Elastic = DefaultElastic
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	fl, err := sim.Start(ctx, simCfg)
	if err != nil {
		return EmbeddedResult{}, err
	}
	defer fl.Close()
	urls := fl.URLs()
	clk := newModelClock(fl.Timeline())
	defer clk.close() // after the gateways stop
	queues := len(e.Gateway.Tenants) > 0 || e.Gateway.FlowControl.Enabled
	// Disaggregated: the replicas' prefix counters summed would count a
	// request's prompt twice, on its prefill replica and again on its
	// decode replica, which looks up what it then pulls (and whose usage
	// counts the pulled prompt as cached). A request's hit is its prefill
	// step's, which the route receipt names (the replay's definition: the
	// prefill replica's hit, the decode replica's when the step was
	// skipped).
	pd := len(answering(urls, simCfg)) < len(urls)
	// A wait in the gateway's queue is the engines' time: the receipt
	// gives it in model time (splitRecord).
	e.Gateway.RouteReceipts = e.Gateway.RouteReceipts || queues || pd
	targets, stop, err := startGateways(ctx, e, policy, urls, simCfg, clk)
	if err != nil {
		return EmbeddedResult{}, err
	}
	defer stop()
	before := counters(fl)
	load := e.Load
	// The replicas that answer (X-Kvgate-Replica): a prefill replica's
	// share would always be 0.
	load.Target, load.Replicas, load.TimeScale = targets[0], targetNames(answering(urls, simCfg), simCfg.DataParallelSize), simCfg.TimeScale
	load.Timeline = fl.Timeline()
	load.GatewayQueues = queues
	if len(targets) > 1 {
		load.Targets = targets
	}
	if load.Model == "" {
		load.Model = cmp.Or(simCfg.Model, sim.DefaultModel)
	}
	began := time.Now()
	recs, wall, err := Run(ctx, load, reqs)
	if err != nil && !errors.Is(err, ErrDeadline) {
		return EmbeddedResult{}, err
	}
	spent := time.Since(began)
	after := counters(fl)
	res := EmbeddedResult{Records: recs}
	res.Run = Summarize(policy, recs, len(load.Replicas), wall)
	if spent > 0 {
		// How fast model time ran: the time scale, or less where the host
		// held it back (sim.Timeline).
		res.Run.Extra = map[string]float64{ExtraTimeScale: wall.Seconds() / spent.Seconds()}
	}
	res.HitRate = res.Run.HitRate
	if q := after.queries - before.queries; q > 0 && !pd {
		res.HitRate = float64(after.hits-before.hits) / float64(q)
		res.Run.HitRate = res.HitRate
	}
	return res, err
}

// answering are the URLs of the replicas of fleet sc that are not of role
// prefill.
func answering(urls []string, sc sim.Config) []string {
	var out []string
	for i, u := range urls {
		role := sc.Role
		if i < len(sc.Roles) {
			role = sc.Roles[i]
		}
		if role != engine.RolePrefill {
			out = append(out, u)
		}
	}
	return out
}

// targetNames are the gateway's targets over servers of dp data-parallel
// ranks each: the URLs, or URL#k for each rank k.
func targetNames(urls []string, dp int) []string {
	if dp <= 1 {
		return urls
	}
	var out []string
	for _, u := range urls {
		for k := range dp {
			out = append(out, fmt.Sprintf("%s#%d", u, k))
		}
	}
	return out
}

// startGateways starts e.Gateways gateways (at least one) in front of the
// replicas at urls; with shared state, in a namespace of their own, so that
// no earlier run's state reaches them. It returns their URLs and the stop
// of them all.
func startGateways(ctx context.Context, e EmbeddedConfig, policy string, urls []string, sc sim.Config, clk clock.Clock) ([]string, func(), error) {
	gcfg := e.Gateway
	if gcfg.SharedState != "" && gcfg.SharedStateNamespace == "" {
		gcfg.SharedStateNamespace = fmt.Sprintf("kvgate-bench-%d", time.Now().UnixNano())
	}
	var targets []string
	var stops []func()
	stopAll := func() {
		for _, s := range stops {
			s()
		}
	}
	for range max(e.Gateways, 1) {
		t, stop, err := startGateway(ctx, gcfg, policy, urls, sc, e.wrapGateway, clk)
		if err != nil {
			stopAll()
			return nil, nil, err
		}
		targets, stops = append(targets, t), append(stops, stop)
	}
	return targets, stopAll, nil
}

// startGateway starts a gateway routing by policy over the replicas at
// urls (with the roles the fleet sc gives them) on a loopback port, and
// waits until it has scraped each of them. It returns the gateway's URL
// and its stop.
func startGateway(ctx context.Context, gcfg gateway.Config, policy string, urls []string, sc sim.Config,
	wrap func(http.Handler) http.Handler, clk clock.Clock) (string, func(), error) {
	gcfg.Policy = policy
	gcfg.Replicas = nil
	for i, u := range urls {
		rc := gateway.ReplicaConfig{URL: u}
		if role := sc.Role; role != engine.RoleBoth || i < len(sc.Roles) {
			if i < len(sc.Roles) {
				role = sc.Roles[i]
			}
			rc.Role = role.String()
		}
		gcfg.Replicas = append(gcfg.Replicas, rc)
	}
	if gcfg.ScrapeInterval == 0 {
		gcfg.ScrapeInterval = gateway.Duration(250 * time.Millisecond)
	}
	g, err := gateway.New(gcfg, gateway.Options{Clock: clk})
	if err != nil {
		return "", nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	srv := g.Server()
	if wrap != nil {
		srv.Handler = wrap(srv.Handler)
	}
	var wg sync.WaitGroup
	wg.Go(func() { g.Run(ctx) })
	wg.Go(func() { _ = srv.Serve(ln) })
	stop := func() {
		cancel()
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = srv.Shutdown(sctx)
		scancel()
		wg.Wait()
	}
	if err := waitReady(ctx, g, len(urls)); err != nil {
		stop()
		return "", nil, err
	}
	return "http://" + ln.Addr().String(), stop, nil
}

type hitCounters struct{ hits, queries int64 }

func counters(fl *sim.Fleet) hitCounters {
	var c hitCounters
	for _, r := range fl.Replicas() {
		s := r.Stats()
		c.hits += s.PrefixHits
		c.queries += s.PrefixQueries
	}
	return c
}

// waitReady polls until the gateway has scraped every replica and lists a
// model, or a deadline passes.
func waitReady(ctx context.Context, g *gateway.Gateway, n int) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		// Every replica scraped, checked healthy and listing its models: a
		// first request is routed over the whole fleet.
		ok := true
		for i := 0; ok && i < g.Router().Replicas(); i++ {
			_, _, have := g.Router().ReplicaMetrics(i)
			r := g.Router().Replica(i)
			ok = have && r.Ready() && r.Served() != nil
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("bench: the embedded fleet was not ready within 10s")
		}
		t := time.NewTimer(5 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}
