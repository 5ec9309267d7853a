package main

import (
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/kvgate/kvgate/internal/gateway"
)

// writePools is --check-config's summary of pools: each pool's models,
// policy (its own, or the top-level one it inherits) and replicas.
func writePools(w io.Writer, cfg gateway.Config) {
	for _, p := range cfg.Pools {
		pol, params := p.Policy, p.PolicyParams
		if pol == "" {
			pol, params = cfg.Policy+" (the top-level policy)", cfg.PolicyParams
		}
		fmt.Fprintf(w, "  pool %s: models %s; policy %s%s\n", p.Name, strings.Join(p.Models, ", "), pol, paramsText(params))
		if len(p.Replicas) == 0 {
			fmt.Fprintf(w, "    replicas: %s\n", replicaSummary(poolSource(cfg, p)))
		}
		for _, r := range p.Replicas {
			fmt.Fprintf(w, "    %s%s\n", r.URL, replicaText(r))
		}
	}
}

// poolsSummary is the startup line's replicas with pools: each pool, its
// replicas and its policy.
func poolsSummary(cfg gateway.Config) string {
	parts := make([]string, 0, len(cfg.Pools))
	for _, p := range cfg.Pools {
		reps := fleetSummary(gateway.Config{Replicas: p.Replicas})
		if len(p.Replicas) == 0 {
			reps = replicaSummary(poolSource(cfg, p))
		}
		pol := p.Policy
		if pol == "" {
			pol = cfg.Policy
		}
		parts = append(parts, fmt.Sprintf("%s (%s, %s)", p.Name, reps, pol))
	}
	return "pools " + strings.Join(parts, "; ")
}

// poolSource is where a pool without listed replicas finds them: its own
// replicas file or discovery, else the top-level ones.
func poolSource(cfg gateway.Config, p gateway.PoolConfig) gateway.Config {
	if p.ReplicasFile != "" || p.Discovery != nil {
		return gateway.Config{ReplicasFile: p.ReplicasFile, Discovery: p.Discovery}
	}
	return gateway.Config{ReplicasFile: cfg.ReplicasFile, Discovery: cfg.Discovery}
}

// checkPoolFiles reads the pools' replicas files as the gateway reads
// them at start (it refuses to start on a bad one).
func checkPoolFiles(cfg gateway.Config) error {
	var errs []error
	for i, p := range cfg.Pools {
		if p.ReplicasFile != "" {
			if _, err := replicasFileList(p.ReplicasFile); err != nil {
				errs = append(errs, &gateway.ConfigError{Key: fmt.Sprintf("pools[%d].replicas_file", i), Msg: err.Error()})
			}
		}
	}
	return errors.Join(errs...)
}
