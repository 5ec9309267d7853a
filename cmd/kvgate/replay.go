package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/replay"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/workload"
)

// replayDefaultRate is the Poisson arrival rate of generated workloads in
// replay (which has no closed loop): enough load on 8 replicas for queueing
// to show, not so much that every policy drowns.
const replayDefaultRate = 20

// replayDefaultWorkload is what the questions replay without --trace or
// --workload: the sharing question needs a workload with a shared prefix,
// and the other two use the same one.
const replayDefaultWorkload = "shared_prefix"

// maxParallel bounds --parallel: each replay at once holds a fleet.
const maxParallel = 1024

// Questions of --question.
const (
	questionSharing   = "sharing"
	questionScore     = "score-surface"
	questionStaleness = "staleness"
	questionPressure  = "cache-pressure"
	// questionSaturation: the pool saturation gauge's lead on a ramp (saturation.go).
	questionSaturation = "saturation"
)

// replayFlags are the flags of `kvgate replay`.
type replayFlags struct {
	trace, workload, policies, profile, question  string
	traceFormat                                   workload.TraceFormat
	kvEvents                                      string
	dataParallel                                  int
	gateways                                      int
	gatewaySync, syncLoads                        string
	syncDelay                                     time.Duration
	workloadParams, policyParams, replicaProfiles listFlag
	requests, replicas, kvBlocks, offloadBlocks   int
	kvPulls                                       bool
	prefillReplicas, decodeReplicas, nonCached    int
	maxSeqs, parallel                             int
	rate, speedup                                 float64
	staleness, scrape, slo, sloITL                time.Duration
	capacity, oracle                              bool
	seed                                          uint64
	out                                           outputFlags
	programs                                      programFlags
	set                                           map[string]bool
	tenancy                                       flowFlags
}

