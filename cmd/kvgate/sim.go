package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
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

// simFlags are the flags of `kvgate sim`: sim.Config's fields, and the
// strings config parses into the others.
type simFlags struct {
	cfg           sim.Config
	form          string
	adapters      string
	servedNames   string
	faultReplicas string
	roles         string
}

func (f *simFlags) register(fs *flag.FlagSet) {
	cfg := &f.cfg
	fs.IntVar(&cfg.Replicas, "replicas", 1, "number of replicas; replica i serves on 127.0.0.1:(port+i)")
	fs.IntVar(&cfg.Port, "port", 8000, "port of replica 0 (0: ephemeral ports, printed)")
	fs.StringVar(&cfg.Model, "model", sim.DefaultModel,
		"the model (vLLM's --model): the name requests use unless --served-model-name, and MODEL in KV-event topics")
	fs.StringVar(&f.adapters, "lora-adapters", "", "comma-separated LoRA adapter names served beside the model")
	fs.StringVar(&f.servedNames, "served-model-name", "",
		"comma-separated names requests use for the model (vLLM's --served-model-name); /v1/models gives --model as their root")
	fs.StringVar(&cfg.Profile, "profile", costmodel.Default,
		"latency profile: "+strings.Join(costmodel.Names(), ", "))
	fs.IntVar(&cfg.DataParallelSize, "data-parallel-size", 1,
		"engine cores per replica, as vLLM's --data-parallel-size: each its own KV cache; header X-Data-Parallel-Rank picks one")
	fs.IntVar(&cfg.KVBlocks, "kv-blocks", engine.DefaultNumBlocks, "KV cache blocks per replica (per engine core)")
	fs.IntVar(&cfg.BlockSize, "block-size", engine.DefaultBlockSize, "tokens per KV block")
	fs.IntVar(&cfg.MaxBatchTokens, "max-batch-tokens", engine.DefaultMaxBatchTokens, "token budget of one scheduler step")
	fs.IntVar(&cfg.MaxSeqs, "max-seqs", engine.DefaultMaxSeqs, "running sequences cap")
	fs.StringVar(&cfg.SchedulingPolicy, "scheduling-policy", sim.SchedulingFCFS,
		"vLLM's --scheduling-policy: fcfs, or priority (the waiting queue by each request's priority field, lower first; "+
			"under fcfs a priority other than 0 is refused with 400, as vLLM does)")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", 0,
		fmt.Sprintf("longest prompt + max_tokens (default min(%d, kv-blocks × block-size))", sim.DefaultMaxModelLen))
	fs.Float64Var(&cfg.Jitter, "jitter", 0, "relative step-time noise in [0, 1)")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "seed of every random draw (output lengths and words, faults, jitter)")
	fs.Float64Var(&cfg.TimeScale, "time-scale", 1,
		fmt.Sprintf("virtual seconds per wall second (> 1 runs faster than real time, at most %g)", float64(sim.MaxTimeScale)))
	fs.IntVar(&cfg.OutputMedian, "output-median", sim.DefaultOutputMedian,
		"median output length (tokens) of requests without ignore_eos, capped by max_tokens")
	fs.Float64Var(&cfg.OutputSigma, "output-sigma", sim.DefaultOutputSigma, "log-normal sigma of that length")
	fs.IntVar(&cfg.KVEventsPort, "kv-events-port", 0,
		"publish KV events, one publisher per data-parallel rank as vLLM: rank k of replica i binds tcp://127.0.0.1:(Q+i×N+k), "+
			"N the --data-parallel-size (N=1: Q+i); topic kv@127.0.0.1:(port+i)@MODEL, MODEL the --model (0: off)")
	fs.StringVar(&cfg.KVEventsConnect, "kv-events-connect", "",
		"publish KV events by connecting instead of binding (llm-d's topology; vLLM when its endpoint names a host): "+
			"rank k of every replica dials tcp://HOST:(PORT+k), e.g. kvgate serve's --kv-events-listen; excludes --kv-events-port")
	fs.IntVar(&cfg.KVEventsReplayPort, "kv-events-replay-port", 0,
		"also bind vLLM's replay socket (replay_endpoint; the latest 10000 batches) of rank k of replica i on "+
			"tcp://127.0.0.1:(R+i×N+k) (0: none; needs --kv-events-port or --kv-events-connect)")
	fs.Uint64Var(&cfg.KVEventsFirstSeq, "kv-events-first-seq", 0,
		"sequence number of each publisher's first batch (vLLM: 0; llm-d's vLLM simulator: 1)")
	fs.StringVar(&f.form, "kv-events-form", "map", "KV event encoding: map (vLLM > 0.23) or array (older positional)")
	fs.StringVar(&f.roles, "role", "both",
		"prefill/decode disaggregation: prefill, decode or both for every replica, or a comma-separated role per replica "+
			"(e.g. prefill,prefill,decode,decode). vLLM's kv_transfer_params protocol (NixlConnector): a prefill replica "+
			"answers do_remote_decode requests with the kv_transfer_params of the blocks it holds, a decode replica pulls "+
			"them for do_remote_prefill requests (remote_host:remote_port is the prefill replica's own address); "+
			"both serves either, and every role serves plain requests")
	fs.DurationVar(&cfg.KVHoldTimeout, "kv-hold-timeout", engine.DefaultKVHoldTimeout,
		"how long a prefill replica holds a request's KV blocks for its decode replica, in simulated time "+
			"(vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
	fs.IntVar(&cfg.OffloadBlocks, "cpu-offload-blocks", 0,
		"host (CPU) KV tier of each replica (each rank), in blocks, as vLLM's OffloadingConnector keeps it: every "+
			"computed block is stored there too (LRU), a prompt evicted from the GPU is loaded from it over PCIe at the "+
			"profile's rate, and its KV events carry medium CPU (0: none). Every replica also serves peer pulls: a "+
			"request with kv_transfer_params.remote_kv_source {remote_host, remote_port} pulls what that sim holds")
	f.registerFaults(fs)
}

