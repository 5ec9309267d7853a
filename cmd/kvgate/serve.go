package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// serveFlags are the flags of `kvgate serve`. Flags given explicitly
// override the --config file; see config.
type serveFlags struct {
	configPath, listen, replicas, policy, kvEvents, tokenizer string
	prefillReplicas                                           string
	nonCached, offloadBlocks                                  int
	kvPulls                                                   bool
	kvReplay, kvListen, kvTrust                               string
	dataParallel                                              int
	adminToken, apiKeys, profile, logLevel                    string
	record, sharedState, stateFile                            string
	replicasFile                                              string
	params                                                    listFlag
	seed                                                      uint64
	blockSize, retries, maxConns                              int
	scrape, firstByte, idle, write, request, drain            time.Duration
	check, accessLog, receipts                                bool
	objective                                                 time.Duration
	// more sets a verb's own flags over the file's before the check
	// (kvgate epp's --pool-name).
	more func(cfg *gateway.Config, set map[string]bool) error
}

func (f *serveFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.configPath, "config", "", "YAML configuration file (flags given explicitly override it)")
	fs.BoolVar(&f.check, "check-config", false, "load and validate the configuration (file and flags), print a summary and exit: "+
		"0 valid, 2 invalid; nothing is started and no replica contacted")
	fs.StringVar(&f.listen, "listen", "127.0.0.1:8080", "address to serve the API on")
	fs.StringVar(&f.replicas, "replicas", "", "comma-separated replica base URLs, e.g. http://127.0.0.1:8001,http://127.0.0.1:8002")
	fs.StringVar(&f.replicasFile, "replicas-file", "", "YAML file listing the replicas (as the config's replicas:), watched "+
		"while kvgate runs and re-read on SIGHUP: replicas added start cold, removed ones drain")
	fs.StringVar(&f.prefillReplicas, "prefill-replicas", "", "prefill/decode disaggregation: comma-separated prefill replica base URLs "+
		"(vLLM with a kv_producer or kv_both NixlConnector); the replicas of --replicas are then decode replicas, which pull the "+
		"prompt's KV and stream the answers")
	fs.IntVar(&f.nonCached, "non-cached-tokens", router.DefaultNonCachedTokens, "prefill/decode: skip the prefill step when the "+
		"decode replica lacks fewer than this many prompt tokens (0: never skip)")
	fs.IntVar(&f.offloadBlocks, "offload-blocks", 0, "each replica's host (CPU) KV tier in blocks (vLLM's OffloadingConnector; "+
		"kvgate sim --cpu-offload-blocks), the size of the approximate index of the host tiers (config offload_blocks; 0: none)")
	fs.BoolVar(&f.kvPulls, "kv-pulls", false, "peer pulls: a decision may send a request to one replica pulling the prompt's cached "+
		"prefix from another, as vLLM's kv_transfer_params.remote_kv_source (config kv_pulls.enabled; kv_pulls.param and .port shape it)")
	fs.StringVar(&f.policy, "policy", policy.Default, "routing policy: "+strings.Join(policy.Names(), ", "))
	fs.Var(&f.params, "policy-param", "a policy parameter name=value (repeatable), e.g. cache_threshold=0.3")
	fs.StringVar(&f.kvEvents, "kv-events", "", "precise mode: each replica's KV-event endpoint, in --replicas order, then --prefill-replicas' "+
		"(tcp://127.0.0.1:5557,...)")
	fs.StringVar(&f.kvReplay, "kv-events-replay", "", "precise mode: each replica's KV-event replay endpoint (vLLM's replay_endpoint), in --replicas order, "+
		"then --prefill-replicas': "+
		"missed batches are fetched from it at start and after a gap")
	fs.StringVar(&f.kvListen, "kv-events-listen", "", "precise mode: bind this SUB socket (tcp://HOST:PORT) for replicas that connect their KV-event "+
		"publishers (vLLM with a host in its --kv-events-config endpoint); the topic kv@HOST:PORT@MODEL names the replica")
	fs.StringVar(&f.kvTrust, "kv-events-trust", kvzmq.TrustReplicaAddress, "who may publish on --kv-events-listen, comma-separated: "+
		"replica_address (a publisher speaks only for the replicas at its own source address), CIDRs (publishers from those "+
		"networks speak for any replica, e.g. 10.0.0.0/8), or any (no check)")
	fs.IntVar(&f.dataParallel, "data-parallel-size", 0, "data-parallel ranks of every replica, each a routing target (0: counted from each replica's metrics at start)")
	fs.StringVar(&f.tokenizer, "tokenizer", "approx", "approx (kvgate's own) or remote (the replicas' POST /tokenize; precise mode needs it)")
	fs.StringVar(&f.adminToken, "admin-token", "", "enables /debug/* and /admin/* behind this bearer token (or $KVGATE_ADMIN_TOKEN)")
	fs.StringVar(&f.apiKeys, "api-keys", "", "comma-separated client API keys; when set, clients must send one as a bearer token")
	fs.Uint64Var(&f.seed, "seed", 1, "seed of the policy's random tie breaks")
	fs.StringVar(&f.profile, "profile", "llama3-8b-h100", "replicas' latency profile (ttft policy's estimate)")
	fs.IntVar(&f.blockSize, "block-size", 16, "tokens per KV block of the replicas")
	fs.DurationVar(&f.scrape, "scrape-interval", 250*time.Millisecond, "how often each replica's /metrics is scraped")
	fs.IntVar(&f.retries, "retries", 2, "other replicas a request may try when one refused it before any work (connection refused, 503, 429)")
	d := gateway.Defaults()
	fs.DurationVar(&f.firstByte, "first-byte-timeout", d.FirstByteTimeout.D(), "streamed requests: the longest wait for the replica's response header; "+
		"prefill/decode: the longest a prefill step may take (0: none)")
	fs.DurationVar(&f.idle, "stream-idle-timeout", d.StreamIdleTimeout.D(), "the longest silence between two events of a stream (0: none)")
	fs.DurationVar(&f.write, "write-timeout", d.WriteTimeout.D(), "the longest a write to a client may block: a client that stops reading loses its request")
	fs.DurationVar(&f.request, "request-timeout", d.RequestTimeout.D(), "the longest a request may take in all")
	fs.DurationVar(&f.drain, "drain-timeout", d.DrainTimeout.D(), "on SIGTERM, how long requests in flight may finish before they are cut")
	fs.IntVar(&f.maxConns, "max-connections", 0, "cap on client connections (0: half the process's open-file limit)")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.BoolVar(&f.accessLog, "access-log", false, "log one line per request at info: method, path, model, replica, status, "+
		"TTFT, e2e, prompt/cached/generated tokens, request id (never the prompt or a key)")
	fs.BoolVar(&f.receipts, "route-receipts", false, "add the X-Kvgate-Route receipt to every answer: policy, matched tokens, "+
		"estimated TTFT, branch, queue wait, a P/D request's prefill cache hit (the access log and spans carry it always)")
	fs.DurationVar(&f.objective, "ttft-objective", d.TTFTObjective.D(), "the TTFT objective the pools' saturation gauge "+
		"(kvgate_pool_saturation) measures load against")
	rd := gateway.DefaultRecord()
	fs.StringVar(&f.record, "record", "", fmt.Sprintf("write a trace of the requests served to this file, for kvgate replay --trace: "+
		"block hashes and lengths, never text (rotates at %d MiB keeping %d files; records waiting for the writer are bounded to %d "+
		"and %d MiB, past which they are dropped and counted in kvgate_record_dropped_total{reason=\"full\"}; config record: for more)",
		rd.MaxBytes>>20, rd.Keep, rd.Buffer, rd.BufferBytes>>20))
	fs.StringVar(&f.sharedState, "shared-state", "", "several gateways in front of the same replicas: share routing decisions and loads "+
		"through this Redis (redis://HOST:PORT/DB); a gateway routes on its own view when Redis is down")
	fs.StringVar(&f.stateFile, "state-file", "", "write the prefix index to this file at shutdown and read it at start (a warm restart without Redis)")
}

