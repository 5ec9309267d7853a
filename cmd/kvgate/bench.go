package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/bench"
	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/workload"
)

// loadDefaults are the defaults in which demo differs from bench.
type loadDefaults struct {
	rate, timeScale float64
	maxDuration     time.Duration
	report          string
}

var (
	benchDefaults = loadDefaults{maxDuration: 30 * time.Minute}
	// demoDefaults make `kvgate demo` what the README says it is:
	// `kvgate bench --embedded --rate 6 --time-scale 5 --max-duration 5m --report kvgate-demo-report`.
	demoDefaults = loadDefaults{rate: 6, timeScale: 5, maxDuration: 5 * time.Minute, report: "kvgate-demo-report"}
)

// benchFlags are the flags of `kvgate bench` (and, with demoDefaults, of demo).
type benchFlags struct {
	target         string
	embedded       bool
	replicas       int
	prefill        int // --prefill-replicas
	decode         int // --decode-replicas
	nonCached      int
	set            map[string]bool
	dataParallel   int
	workload       string
	workloadParams listFlag
	policyParams   listFlag
	requests       int
	rate           float64
	concurrency    int
	policies       string
	model          string
	timeScale      float64
	profile        string
	kvBlocks       int
	seed           uint64
	out            outputFlags
	timeout        time.Duration
	maxDuration    time.Duration
	duration       time.Duration
	soakEvery      time.Duration
	gateways       int
	sharedState    string
	tenancy        flowFlags // --tenant, --flow and its settings (benchtenants.go)
}

func (f *benchFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.target, "target", "", "base URL of a running gateway (or any OpenAI-compatible server)")
	fs.BoolVar(&f.embedded, "embedded", false, "run simulated replicas and a gateway in-process, fresh for each policy")
	f.registerLoad(fs, benchDefaults)
	fs.DurationVar(&f.duration, "duration", 0, "soak: repeat the workload (new prompts each round) against --target for this long, reading the gateway's goroutines and heap")
	fs.DurationVar(&f.soakEvery, "soak-interval", 10*time.Second, "soak: how often the gateway's /metrics is read")
	fs.IntVar(&f.gateways, "gateways", 1, "gateways in front of the simulated replicas (--embedded), each with its own router; requests go to them in turn")
	fs.StringVar(&f.sharedState, "shared-state", "", "the --embedded gateways share their routing state through this Redis (redis://HOST:PORT/DB)")
	f.tenancy.register(fs)
}