func (f *replayFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.trace, "trace", "", "trace to replay, JSON lines, its format told by its first line: a Mooncake trace (hash_ids), "+
		"one recorded by kvgate serve --record (hash_ids and block_size), or a log of OpenAI request bodies with timestamps "+
		"(timestamp or created, the request under body or request or the line itself)")
	fs.StringVar(&f.workload, "workload", "", "a generated workload instead of a trace: "+strings.Join(workload.Names(), ", ")+" (or trace:FILE)")
	fs.Var(&f.workloadParams, "workload-param", "a workload parameter, name=value (repeatable)")
	fs.IntVar(&f.requests, "requests", 0, "requests to make (a trace: its first N records; 0: the workload's default, the whole trace)")
	fs.Float64Var(&f.rate, "rate", replayDefaultRate, "Poisson arrival rate of a generated workload, requests/s (0: all at once)")
	fs.IntVar(&f.replicas, "replicas", replay.DefaultReplicas, "simulated aggregated replicas (each serves whole requests; "+
		"0 by default beside --prefill-replicas and --decode-replicas)")
	fs.IntVar(&f.prefillReplicas, "prefill-replicas", 0, "prefill/decode disaggregation: simulated prefill replicas, which compute prompts "+
		"for the decode replicas to pull (with --decode-replicas)")
	fs.IntVar(&f.decodeReplicas, "decode-replicas", 0, "prefill/decode disaggregation: simulated decode replicas, which pull a prompt's "+
		"KV from a prefill replica and generate (with --prefill-replicas)")
	fs.IntVar(&f.nonCached, "non-cached-tokens", router.DefaultNonCachedTokens, "prefill/decode: skip the prefill step when the "+
		"decode replica lacks fewer than this many prompt tokens (0: never skip), as kvgate serve's flag")
	fs.StringVar(&f.policies, "policies", "all", "comma-separated policies, or all")
	fs.Var(&f.policyParams, "policy-param", "a policy parameter name=value for every policy, or POLICY.name=value for one (repeatable)")
	fs.StringVar(&f.profile, "profile", costmodel.Default, "latency profile: "+strings.Join(costmodel.Names(), ", "))
	fs.Var(&f.replicaProfiles, "replica-profile", "replica I runs profile NAME instead (I=NAME, repeatable): a heterogeneous fleet; the policies still assume --profile")
	fs.IntVar(&f.kvBlocks, "kv-blocks", engine.DefaultNumBlocks, "KV cache blocks per replica (16 tokens each)")
	fs.IntVar(&f.offloadBlocks, "offload-blocks", 0, "host (CPU) KV tier of each replica, in blocks, as vLLM's OffloadingConnector keeps "+
		"it (write-through LRU; a hit there loads over PCIe at the profile's rate) and as the router's approximate index of it is sized (0: none)")
	fs.BoolVar(&f.kvPulls, "kv-pulls", false, "peer pulls: a replica told kv_transfer_params.remote_kv_source pulls the prefix the named peer holds "+
		"over the KV link; ttft plans pulls in its estimate, the other policies get llm-d's p2p-source-producer's after their choice")
	fs.IntVar(&f.maxSeqs, "max-seqs", engine.DefaultMaxSeqs, "each engine's running-sequence cap (vLLM's --max-num-seqs; 1 serves one request at a time)")
	fs.IntVar(&f.dataParallel, "data-parallel-size", 1, "data-parallel ranks per replica: each rank an engine and a routing target, as the gateway routes a DP server")
	fs.StringVar(&f.kvEvents, "kv-events", string(replay.KVAuto), "precise mode, the router following the engines' KV events: auto (for policies defined on them, e.g. precise), on (every policy), off")
	fs.IntVar(&f.gateways, "gateways", 1, "gateways in front of the replicas, each with its own router and policy; requests go to them in turn, as a Kubernetes Service spreads them")
	fs.StringVar(&f.gatewaySync, "gateway-sync", string(replay.SyncShared), "with --gateways > 1: shared (each gateway's decisions and loads reach the others --sync-delay later, as through Redis) or none (they know nothing of each other)")
	fs.DurationVar(&f.syncDelay, "sync-delay", 10*time.Millisecond, "with --gateway-sync shared: how long a gateway's published batch takes to reach the others")
	fs.StringVar(&f.syncLoads, "sync-loads", string(replay.LoadsOnChange), "with --gateway-sync shared: when a gateway publishes its loads: change (at its next 5ms tick after they change, as the gateway does) or batch (only with its decisions and on its 250ms heartbeat)")
	fs.Float64Var(&f.speedup, "speedup", 1, "arrival (and think) times are divided by this")
	fs.DurationVar(&f.staleness, "staleness", 0, "policies see the replicas' scraped metrics (and KV events) this much late")
	fs.DurationVar(&f.scrape, "scrape-interval", 0, "period of the metric scrapes (0: each policy's upstream period: llm-d's 50 ms for llmd and precise, else 250 ms, the gateway's)")
	fs.BoolVar(&f.capacity, "capacity", false, "search each policy's largest speed-up meeting --slo-ttft-p90")
	fs.DurationVar(&f.slo, "slo-ttft-p90", 2*time.Second, "the p90 TTFT objective of --capacity and of --question saturation")
	fs.BoolVar(&f.oracle, "oracle", true, "compute the oracle bound beside the hit-rate bounds: every request hits as in one LRU of the fleet's "+
		"capacity and goes where the engines' exact queues give it its first token soonest (its TTFT, and with --capacity its capacity "+
		"and each run's capacity_vs_bound); one gateway, aggregated replicas")
	fs.IntVar(&f.parallel, "parallel", 0, "replays run at once (the bounds, the oracle's and each policy's run and capacity search, each on a fleet of its own; "+
		"0: one per CPU, 1: one after another): the figures are the same, memory grows with it")
	fs.DurationVar(&f.sloITL, "slo-itl-p99", 0, "with --capacity, an objective on the p99 of the requests' mean inter-token latency too (0: none)")
	f.out.register(fs, "")
	f.tenancy.register(fs)
	f.programs.register(fs)
	fs.Uint64Var(&f.seed, "seed", 1, "seed of the workload and the policies")
	fs.StringVar(&f.question, "question", "", "answer one question instead: sharing (TTFT and hit rate against the sharing ratio), "+
		"score-surface (score's cache weight against load weight), staleness (p90 TTFT against staleness), "+
		"cache-pressure (p90 TTFT and hit rate against --kv-blocks from 1000 to 8000), "+
		"saturation (the pool saturation gauge on a ramp from --rate/10 to 2×--rate, and at steady rates: its lead on "+
		"the measured p90 TTFT over --slo-ttft-p90); "+
		"without --trace or --workload, on the "+replayDefaultWorkload+" workload at --rate")
}

