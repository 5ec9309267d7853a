package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/replay"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/workload"
)

// replayDefaultRate is the Poisson arrival rate of generated workloads in
// replay (which has no closed loop): enough load on 8 replicas for queueing
// to show, not so much that every policy drowns.
const replayDefaultRate = 20

// Questions of --question.
const (
	questionSharing   = "sharing"
	questionScore     = "score-surface"
	questionStaleness = "staleness"
)

// replayParams collects repeated --workload-param flags.
type replayParams []string

func (p *replayParams) String() string     { return strings.Join(*p, ",") }
func (p *replayParams) Set(v string) error { *p = append(*p, v); return nil }

type replayFlags struct {
	trace, workload, policies, profile, question, jsonOut, reportDir string
	params                                                           replayParams
	policyParams                                                     paramsFlag
	replicaProfiles                                                  profilesFlag
	requests, replicas, kvBlocks                                     int
	rate, speedup                                                    float64
	staleness, scrape, slo                                           time.Duration
	capacity                                                         bool
	seed                                                             uint64
	set                                                              map[string]bool
}

func runReplay(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) error {
	fs := newFlags("replay", "(--trace FILE | --workload NAME) [flags]", stderr)
	var f replayFlags
	fs.StringVar(&f.trace, "trace", "", "Mooncake trace (JSON lines) to replay")
	fs.StringVar(&f.workload, "workload", "", "a generated workload instead of a trace: "+strings.Join(workload.Names(), ", ")+" (or trace:FILE)")
	fs.Var(&f.params, "workload-param", "a workload parameter, name=value (repeatable)")
	fs.IntVar(&f.requests, "requests", 0, "requests to make (a trace: its first N records; 0: the workload's default, the whole trace)")
	fs.Float64Var(&f.rate, "rate", replayDefaultRate, "Poisson arrival rate of a generated workload, requests/s (0: all at once)")
	fs.IntVar(&f.replicas, "replicas", replay.DefaultReplicas, "simulated replicas")
	fs.StringVar(&f.policies, "policies", "all", "comma-separated policies, or all")
	f.policyParams = paramsFlag{}
	fs.Var(f.policyParams, "policy-param", "a policy parameter name=value for every policy, or POLICY.name=value for one (repeatable)")
	fs.StringVar(&f.profile, "profile", costmodel.Default, "latency profile: "+strings.Join(costmodel.Names(), ", "))
	f.replicaProfiles = profilesFlag{}
	fs.Var(f.replicaProfiles, "replica-profile", "replica I runs profile NAME instead (I=NAME, repeatable): a heterogeneous fleet; the policies still assume --profile")
	fs.IntVar(&f.kvBlocks, "kv-blocks", engine.DefaultNumBlocks, "KV cache blocks per replica (16 tokens each)")
	fs.Float64Var(&f.speedup, "speedup", 1, "arrival (and think) times are divided by this")
	fs.DurationVar(&f.staleness, "staleness", 0, "policies see the replicas' scraped metrics (and KV events) this much late")
	fs.DurationVar(&f.scrape, "scrape-interval", replay.DefaultScrapeInterval, "period of the metric scrapes")
	fs.BoolVar(&f.capacity, "capacity", false, "search each policy's largest speed-up meeting --slo-ttft-p90")
	fs.DurationVar(&f.slo, "slo-ttft-p90", 2*time.Second, "the p90 TTFT objective of --capacity")
	fs.StringVar(&f.jsonOut, "json", "", "write the result as JSON to this file")
	fs.StringVar(&f.reportDir, "report", "", "write an HTML report (with charts) to this directory")
	fs.Uint64Var(&f.seed, "seed", 1, "seed of the workload and the policies")
	fs.StringVar(&f.question, "question", "", "answer one question instead: sharing (TTFT and hit rate against the sharing ratio), "+
		"score-surface (score's cache weight against load weight), staleness (p90 TTFT against staleness)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	f.set = map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { f.set[fl.Name] = true })
	if err := f.check(); err != nil {
		return err
	}
	prof, err := costmodel.Lookup(f.profile)
	if err != nil {
		return fmt.Errorf("%w: --profile: %v", errUsage, err)
	}
	cfg := replay.Config{
		Replicas: f.replicas, Profile: prof, KVBlocks: f.kvBlocks, Speedup: f.speedup,
		Staleness: f.staleness, ScrapeInterval: f.scrape, Seed: f.seed,
	}
	if len(f.replicaProfiles) > 0 {
		cfg.ReplicaProfiles = map[int]costmodel.Profile{}
		for i, name := range f.replicaProfiles {
			if i >= f.replicas {
				return fmt.Errorf("%w: --replica-profile %d=%s: there are %d replicas (0 to %d)", errUsage, i, name, f.replicas, f.replicas-1)
			}
			if cfg.ReplicaProfiles[i], err = costmodel.Lookup(name); err != nil {
				return fmt.Errorf("%w: --replica-profile %d=%s: %v", errUsage, i, name, err)
			}
		}
	}
	specs, err := f.specs()
	if err != nil {
		return err
	}
	wspec, err := f.workloadSpec()
	if err != nil {
		return err
	}

	start := time.Now()
	last := start
	progress := func(spec replay.PolicySpec, run report.Run) {
		now := time.Now()
		line := fmt.Sprintf("replay: %-24s %6d requests  hit %5.1f%%  ttft p90 %8.1f ms  errors %d",
			spec.RunName(), run.Requests, 100*run.HitRate, run.TTFTms.P90, run.Errors)
		if run.CapacitySpeedup != nil {
			line += fmt.Sprintf("  capacity %.2fx", *run.CapacitySpeedup)
		}
		fmt.Fprintf(stderr, "%s  (%.1f s)\n", line, now.Sub(last).Seconds())
		last = now
	}

	var (
		res    report.Result
		charts []report.Chart
	)
	if f.question == questionSharing {
		res, charts, err = replay.Sharing(ctx, cfg, wspec, f.rate, replay.DefaultSharingRatios(), specs, progress)
	} else {
		var reqs []workload.Request
		reqs, err = workload.Generate(wspec)
		if err != nil {
			return err
		}
		if wspec.Name != workload.TraceName {
			workload.Arrivals(reqs, f.rate, f.seed)
		}
		switch f.question {
		case questionScore:
			res, charts, err = replay.ScoreSurface(ctx, cfg, reqs, replay.DefaultScoreWeights(), progress)
		case questionStaleness:
			res, charts, err = replay.Staleness(ctx, cfg, reqs, replay.DefaultStaleness(), specs, progress)
		default:
			opt := replay.Options{Progress: progress}
			if f.capacity {
				opt.Capacity = &replay.SLO{TTFTP90: f.slo}
			}
			res, err = replay.Compare(ctx, cfg, reqs, specs, opt)
		}
	}
	if err != nil {
		return err
	}
	res.Meta = f.meta(args, wspec, prof)
	fmt.Fprintf(stderr, "replay: done in %.1f s\n", time.Since(start).Seconds())

	report.WriteTable(stdout, res)
	if f.jsonOut != "" {
		var b bytes.Buffer
		if err := report.WriteJSON(&b, res); err != nil {
			return err
		}
		if err := os.WriteFile(f.jsonOut, b.Bytes(), 0o644); err != nil {
			return err
		}
	}
	if f.reportDir != "" {
		title := "kvgate replay: " + f.source(wspec)
		if f.question != "" {
			title += " — question " + f.question
		}
		if err := report.WriteReport(f.reportDir, res, title, charts...); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "replay: report in %s\n", filepath.Join(f.reportDir, "index.html"))
	}
	return nil
}

