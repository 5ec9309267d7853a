package chaos

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
)

// scenario is one fault kind's setup.
type scenario struct {
	kind          Kind
	replicas      int
	timeScale     float64
	faults        sim.Faults
	faultReplicas []int
	// limit429 > 0 puts every replica behind a frontend answering 429 at that rate.
	limit429 float64
	// truncate > 0 puts replica 0 behind a frontend cutting streams at that rate.
	truncate float64
	// flap puts replica 0 behind a frontend that goes down for flapDown
	// every flapUp, for as long as the load runs.
	flap             bool
	flapUp, flapDown time.Duration
	gateway          func(*gateway.Config)
	// out: replicas that fail for good and must be out of rotation at the end.
	out []int
	// preEngine: the fault strikes before the replica's engine admits the
	// request, so no generation may be wasted.
	preEngine bool
	// backAfter: how long after the fleet starts the fault can keep a
	// replica down (the refuse window's end).
	backAfter time.Duration
	overload  *overloadSpec
	// server adjusts the gateway's http.Server (tests of slow clients).
	server func(*http.Server)
}

// overloadSpec is the overload scenario's limiter and offered load.
type overloadSpec struct {
	concurrency, queue int
	queueTimeout       time.Duration
	factor             float64 // offered rate / admitted capacity
}

// readyMargin is the time a fleet and gateway take to start and see each
// other, on a loaded machine; fault windows open after it.
const readyMargin = 300 * time.Millisecond

// The gateway settings of the suite: probes and cooldowns short enough for
// a scenario of about a second to see replicas ejected and coming back,
// and the active health check at its default, 1 s: against real traffic,
// requests meet a dead replica before the check does, so the passive
// ejection is what is under test.
const (
	suiteScrape   = 50 * time.Millisecond
	suiteHealth   = time.Second
	suiteCooldown = 300 * time.Millisecond
	suiteRetries  = 2
)

func scenarioFor(k Kind, o Options) (scenario, error) {
	d := time.Duration(float64(o.Requests) / o.Rate * float64(time.Second)) // the load's expected length
	sc := scenario{kind: k, replicas: o.Replicas, timeScale: o.TimeScale, faultReplicas: []int{0}}
	switch k {
	case Refuse:
		sc.faults = sim.Faults{RefuseAfter: readyMargin + d/5, RefuseFor: 2 * d / 5}
		sc.backAfter = sc.faults.RefuseAfter + sc.faults.RefuseFor
	case Die:
		sc.faults = sim.Faults{DieRate: 0.5}
	case Stall:
		// Not before the engine: a stalled replica that has not read the
		// body yet does not notice the gateway hanging up (Go's server, like
		// most, watches the connection only once the body is read), so after
		// the stall it generates the request the gateway already sent
		// elsewhere — a duplicate within the retry rule, counted as wasted.
		sc.faults = sim.Faults{StallRate: 0.5, Stall: 5 * time.Second}
		sc.gateway = func(c *gateway.Config) { c.FirstByteTimeout = gateway.Duration(250 * time.Millisecond) }
	case Error500:
		sc.faults = sim.Faults{ErrorRate: 0.3}
		sc.preEngine = true
	case Fail503:
		sc.faults = sim.Faults{FailAfter: 8}
		sc.out = []int{0}
		sc.preEngine = true
	case Limit429:
		sc.limit429 = 0.3
		sc.preEngine = true
	case Flap:
		sc.flap, sc.flapUp, sc.flapDown = true, max(d/8, 50*time.Millisecond), max(d/8, 50*time.Millisecond)
	case Timeout:
		sc.faults = sim.Faults{StallRate: 0.2, Stall: 5 * time.Second}
		sc.faultReplicas = nil // every replica
		// As with Stall, the replica generates a timed-out request after its
		// stall, for nobody: wasted, though not duplicated (no retry).
		sc.gateway = func(c *gateway.Config) { c.RequestTimeout = gateway.Duration(300 * time.Millisecond) }
	case Truncate:
		sc.truncate = 0.5
	case Overload:
		sc.replicas = 2
		// Real time: a request's service time (a quarter second) dwarfs the
		// gateway's and the load generator's CPU time, so that the 10×
		// offered rate measures the limiter, not a starved test machine.
		sc.timeScale = 1
		sc.faultReplicas = nil
		sc.overload = &overloadSpec{concurrency: 4, queue: 2, queueTimeout: 2 * time.Second, factor: 10}
		sc.gateway = func(c *gateway.Config) {
			c.MaxConcurrency, c.MaxQueue = sc.overload.concurrency, sc.overload.queue
			c.QueueTimeout = gateway.Duration(sc.overload.queueTimeout)
		}
		sc.preEngine = true
	default:
		return sc, fmt.Errorf("%w %q", ErrUnknownKind, k)
	}
	return sc, nil
}