func (f *serveFlags) run(ctx context.Context, inv invocation) error {
	cfg, level, err := f.config(inv.set)
	if f.check {
		return reportCheck(inv.stdout, cmp.Or(f.configPath, "flags only"), cfg, err)
	}
	if err != nil {
		return err // every problem, as --check-config lists them
	}
	log := newLogger(inv.stderr, level)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	tp, stopTracing, err := startTracing(ctx, cfg) // nil when off (tracing: true, or OTEL_TRACES_EXPORTER=otlp)
	if err != nil {
		return err
	}
	defer flushTracing(stopTracing, log) // after the drain: the last requests' spans are exported
	g, err := gateway.New(cfg, gateway.Options{Registry: reg, Logger: log, TracerProvider: tp})
	if err != nil {
		return err
	}
	if cfg.AdminToken == "" {
		log.Info("admin endpoints off: /debug/route, /admin/replicas and /ui answer 404; --admin-token TOKEN " +
			"(or $KVGATE_ADMIN_TOKEN, or admin_token: in the config) turns them on")
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	defer watchSIGHUP(f, inv.set, g, log)()
	if len(cfg.Pools) > 0 {
		// The pools name each one's policy.
		fmt.Fprintf(inv.stdout, "kvgate serving http://%s → %s\n", ln.Addr(), replicaSummary(cfg))
	} else {
		fmt.Fprintf(inv.stdout, "kvgate serving http://%s → %s, policy %s\n", ln.Addr(), replicaSummary(cfg), cfg.Policy)
	}
	if cfg.Record.Path != "" {
		fmt.Fprintf(inv.stdout, "recording served requests to %s (replay it with: kvgate replay --trace %s)\n", cfg.Record.Path, cfg.Record.Path)
	}
	if cfg.SharedState != "" {
		fmt.Fprintf(inv.stdout, "sharing routing state with the other gateways through %s\n", redactURL(cfg.SharedState))
	}
	return serveUntil(ctx, ln, g, log)
}

// newLogger is serve's logger: JSON lines on w, each duration written as
// Go and the config file write it ("30s", "250ms") instead of slog's JSON
// handler's integer nanoseconds (30000000000). One place for every line
// the gateway logs.
func newLogger(w io.Writer, level slog.Level) *slog.Logger {
	return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: level,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Value.Kind() == slog.KindDuration {
				a.Value = slog.StringValue(a.Value.Duration().String())
			}
			return a
		}}))
}