func (f *replayFlags) run(ctx context.Context, inv invocation) error {
	c, err := f.config(inv)
	if err != nil {
		return err
	}
	start := time.Now()
	res, charts, err := c.execute(ctx, replayProgress(inv.stderr))
	if err != nil {
		return err
	}
	res.Meta = c.meta
	fmt.Fprintf(inv.stderr, "replay: done in %.1f s\n", time.Since(start).Seconds())
	c.out.Charts = charts
	c.forReport(&res)
	return c.out.Write(inv.stdout, inv.stderr, res)
}

// forReport readies the outputs and the result for the report: a
// comparison of policies opens with the verdict (a question's sweep of
// one policy's settings does not), and a capacity search records its
// precision and, for a policy that failed even at its lowest speed-up,
// that speed-up (the table's "< X").
func (c *replayConfig) forReport(res *report.Result) {
	c.out.Verdict = c.question == ""
	if c.capacity == nil {
		return
	}
	if res.Meta == nil {
		res.Meta = map[string]any{}
	}
	res.Meta["capacity_precision"] = replay.CapacityPrecision
	for i := range res.Runs {
		if r := &res.Runs[i]; r.CapacitySpeedup != nil && *r.CapacitySpeedup == 0 {
			below := replay.CapacityBelow(c.replay.Speedup)
			r.CapacityBelow = &below
		}
	}
}

// replayProgress prints a line per policy run, with its wall time.
func replayProgress(w io.Writer) func(replay.PolicySpec, report.Run) {
	last := time.Now()
	return func(spec replay.PolicySpec, run report.Run) {
		now := time.Now()
		line := fmt.Sprintf("replay: %-24s %6d requests  hit %5.1f%%  ttft p90 %8.1f ms  errors %d",
			spec.RunName(), run.Requests, 100*run.HitRate, run.TTFTms.P90, run.Errors)
		switch {
		case run.CapacitySpeedup != nil && run.CapacityCeiling:
			line += fmt.Sprintf("  capacity ≥ %.2fx (the search's upper limit)", *run.CapacitySpeedup)
		case run.CapacitySpeedup != nil:
			line += fmt.Sprintf("  capacity %.2fx", *run.CapacitySpeedup)
		}
		fmt.Fprintf(w, "%s  (%.1f s)\n", line, now.Sub(last).Seconds())
		last = now
	}
}

// replayConfig is a validated replay: the fleet, the policies, the request
// sequence and what to answer.
type replayConfig struct {
	replay   replay.Config
	specs    []replay.PolicySpec
	workload workload.Spec
	tenants  []workload.TenantSpec // a multi-tenant workload (--tenant) instead
	rate     float64
	slo      time.Duration // --question saturation's objective
	question string
	capacity *replay.SLO
	oracle   bool
	parallel int
	meta     map[string]any
	out      report.Outputs
}