// env is one scenario's running system.
type env struct {
	fleet     *sim.Fleet
	fronts    []*frontend // by replica index; nil where the gateway talks to the sim directly
	urls      []string    // what the gateway is configured with, by replica index
	gw        *gateway.Gateway
	cfg       gateway.Config
	reg       *prometheus.Registry
	rec       *recorder
	base      string // the gateway's URL
	clientTr  *http.Transport
	stopOnce  sync.Once
	stopFuncs []func()
}

func (e *env) stop() {
	e.stopOnce.Do(func() {
		for i := len(e.stopFuncs) - 1; i >= 0; i-- {
			e.stopFuncs[i]()
		}
	})
}

// start brings up the fleet, the frontends and the gateway, and waits until
// the gateway sees every replica healthy.
func start(ctx context.Context, sc scenario, o Options) (_ *env, err error) {
	e := &env{}
	defer func() {
		if err != nil {
			e.stop()
		}
	}()
	fl, err := sim.Start(ctx, sim.Config{Replicas: sc.replicas, Seed: o.Seed, TimeScale: sc.timeScale,
		KVBlocks: 4096, Faults: sc.faults, FaultReplicas: sc.faultReplicas})
	if err != nil {
		return nil, err
	}
	e.fleet = fl
	e.stopFuncs = append(e.stopFuncs, func() { _ = fl.Close() })
	e.fronts = make([]*frontend, sc.replicas)
	for i, r := range fl.Replicas() {
		var h http.Handler
		switch {
		case sc.limit429 > 0:
			h = limit429(r.Handler(), sc.limit429, o.Seed+uint64(i))
		case sc.flap && i == 0:
			h = r.Handler()
		case sc.truncate > 0 && i == 0:
			h = truncateStreams(r.Handler(), sc.truncate, o.Seed)
		}
		if h == nil {
			e.urls = append(e.urls, r.URL())
			continue
		}
		f, err := startFrontend(h)
		if err != nil {
			return nil, err
		}
		e.fronts[i] = f
		e.stopFuncs = append(e.stopFuncs, f.close)
		e.urls = append(e.urls, f.URL())
	}

	cfg := gateway.Defaults()
	cfg.Policy, cfg.Seed = o.Policy, o.Seed
	for _, u := range e.urls {
		cfg.Replicas = append(cfg.Replicas, gateway.ReplicaConfig{URL: u})
	}
	cfg.ScrapeInterval, cfg.HealthInterval = gateway.Duration(suiteScrape), gateway.Duration(suiteHealth)
	cfg.EjectAfter, cfg.EjectCooldown = 3, gateway.Duration(suiteCooldown)
	cfg.Retries = suiteRetries
	cfg.RetryBackoff, cfg.RetryBackoffMax = gateway.Duration(5*time.Millisecond), gateway.Duration(50*time.Millisecond)
	cfg.ConnectTimeout = gateway.Duration(time.Second)
	cfg.RequestTimeout = gateway.Duration(o.ClientTimeout / 2)
	if sc.gateway != nil {
		sc.gateway(&cfg)
	}
	e.cfg = cfg
	e.rec = newRecorder(cfg)
	e.stopFuncs = append(e.stopFuncs, e.rec.close)
	e.reg = prometheus.NewRegistry()
	g, err := gateway.New(cfg, gateway.Options{Registry: e.reg, Logger: o.Logger, Transport: e.rec})
	if err != nil {
		return nil, err
	}
	e.gw = g
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	e.base = "http://" + ln.Addr().String()
	srv := g.Server()
	if sc.server != nil {
		sc.server(srv)
	}
	gctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { g.Run(gctx) })
	wg.Go(func() { _ = srv.Serve(ln) })
	e.stopFuncs = append(e.stopFuncs, func() {
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = srv.Shutdown(sctx)
		scancel()
		_ = srv.Close()
		cancel()
		wg.Wait()
	})
	e.clientTr = &http.Transport{Proxy: nil, MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024, DisableCompression: true}
	e.stopFuncs = append(e.stopFuncs, e.clientTr.CloseIdleConnections)

	err = poll(ctx, 10*time.Second, func() bool {
		if len(g.Fleet().Models()) == 0 {
			return false
		}
		for i := range e.urls {
			if _, _, have := g.Router().ReplicaMetrics(i); !have || !g.Router().Healthy(i) {
				return false
			}
		}
		return true
	})
	if err != nil {
		return nil, fmt.Errorf("the gateway did not see its replicas ready: %w", err)
	}
	return e, nil
}