// config is the gateway's configuration: the --config file (or the
// defaults), with the flags given explicitly (set) on top, checked
// (checkConfig); and the log level. A configuration with problems is
// refused with all of them (configProblems), each with the file and line
// of its key where the file writes it (a flag given replaces the file's).
func (f *serveFlags) config(set map[string]bool) (gateway.Config, slog.Level, error) {
	var level slog.Level
	cfg, src, fileErr := gateway.Defaults(), (*gateway.ConfigSource)(nil), error(nil)
	if f.configPath != "" {
		if cfg, src, fileErr = gateway.ReadConfig(f.configPath); src == nil {
			return cfg, level, configProblems{fileErr} // the file cannot be read
		}
	}
	if err := f.override(&cfg, set); err != nil {
		return cfg, level, err
	}
	if f.more != nil {
		if err := f.more(&cfg, set); err != nil {
			return cfg, level, err
		}
	}
	for name := range set {
		for _, key := range flagKeys(name) {
			src.Forget(key)
		}
	}
	if err := level.UnmarshalText([]byte(f.logLevel)); err != nil {
		return cfg, level, fmt.Errorf("%w: --log-level: %v", errUsage, err)
	}
	if err := src.Locate(errors.Join(fileErr, checkConfig(cfg))); err != nil {
		return cfg, level, configProblems(gateway.ConfigProblems(err))
	}
	return cfg, level, nil
}

// flagKeys are the configuration keys a flag given replaces: the flag's
// name with _ for -, but for the flags that set a replica's fields.
func flagKeys(flag string) []string {
	switch flag {
	case "replicas", "prefill-replicas", "kv-events", "kv-events-replay", "data-parallel-size", "replicas-file",
		"pool-name", "pool-namespace", "pool-group":
		return []string{"replicas", "replicas_file", "discovery"}
	case "policy-param":
		return []string{"policy_params"}
	case "record":
		return []string{"record.path"}
	}
	return []string{strings.ReplaceAll(flag, "-", "_")}
}

// override sets in cfg the flags given explicitly, and without a file the
// listen address, policy and tokenizer.
func (f *serveFlags) override(cfg *gateway.Config, set map[string]bool) error {
	noFile := f.configPath == ""
	if set["listen"] || noFile {
		cfg.Listen = f.listen
	}
	if set["kv-events-listen"] {
		cfg.KVEventsListen = f.kvListen
	}
	if set["kv-events-trust"] {
		cfg.KVEventsTrust = strings.Split(f.kvTrust, ",")
	}
	overrideSource(cfg, set, f.replicasFile)
	if set["replicas"] || set["prefill-replicas"] || set["kv-events"] || set["kv-events-replay"] {
		rs, err := gateway.ParseReplicaList(f.replicas, gateway.ReplicaLists{Prefill: f.prefillReplicas, KVEvents: f.kvEvents,
			KVEventsReplay: f.kvReplay, DataParallelSize: f.dataParallel})
		if err != nil {
			return fmt.Errorf("%w: %v", errUsage, err)
		}
		cfg.Replicas = rs
	}
	if set["data-parallel-size"] {
		for k := range cfg.Replicas {
			cfg.Replicas[k].DataParallelSize = f.dataParallel
		}
	}
	if set["non-cached-tokens"] {
		cfg.NonCachedTokens = f.nonCached
	}
	if set["offload-blocks"] {
		cfg.OffloadBlocks = f.offloadBlocks
	}
	if set["kv-pulls"] {
		cfg.KVPulls.Enabled = f.kvPulls
	}
	if set["policy"] || noFile {
		cfg.Policy = f.policy
	}
	if err := f.overrideParams(cfg); err != nil {
		return err
	}
	if set["tokenizer"] || noFile {
		cfg.Tokenizer = f.tokenizer
	}
	if set["seed"] {
		cfg.Seed = f.seed
	}
	if set["profile"] {
		cfg.Profile = f.profile
	}
	if set["block-size"] {
		cfg.BlockSize = f.blockSize
	}
	if set["scrape-interval"] {
		cfg.ScrapeInterval = gateway.Duration(f.scrape)
	}
	if set["retries"] {
		cfg.Retries = f.retries
	}
	if set["record"] {
		cfg.Record.Path = f.record
	}
	if set["shared-state"] {
		cfg.SharedState = f.sharedState
	}
	if set["state-file"] {
		cfg.StateFile = f.stateFile
	}
	if set["access-log"] {
		cfg.AccessLog = f.accessLog
	}
	if set["route-receipts"] {
		cfg.RouteReceipts = f.receipts
	}
	if set["ttft-objective"] {
		cfg.TTFTObjective = gateway.Duration(f.objective)
	}
	f.overrideLimits(cfg, set)
	f.overrideSecrets(cfg)
	return nil
}