// registerLoad registers the flags bench and demo share, with d's defaults.
func (f *benchFlags) registerLoad(fs *flag.FlagSet, d loadDefaults) {
	fs.IntVar(&f.replicas, "replicas", 4, "simulated replicas (--embedded)")
	fs.IntVar(&f.prefill, "prefill-replicas", 0, "prefill/decode disaggregation (--embedded): simulated prefill replicas (with --decode-replicas; "+
		"--replicas then defaults to 0)")
	fs.IntVar(&f.decode, "decode-replicas", 0, "prefill/decode disaggregation (--embedded): simulated decode replicas (with --prefill-replicas)")
	fs.IntVar(&f.nonCached, "non-cached-tokens", router.DefaultNonCachedTokens, "prefill/decode (--embedded): the gateway skips the prefill "+
		"step when the decode replica lacks fewer than this many prompt tokens (0: never skip)")
	fs.IntVar(&f.dataParallel, "data-parallel-size", 1, "data-parallel ranks per simulated replica (--embedded): the gateway routes to each rank")
	fs.StringVar(&f.workload, "workload", "multiturn", "workload: "+strings.Join(workload.Names(), ", ")+", or trace:FILE")
	fs.Var(&f.workloadParams, "workload-param", "a workload parameter name=value (repeatable)")
	fs.IntVar(&f.requests, "requests", 0, "number of requests (0: the workload's default)")
	fs.Float64Var(&f.rate, "rate", d.rate, "open loop: Poisson arrivals at this many requests/s (model time); 0: closed loop")
	fs.IntVar(&f.concurrency, "concurrency", 16, "closed loop: concurrent clients (ignored with --rate, a trace, or a workload that times its own arrivals: agents, rl)")
	fs.StringVar(&f.policies, "policies", "round_robin,least_load,prefix_key,sglang,ttft", "policies to compare (--embedded), comma-separated, or all")
	fs.Var(&f.policyParams, "policy-param", "a policy parameter name=value for every policy, or POLICY.name=value for one (repeatable; --embedded)")
	fs.StringVar(&f.model, "model", sim.DefaultModel, "model name sent in requests")
	fs.Float64Var(&f.timeScale, "time-scale", d.timeScale, "the replicas run this many times faster than real time (--embedded: at most; a busy host slows model time down): "+
		"a replica that tells its own times (kvgate sim) has them counted in model time and the rest (gateway, network, client) in real time; "+
		"other latencies are multiplied by it (0: 20 with --embedded, 1 with --target)")
	fs.StringVar(&f.profile, "profile", costmodel.Default, "latency profile of the simulated replicas: "+strings.Join(costmodel.Names(), ", "))
	fs.IntVar(&f.kvBlocks, "kv-blocks", 30000, "KV cache blocks per simulated replica")
	fs.Uint64Var(&f.seed, "seed", 1, "seed of the workload, the replicas and the policies")
	f.out.register(fs, d.report)
	fs.DurationVar(&f.timeout, "timeout", 10*time.Minute, "per-request timeout (model time)")
	fs.DurationVar(&f.maxDuration, "max-duration", d.maxDuration, "bound on each run's wall time")
}

func (f *benchFlags) run(ctx context.Context, inv invocation) error {
	if f.duration > 0 {
		return f.soak(ctx, inv)
	}
	c, err := f.config(inv, "kvgate bench")
	if err != nil {
		return err
	}
	res, err := c.run(ctx, inv.stderr)
	if err != nil {
		return err
	}
	return c.out.Write(inv.stdout, inv.stderr, res)
}

// benchConfig is a validated bench: the request sequence, the load, and
// with --embedded the fleet each policy runs on.
type benchConfig struct {
	policies []string // "target" alone with --target
	params   policyParams
	embedded bool
	target   string
	reach    error // why the --target's /metrics could not be read (discover)
	reqs     []workload.Request
	load     bench.Config
	sim      sim.Config
	gateway  gateway.Config // without replicas, policy and its parameters
	gateways int            // --embedded: gateways in front of the fleet
	meta     map[string]any
	out      report.Outputs
}

func (f *benchFlags) config(inv invocation, title string) (benchConfig, error) {
	f.set = inv.set
	if err := f.validate(); err != nil {
		return benchConfig{}, err
	}
	if err := f.targetOnly(inv.set); err != nil {
		return benchConfig{}, err
	}
	c := benchConfig{policies: []string{"target"}, embedded: f.embedded, target: f.target, out: f.out.outputs(title)}
	var err error
	if f.embedded {
		if c.policies, err = f.policyList(); err != nil {
			return c, err
		}
	}
	if _, err := costmodel.Lookup(f.profile); err != nil {
		return c, fmt.Errorf("%w: %v", errUsage, err)
	}
	if c.params, err = parsePolicyParams(f.policyParams, c.policies); err != nil {
		return c, err
	}
	reqs, keys, err := f.tenantRequests()
	if err != nil {
		return c, err
	}
	var spec workload.Spec
	if reqs == nil {
		if reqs, spec, err = f.requestsFor(f.seed); err != nil {
			return c, err
		}
	}
	c.reqs = reqs
	c.load = f.loadConfig()
	c.load.MaxDuration, c.load.Keys = f.maxDuration, keys
	// A request's priority goes to a --target gateway as given; an
	// embedded one gets it only with its flow control (its sims schedule
	// first come first served and refuse a priority, as vLLM does).
	c.load.SendPriority = !f.embedded || f.tenancy.flow
	c.sim = sim.Config{Replicas: f.aggregated() + f.decode + f.prefill, Roles: f.roles(), Profile: f.profile, KVBlocks: f.kvBlocks,
		TimeScale: f.timeScale, Seed: f.seed, Model: f.model, DataParallelSize: f.dataParallel}
	c.gateway = gateway.Defaults()
	c.gateway.NonCachedTokens = f.nonCached
	c.gateway.Seed, c.gateway.Profile = f.seed, f.profile
	c.gateway.SharedState, c.gateways = f.sharedState, max(f.gateways, 1)
	if err := f.tenantGateway(&c.gateway, &c.sim, keys); err != nil {
		return c, err
	}
	c.meta = f.meta(inv, spec, len(reqs))
	f.tenancy.meta(c.meta)
	c.out.Verdict = true
	return c, nil
}