func (f *replayFlags) config(inv invocation) (replayConfig, error) {
	f.set = inv.set
	if err := f.check(); err != nil {
		return replayConfig{}, err
	}
	prof, err := costmodel.Lookup(f.profile)
	if err != nil {
		return replayConfig{}, fmt.Errorf("%w: --profile: %v", errUsage, err)
	}
	c := replayConfig{rate: f.rate, question: f.question, slo: f.slo, parallel: f.parallel,
		oracle: f.oracle && f.gateways <= 1 && f.prefillReplicas == 0 && f.decodeReplicas == 0}
	c.replay = replay.Config{
		Replicas: f.aggregated(), PrefillReplicas: f.prefillReplicas, DecodeReplicas: f.decodeReplicas,
		NonCachedTokens: nonCachedConfig(f.nonCached), Profile: prof, MaxSeqs: f.maxSeqs, KVBlocks: f.kvBlocks, Speedup: f.speedup,
		OffloadBlocks: f.offloadBlocks, Pulls: f.kvPulls,
		Staleness: f.staleness, ScrapeInterval: f.scrape, Seed: f.seed,
		KVEvents: replay.KVMode(f.kvEvents), DataParallelSize: f.dataParallel,
		Gateways: f.gateways, GatewaySync: replay.GatewaySync(f.gatewaySync), SyncDelay: f.syncDelay,
		SyncLoads: replay.SyncLoads(f.syncLoads), Programs: f.programs.config(),
	}
	profiles, err := f.replicaProfileMap()
	if err != nil {
		return c, err
	}
	for i, name := range profiles {
		if c.replay.ReplicaProfiles == nil {
			c.replay.ReplicaProfiles = map[int]costmodel.Profile{}
		}
		if c.replay.ReplicaProfiles[i], err = costmodel.Lookup(name); err != nil {
			return c, fmt.Errorf("%w: --replica-profile %d=%s: %v", errUsage, i, name, err)
		}
	}
	if c.specs, err = f.specs(); err != nil {
		return c, err
	}
	if c.workload, err = f.workloadSpec(); err != nil {
		return c, err
	}
	if c.tenants, err = f.tenancy.tenantSpecs(); err != nil {
		return c, err
	}
	if c.replay.Flow, err = f.tenancy.config(c.tenants); err != nil {
		return c, err
	}
	c.replay.EnginePriority = f.tenancy.enginePriority
	if f.capacity {
		c.capacity = &replay.SLO{TTFTP90: f.slo, ITLP99: f.sloITL}
	}
	c.meta = f.meta(inv, c.workload, prof, profiles)
	title := "kvgate replay: " + source(c.workload)
	if f.question != "" {
		title += " — question " + f.question
	}
	c.out = f.out.outputs(title)
	return c, nil
}

// aggregated is the aggregated replicas: --replicas, whose default is 0
// beside a prefill/decode fleet.
func (f *replayFlags) aggregated() int {
	if f.decodeReplicas > 0 && !f.set["replicas"] {
		return 0
	}
	return f.replicas
}

// nonCachedConfig is --non-cached-tokens as replay.Config takes it (0
// there is the default; negative never skips).
func nonCachedConfig(n int) int {
	if n == 0 {
		return -1
	}
	return n
}

// replayProfileMap is --replica-profile, each replica checked against --replicas.
func (f *replayFlags) replicaProfileMap() (map[int]string, error) {
	profiles, err := parseReplicaProfiles(f.replicaProfiles)
	if err != nil {
		return nil, err
	}
	n := f.aggregated() + f.decodeReplicas + f.prefillReplicas
	for i, name := range profiles {
		if i >= n {
			return nil, fmt.Errorf("%w: --replica-profile %d=%s: %s, numbered 0 to %d", errUsage, i, name, count(n, "replica"), n-1)
		}
	}
	return profiles, nil
}

