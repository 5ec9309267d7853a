package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/sim"
)

// simShutdownGrace is how long in-flight requests may finish after SIGINT.
const simShutdownGrace = 5 * time.Second

// runSim is `kvgate sim`: N simulated vLLM replicas on consecutive ports,
// until ctx is cancelled.
func runSim(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) error {
	fs := newFlags("sim", "--replicas N --port P [flags]", stderr)
	var (
		cfg           sim.Config
		seed          uint64
		form          string
		adapters      string
		faultReplicas string
	)
	fs.IntVar(&cfg.Replicas, "replicas", 1, "number of replicas; replica i serves on 127.0.0.1:(port+i)")
	fs.IntVar(&cfg.Port, "port", 8000, "port of replica 0 (0: ephemeral ports, printed)")
	fs.StringVar(&cfg.Model, "model", sim.DefaultModel, "served model name")
	fs.StringVar(&adapters, "lora-adapters", "", "comma-separated LoRA adapter names served beside the model")
	fs.StringVar(&cfg.Profile, "profile", costmodel.Default,
		"latency profile: "+strings.Join(costmodel.Names(), ", "))
	fs.IntVar(&cfg.KVBlocks, "kv-blocks", engine.DefaultNumBlocks, "KV cache blocks per replica")
	fs.IntVar(&cfg.BlockSize, "block-size", engine.DefaultBlockSize, "tokens per KV block")
	fs.IntVar(&cfg.MaxBatchTokens, "max-batch-tokens", engine.DefaultMaxBatchTokens, "token budget of one scheduler step")
	fs.IntVar(&cfg.MaxSeqs, "max-seqs", engine.DefaultMaxSeqs, "running sequences cap")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", 0,
		fmt.Sprintf("longest prompt + max_tokens (default min(%d, kv-blocks × block-size))", sim.DefaultMaxModelLen))
	fs.Float64Var(&cfg.Jitter, "jitter", 0, "relative step-time noise in [0, 1)")
	fs.Uint64Var(&seed, "seed", 1, "seed of every random draw (output lengths and words, faults, jitter)")
	fs.Float64Var(&cfg.TimeScale, "time-scale", 1,
		fmt.Sprintf("virtual seconds per wall second (> 1 runs faster than real time, at most %g)", float64(sim.MaxTimeScale)))
	fs.IntVar(&cfg.OutputMedian, "output-median", sim.DefaultOutputMedian,
		"median output length (tokens) of requests without ignore_eos, capped by max_tokens")
	fs.Float64Var(&cfg.OutputSigma, "output-sigma", sim.DefaultOutputSigma, "log-normal sigma of that length")
	fs.IntVar(&cfg.KVEventsPort, "kv-events-port", 0,
		"publish KV events: replica i binds tcp://127.0.0.1:(Q+i), topic kv@127.0.0.1:(port+i)@MODEL (0: off)")
	fs.StringVar(&form, "kv-events-form", "map", "KV event encoding: map (vLLM > 0.23) or array (older positional)")
	fs.StringVar(&faultReplicas, "fault-replicas", "", "comma-separated replica indexes the faults apply to (default all)")
	fs.Float64Var(&cfg.Faults.ErrorRate, "fault-error-rate", 0, "probability of a 500 answer")
	fs.IntVar(&cfg.Faults.FailAfter, "fault-fail-after", 0, "every request after the N-th gets 503, /health too (0: never)")
	fs.Float64Var(&cfg.Faults.StallRate, "fault-stall-rate", 0, "probability of holding a request before its first byte")
	fs.DurationVar(&cfg.Faults.Stall, "fault-stall", 0, "how long a stalled request is held (wall time)")
	fs.Float64Var(&cfg.Faults.DieRate, "fault-die-rate", 0,
		"probability of cutting the connection after the first streamed chunk (non-streamed: before any byte)")
	fs.DurationVar(&cfg.Faults.RefuseAfter, "fault-refuse-after", 0, "close the listener this long after start")
	fs.DurationVar(&cfg.Faults.RefuseFor, "fault-refuse-for", 0, "and listen again on the same port after this window")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	cfg.Seed = seed
	usageErr := func(format string, a ...any) error {
		return fmt.Errorf("%w: kvgate sim: %s", errUsage, fmt.Sprintf(format, a...))
	}
	switch {
	case cfg.Replicas < 1:
		return usageErr("--replicas %d: want at least 1", cfg.Replicas)
	case cfg.Port < 0 || cfg.Port+cfg.Replicas-1 > 65535:
		return usageErr("--port %d: ports %d..%d out of range", cfg.Port, cfg.Port, cfg.Port+cfg.Replicas-1)
	case cfg.KVEventsPort < 0 || cfg.KVEventsPort+cfg.Replicas-1 > 65535:
		return usageErr("--kv-events-port %d: ports out of range", cfg.KVEventsPort)
	case !(cfg.TimeScale > 0):
		return usageErr("--time-scale %v: want > 0", cfg.TimeScale)
	}
	if _, err := costmodel.Lookup(cfg.Profile); err != nil {
		return usageErr("--profile: %v", err)
	}
	f, err := kvevents.ParseForm(form)
	if err != nil {
		return usageErr("--kv-events-form: %v", err)
	}
	cfg.KVEventsForm = f
	cfg.KVEvents = cfg.KVEventsPort > 0
	if adapters != "" {
		cfg.Adapters = strings.Split(adapters, ",")
	}
	if faultReplicas != "" {
		for _, s := range strings.Split(faultReplicas, ",") {
			i, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil {
				return usageErr("--fault-replicas %q: %v", faultReplicas, err)
			}
			cfg.FaultReplicas = append(cfg.FaultReplicas, i)
		}
	}

	// The fleet outlives ctx by the grace period: Shutdown below ends it.
	fleet, err := sim.Start(context.WithoutCancel(ctx), cfg)
	if err != nil {
		if errors.Is(err, sim.ErrInvalidConfig) {
			return fmt.Errorf("%w: kvgate sim: %v", errUsage, err)
		}
		return err
	}
	for _, r := range fleet.Replicas() {
		line := fmt.Sprintf("replica %d %s", r.Index(), r.URL())
		if r.KVEndpoint() != "" {
			line += fmt.Sprintf(" kv-events %s topic %s", r.KVEndpoint(), r.KVTopic())
		}
		fmt.Fprintln(stdout, line)
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), simShutdownGrace)
	defer cancel()
	return fleet.Shutdown(sctx)
}