// embeddedOnly are the flags that describe the in-process fleet: with
// --target they would describe nothing.
var embeddedOnly = []string{"replicas", "prefill-replicas", "decode-replicas", "non-cached-tokens", "data-parallel-size", "profile",
	"kv-blocks", "policies", "gateways", "shared-state"}

// aggregated is the embedded fleet's aggregated replicas: --replicas,
// whose default is 0 beside prefill and decode replicas.
func (f *benchFlags) aggregated() int {
	if f.decode > 0 && !f.set["replicas"] {
		return 0
	}
	return f.replicas
}

// roles are the embedded replicas' roles: the aggregated ones, the decode
// ones, then the prefill ones (none for an aggregated fleet).
func (f *benchFlags) roles() []engine.Role {
	if f.decode == 0 {
		return nil
	}
	var out []engine.Role
	for range f.aggregated() {
		out = append(out, engine.RoleBoth)
	}
	for range f.decode {
		out = append(out, engine.RoleDecode)
	}
	for range f.prefill {
		out = append(out, engine.RolePrefill)
	}
	return out
}

// targetOnly rejects, with --target, the flags that only shape an
// embedded fleet.
func (f *benchFlags) targetOnly(set map[string]bool) error {
	if f.embedded {
		return nil
	}
	for _, name := range append(embeddedOnly, flowOnly...) {
		if set[name] {
			return fmt.Errorf("%w: --%s describes the --embedded fleet: a --target gateway has its own", errUsage, name)
		}
	}
	return nil
}

// meta describes the run in the result and the report: the workload and
// the load in both modes; the simulated fleet with --embedded only (with
// --target, the target's replicas are read from it when the run starts:
// benchConfig.discover).
func (f *benchFlags) meta(inv invocation, spec workload.Spec, requests int) map[string]any {
	m := map[string]any{"command": inv.commandLine(), "workload": spec.String(), "requests": requests, "seed": f.seed}
	if f.open() {
		if f.rate > 0 {
			m["rate"] = f.rate
		}
	} else {
		m["concurrency"] = f.concurrency
	}
	if !f.embedded {
		m["target"] = f.target
		if f.timeScale != 1 {
			// Told by the user (a --target run's default is 1): the latencies were scaled by it.
			m["time_scale"] = f.timeScale
		}
		return m
	}
	m["replicas"], m["profile"], m["kv_blocks"], m["time_scale"] = f.aggregated(), f.profile, f.kvBlocks, f.timeScale
	if f.decode > 0 {
		m["prefill_replicas"], m["decode_replicas"], m["non_cached_tokens"] = f.prefill, f.decode, f.nonCached
	}
	if f.dataParallel > 1 {
		m["data_parallel_size"] = f.dataParallel
	}
	if f.gateways > 1 {
		m["gateways"] = f.gateways
		m["gateway_sync"] = "none"
		if f.sharedState != "" {
			m["gateway_sync"] = "shared (redis)"
		}
	}
	return m
}