// check rejects flag values that cannot run, as usage errors.
func (f *replayFlags) check() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: kvgate replay: "+format, append([]any{errUsage}, a...)...)
	}
	switch {
	case f.trace != "" && f.workload != "":
		return bad("give --trace or --workload, not both")
	case len(f.tenancy.tenants) > 0 && (f.trace != "" || f.workload != "" || f.question != ""):
		return bad("--tenant makes the workload: drop --trace, --workload and --question")
	case f.trace == "" && f.workload == "" && f.question == "" && len(f.tenancy.tenants) == 0:
		return bad("give --trace FILE, --workload NAME or --tenant SPEC (or --question %s|%s|%s|%s)", questionSharing, questionScore, questionStaleness, questionPressure)
	case f.replicas < 0 || f.prefillReplicas < 0 || f.decodeReplicas < 0:
		return bad("--replicas, --prefill-replicas and --decode-replicas must be ≥ 0")
	case (f.prefillReplicas > 0) != (f.decodeReplicas > 0):
		return bad("--prefill-replicas %d and --decode-replicas %d: a prefill/decode fleet needs both", f.prefillReplicas, f.decodeReplicas)
	case f.aggregated()+f.decodeReplicas < 1:
		return bad("--replicas %d: need at least 1 (or --prefill-replicas and --decode-replicas)", f.replicas)
	case f.nonCached < 0:
		return bad("--non-cached-tokens %d: must be ≥ 0", f.nonCached)
	case f.sloITL < 0:
		return bad("--slo-itl-p99 %v: must be ≥ 0", f.sloITL)
	case f.set["slo-itl-p99"] && !f.capacity:
		return bad("--slo-itl-p99 needs --capacity")
	case f.kvBlocks < 1:
		return bad("--kv-blocks %d: need at least 1", f.kvBlocks)
	case f.offloadBlocks < 0 || f.offloadBlocks >= 1<<31-1:
		return bad("--offload-blocks %d: want 0 to %d", f.offloadBlocks, 1<<31-2)
	case f.kvPulls && f.decodeReplicas > 0:
		return bad("--kv-pulls is for aggregated replicas (a decode replica pulls its whole prompt already)")
	case f.maxSeqs < 1:
		return bad("--max-seqs %d: need at least 1", f.maxSeqs)
	case f.parallel < 0 || f.parallel > maxParallel:
		return bad("--parallel %d: want 0 (one per CPU) to %d", f.parallel, maxParallel)
	case f.requests < 0:
		return bad("--requests %d: must be ≥ 0", f.requests)
	case !(f.rate >= 0):
		return bad("--rate %v: must be ≥ 0", f.rate)
	case !(f.speedup > 0) || f.speedup > 1e9:
		return bad("--speedup %v: must be in (0, 1e9]", f.speedup)
	case f.staleness < 0:
		return bad("--staleness %v: must be ≥ 0", f.staleness)
	case f.dataParallel < 1 || f.dataParallel > 1024:
		return bad("--data-parallel-size %d: want 1 to 1024", f.dataParallel)
	case f.gateways < 1 || f.gateways > replay.MaxGateways:
		return bad("--gateways %d: want 1 to %d", f.gateways, replay.MaxGateways)
	case f.gatewaySync != string(replay.SyncShared) && f.gatewaySync != string(replay.SyncNone):
		return bad("--gateway-sync %q: want shared or none", f.gatewaySync)
	case f.syncDelay < 0:
		return bad("--sync-delay %v: must be ≥ 0", f.syncDelay)
	case f.syncLoads != string(replay.LoadsWithBatches) && f.syncLoads != string(replay.LoadsOnChange):
		return bad("--sync-loads %q: want batch or change", f.syncLoads)
	case f.kvEvents != string(replay.KVAuto) && f.kvEvents != string(replay.KVOn) && f.kvEvents != string(replay.KVOff):
		return bad("--kv-events %q: want auto, on or off", f.kvEvents)
	case f.scrape < 0:
		return bad("--scrape-interval %v: must be ≥ 0 (0: each policy's own)", f.scrape)
	case f.capacity && f.slo <= 0:
		return bad("--slo-ttft-p90 %v: must be > 0", f.slo)
	case f.capacity && f.question != "":
		return bad("--capacity and --question do not combine")
	case f.set["slo-ttft-p90"] && !f.capacity && f.question != questionSaturation:
		return bad("--slo-ttft-p90 needs --capacity")
	case f.set["oracle"] && f.oracle && (f.gateways > 1 || f.decodeReplicas > 0):
		return bad("--oracle is computed for one gateway in front of aggregated replicas")
	}
	if err := f.programs.check(); err != nil {
		return err
	}
	return f.checkQuestion(bad)
}