func (f *simFlags) registerFaults(fs *flag.FlagSet) {
	faults := &f.cfg.Faults
	fs.StringVar(&f.faultReplicas, "fault-replicas", "", "comma-separated replica indexes the faults apply to (default all)")
	fs.Float64Var(&faults.ErrorRate, "fault-error-rate", 0, "probability of a 500 answer")
	fs.IntVar(&faults.FailAfter, "fault-fail-after", 0, "every request after the N-th gets 503, /health too (0: never)")
	fs.Float64Var(&faults.StallRate, "fault-stall-rate", 0, "probability of holding a request before its first byte")
	fs.DurationVar(&faults.Stall, "fault-stall", 0, "how long a stalled request is held (wall time)")
	fs.Float64Var(&faults.DieRate, "fault-die-rate", 0,
		"probability of cutting the connection after the first streamed chunk (non-streamed: before any byte)")
	fs.DurationVar(&faults.RefuseAfter, "fault-refuse-after", 0, "close the listener this long after start")
	fs.DurationVar(&faults.RefuseFor, "fault-refuse-for", 0, "and listen again on the same port after this window")
	fs.StringVar(&faults.CrashOn, "fault-crash-on", "",
		"a query of death: a request whose prompt contains this text crashes the replica (listener and connections closed)")
	fs.DurationVar(&faults.CrashFor, "fault-crash-for", 0, "how long a crashed replica stays down before it listens again")
}

// config validates the flags and completes sim.Config.
func (f *simFlags) config() (sim.Config, error) {
	cfg := f.cfg
	usageErr := func(format string, a ...any) error {
		return fmt.Errorf("%w: kvgate sim: %s", errUsage, fmt.Sprintf(format, a...))
	}
	switch {
	case cfg.Replicas < 1:
		return cfg, usageErr("--replicas %d: want at least 1", cfg.Replicas)
	case cfg.DataParallelSize < 1:
		return cfg, usageErr("--data-parallel-size %d: want at least 1", cfg.DataParallelSize)
	case cfg.Port < 0 || cfg.Port+cfg.Replicas-1 > 65535:
		return cfg, usageErr("--port %d: ports %d..%d out of range", cfg.Port, cfg.Port, cfg.Port+cfg.Replicas-1)
	case cfg.KVEventsPort < 0 || cfg.KVEventsPort+cfg.Replicas*cfg.DataParallelSize-1 > 65535:
		return cfg, usageErr("--kv-events-port %d: ports %d..%d (replicas × data-parallel ranks) out of range",
			cfg.KVEventsPort, cfg.KVEventsPort, cfg.KVEventsPort+cfg.Replicas*cfg.DataParallelSize-1)
	case cfg.KVEventsReplayPort < 0 || cfg.KVEventsReplayPort+cfg.Replicas*cfg.DataParallelSize-1 > 65535:
		return cfg, usageErr("--kv-events-replay-port %d: ports %d..%d (replicas × data-parallel ranks) out of range",
			cfg.KVEventsReplayPort, cfg.KVEventsReplayPort, cfg.KVEventsReplayPort+cfg.Replicas*cfg.DataParallelSize-1)
	case cfg.KVEventsPort > 0 && cfg.KVEventsConnect != "":
		return cfg, usageErr("--kv-events-port and --kv-events-connect exclude each other: bind or connect")
	case cfg.KVEventsReplayPort > 0 && cfg.KVEventsPort == 0 && cfg.KVEventsConnect == "":
		return cfg, usageErr("--kv-events-replay-port needs --kv-events-port or --kv-events-connect")
	case !(cfg.TimeScale > 0):
		return cfg, usageErr("--time-scale %v: want > 0", cfg.TimeScale)
	case cfg.KVHoldTimeout <= 0:
		return cfg, usageErr("--kv-hold-timeout %v: want > 0", cfg.KVHoldTimeout)
	case cfg.OffloadBlocks < 0 || cfg.OffloadBlocks >= math.MaxInt32:
		return cfg, usageErr("--cpu-offload-blocks %d: want 0 to %d", cfg.OffloadBlocks, math.MaxInt32-1)
	}
	if err := f.parseRoles(&cfg); err != nil {
		return cfg, usageErr("%v", err)
	}
	if _, err := costmodel.Lookup(cfg.Profile); err != nil {
		return cfg, usageErr("--profile: %v", err)
	}
	form, err := kvevents.ParseForm(f.form)
	if err != nil {
		return cfg, usageErr("--kv-events-form: %v", err)
	}
	cfg.KVEventsForm = form
	cfg.KVEvents = cfg.KVEventsPort > 0 || cfg.KVEventsConnect != ""
	cfg.KVEventsReplay = cfg.KVEventsReplayPort > 0
	if f.adapters != "" {
		cfg.Adapters = strings.Split(f.adapters, ",")
	}
	if f.servedNames != "" {
		cfg.ServedModelNames = strings.Split(f.servedNames, ",")
	}
	if f.faultReplicas != "" {
		for _, s := range strings.Split(f.faultReplicas, ",") {
			i, err := strconv.Atoi(strings.TrimSpace(s))
			if err != nil {
				return cfg, usageErr("--fault-replicas %q: %v", f.faultReplicas, err)
			}
			cfg.FaultReplicas = append(cfg.FaultReplicas, i)
		}
	}
	return cfg, nil
}