// validate rejects flags that cannot run and sets the time scale's default.
func (f *benchFlags) validate() error {
	if f.timeScale == 0 {
		f.timeScale = 1
		if f.embedded {
			f.timeScale = 20
		}
	}
	switch {
	case f.embedded == (f.target != ""):
		return fmt.Errorf("%w: give exactly one of --target URL and --embedded", errUsage)
	case f.replicas < 0 || f.prefill < 0 || f.decode < 0 || f.nonCached < 0:
		return fmt.Errorf("%w: --replicas, --prefill-replicas, --decode-replicas and --non-cached-tokens must be ≥ 0", errUsage)
	case (f.prefill > 0) != (f.decode > 0):
		return fmt.Errorf("%w: --prefill-replicas %d and --decode-replicas %d: a prefill/decode fleet needs both", errUsage, f.prefill, f.decode)
	case f.aggregated()+f.decode < 1:
		return fmt.Errorf("%w: --replicas must be at least 1 (or give --prefill-replicas and --decode-replicas)", errUsage)
	case f.gateways < 0 || f.gateways > 64:
		return fmt.Errorf("%w: --gateways must be in [1, 64]", errUsage)
	case f.dataParallel < 1 || f.dataParallel > sim.MaxDataParallelSize:
		return fmt.Errorf("%w: --data-parallel-size must be in [1, %d]", errUsage, sim.MaxDataParallelSize)
	case f.rate < 0 || f.concurrency < 1 || f.requests < 0:
		return fmt.Errorf("%w: --rate ≥ 0, --concurrency ≥ 1, --requests ≥ 0", errUsage)
	case f.timeScale <= 0:
		return fmt.Errorf("%w: --time-scale must be > 0", errUsage)
	case len(f.policyParams) > 0 && !f.embedded:
		return fmt.Errorf("%w: --policy-param needs --embedded: a --target gateway routes with its own policy", errUsage)
	}
	return nil
}

func (f *benchFlags) policyList() ([]string, error) {
	if f.policies == "all" {
		return policy.Names(), nil
	}
	var out []string
	known := policy.Names()
	for _, p := range strings.Split(f.policies, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		if !slices.Contains(known, p) {
			return nil, fmt.Errorf("%w: unknown policy %q (known: %s)", errUsage, p, strings.Join(known, ", "))
		}
		out = append(out, p)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: --policies is empty", errUsage)
	}
	return out, nil
}

// open reports an open loop: arrivals at --rate, at the tenants' rates,
// or where the workload times its own (a trace's timestamps; agents' and
// rl's programs and batches: workload.Spec.Timed). Run as a closed loop
// of --concurrency clients, 100 agent programs on 4 replicas waited for a
// free client: program makespan p50 201.7 s against the replay's 101.0 s
// (open: 100.7 s), and RL batches went out 16 requests at a time.
func (f *benchFlags) open() bool {
	if f.rate > 0 || len(f.tenancy.tenants) > 0 {
		return true
	}
	spec, err := workload.Parse(f.workload)
	return err == nil && spec.Timed()
}

// loadConfig is the load generator's configuration without target and bound.
func (f *benchFlags) loadConfig() bench.Config {
	load := bench.Config{Model: f.model, RequestTimeout: f.timeout, TimeScale: f.timeScale}
	if !f.open() {
		load.Concurrency = f.concurrency
	}
	return load
}

// requestsFor generates the workload's request sequence for seed (the same
// for every policy).
func (f *benchFlags) requestsFor(seed uint64) ([]workload.Request, workload.Spec, error) {
	spec, err := workload.Parse(f.workload)
	if err != nil {
		return nil, spec, fmt.Errorf("%w: %v", errUsage, err)
	}
	for _, kv := range f.workloadParams {
		if err := spec.SetParam(kv); err != nil {
			return nil, spec, fmt.Errorf("%w: %v", errUsage, err)
		}
	}
	spec.Seed = seed
	if f.requests > 0 {
		spec.Requests = f.requests
	}
	reqs, err := workload.Generate(spec)
	if err != nil {
		return nil, spec, err
	}
	if f.rate > 0 {
		workload.Arrivals(reqs, f.rate, seed)
	}
	return reqs, spec, nil
}