// errPollDeadline: a condition polled for did not come true in time.
var errPollDeadline = errors.New("condition not met before the deadline")

// poll checks cond every few milliseconds until it holds, the deadline
// passes or ctx ends.
func poll(ctx context.Context, within time.Duration, cond func() bool) error {
	deadline := time.Now().Add(within)
	t := time.NewTimer(0)
	defer t.Stop()
	<-t.C
	for {
		if cond() {
			return nil
		}
		if time.Now().After(deadline) {
			return errPollDeadline
		}
		t.Reset(5 * time.Millisecond)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// admitted is the number of requests replica i's engine has taken in.
func admitted(r *sim.Replica) int {
	s := r.Stats()
	return int(s.RequestsFinished + s.RequestsAborted + int64(s.Running) + int64(s.Waiting))
}

// metricSum sums every series of a counter or gauge family of reg.
func metricSum(reg *prometheus.Registry, name string) float64 {
	fams, err := reg.Gather()
	if err != nil {
		return 0
	}
	t := 0.0
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			switch {
			case m.GetCounter() != nil:
				t += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				t += m.GetGauge().GetValue()
			}
		}
	}
	return t
}

func runScenario(ctx context.Context, sc scenario, o Options) (*Result, error) {
	ctx, cancel := context.WithTimeout(ctx, o.ScenarioTimeout)
	defer cancel()
	started := time.Now()
	e, err := start(ctx, sc, o)
	if err != nil {
		return nil, err
	}
	defer e.stop()
	cl := &client{http: &http.Client{Transport: e.clientTr}, base: e.base, model: sim.DefaultModel,
		maxTokens: o.MaxTokens, timeout: o.ClientTimeout, prefix: fmt.Sprintf("chaos-%s-%d-", sc.kind, o.Seed)}
	before := make([]int, len(e.urls))
	for i, r := range e.fleet.Replicas() {
		before[i] = admitted(r)
	}
	retries0 := metricSum(e.reg, "kvgate_retries_total")
	ejections0 := metricSum(e.reg, "kvgate_ejections_total")

	// The fault controller of a flapping replica runs as long as the load.
	// It must end before the frontend closes (deferred earlier, so later).
	fctx, fcancel := context.WithCancel(ctx)
	var fwg sync.WaitGroup
	defer func() { fcancel(); fwg.Wait() }()
	windows := 0
	var flapErr error
	if sc.flap {
		fwg.Go(func() { windows, flapErr = e.fronts[0].flap(fctx, sc.flapUp, sc.flapDown) })
	}

	var results []result
	var mu sync.Mutex
	send := func(ctx context.Context, i int) {
		r := cl.do(ctx, i)
		mu.Lock()
		results = append(results, r)
		mu.Unlock()
	}
	res := &Result{Kind: sc.kind, Status: map[int]int{}, PreEngine: sc.preEngine}
	loadStart := time.Now()
	if ov := sc.overload; ov != nil {
		// Baseline: closed loop at the concurrency limit — the replicas as
		// busy as the gateway lets them be, nobody queued or shed.
		nb := min(max(o.Requests/2, 2*ov.concurrency), 200)
		runLoad(ctx, loadSpec{first: 0, n: nb, concurrency: ov.concurrency}, send)
		if err := quiet(ctx, e); err != nil {
			return nil, err
		}
		base := &Result{Kind: sc.kind, Status: map[int]int{}}
		tally(base, results, e)
		reconcile(base, results, e, before)
		base.RetriesMetric = int(metricSum(e.reg, "kvgate_retries_total") - retries0)
		retries0 += float64(base.RetriesMetric)
		for i, r := range e.fleet.Replicas() {
			before[i] = admitted(r)
		}
		res.Baseline = base
		mean := meanLatency(results)
		results = nil
		if base.Succeeded == 0 || mean <= 0 {
			return nil, fmt.Errorf("overload baseline: %d of %d succeeded", base.Succeeded, nb)
		}
		// Overload: open loop at factor × the admitted capacity (limit / mean latency).
		res.OfferedRate = ov.factor * float64(ov.concurrency) / mean.Seconds()
		loadStart = time.Now()
		runLoad(ctx, loadSpec{first: nb, n: 3 * o.Requests, rate: res.OfferedRate,
			maxInFlight: int(ov.factor) * (ov.concurrency + ov.queue) * 4, seed: o.Seed}, send)
	} else {
		runLoad(ctx, loadSpec{first: 0, n: o.Requests, rate: o.Rate, maxInFlight: 256, seed: o.Seed}, send)
	}
	res.Wall = time.Since(loadStart)
	fcancel()
	fwg.Wait()
	if flapErr != nil {
		return nil, fmt.Errorf("%w: flap: %v", errFrontend, flapErr)
	}
	res.FaultWindows = windows

	// In flight back to zero: the router's per-replica counts and the limiter's.
	rt := e.gw.Router()
	res.InFlightZero = poll(ctx, 5*time.Second, func() bool {
		for i := range e.urls {
			if rt.InFlight(i) != 0 {
				return false
			}
		}
		return metricSum(e.reg, "kvgate_admitted_requests") == 0 && metricSum(e.reg, "kvgate_queued_requests") == 0
	}) == nil
	if err := quiet(ctx, e); err != nil {
		return nil, err
	}
	// Back in rotation: every replica not failed for good, once the fault
	// window is over, within a few cooldowns and health intervals.
	backBy := max(time.Until(started.Add(sc.backAfter)), 0) + 4*suiteCooldown + 10*suiteHealth + 2*time.Second
	res.Back = poll(ctx, backBy, func() bool {
		for i := range e.urls {
			if !slices.Contains(sc.out, i) && !rt.Healthy(i) {
				return false
			}
		}
		return true
	}) == nil
	res.StayedOut = true
	for _, i := range sc.out {
		res.StayedOut = res.StayedOut && !rt.Healthy(i)
	}

	tally(res, results, e)
	reconcile(res, results, e, before)
	res.RetriesMetric = int(metricSum(e.reg, "kvgate_retries_total") - retries0)
	res.Ejections = int(metricSum(e.reg, "kvgate_ejections_total") - ejections0)
	if res.Baseline != nil {
		res.Admitted, res.Shed, res.QTime = res.Succeeded, res.Status[http.StatusTooManyRequests], 0
		for _, r := range results {
			if r.status == http.StatusServiceUnavailable && r.verdict.class == FailedClear {
				res.QTime++
			}
		}
	}
	return res, nil
}

