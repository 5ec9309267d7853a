// Package discovery finds the replicas a gateway routes to while it runs:
// a YAML file watched for changes, a DNS name re-resolved (A/AAAA, or SRV
// for a _service._proto name), or the EndpointSlices of a Kubernetes
// Service (in its own package, internal/discovery/kubernetes, which
// registers itself: registry.go). Each Source produces the whole desired list each time it
// changes; the gateway reconciles its router with it (adding replicas
// cold, draining removed ones). A source that cannot read its answer (a
// bad file, a failed lookup, a lost watch) keeps the last list it gave:
// replicas are never dropped for the source's own failure.
package discovery

import (
	"context"
	"log/slog"
	"slices"
	"strings"
)

// Replica is one replica as configured: the gateway's ReplicaConfig (the
// config file's replicas: entries and the replicas file's) is this type.
type Replica struct {
	URL string `json:"url"`
	// KVEvents is the replica's KV-event publisher (tcp://host:port), for
	// precise mode: kvgate connects to it (vLLM binds tcp://*:PORT).
	// Static configuration only: discovered replicas use kv_events_listen.
	KVEvents string `json:"kv_events,omitempty"`
	// KVEventsReplay is its replay endpoint (vLLM's replay_endpoint),
	// asked for missed batches at start and after a gap.
	KVEventsReplay string `json:"kv_events_replay,omitempty"`
	// DataParallelSize is the server's data-parallel ranks, each a routing
	// target (0: counted from its metrics when it joins; 1: none).
	DataParallelSize int `json:"data_parallel_size,omitempty"`
	// APIKey is sent upstream as a bearer token (replicas started with --api-key).
	APIKey string `json:"api_key,omitempty"`
	// Role is the replica's part in prefill/decode disaggregation: both
	// (the default: it serves whole requests), prefill (vLLM with
	// kv_role kv_producer or kv_both: it computes prompts for decode
	// replicas to pull) or decode (kv_consumer or kv_both: it pulls a
	// prompt's KV and generates). A fleet with a replica of another role
	// than both is routed in two steps.
	Role string `json:"role,omitempty"`
}

// Source produces the desired replica list.
type Source interface {
	// Name says what the source watches, for logs.
	Name() string
	// Run watches until ctx ends, calling update with the whole list each
	// time it changes (the first time as soon as it is known). update is
	// called from one goroutine at a time.
	Run(ctx context.Context, update func([]Replica))
}

// Sorted is list sorted by URL: sources give lists in a stable order, so
// that an unchanged answer is recognised.
func Sorted(list []Replica) []Replica {
	out := slices.Clone(list)
	slices.SortFunc(out, func(a, b Replica) int { return strings.Compare(a.URL, b.URL) })
	return out
}

func logger(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}
