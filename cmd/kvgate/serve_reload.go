package main

import (
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/kvgate/kvgate/internal/gateway"
)

// overrideSource: a replica source given by flag replaces the config
// file's (replicas come from one source): --replicas (or
// --prefill-replicas) the file's replicas_file and discovery,
// --replicas-file the file's replicas and discovery.
func overrideSource(cfg *gateway.Config, set map[string]bool, replicasFile string) {
	switch {
	case set["replicas-file"]:
		cfg.ReplicasFile, cfg.Replicas, cfg.Discovery = replicasFile, nil, nil
	case set["replicas"] || set["prefill-replicas"]:
		cfg.ReplicasFile, cfg.Discovery = "", nil
	}
}

// watchSIGHUP reloads on SIGHUP until the returned stop is called: the
// replicas file is read again at once, and the --config file (with the
// flags given on top) is applied as gateway.ReloadConfig allows. A file
// that does not load is logged, and the running configuration kept.
func watchSIGHUP(f *serveFlags, set map[string]bool, g *gateway.Gateway, log *slog.Logger) (stop func()) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	done := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		for {
			select {
			case <-done:
				return
			case <-hup:
				log.Info("SIGHUP: reloading the replicas file and the configuration")
				reload(f, set, g, log)
			}
		}
	}()
	return func() { signal.Stop(hup); close(done); <-exited }
}

func reload(f *serveFlags, set map[string]bool, g *gateway.Gateway, log *slog.Logger) {
	g.Reload()
	if f.configPath == "" {
		return // flags only: nothing to read again
	}
	cfg, _, err := f.config(set)
	if err == nil {
		_, _, err = g.ReloadConfig(cfg)
	}
	if err != nil {
		log.Error("config reload failed: keeping the running configuration", "path", f.configPath, "err", err)
	}
}

// replicaSummary says where the replicas come from, for the startup line.
func replicaSummary(cfg gateway.Config) string {
	switch {
	case len(cfg.Pools) > 0:
		return poolsSummary(cfg)
	case cfg.ReplicasFile != "":
		return fmt.Sprintf("replicas of %s (watched; SIGHUP re-reads it)", cfg.ReplicasFile)
	case cfg.Discovery != nil && cfg.Discovery.DNS != "":
		return "replicas found by DNS " + cfg.Discovery.DNS
	case cfg.Discovery != nil && cfg.Discovery.Kubernetes != nil:
		return kubernetesSummary(cfg.Discovery.Kubernetes)
	}
	return fleetSummary(cfg)
}