// overrideLimits sets the timeouts and caps given explicitly.
func (f *serveFlags) overrideLimits(cfg *gateway.Config, set map[string]bool) {
	for _, d := range []struct {
		flag string
		val  time.Duration
		dst  *gateway.Duration
	}{{"first-byte-timeout", f.firstByte, &cfg.FirstByteTimeout}, {"stream-idle-timeout", f.idle, &cfg.StreamIdleTimeout},
		{"write-timeout", f.write, &cfg.WriteTimeout}, {"request-timeout", f.request, &cfg.RequestTimeout},
		{"drain-timeout", f.drain, &cfg.DrainTimeout}} {
		if set[d.flag] {
			*d.dst = gateway.Duration(d.val)
		}
	}
	if set["max-connections"] {
		cfg.MaxConnections = f.maxConns
	}
}

// overrideParams adds each --policy-param to the file's policy_params.
func (f *serveFlags) overrideParams(cfg *gateway.Config) error {
	for _, s := range f.params {
		k, v, err := parseParam(s)
		if err != nil {
			return fmt.Errorf("%w: --policy-param: %v", errUsage, err)
		}
		if cfg.PolicyParams == nil {
			cfg.PolicyParams = map[string]any{}
		}
		cfg.PolicyParams[k] = v
	}
	return nil
}

// overrideSecrets sets the admin token (flag, else file, else environment)
// and the client API keys.
func (f *serveFlags) overrideSecrets(cfg *gateway.Config) {
	if f.adminToken != "" {
		cfg.AdminToken = f.adminToken
	} else if cfg.AdminToken == "" {
		cfg.AdminToken = os.Getenv("KVGATE_ADMIN_TOKEN")
	}
	if f.apiKeys != "" {
		cfg.APIKeys = strings.Split(f.apiKeys, ",")
	}
}

// serveUntil serves g on ln until ctx ends (SIGINT, SIGTERM), then drains
// (gateway.Serve): /ready answers 503, requests in flight get drain_timeout.
func serveUntil(ctx context.Context, ln net.Listener, g *gateway.Gateway, log *slog.Logger) error {
	runCtx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); g.Run(runCtx) }()
	err := g.Serve(ctx, ln)
	cancel() // the replicas are watched until the last request is done
	wg.Wait()
	return err
}

// fleetSummary counts the replicas for the startup line: "4 replicas", or
// by role on a prefill/decode fleet ("2 prefill + 2 decode replicas").
func fleetSummary(cfg gateway.Config) string {
	n := map[string]int{}
	for _, r := range cfg.Replicas {
		role := r.Role
		if role == "" {
			role = policy.RoleBoth.String()
		}
		n[role]++
	}
	if n[policy.RoleBoth.String()] == len(cfg.Replicas) {
		return count(len(cfg.Replicas), "replica")
	}
	var parts []string
	for _, r := range []policy.Role{policy.RolePrefill, policy.RoleDecode, policy.RoleBoth} {
		if n[r.String()] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", n[r.String()], r))
		}
	}
	if len(cfg.Replicas) == 1 {
		return strings.Join(parts, " + ") + " replica"
	}
	return strings.Join(parts, " + ") + " replicas"
}

// redactURL is u without its password (a redis:// URL may carry one).
func redactURL(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return "(an unparsable URL)"
	}
	return p.Redacted()
}