// checkQuestion rejects --question values and the flags a question sweeps.
func (f *replayFlags) checkQuestion(bad func(format string, a ...any) error) error {
	switch f.question {
	case "", questionSharing, questionScore, questionStaleness, questionPressure, questionSaturation:
	default:
		return bad("--question %q: want %s, %s, %s, %s or %s", f.question, questionSharing, questionScore, questionStaleness,
			questionPressure, questionSaturation)
	}
	switch {
	case f.question == questionScore && (f.set["policies"] || len(f.policyParams) > 0):
		return bad("--question score-surface sweeps the score policy's weights: drop --policies and --policy-param")
	case f.question == questionSharing && f.trace != "":
		return bad("--question sharing sweeps a generated workload (%s), not a trace", strings.Join(replay.SharingWorkloads(), ", "))
	case f.question == questionStaleness && f.set["staleness"]:
		return bad("--question staleness sweeps the staleness: drop --staleness")
	case f.question == questionPressure && f.set["kv-blocks"]:
		return bad("--question cache-pressure sweeps --kv-blocks: drop it")
	case f.question == questionSaturation && (strings.Contains(f.policies, ",") || f.rate <= 0 || f.trace != ""):
		return bad("--question saturation replays one policy (--policies), on a generated workload at --rate > 0")
	}
	return nil
}

// specs are the policies to run: --policies, or the question's default,
// with their --policy-param.
func (f *replayFlags) specs() ([]replay.PolicySpec, error) {
	names := strings.Split(f.policies, ",")
	if !f.set["policies"] {
		switch f.question {
		case questionSharing:
			names = replay.SharingPolicies()
		case questionStaleness, questionPressure:
			names = replay.CacheAware()
		case questionSaturation:
			names = []string{policy.Default}
		}
	}
	for i := range names {
		names[i] = strings.TrimSpace(names[i])
	}
	specs, err := replay.Specs(names)
	if err != nil {
		return nil, fmt.Errorf("%w: --policies: %v", errUsage, err)
	}
	runNames := make([]string, len(specs))
	for i, sp := range specs {
		runNames[i] = sp.Name
	}
	params, err := parsePolicyParams(f.policyParams, runNames)
	if err != nil {
		return nil, err
	}
	for i := range specs {
		specs[i].Params = params.of(specs[i].Name)
	}
	return specs, nil
}

// workloadSpec is the request sequence: --trace, or --workload with its
// parameters (shared_prefix for the questions by default).
func (f *replayFlags) workloadSpec() (workload.Spec, error) {
	var ws workload.Spec
	switch {
	case f.trace != "":
		if _, err := os.Stat(f.trace); err != nil {
			return ws, fmt.Errorf("trace: %w", err)
		}
		var err error
		if f.traceFormat, err = workload.TraceFormatOf(f.trace); err != nil {
			return ws, fmt.Errorf("trace: %w", err)
		}
		ws = workload.Spec{Name: workload.TraceName, Path: f.trace}
	case f.workload != "":
		var err error
		if ws, err = workload.Parse(f.workload); err != nil {
			return ws, fmt.Errorf("%w: --workload: %v", errUsage, err)
		}
	default:
		ws = workload.Spec{Name: replayDefaultWorkload}
	}
	ws.Requests, ws.Seed = f.requests, f.seed
	for _, kv := range f.workloadParams {
		if err := ws.SetParam(kv); err != nil {
			return ws, fmt.Errorf("%w: --workload-param: %v", errUsage, err)
		}
	}
	if f.question == questionSharing {
		if _, err := replay.SharingSpec(ws, 0.5); err != nil {
			return ws, fmt.Errorf("%w: --question sharing: %v", errUsage, err)
		}
	}
	return ws, nil
}

// source names the request sequence in the report's title.
func source(ws workload.Spec) string {
	if ws.Name == workload.TraceName {
		return filepath.Base(ws.Path)
	}
	return ws.Name
}