// tally counts results into res: classes, statuses, retries, latency.
func tally(res *Result, results []result, e *env) {
	var lat []time.Duration
	for _, r := range results {
		res.Sent++
		if r.status != 0 {
			res.Status[r.status]++
		}
		if r.noRetryAt {
			res.NoRetryAfter++
		}
		as := e.rec.attempts(r.id)
		if r.replica != "" && (len(as) == 0 || as[len(as)-1].target != r.replica) {
			res.Mismatches = append(res.Mismatches, fmt.Sprintf("%s: answered with X-Kvgate-Replica %s, not its last attempt's replica", r.id, r.replica))
		}
		res.Attempts += len(as)
		if len(as) > 1 {
			res.Retried++
			res.RecordedRetries += len(as) - 1
		}
		v := r.verdict
		if why := ruleViolation(as, e.cfg.Retries); why != "" {
			res.RuleViolations++
			v = verdict{class: Lost, reason: "duplicate generation: " + why}
		}
		switch v.class {
		case Succeeded:
			res.Succeeded++
			lat = append(lat, r.latency)
		case FailedClear:
			res.FailedClear++
			if v.streamErr {
				res.StreamErrors++
			}
			if len(res.FailReasons) < 5 {
				res.FailReasons = append(res.FailReasons, r.id+": "+v.reason)
			}
		default:
			res.Lost++
			if len(res.LostReasons) < 5 {
				res.LostReasons = append(res.LostReasons, r.id+": "+v.reason)
			}
		}
	}
	res.P50, res.P99 = quantile(lat, 0.50), quantile(lat, 0.99)
}

