package main

import (
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
			fmt.Fprintf(w, "    replicas: %s\n", replicaSummary(gateway.Config{ReplicasFile: cfg.ReplicasFile, Discovery: cfg.Discovery}))
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
			reps = replicaSummary(gateway.Config{ReplicasFile: cfg.ReplicasFile, Discovery: cfg.Discovery})
		}
		pol := p.Policy
		if pol == "" {
			pol = cfg.Policy
		}
		parts = append(parts, fmt.Sprintf("%s (%s, %s)", p.Name, reps, pol))
	}
	return "pools " + strings.Join(parts, "; ")
}