// meta describes the run in the result and the report.
func (f *replayFlags) meta(inv invocation, ws workload.Spec, prof costmodel.Profile, profiles map[int]string) map[string]any {
	m := map[string]any{
		// Where a result is written is not part of the experiment, and
		// the same experiment must give the same JSON.
		"command":         inv.commandLine("json", "report"),
		"seed":            f.seed,
		"replicas":        f.aggregated(),
		"profile":         prof.Name,
		"kv_blocks":       f.kvBlocks,
		"max_seqs":        f.maxSeqs,
		"speedup":         f.speedup,
		"staleness":       f.staleness.String(),
		"scrape_interval": scrapeMeta(f.scrape),
		"virtual_time":    "yes: engines and router on one simulated clock",
	}
	if f.dataParallel > 1 {
		m["data_parallel_size"] = f.dataParallel
	}
	if f.offloadBlocks > 0 {
		m["offload_blocks"] = f.offloadBlocks
	}
	if f.kvPulls {
		m["kv_pulls"] = true
	}
	if f.decodeReplicas > 0 {
		m["prefill_replicas"], m["decode_replicas"] = f.prefillReplicas, f.decodeReplicas
		m["non_cached_tokens"] = f.nonCached
	}
	m["gateways"] = f.gateways
	if f.gateways > 1 {
		m["gateway_sync"] = f.gatewaySync
		if f.gatewaySync == string(replay.SyncShared) {
			m["sync_delay"] = f.syncDelay.String()
			m["sync_loads"] = f.syncLoads
		}
	}
	if f.kvEvents != string(replay.KVAuto) {
		m["kv_events"] = f.kvEvents
	}
	if ws.Name == workload.TraceName {
		m["trace"] = filepath.Base(ws.Path)
		if f.traceFormat != "" {
			m["trace_format"] = string(f.traceFormat)
		}
	} else {
		m["workload"] = ws.String()
		m["rate"] = f.rate
	}
	if f.requests > 0 {
		m["requests"] = f.requests
	}
	if f.question != "" {
		m["question"] = f.question
	}
	if f.capacity {
		m["slo_ttft_p90"] = f.slo.String()
		if f.sloITL > 0 {
			m["slo_itl_p99"] = f.sloITL.String()
		}
	}
	if len(profiles) > 0 {
		pm := make(map[string]string, len(profiles))
		for i, name := range profiles {
			pm[strconv.Itoa(i)] = name
		}
		m["replica_profiles"] = pm
	}
	f.tenancy.meta(m)
	return m
}

// execute runs the question, or compares the policies.
func (c replayConfig) execute(ctx context.Context, progress func(replay.PolicySpec, report.Run)) (report.Result, []report.Chart, error) {
	if c.question == questionSharing {
		return replay.Sharing(ctx, c.replay, c.workload, c.rate, replay.DefaultSharingRatios(), c.specs, progress)
	}
	reqs, err := c.requests()
	if err != nil {
		return report.Result{}, nil, err
	}
	switch c.question {
	case questionScore:
		return replay.ScoreSurface(ctx, c.replay, reqs, replay.DefaultScoreWeights(), progress)
	case questionStaleness:
		return replay.Staleness(ctx, c.replay, reqs, replay.DefaultStaleness(), c.specs, progress)
	case questionPressure:
		return replay.CachePressure(ctx, c.replay, reqs, replay.DefaultPressureBlocks(), c.specs, progress)
	case questionSaturation:
		res, charts, _, err := replay.SaturationQuestion(ctx, c.replay, reqs, c.specs[0], replay.SaturationOptions{Objective: c.slo,
			Window: 5 * time.Second, P90Window: 10 * time.Second, From: c.rate / 10, To: 2 * c.rate,
			Steady: []float64{c.rate / 4, c.rate / 2, c.rate * 0.8}, Seed: c.workload.Seed})
		return res, charts, err
	}
	res, err := replay.Compare(ctx, c.replay, reqs, c.specs, replay.Options{Progress: progress, Capacity: c.capacity, Oracle: c.oracle, Parallel: c.parallel})
	return res, nil, err
}

// requests is the replay's request sequence: the tenants' merged, or the
// workload's with its arrivals.
func (c replayConfig) requests() ([]workload.Request, error) {
	if len(c.tenants) > 0 {
		reqs, err := workload.Mix(c.tenants, c.workload.Seed)
		if err != nil {
			return nil, fmt.Errorf("%w: --tenant: %v", errUsage, err)
		}
		return reqs, nil
	}
	reqs, err := workload.Generate(c.workload)
	if err != nil {
		return nil, err
	}
	if c.workload.Name != workload.TraceName {
		workload.Arrivals(reqs, c.rate, c.workload.Seed)
	}
	return reqs, nil
}

// scrapeMeta records the scrape period of a replay: each policy's own when
// not given.
func scrapeMeta(d time.Duration) string {
	if d == 0 {
		return "per policy (llmd, precise: 50ms; others: 250ms)"
	}
	return d.String()
}