// check rejects flag values that cannot run, as usage errors.
func (f *replayFlags) check() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: kvgate replay: "+format, append([]any{errUsage}, a...)...)
	}
	switch {
	case f.trace != "" && f.workload != "":
		return bad("give --trace or --workload, not both")
	case f.trace == "" && f.workload == "" && f.question != questionSharing:
		return bad("give --trace FILE or --workload NAME")
	case f.replicas < 1:
		return bad("--replicas %d: need at least 1", f.replicas)
	case f.kvBlocks < 1:
		return bad("--kv-blocks %d: need at least 1", f.kvBlocks)
	case f.requests < 0:
		return bad("--requests %d: must be ≥ 0", f.requests)
	case !(f.rate >= 0):
		return bad("--rate %v: must be ≥ 0", f.rate)
	case !(f.speedup > 0) || f.speedup > 1e9:
		return bad("--speedup %v: must be in (0, 1e9]", f.speedup)
	case f.staleness < 0:
		return bad("--staleness %v: must be ≥ 0", f.staleness)
	case f.scrape <= 0:
		return bad("--scrape-interval %v: must be > 0", f.scrape)
	case f.capacity && f.slo <= 0:
		return bad("--slo-ttft-p90 %v: must be > 0", f.slo)
	case f.capacity && f.question != "":
		return bad("--capacity and --question do not combine")
	case f.set["slo-ttft-p90"] && !f.capacity:
		return bad("--slo-ttft-p90 needs --capacity")
	case f.question == questionScore && (f.set["policies"] || len(f.policyParams) > 0):
		return bad("--question score-surface sweeps the score policy's weights: drop --policies and --policy-param")
	case f.question == questionSharing && f.trace != "":
		return bad("--question sharing sweeps a generated workload (%s), not a trace", strings.Join(replay.SharingWorkloads(), ", "))
	case f.question == questionStaleness && f.set["staleness"]:
		return bad("--question staleness sweeps the staleness: drop --staleness")
	}
	switch f.question {
	case "", questionSharing, questionScore, questionStaleness:
	default:
		return bad("--question %q: want %s, %s or %s", f.question, questionSharing, questionScore, questionStaleness)
	}
	return nil
}

