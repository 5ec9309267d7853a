package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvgate/kvgate/internal/epp"
	"github.com/kvgate/kvgate/internal/epp/standin"
	"github.com/kvgate/kvgate/internal/gateway"
)

// eppFlags are the flags of `kvgate epp`: serve's (the same routing,
// replicas, policies, pools, state), and the picker's own.
type eppFlags struct {
	serveFlags
	grpcListen, standin, standinMode   string
	fallbacks                          int
	poolName, poolNamespace, poolGroup string
}

func (f *eppFlags) register(fs *flag.FlagSet) {
	f.serveFlags.register(fs)
	d := gateway.DefaultEPP()
	fs.StringVar(&f.grpcListen, "epp-listen", d.Listen, "address of the ext_proc gRPC service and of gRPC health checking "+
		"(--listen serves /metrics, /health, /ready, /debug, /admin and /ui)")
	fs.IntVar(&f.fallbacks, "epp-fallbacks", d.Fallbacks, "endpoints listed after the chosen one, which the proxy tries in order "+
		"when its retry policy allows")
	fs.StringVar(&f.standin, "standin", "", "also serve an in-process Envoy stand-in (ext_proc client + HTTP forwarder) on this "+
		"address, to try and benchmark the picker without Envoy; not for production")
	fs.StringVar(&f.standinMode, "standin-mode", "full_duplex_streamed", "the stand-in's body mode: full_duplex_streamed or buffered")
	// The reference endpoint picker's flags for its InferencePool.
	fs.StringVar(&f.poolName, "pool-name", "", "the InferencePool to follow: its selector's Ready pods, on each of its target ports, "+
		"are the replicas (discovery.kubernetes.inference_pool; replaces the file's replicas, replicas_file or discovery target)")
	fs.StringVar(&f.poolNamespace, "pool-namespace", "", "the InferencePool's namespace (default: the file's "+
		"discovery.kubernetes.namespace, else $NAMESPACE, else default)")
	fs.StringVar(&f.poolGroup, "pool-group", "", "the InferencePool's API group: inference.networking.k8s.io (v1, the default) "+
		"or inference.networking.x-k8s.io (v1alpha2)")
	f.more = f.overridePool
}

// overridePool makes --pool-name (with --pool-namespace and --pool-group)
// the replicas' source: the file's discovery settings (scheme, api_key,
// kubeconfig, role_label) stay, its target is replaced. The namespace
// falls back as the reference picker's does: the flag, $NAMESPACE, then
// default (the file's own namespace before $NAMESPACE).
func (f *eppFlags) overridePool(cfg *gateway.Config, set map[string]bool) error {
	if !set["pool-name"] {
		if set["pool-namespace"] || set["pool-group"] {
			return fmt.Errorf("%w: --pool-namespace and --pool-group need --pool-name", errUsage)
		}
		return nil
	}
	d := &gateway.DiscoveryConfig{}
	if cfg.Discovery != nil && cfg.Discovery.DNS == "" {
		d = cfg.Discovery
	}
	k := &gateway.KubernetesConfig{}
	if d.Kubernetes != nil {
		k.Namespace, k.Kubeconfig, k.RoleLabel = d.Kubernetes.Namespace, d.Kubernetes.Kubeconfig, d.Kubernetes.RoleLabel
	}
	k.Namespace = cmp.Or(f.poolNamespace, k.Namespace, os.Getenv("NAMESPACE"), "default")
	k.InferencePool, k.InferencePoolGroup = f.poolName, f.poolGroup
	d.Kubernetes = k
	cfg.Replicas, cfg.ReplicasFile, cfg.Discovery = nil, "", d
	return nil
}

