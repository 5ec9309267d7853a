package chaos

import (
	"context"
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
	"github.com/kvgate/kvgate/internal/testutil"
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
	// adapter: replica 0 also serves the LoRA adapter chaosAdapter.
	adapter bool
	// clients: the client-side scenarios' mix; clientCaused: the replicas
	// stay healthy, so ejections and ordinary failures are the clients' doing.
	clients      clientPlan
	clientCaused bool
	// defaults: the gateway keeps its default settings, not the suite's.
	defaults bool
	gateway  func(*gateway.Config)
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
	sc := scenario{kind: k, replicas: o.Replicas, timeScale: o.TimeScale, faultReplicas: []int{0}}
	if slices.Contains(ClientKinds(), k) {
		return clientScenario(sc, o), nil
	}
	if k == Overload {
		return overloadScenario(sc), nil
	}
	if !slices.Contains(ReplicaKinds(), k) {
		return sc, fmt.Errorf("%w %q", ErrUnknownKind, k)
	}
	return replicaScenario(sc, o), nil
}

// replicaScenario sets up a replica fault but overload.
func replicaScenario(sc scenario, o Options) scenario {
	d := time.Duration(float64(o.Requests) / o.Rate * float64(time.Second)) // the load's expected length
	switch sc.kind {
	case Refuse:
		sc.faults = sim.Faults{RefuseAfter: readyMargin + d/5, RefuseFor: 2 * d / 5}
		sc.backAfter = sc.faults.RefuseAfter + sc.faults.RefuseFor
	case Die:
		sc.faults = sim.Faults{DieRate: 0.5}
	case Stall:
		// Not before the engine: a stalled replica that has not read the
		// body yet may not notice the gateway hanging up (Go's server, like
		// most, watches the connection only once the body is read), so after
		// the stall it may generate the request the gateway gave up on:
		// wasted, though never duplicated (the gateway does not resend it).
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
	}
	return sc
}

// overloadScenario: no fault; the gateway's concurrency limit and bounded
// queue meet 10× the load they admit.
func overloadScenario(sc scenario) scenario {
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
	return sc
}

// clientScenario sets up a client-side scenario: healthy replicas (but for
// the query of death), misbehaving clients.
func clientScenario(sc scenario, o Options) scenario {
	sc.faultReplicas = nil
	sc.clientCaused = true
	switch sc.kind {
	case HangUp10:
		sc.clients.hangUp = 0.1
	case HangUp50:
		sc.clients.hangUp = 0.5
	case SlowReader:
		sc.clients.slow = 4
	case Overflow:
		sc.clients.overflowEvery = 20
	case QueryOfDeath:
		// The replica that reads it crashes: ejecting it and failing the
		// requests it held are right, not the clients' doing.
		sc.clientCaused = false
		sc.clients.poison, sc.clients.poisonAt = true, o.Requests/2
		sc.faults = sim.Faults{CrashOn: queryOfDeath, CrashFor: 500 * time.Millisecond} // on every replica
		sc.backAfter = readyMargin + 2*time.Duration(float64(o.Requests)/o.Rate*float64(time.Second))
	case Hetero:
		sc.adapter = true
		sc.clients.adapterEvery = 3
	case Defaults:
		sc.defaults = true
		sc.clients = clientPlan{hangUp: 0.1, slow: 2, overflowEvery: 20}
	}
	return sc
}

// env is one scenario's running system.
type env struct {
	sims      []*sim.Replica // by replica index
	fronts    []*frontend    // by replica index; nil where the gateway talks to the sim directly
	urls      []string       // what the gateway is configured with, by replica index
	gw        *gateway.Gateway
	cfg       gateway.Config
	reg       *prometheus.Registry
	rec       *recorder
	base      string // the gateway's URL
	clientTr  *http.Transport
	slowTr    *http.Transport // slow readers' transport
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
	if err := e.startFleet(ctx, sc, o); err != nil {
		return nil, err
	}
	if err := e.startFronts(sc, o); err != nil {
		return nil, err
	}
	if err := e.startGateway(ctx, sc, o); err != nil {
		return nil, err
	}
	e.clientTr = &http.Transport{Proxy: nil, MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024, DisableCompression: true}
	e.slowTr = slowTransport()
	e.stopFuncs = append(e.stopFuncs, e.clientTr.CloseIdleConnections, e.slowTr.CloseIdleConnections)
	if err := e.waitReady(ctx); err != nil {
		return nil, fmt.Errorf("the gateway did not see its replicas ready: %w", err)
	}
	return e, nil
}