// run runs every policy, one after another.
func (c benchConfig) run(ctx context.Context, stderr io.Writer) (report.Result, error) {
	if !c.embedded {
		c.load.Replicas, c.reach = discover(ctx, c.target, c.load.Header, c.meta, stderr)
	}
	res := report.Result{Meta: c.meta}
	for _, p := range c.policies {
		run, err := c.runPolicy(ctx, p, stderr)
		if err != nil {
			return res, err
		}
		res.Runs = append(res.Runs, run)
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
	}
	return res, nil
}

// runPolicy sends the requests through a fresh embedded fleet routed by p,
// or to the target.
func (c benchConfig) runPolicy(ctx context.Context, p string, stderr io.Writer) (report.Run, error) {
	bar := newProgress(stderr, len(c.reqs), p)
	defer bar.finish()
	load := c.load
	load.Progress = bar.add
	if !c.embedded {
		return c.runTarget(ctx, load, stderr)
	}
	gcfg := c.gateway
	gcfg.PolicyParams = c.params.of(p)
	er, err := bench.RunEmbedded(ctx, bench.EmbeddedConfig{Sim: c.sim, Gateway: gcfg, Load: load, Gateways: c.gateways}, p, c.reqs)
	if err != nil && !errors.Is(err, bench.ErrDeadline) {
		return report.Run{}, fmt.Errorf("policy %s: %w", p, err)
	}
	return er.Run, nil
}

// runTarget sends the requests to the --target and splits the run's time
// into the engines' and the rest: per request when the replicas tell their
// own (kvgate sim), else from the replicas' vLLM histograms read before
// and after the run (bench.EngineSplit) — or says on stderr, and in the
// result's meta (engine_split), why there is no split.
func (c benchConfig) runTarget(ctx context.Context, load bench.Config, stderr io.Writer) (report.Run, error) {
	load.Target = c.target
	engines := bench.EngineURLs(c.target, load.Replicas)
	before := bench.ScrapeEngines(ctx, nil, engines, nil)
	counted, _ := bench.PolicyCounts(ctx, nil, c.target, load.Header)
	recs, wall, err := bench.Run(ctx, load, c.reqs)
	if err != nil && !errors.Is(err, bench.ErrDeadline) {
		return report.Run{}, err
	}
	if err := noneServed(c.target, recs, c.reach); err != nil && ctx.Err() == nil {
		return report.Run{}, err
	}
	// The run is named by the policy the gateway routed it with, read from
	// its kvgate_requests_total before and after; "target" when it does not
	// say (not a kvgate gateway).
	now, _ := bench.PolicyCounts(ctx, nil, c.target, load.Header)
	name := cmp.Or(bench.RoutedBy(counted, now), "target")
	run := bench.Summarize(name, recs, max(len(load.Replicas), maxReplica(recs)+1), wall)
	if run.Split != nil {
		return run, nil
	}
	why := ""
	if load.TimeScale != 1 {
		why = fmt.Sprintf("the replicas' histograms are read at time scale 1 only (--time-scale %g)", load.TimeScale)
	} else {
		after := bench.ScrapeEngines(ctx, nil, engines, nil)
		split, note, err := bench.EngineSplit(before, after, run)
		switch {
		case err != nil:
			why = fmt.Sprintf("%v (read %s)", err, strings.Join(engines, ", "))
		case note != "":
			fmt.Fprintf(stderr, "bench: the engine split is %s\n", note)
			c.meta["engine_split_note"] = note
		}
		run.Split = split
	}
	if why != "" {
		fmt.Fprintf(stderr, "bench: no split of the time into the engines' and the rest: %s\n", why)
		c.meta["engine_split"] = "unavailable: " + why
	}
	return run, nil
}

