package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/kvgate/kvgate/internal/bench"
	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/workload"
)

// listFlag collects repeated string flags.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

// benchOptions are the flags shared by bench and demo.
type benchOptions struct {
	target      string
	embedded    bool
	replicas    int
	workload    string
	params      listFlag
	requests    int
	rate        float64
	concurrency int
	policies    string
	model       string
	timeScale   float64
	profile     string
	kvBlocks    int
	seed        uint64
	jsonPath    string
	reportDir   string
	timeout     time.Duration
	maxDuration time.Duration
	duration    time.Duration
	soakEvery   time.Duration
}

func runBench(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) error {
	o := benchOptions{}
	fs := newFlags("bench", "(--target URL | --embedded [--replicas N]) [--workload NAME] [--policies a,b,...]", stderr)
	fs.StringVar(&o.target, "target", "", "base URL of a running gateway (or any OpenAI-compatible server)")
	fs.BoolVar(&o.embedded, "embedded", false, "run simulated replicas and a gateway in-process, fresh for each policy")
	fs.IntVar(&o.replicas, "replicas", 4, "simulated replicas (--embedded)")
	fs.StringVar(&o.workload, "workload", "multiturn", "workload: "+strings.Join(workload.Names(), ", ")+", or trace:FILE")
	fs.Var(&o.params, "workload-param", "a workload parameter name=value (repeatable)")
	fs.IntVar(&o.requests, "requests", 0, "number of requests (0: the workload's default)")
	fs.Float64Var(&o.rate, "rate", 0, "open loop: Poisson arrivals at this many requests/s (model time); 0: closed loop")
	fs.IntVar(&o.concurrency, "concurrency", 16, "closed loop: concurrent clients (ignored with --rate or a trace)")
	fs.StringVar(&o.policies, "policies", "round_robin,least_load,prefix_key,sglang,ttft", "policies to compare (--embedded), comma-separated, or all")
	fs.StringVar(&o.model, "model", sim.DefaultModel, "model name sent in requests")
	fs.Float64Var(&o.timeScale, "time-scale", 0, "the replicas run this many times faster than real time: latencies are multiplied by it (default 20 with --embedded, 1 with --target)")
	fs.StringVar(&o.profile, "profile", costmodel.Default, "latency profile of the simulated replicas: "+strings.Join(costmodel.Names(), ", "))
	fs.IntVar(&o.kvBlocks, "kv-blocks", 30000, "KV cache blocks per simulated replica")
	fs.Uint64Var(&o.seed, "seed", 1, "seed of the workload, the replicas and the policies")
	fs.StringVar(&o.jsonPath, "json", "", "write the results as JSON to this file")
	fs.StringVar(&o.reportDir, "report", "", "write charts and an HTML report into this directory")
	fs.DurationVar(&o.timeout, "timeout", 10*time.Minute, "per-request timeout (model time)")
	fs.DurationVar(&o.maxDuration, "max-duration", 30*time.Minute, "bound on each run's wall time")
	fs.DurationVar(&o.duration, "duration", 0, "soak: repeat the workload (new prompts each round) against --target for this long, reading the gateway's goroutines and heap")
	fs.DurationVar(&o.soakEvery, "soak-interval", 10*time.Second, "soak: how often the gateway's /metrics is read")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if o.duration > 0 {
		return o.soak(ctx, stdout)
	}
	res, err := o.run(ctx, stderr)
	if err != nil {
		return err
	}
	return o.output(res, stdout, "kvgate bench")
}

func (o *benchOptions) validate() error {
	if o.timeScale == 0 {
		o.timeScale = 1
		if o.embedded {
			o.timeScale = 20
		}
	}
	switch {
	case o.embedded == (o.target != ""):
		return fmt.Errorf("%w: give exactly one of --target URL and --embedded", errUsage)
	case o.replicas < 1:
		return fmt.Errorf("%w: --replicas must be at least 1", errUsage)
	case o.rate < 0 || o.concurrency < 1 || o.requests < 0:
		return fmt.Errorf("%w: --rate ≥ 0, --concurrency ≥ 1, --requests ≥ 0", errUsage)
	case o.timeScale <= 0:
		return fmt.Errorf("%w: --time-scale must be > 0", errUsage)
	}
	return nil
}

func (o *benchOptions) policyList() ([]string, error) {
	if o.policies == "all" {
		return policy.Names(), nil
	}
	var out []string
	known := map[string]bool{}
	for _, n := range policy.Names() {
		known[n] = true
	}
	for _, p := range strings.Split(o.policies, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		if !known[p] {
			return nil, fmt.Errorf("%w: unknown policy %q (known: %s)", errUsage, p, strings.Join(policy.Names(), ", "))
		}
		out = append(out, p)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: --policies is empty", errUsage)
	}
	return out, nil
}

// requests generates the workload's request sequence (the same for every policy).
func (o *benchOptions) requestsFor() ([]workload.Request, workload.Spec, error) {
	spec, err := workload.Parse(o.workload)
	if err != nil {
		return nil, spec, fmt.Errorf("%w: %v", errUsage, err)
	}
	for _, kv := range o.params {
		if err := spec.SetParam(kv); err != nil {
			return nil, spec, fmt.Errorf("%w: %v", errUsage, err)
		}
	}
	spec.Seed = o.seed
	if o.requests > 0 {
		spec.Requests = o.requests
	}
	reqs, err := workload.Generate(spec)
	if err != nil {
		return nil, spec, err
	}
	if o.rate > 0 {
		workload.Arrivals(reqs, o.rate, o.seed)
	}
	return reqs, spec, nil
}