// startFleet starts the simulated replicas; for a heterogeneous fleet,
// replica 0 also serves the adapter.
func (e *env) startFleet(ctx context.Context, sc scenario, o Options) error {
	cfg := sim.Config{Replicas: sc.replicas, Seed: o.Seed, TimeScale: sc.timeScale,
		KVBlocks: 4096, Faults: sc.faults, FaultReplicas: sc.faultReplicas}
	if sc.adapter {
		cfg.PerReplica = []sim.ReplicaOverride{{Adapters: []string{chaosAdapter}}}
	}
	fl, err := sim.Start(ctx, cfg)
	if err != nil {
		return err
	}
	e.stopFuncs = append(e.stopFuncs, func() { _ = fl.Close() })
	e.sims = fl.Replicas()
	return nil
}

// startFronts puts a frontend before the replicas whose fault the sim
// cannot inject, and lists the URLs the gateway is given.
func (e *env) startFronts(sc scenario, o Options) error {
	e.fronts = make([]*frontend, len(e.sims))
	for i, r := range e.sims {
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
			return err
		}
		e.fronts[i] = f
		e.stopFuncs = append(e.stopFuncs, f.close)
		e.urls = append(e.urls, f.URL())
	}
	return nil
}

// gatewayConfig is the scenario's gateway configuration: the suite's tight
// settings over the defaults, or the defaults untouched.
func gatewayConfig(sc scenario, o Options, urls []string) gateway.Config {
	cfg := gateway.Defaults()
	cfg.Policy, cfg.Seed = o.Policy, o.Seed
	for _, u := range urls {
		cfg.Replicas = append(cfg.Replicas, gateway.ReplicaConfig{URL: u})
	}
	if !sc.defaults {
		cfg.ScrapeInterval, cfg.HealthInterval = gateway.Duration(suiteScrape), gateway.Duration(suiteHealth)
		cfg.EjectAfter, cfg.EjectCooldown = 3, gateway.Duration(suiteCooldown)
		cfg.Retries = suiteRetries
		cfg.RetryBackoff, cfg.RetryBackoffMax = gateway.Duration(5*time.Millisecond), gateway.Duration(50*time.Millisecond)
		cfg.ConnectTimeout = gateway.Duration(time.Second)
		cfg.RequestTimeout = gateway.Duration(o.ClientTimeout / 2)
	}
	if sc.gateway != nil {
		sc.gateway(&cfg)
	}
	return cfg
}