// specs are the policies to run: --policies, or the question's default.
func (f *replayFlags) specs() ([]replay.PolicySpec, error) {
	names := strings.Split(f.policies, ",")
	if !f.set["policies"] {
		switch f.question {
		case questionSharing:
			names = replay.SharingPolicies()
		case questionStaleness:
			names = replay.CacheAware()
		}
	}
	for i := range names {
		names[i] = strings.TrimSpace(names[i])
	}
	specs, err := replay.Specs(names)
	if err != nil {
		return nil, fmt.Errorf("%w: --policies: %v", errUsage, err)
	}
	// name=value goes to every policy, POLICY.name=value to that one.
	scoped := map[string]map[string]any{}
	common := map[string]any{}
	for k, v := range f.policyParams {
		if pol, name, ok := strings.Cut(k, "."); ok {
			if !slices.ContainsFunc(specs, func(sp replay.PolicySpec) bool { return sp.Name == pol }) {
				return nil, fmt.Errorf("%w: --policy-param %s: policy %q is not in --policies", errUsage, k, pol)
			}
			if scoped[pol] == nil {
				scoped[pol] = map[string]any{}
			}
			scoped[pol][name] = v
			continue
		}
		common[k] = v
	}
	for i := range specs {
		if len(common)+len(scoped[specs[i].Name]) == 0 {
			continue
		}
		ps := map[string]any{}
		for k, v := range common {
			ps[k] = v
		}
		for k, v := range scoped[specs[i].Name] {
			ps[k] = v
		}
		specs[i].Params = ps
		// Fail now, with the flag named, rather than after other policies ran.
		if _, err := policy.New(specs[i].Name, policy.Options{Params: ps}); err != nil {
			return nil, fmt.Errorf("%w: --policy-param: %v", errUsage, err)
		}
	}
	return specs, nil
}

// workloadSpec is the request sequence: --trace, or --workload with its
// parameters (shared_prefix for the sharing question by default).
func (f *replayFlags) workloadSpec() (workload.Spec, error) {
	var ws workload.Spec
	switch {
	case f.trace != "":
		if _, err := os.Stat(f.trace); err != nil {
			return ws, fmt.Errorf("trace: %w", err)
		}
		ws = workload.Spec{Name: workload.TraceName, Path: f.trace}
	case f.workload != "":
		var err error
		if ws, err = workload.Parse(f.workload); err != nil {
			return ws, fmt.Errorf("%w: --workload: %v", errUsage, err)
		}
	default:
		ws = workload.Spec{Name: "shared_prefix"}
	}
	ws.Requests, ws.Seed = f.requests, f.seed
	for _, kv := range f.params {
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

func (f *replayFlags) source(ws workload.Spec) string {
	if ws.Name == workload.TraceName {
		return filepath.Base(ws.Path)
	}
	return ws.Name
}

// meta describes the run in the result and the report.
func (f *replayFlags) meta(args []string, ws workload.Spec, prof costmodel.Profile) map[string]any {
	m := map[string]any{
		"command":         replayCommand(args),
		"seed":            f.seed,
		"replicas":        f.replicas,
		"profile":         prof.Name,
		"kv_blocks":       f.kvBlocks,
		"speedup":         f.speedup,
		"staleness":       f.staleness.String(),
		"scrape_interval": f.scrape.String(),
		"virtual_time":    "yes: engines and router on one simulated clock",
	}
	if ws.Name == workload.TraceName {
		m["trace"] = filepath.Base(ws.Path)
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
	}
	if pm := f.replicaProfiles.meta(); pm != nil {
		m["replica_profiles"] = pm
	}
	return m
}

// replayCommand is the command line in the result, without the output
// flags: where a result is written is not part of the experiment, and the
// same experiment must give the same JSON.
func replayCommand(args []string) string {
	out := []string{"kvgate", "replay"}
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && (name == "json" || name == "report") {
			if !hasValue {
				i++ // the value is the next argument
			}
			continue
		}
		out = append(out, a)
	}
	return strings.Join(out, " ")
}

// profilesFlag collects repeated --replica-profile I=NAME.
type profilesFlag map[int]string

func (p profilesFlag) String() string { return "" }

func (p profilesFlag) Set(v string) error {
	k, name, ok := strings.Cut(v, "=")
	i, err := strconv.Atoi(strings.TrimSpace(k))
	if !ok || err != nil || i < 0 || strings.TrimSpace(name) == "" {
		return fmt.Errorf("want I=NAME with I a replica number from 0, got %q", v)
	}
	p[i] = strings.TrimSpace(name)
	return nil
}

// meta is the flag in the JSON's meta: replica → profile name (nil if unset).
func (p profilesFlag) meta() map[string]string {
	if len(p) == 0 {
		return nil
	}
	m := make(map[string]string, len(p))
	for i, name := range p {
		m[strconv.Itoa(i)] = name
	}
	return m
}