// parseRoles reads --role: one role for every replica, or one per replica.
func (f *simFlags) parseRoles(cfg *sim.Config) error {
	parts := strings.Split(f.roles, ",")
	roles := make([]engine.Role, len(parts))
	for i, p := range parts {
		r, err := engine.ParseRole(strings.TrimSpace(p))
		if err != nil {
			return fmt.Errorf("--role: %w", err)
		}
		roles[i] = r
	}
	switch {
	case len(roles) == 1:
		cfg.Role = roles[0]
	case len(roles) == cfg.Replicas:
		cfg.Roles = roles
	default:
		return fmt.Errorf("--role %q: %s for %s (give one, or one per replica)", f.roles, count(len(roles), "role"), count(cfg.Replicas, "replica"))
	}
	return nil
}

// run serves N simulated vLLM replicas on consecutive ports until ctx is
// cancelled.
func (f *simFlags) run(ctx context.Context, inv invocation) error {
	cfg, err := f.config()
	if err != nil {
		return err
	}
	cfg.Logger = slog.New(slog.NewTextHandler(inv.stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	// The fleet outlives ctx by the grace period: Shutdown below ends it.
	fleet, err := sim.Start(context.WithoutCancel(ctx), cfg)
	if err != nil {
		if errors.Is(err, sim.ErrInvalidConfig) {
			return fmt.Errorf("%w: kvgate sim: %v", errUsage, err)
		}
		return err
	}
	for _, r := range fleet.Replicas() {
		fmt.Fprintln(inv.stdout, replicaLine(r, cfg.KVEventsConnect))
	}
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), simShutdownGrace)
	defer cancel()
	return fleet.Shutdown(sctx)
}

// replicaLine is the startup line of a replica:
//
//	replica I URL [kv-events [connect] EP... topic TOPIC [replay EP...]] [role ROLE]
//
// (the role only for a prefill or decode replica), the KV-event endpoints one per data-parallel rank (rank 0 first; the
// ones dialed after "connect" in connect mode), the replay sockets' too.
// Its first words, "replica I URL kv-events EP0 ... topic", are what
// scripts and tests read; one rank and no replay socket give exactly
// "replica I URL kv-events EP topic TOPIC".
func replicaLine(r *sim.Replica, connect string) string {
	line := kvLine(r, connect)
	if role := r.Config().Role; role != engine.RoleBoth {
		line += " role " + role.String()
	}
	return line
}

// kvLine is the replica line up to its role.
func kvLine(r *sim.Replica, connect string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "replica %d %s", r.Index(), r.URL())
	if r.KVTopic() == "" {
		return b.String()
	}
	b.WriteString(" kv-events")
	eps := r.KVEndpoints()
	if connect != "" {
		b.WriteString(" connect")
		eps = nil
		for k := range r.DataParallelSize() {
			eps = append(eps, kvevents.OffsetPort(connect, k))
		}
	}
	for _, ep := range eps {
		b.WriteString(" " + ep)
	}
	b.WriteString(" topic " + r.KVTopic())
	if rep := r.KVReplayEndpoints(); len(rep) > 0 {
		b.WriteString(" replay " + strings.Join(rep, " "))
	}
	return b.String()
}