// startGateway starts the gateway on a loopback port, its upstream
// transport wrapped by the recorder.
func (e *env) startGateway(ctx context.Context, sc scenario, o Options) error {
	e.cfg = gatewayConfig(sc, o, e.urls)
	e.rec = newRecorder(e.cfg)
	e.stopFuncs = append(e.stopFuncs, e.rec.close)
	e.reg = prometheus.NewRegistry()
	g, err := gateway.New(e.cfg, gateway.Options{Registry: e.reg, Logger: o.Logger, Transport: e.rec})
	if err != nil {
		return err
	}
	e.gw = g
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", "127.0.0.1:0")
	if err != nil {
		return err
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
	return nil
}

// waitReady polls until the gateway lists a model and has scraped every
// replica and found it healthy.
func (e *env) waitReady(ctx context.Context) error { return gatewayReady(ctx, e.gw, len(e.urls)) }

// gatewayReady polls until g lists a model and has scraped each of its n
// replicas and found it healthy.
func gatewayReady(ctx context.Context, g *gateway.Gateway, n int) error {
	return testutil.Poll(ctx, 10*time.Second, func() bool {
		if len(g.Fleet().Models()) == 0 {
			return false
		}
		for i := range n {
			if _, _, have := g.Router().ReplicaMetrics(i); !have || !g.Router().Healthy(i) {
				return false
			}
		}
		return true
	})
}

// newClient is the scenario's client of the gateway.
func (e *env) newClient(sc scenario, o Options) *client {
	return &client{http: &http.Client{Transport: e.clientTr}, slowHTTP: &http.Client{Transport: e.slowTr},
		base: e.base, model: sim.DefaultModel, maxTokens: o.MaxTokens, timeout: o.ClientTimeout,
		prefix: fmt.Sprintf("chaos-%s-%d-", sc.kind, o.Seed), plan: sc.clients, seed: o.Seed}
}

// admitted is the number of requests replica i's engine has taken in.
func admitted(r *sim.Replica) int {
	s := r.Stats()
	return int(s.RequestsFinished + s.RequestsAborted + int64(s.Running) + int64(s.Waiting))
}

// metricSum sums every series of a counter or gauge family of reg.
func metricSum(reg *prometheus.Registry, name string) float64 { return metricWith(reg, name, nil) }

// run is one scenario's load and its account.
type run struct {
	sc scenario
	o  Options
	e  *env
	cl *client
	// before: each replica's admitted count before the (current phase's)
	// load; retries0, ejections0: the gateway's counters then.
	before                         []int
	retries0, ejections0, aborted0 float64

	mu      sync.Mutex
	results []result
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
	r := &run{sc: sc, o: o, e: e, cl: e.newClient(sc, o)}
	r.mark()
	res := &Result{Kind: sc.kind, Status: map[int]int{}, PreEngine: sc.preEngine, ClientCaused: sc.clientCaused}
	if err := r.load(ctx, res); err != nil {
		return nil, err
	}
	if err := r.settle(ctx, res, started); err != nil {
		return nil, err
	}
	r.account(res, r.take())
	return res, nil
}

// mark notes the replicas' and the gateway's counts before a load.
func (r *run) mark() {
	r.before = make([]int, len(r.e.sims))
	aborted := 0
	for i, s := range r.e.sims {
		r.before[i] = admitted(s)
		aborted += int(s.Stats().RequestsAborted)
	}
	r.retries0 = metricSum(r.e.reg, "kvgate_retries_total")
	r.ejections0 = metricSum(r.e.reg, "kvgate_ejections_total")
	r.aborted0 = float64(aborted)
}

// send sends request i and keeps its result.
func (r *run) send(ctx context.Context, i int) {
	res := r.cl.do(ctx, i)
	r.mu.Lock()
	r.results = append(r.results, res)
	r.mu.Unlock()
}

// take returns the results so far and forgets them.
func (r *run) take() []result {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.results
	r.results = nil
	return out
}

// load runs the scenario's load (overload: its baseline, then the
// overload), with a flapping replica's fault controller running beside it.
func (r *run) load(ctx context.Context, res *Result) error {
	// The fault controller must end before the frontend closes (deferred
	// earlier by start, so later).
	fctx, fcancel := context.WithCancel(ctx)
	var fwg sync.WaitGroup
	defer func() { fcancel(); fwg.Wait() }()
	var flapErr error
	if r.sc.flap {
		fwg.Go(func() { res.FaultWindows, flapErr = r.e.fronts[0].flap(fctx, r.sc.flapUp, r.sc.flapDown) })
	}
	if r.sc.clients.slow > 0 {
		r.cl.ordinaryDone = newCountdown(r.o.Requests - min(r.sc.clients.slow, r.o.Requests))
	}
	loadStart := time.Now()
	if ov := r.sc.overload; ov != nil {
		first, err := r.baseline(ctx, res)
		if err != nil {
			return err
		}
		loadStart = time.Now()
		runLoad(ctx, loadSpec{first: first, n: 3 * r.o.Requests, rate: res.OfferedRate,
			maxInFlight: int(ov.factor) * (ov.concurrency + ov.queue) * 4, seed: r.o.Seed}, r.send)
	} else {
		runLoad(ctx, loadSpec{first: 0, n: r.o.Requests, rate: r.o.Rate, maxInFlight: 256, seed: r.o.Seed}, r.send)
	}
	res.Wall = time.Since(loadStart)
	fcancel()
	fwg.Wait()
	if flapErr != nil {
		return fmt.Errorf("%w: flap: %v", errFrontend, flapErr)
	}
	return nil
}

// baseline runs the overload scenario's first phase: a closed loop at the
// concurrency limit — the replicas as busy as the gateway lets them be,
// nobody queued or shed — and sets the overload's offered rate to factor ×
// the admitted capacity (limit / mean latency). It returns the index of the
// overload's first request.
func (r *run) baseline(ctx context.Context, res *Result) (int, error) {
	ov := r.sc.overload
	nb := min(max(r.o.Requests/2, 2*ov.concurrency), 200)
	runLoad(ctx, loadSpec{first: 0, n: nb, concurrency: ov.concurrency}, r.send)
	if err := quiet(ctx, r.e); err != nil {
		return 0, err
	}
	results := r.take()
	base := &Result{Kind: r.sc.kind, Status: map[int]int{}}
	r.account(base, results)
	r.mark()
	res.Baseline = base
	mean := meanLatency(results)
	if base.Succeeded == 0 || mean <= 0 {
		return 0, fmt.Errorf("overload baseline: %d of %d succeeded", base.Succeeded, nb)
	}
	res.OfferedRate = ov.factor * float64(ov.concurrency) / mean.Seconds()
	return nb, nil
}

// settle waits for the gateway's in-flight counts to return to zero, the
// replicas to go idle and the replicas expected back to be in rotation.
func (r *run) settle(ctx context.Context, res *Result, started time.Time) error {
	rt, e := r.e.gw.Router(), r.e
	res.InFlightZero = testutil.Poll(ctx, 5*time.Second, func() bool {
		for i := range e.urls {
			if rt.InFlight(i) != 0 {
				return false
			}
		}
		return metricSum(e.reg, "kvgate_admitted_requests") == 0 && metricSum(e.reg, "kvgate_queued_requests") == 0
	}) == nil
	if err := quiet(ctx, e); err != nil {
		return err
	}
	// Back in rotation: every replica not failed for good, once the fault
	// window is over, within a breaker's re-opening (twice the cooldown) and
	// a few health intervals.
	backBy := max(time.Until(started.Add(r.sc.backAfter)), 0) + 2*e.cfg.EjectCooldown.D() + 3*e.cfg.HealthInterval.D() + 2*time.Second
	res.Back = testutil.Poll(ctx, backBy, func() bool {
		for i := range e.urls {
			if !slices.Contains(r.sc.out, i) && !rt.Healthy(i) {
				return false
			}
		}
		return true
	}) == nil
	res.StayedOut = true
	for _, i := range r.sc.out {
		res.StayedOut = res.StayedOut && !rt.Healthy(i)
	}
	return nil
}

// account counts results into res, reconciles them with the replicas'
// engines and reads the gateway's counters.
func (r *run) account(res *Result, results []result) {
	tally(res, results, r.e)
	reconcile(res, results, r.e, r.before)
	res.RetriesMetric = int(metricSum(r.e.reg, "kvgate_retries_total") - r.retries0)
	res.Ejections = int(metricSum(r.e.reg, "kvgate_ejections_total") - r.ejections0)
	aborted := 0
	for _, s := range r.e.sims {
		aborted += int(s.Stats().RequestsAborted)
	}
	res.Aborted = aborted - int(r.aborted0)
	if res.Baseline != nil {
		res.Admitted, res.Shed, res.QTime = res.Succeeded, res.Status[http.StatusTooManyRequests], 0
		for _, x := range results {
			if x.status == http.StatusServiceUnavailable && x.verdict.class == FailedClear {
				res.QTime++
			}
		}
	}
}

// tally counts results into res: classes, statuses, retries, latency, and
// what each client-side behaviour met.
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
		checkAnswer(res, r, as)
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
		if count(res, r.id, v) {
			lat = append(lat, r.latency)
		}
		tallyBehaviour(res, r, v, as, e)
	}
	res.P50, res.P99 = quantile(lat, 0.50), quantile(lat, 0.99)
}