func (o *benchOptions) run(ctx context.Context, stderr io.Writer) (report.Result, error) {
	if err := o.validate(); err != nil {
		return report.Result{}, err
	}
	pols := []string{"target"}
	if o.embedded {
		var err error
		if pols, err = o.policyList(); err != nil {
			return report.Result{}, err
		}
	}
	if _, err := costmodel.Lookup(o.profile); err != nil {
		return report.Result{}, fmt.Errorf("%w: %v", errUsage, err)
	}
	reqs, spec, err := o.requestsFor()
	if err != nil {
		return report.Result{}, err
	}
	open := o.rate > 0 || strings.HasPrefix(o.workload, "trace:")
	load := bench.Config{Model: o.model, RequestTimeout: o.timeout, MaxDuration: o.maxDuration, TimeScale: o.timeScale}
	if !open {
		load.Concurrency = o.concurrency
	}
	res := report.Result{Meta: map[string]any{
		"command": "kvgate " + strings.Join(os.Args[1:], " "), "workload": spec.String(), "requests": len(reqs),
		"seed": o.seed, "replicas": o.replicas, "profile": o.profile, "time_scale": o.timeScale,
	}}
	for _, p := range pols {
		bar := newProgress(stderr, len(reqs), p)
		load.Progress = bar.add
		var run report.Run
		if o.embedded {
			gcfg := gateway.Defaults()
			gcfg.Seed, gcfg.Profile = o.seed, o.profile
			er, err := bench.RunEmbedded(ctx, bench.EmbeddedConfig{
				Sim: sim.Config{Replicas: o.replicas, Profile: o.profile, KVBlocks: o.kvBlocks, TimeScale: o.timeScale,
					Seed: o.seed, Model: o.model},
				Gateway: gcfg, Load: load}, p, reqs)
			bar.finish()
			if err != nil && !errors.Is(err, bench.ErrDeadline) {
				return res, fmt.Errorf("policy %s: %w", p, err)
			}
			run = er.Run
		} else {
			load.Target = o.target
			recs, wall, err := bench.Run(ctx, load, reqs)
			bar.finish()
			if err != nil && !errors.Is(err, bench.ErrDeadline) {
				return res, err
			}
			run = report.Summarize(p, recs, maxReplica(recs)+1, wall)
		}
		res.Runs = append(res.Runs, run)
		if ctx.Err() != nil {
			return res, ctx.Err()
		}
	}
	return res, nil
}

func maxReplica(recs []report.Record) int {
	m := 0
	for _, r := range recs {
		m = max(m, r.Replica)
	}
	return m
}

func (o *benchOptions) output(res report.Result, stdout io.Writer, title string) error {
	report.WriteTable(stdout, res)
	if o.jsonPath != "" {
		f, err := os.Create(o.jsonPath)
		if err != nil {
			return err
		}
		if err := report.WriteJSON(f, res); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "JSON: %s\n", o.jsonPath)
	}
	if o.reportDir != "" {
		if err := report.WriteReport(o.reportDir, res, title); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "Report: %s\n", o.reportDir+"/index.html")
	}
	return nil
}

// progress shows a bar on a terminal and a line every 10% otherwise.
type progress struct {
	mu    sync.Mutex
	bar   *progressbar.ProgressBar
	w     io.Writer
	label string
	total int
	last  int
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func newProgress(w io.Writer, total int, label string) *progress {
	p := &progress{w: w, label: label, total: total}
	if isTerminal(w) {
		p.bar = progressbar.NewOptions(total, progressbar.OptionSetWriter(w), progressbar.OptionSetDescription(fmt.Sprintf("%-14s", label)),
			progressbar.OptionShowCount(), progressbar.OptionClearOnFinish(), progressbar.OptionThrottle(100*time.Millisecond))
	}
	return p
}

func (p *progress) add(done, total int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.bar != nil {
		_ = p.bar.Set(done)
		return
	}
	if step := max(total/10, 1); done-p.last >= step || done == total {
		p.last = done
		fmt.Fprintf(p.w, "%s: %d/%d requests\n", p.label, done, total)
	}
}

func (p *progress) finish() {
	if p.bar != nil {
		_ = p.bar.Finish()
	}
}

// soak runs the workload round after round against --target for --duration
// and prints the gateway's goroutines and heap over time.
func (o *benchOptions) soak(ctx context.Context, stdout io.Writer) error {
	if o.target == "" || o.embedded {
		return fmt.Errorf("%w: --duration soaks a running gateway: give --target URL (kvgate serve registers go_goroutines and heap metrics)", errUsage)
	}
	if err := o.validate(); err != nil {
		return err
	}
	load := bench.Config{Target: o.target, Model: o.model, RequestTimeout: o.timeout, Concurrency: o.concurrency, TimeScale: o.timeScale}
	if o.rate > 0 || strings.HasPrefix(o.workload, "trace:") {
		load.Concurrency = 0
	}
	seed := o.seed
	gen := func(round int) ([]workload.Request, error) {
		o.seed = seed + uint64(round)
		reqs, _, err := o.requestsFor()
		return reqs, err
	}
	start := time.Now()
	samples, recs, err := bench.Soak(ctx, load, gen, o.duration, o.soakEvery)
	if err != nil {
		return err
	}
	bench.WriteSoak(stdout, samples)
	run := report.Summarize("soak", recs, maxReplica(recs)+1, time.Since(start))
	res := report.Result{Runs: []report.Run{run}, Meta: map[string]any{"soak": samples, "workload": o.workload,
		"duration": o.duration.String(), "target": o.target}}
	return o.output(res, stdout, "kvgate bench soak")
}
