package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/policy"
)

// paramsFlag collects repeated --policy-param name=value.
type paramsFlag map[string]any

func (p paramsFlag) String() string { return "" }

func (p paramsFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return fmt.Errorf("want name=value, got %q", s)
	}
	if f, err := strconv.ParseFloat(v, 64); err == nil {
		p[k] = f
	} else if b, err := strconv.ParseBool(v); err == nil {
		p[k] = b
	} else {
		p[k] = v
	}
	return nil
}

func runServe(ctx context.Context, args []string, _ io.Reader, stdout, stderr io.Writer) error {
	fs := newFlags("serve", "--replicas URL,URL,... [--policy NAME] | --config FILE", stderr)
	configPath := fs.String("config", "", "YAML configuration file (flags given explicitly override it)")
	listen := fs.String("listen", "127.0.0.1:8080", "address to serve the API on")
	replicas := fs.String("replicas", "", "comma-separated replica base URLs, e.g. http://127.0.0.1:8001,http://127.0.0.1:8002")
	pol := fs.String("policy", policy.Default, "routing policy: "+strings.Join(policy.Names(), ", "))
	params := paramsFlag{}
	fs.Var(params, "policy-param", "a policy parameter name=value (repeatable), e.g. cache_threshold=0.3")
	kvEvents := fs.String("kv-events", "", "precise mode: each replica's KV-event endpoint, in --replicas order (tcp://127.0.0.1:5557,...)")
	tokenizer := fs.String("tokenizer", "approx", "approx (kvgate's own) or remote (the replicas' POST /tokenize)")
	adminToken := fs.String("admin-token", "", "enables /debug/* and /admin/* behind this bearer token (or $KVGATE_ADMIN_TOKEN)")
	apiKeys := fs.String("api-keys", "", "comma-separated client API keys; when set, clients must send one as a bearer token")
	seed := fs.Uint64("seed", 1, "seed of the policy's random tie breaks")
	profile := fs.String("profile", "llama3-8b-h100", "replicas' latency profile (ttft policy's estimate)")
	blockSize := fs.Int("block-size", 16, "tokens per KV block of the replicas")
	scrape := fs.Duration("scrape-interval", 250*time.Millisecond, "how often each replica's /metrics is scraped")
	retries := fs.Int("retries", 2, "other replicas a request may try before its first response byte")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	cfg := gateway.Defaults()
	if *configPath != "" {
		var err error
		if cfg, err = gateway.LoadConfig(*configPath); err != nil {
			return err
		}
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if set["listen"] || *configPath == "" {
		cfg.Listen = *listen
	}
	if set["replicas"] || set["kv-events"] {
		rs, err := gateway.ParseReplicaList(*replicas, *kvEvents)
		if err != nil {
			return fmt.Errorf("%w: %v", errUsage, err)
		}
		cfg.Replicas = rs
	}
	if set["policy"] || *configPath == "" {
		cfg.Policy = *pol
	}
	if len(params) > 0 {
		if cfg.PolicyParams == nil {
			cfg.PolicyParams = map[string]any{}
		}
		for k, v := range params {
			cfg.PolicyParams[k] = v
		}
	}
	if set["tokenizer"] || *configPath == "" {
		cfg.Tokenizer = *tokenizer
	}
	if set["seed"] {
		cfg.Seed = *seed
	}
	if set["profile"] {
		cfg.Profile = *profile
	}
	if set["block-size"] {
		cfg.BlockSize = *blockSize
	}
	if set["scrape-interval"] {
		cfg.ScrapeInterval = gateway.Duration(*scrape)
	}
	if set["retries"] {
		cfg.Retries = *retries
	}
	if *adminToken != "" {
		cfg.AdminToken = *adminToken
	} else if cfg.AdminToken == "" {
		cfg.AdminToken = os.Getenv("KVGATE_ADMIN_TOKEN")
	}
	if *apiKeys != "" {
		cfg.APIKeys = strings.Split(*apiKeys, ",")
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		return fmt.Errorf("%w: --log-level: %v", errUsage, err)
	}
	log := slog.New(slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level}))
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	g, err := gateway.New(cfg, gateway.Options{Registry: reg, Logger: log})
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "kvgate serving http://%s → %d replicas, policy %s\n", ln.Addr(), len(cfg.Replicas), cfg.Policy)
	return serveUntil(ctx, ln, g, log)
}

// serveUntil serves g on ln until ctx ends, then shuts down gracefully.
func serveUntil(ctx context.Context, ln net.Listener, g *gateway.Gateway, log *slog.Logger) error {
	srv := g.Server()
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); g.Run(runCtx) }()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	var err error
	select {
	case <-ctx.Done():
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		err = srv.Shutdown(sctx)
		scancel()
		<-errc
	case err = <-errc:
	}
	cancel()
	wg.Wait()
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	log.Info("gateway stopped")
	return err
}