// checkAnswer notes an answer that no attempt upstream explains.
func checkAnswer(res *Result, r result, as []attempt) {
	switch {
	case r.replica != "" && (len(as) == 0 || as[len(as)-1].target != r.replica):
		res.Mismatches = append(res.Mismatches, fmt.Sprintf("%s: answered with X-Kvgate-Replica %s, not its last attempt's replica", r.id, r.replica))
	case len(as) == 0 && (r.verdict.class == Succeeded || r.verdict.class == HungUp):
		res.Mismatches = append(res.Mismatches, fmt.Sprintf("%s: a %s answer without any attempt upstream", r.id, r.verdict.class))
	}
}

// count adds one request's class to res; true when it succeeded.
func count(res *Result, id string, v verdict) bool {
	switch v.class {
	case Succeeded:
		res.Succeeded++
		return true
	case FailedClear:
		res.FailedClear++
		if v.streamErr {
			res.StreamErrors++
		}
		res.FailReasons = sample(res.FailReasons, id+": "+v.reason)
	case HungUp:
		res.HungUp++
	default:
		res.Lost++
		res.LostReasons = sample(res.LostReasons, id+": "+v.reason)
	}
	return false
}

// sample appends s to a sample of at most five.
func sample(ss []string, s string) []string {
	if len(ss) < 5 {
		ss = append(ss, s)
	}
	return ss
}