func (f *eppFlags) run(ctx context.Context, inv invocation) error {
	cfg, level, err := f.eppConfig(inv.set)
	if err == nil {
		err = cfg.Validate()
	}
	if f.check {
		return reportCheck(inv.stdout, cmp.Or(f.configPath, "flags only"), cfg, err)
	}
	if err != nil {
		return err
	}
	if f.standinMode != gateway.BodyModeFullDuplex && f.standinMode != gateway.BodyModeBuffered {
		return fmt.Errorf("%w: --standin-mode %q: want full_duplex_streamed or buffered", errUsage, f.standinMode)
	}
	log := slog.New(slog.NewJSONHandler(inv.stderr, &slog.HandlerOptions{Level: level}))
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	tp, stopTracing, err := startTracing(ctx, cfg)
	if err != nil {
		return err
	}
	defer flushTracing(stopTracing, log)
	g, err := gateway.New(cfg, gateway.Options{Registry: reg, Logger: log, TracerProvider: tp})
	if err != nil {
		return err
	}
	srv, err := epp.New(g, cfg.EPP, cfg.MaxBodyBytes, log)
	if err != nil {
		return err
	}
	return f.serve(ctx, inv, cfg, g, srv, log)
}

// eppConfig is serve's configuration with the picker's flags given
// explicitly set over it (overrideEPP).
func (f *eppFlags) eppConfig(set map[string]bool) (gateway.Config, slog.Level, error) {
	cfg, level, err := f.config(set)
	if err == nil {
		f.overrideEPP(&cfg, set)
	}
	return cfg, level, err
}

// overrideEPP sets the picker's flags given explicitly.
func (f *eppFlags) overrideEPP(cfg *gateway.Config, set map[string]bool) {
	if set["epp-listen"] {
		cfg.EPP.Listen = f.grpcListen
	}
	if set["epp-fallbacks"] {
		cfg.EPP.Fallbacks = f.fallbacks
	}
}

// serve runs the picker until ctx ends: the control plane, the ops HTTP
// endpoints, the gRPC service and, when asked, the stand-in.
func (f *eppFlags) serve(ctx context.Context, inv invocation, cfg gateway.Config, g *gateway.Gateway, srv *epp.Server,
	log *slog.Logger) error {
	gln, err := net.Listen("tcp", cfg.EPP.Listen)
	if err != nil {
		return err
	}
	hln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		_ = gln.Close()
		return err
	}
	runCtx, stopRun := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { g.Run(runCtx) })
	ops := &http.Server{Handler: g.OpsHandler(), ReadHeaderTimeout: cfg.ReadHeaderTimeout.D()}
	wg.Go(func() { _ = ops.Serve(hln) })
	fmt.Fprintf(inv.stdout, "kvgate endpoint picker: ext_proc grpc://%s (ops http://%s) → %s\n", gln.Addr(), hln.Addr(), replicaSummary(cfg))
	stopStandin, err := f.startStandin(cfg, gln.Addr().String(), inv)
	if err != nil {
		_ = gln.Close()
		stopRun()
		_ = ops.Close()
		wg.Wait()
		return err
	}
	err = srv.Serve(ctx, gln, g, cfg.DrainTimeout.D())
	stopStandin()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	_ = ops.Shutdown(sctx)
	cancel()
	stopRun()
	wg.Wait()
	log.Info("endpoint picker stopped")
	return err
}

// startStandin serves the Envoy stand-in on --standin (a no-op without it).
func (f *eppFlags) startStandin(cfg gateway.Config, picker string, inv invocation) (stop func(), err error) {
	if f.standin == "" {
		return func() {}, nil
	}
	conn, err := grpc.NewClient(picker, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	mode := standin.FullDuplex
	if f.standinMode == gateway.BodyModeBuffered {
		mode = standin.Buffered
	}
	ln, err := net.Listen("tcp", f.standin)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	// The picker answers within its queue_timeout: the stand-in waits that long.
	p := standin.New(standin.Config{Conn: conn, RequestMode: mode, ResponseMode: mode, MessageTimeout: cfg.QueueTimeout.D() + 5*time.Second,
		MaxBody: cfg.MaxBodyBytes})
	hs := &http.Server{Handler: p, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() { defer close(done); _ = hs.Serve(ln) }()
	fmt.Fprintf(inv.stdout, "Envoy stand-in (%s) on http://%s\n", f.standinMode, ln.Addr())
	return func() {
		if err := hs.Close(); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintln(inv.stderr, "stand-in:", err)
		}
		<-done
		_ = conn.Close()
	}, nil
}