// quiet waits until every replica's engine is idle: each generation
// finished or aborted.
func quiet(ctx context.Context, e *env) error {
	err := poll(ctx, 10*time.Second, func() bool {
		for _, r := range e.fleet.Replicas() {
			if s := r.Stats(); s.Running+s.Waiting != 0 {
				return false
			}
		}
		return true
	})
	if err != nil {
		return fmt.Errorf("replicas still busy after the load: %w", err)
	}
	return nil
}

// reconcile compares, per replica, the engine's admitted requests with the
// gateway's recorded attempts: seen ≤ generations ≤ seen + ambiguous.
func reconcile(res *Result, results []result, e *env, before []int) {
	index := map[string]int{}
	for i, u := range e.urls {
		index[u] = i
	}
	seen := make([]int, len(e.urls))
	amb := make([]int, len(e.urls))
	for _, r := range results {
		for _, a := range e.rec.attempts(r.id) {
			i, ok := index[a.target]
			if !ok {
				res.Mismatches = append(res.Mismatches, "attempt to an unknown replica "+a.target)
				continue
			}
			switch {
			case a.status == http.StatusOK:
				seen[i]++
			case a.status == 0 && a.wrote:
				amb[i]++
			}
		}
	}
	for i, r := range e.fleet.Replicas() {
		gen := admitted(r) - before[i]
		res.Generations += gen
		res.Seen += seen[i]
		res.Ambiguous += amb[i]
		if gen < seen[i] || gen > seen[i]+amb[i] {
			res.Mismatches = append(res.Mismatches, fmt.Sprintf("replica %d: engine admitted %d, gateway saw %d answered and %d broken after sending",
				i, gen, seen[i], amb[i]))
		}
	}
	res.Wasted = res.Generations - res.Seen
}

func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	// Nearest rank: the smallest value with at least q of the sample at or below it.
	k := int(float64(len(s))*q+0.999999) - 1
	return s[min(max(k, 0), len(s)-1)]
}

func meanLatency(rs []result) time.Duration {
	var t time.Duration
	n := 0
	for _, r := range rs {
		if r.verdict.class == Succeeded {
			t += r.latency
			n++
		}
	}
	if n == 0 {
		return 0
	}
	return t / time.Duration(n)
}