// tallyBehaviour counts what the client-side behaviours met.
func tallyBehaviour(res *Result, r result, v verdict, as []attempt, e *env) {
	switch r.as {
	case ordinary:
		res.Ordinary++
		if v.class != Succeeded {
			res.OrdinaryFailed++
			res.OrdinaryReasons = sample(res.OrdinaryReasons, r.id+": "+v.class.String()+" "+v.reason)
		}
	case overflow:
		res.Overflow++
		if r.status == http.StatusBadRequest && v.class == FailedClear {
			res.Overflow400++
		} else {
			res.OddReasons = sample(res.OddReasons, fmt.Sprintf("%s: max_tokens 2^63−1 answered %d, %s %s", r.id, r.status, v.class, v.reason))
		}
	case poison:
		res.Poison++
		targets := map[string]bool{}
		for _, a := range as {
			targets[a.target] = true
		}
		res.PoisonReplicas += len(targets)
	case onAdapter:
		tallyAdapter(res, r, v, as, e)
	}
}

// tallyAdapter counts an adapter request: every attempt must go to replica
// 0 (the only one serving the adapter) and it must not be answered 404.
func tallyAdapter(res *Result, r result, v verdict, as []attempt, e *env) {
	res.Adapter++
	elsewhere := false
	for _, a := range as {
		elsewhere = elsewhere || a.target != e.urls[0]
	}
	if elsewhere {
		res.AdapterElsewhere++
	}
	if r.status == http.StatusNotFound {
		res.Adapter404++
	}
	if elsewhere || r.status == http.StatusNotFound {
		res.OddReasons = sample(res.OddReasons, fmt.Sprintf("%s: adapter request answered %d after %d attempts, %s %s", r.id, r.status, len(as), v.class, v.reason))
	}
}

// quiet waits until every replica's engine is idle: each generation
// finished or aborted.
func quiet(ctx context.Context, e *env) error {
	err := testutil.Poll(ctx, 10*time.Second, func() bool {
		for _, r := range e.sims {
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
	for i, r := range e.sims {
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