// discover reads a --target gateway's routing targets (bench.Targets), so
// that one that gets no request counts in the imbalance, and records them
// in meta: "replicas" and "targets" (and "targets_down", those out of
// rotation at the start). Without them (not a kvgate gateway, or its
// metrics unreadable) it says so on log and returns nil: the run then knows
// the targets that answer only; the error is why the page could not be
// read.
func discover(ctx context.Context, target string, h http.Header, meta map[string]any, log io.Writer) ([]string, error) {
	all, down, err := bench.Targets(ctx, nil, target, h)
	switch {
	case err != nil:
		fmt.Fprintf(log, "bench: %v; the imbalance counts only the replicas that answer\n", err)
	case len(all) == 0:
		fmt.Fprintf(log, "bench: %s/metrics lists no kvgate_replica_healthy series (not a kvgate gateway?): the imbalance counts only the replicas that answer\n", strings.TrimRight(target, "/"))
	default:
		meta["replicas"], meta["targets"] = len(all), all
		if len(down) > 0 {
			meta["targets_down"] = down
		}
	}
	return all, err
}

// noneServed is the error of a --target run in which no request
// succeeded, instead of a table of zeros: the failures by kind, why the
// target's /metrics could not be read (reach: a refused connection says
// more than "connect"), and the /v1 an OpenAI client's base URL has and a
// gateway's does not; nil when some request succeeded.
func noneServed(target string, recs []report.Record, reach error) error {
	kinds := map[string]int{}
	for _, r := range recs {
		if !r.Err {
			return nil
		}
		kinds[r.ErrKind]++
	}
	if len(recs) == 0 {
		return nil
	}
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(kinds)) {
		parts = append(parts, fmt.Sprintf("%s ×%d", k, kinds[k]))
	}
	msg := fmt.Sprintf("no request succeeded: %d of %d failed (%s)", len(recs), len(recs), strings.Join(parts, ", "))
	if reach != nil {
		msg += "; " + cmp.Or(errors.Unwrap(reach), reach).Error()
	}
	if strings.HasSuffix(strings.TrimRight(target, "/"), "/v1") {
		msg += "; give --target the gateway's base URL, without /v1 (bench adds /v1/completions)"
	}
	return errors.New(msg)
}

func maxReplica(recs []report.Record) int {
	m := 0
	for _, r := range recs {
		m = max(m, r.Replica)
	}
	return m
}

// soak runs the workload round after round against --target for --duration
// and prints the gateway's goroutines and heap over time.
func (f *benchFlags) soak(ctx context.Context, inv invocation) error {
	if f.target == "" || f.embedded {
		return fmt.Errorf("%w: --duration soaks a running gateway: give --target URL (kvgate serve registers go_goroutines and heap metrics)", errUsage)
	}
	f.set = inv.set
	if err := f.validate(); err != nil {
		return err
	}
	if err := f.targetOnly(inv.set); err != nil {
		return err
	}
	load := f.loadConfig()
	load.Target = f.target
	meta := map[string]any{"workload": f.workload, "duration": f.duration.String(), "target": f.target}
	load.Replicas, _ = discover(ctx, f.target, load.Header, meta, inv.stderr)
	gen := func(round int) ([]workload.Request, error) {
		reqs, _, err := f.requestsFor(f.seed + uint64(round))
		return reqs, err
	}
	start := time.Now()
	samples, recs, err := bench.Soak(ctx, load, gen, f.duration, f.soakEvery)
	if err != nil {
		return err
	}
	bench.WriteSoak(inv.stdout, samples)
	run := bench.Summarize("soak", recs, max(len(load.Replicas), maxReplica(recs)+1), time.Since(start))
	meta["soak"] = samples
	res := report.Result{Runs: []report.Run{run}, Meta: meta}
	return f.out.outputs("kvgate bench soak").Write(inv.stdout, inv.stderr, res)
}
