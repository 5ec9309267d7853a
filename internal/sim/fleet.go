// Package sim runs simulated vLLM replicas over HTTP: the same OpenAI API
// (completions and chat, streamed or not), the same Prometheus metrics and
// the same ZMQ KV events as vLLM, with latency from the engine model
// (internal/engine) so that it responds to prefix-cache hits and load as a
// real replica does. It is what `kvgate sim` serves and what tests and
// `kvgate bench --embedded` start in-process.
//
// Each engine core's driver goroutine steps its engine in virtual time, which
// runs TimeScale times faster than the wall clock; see core.drive. A replica
// has one core, or one per data-parallel rank (Config.DataParallelSize).
package sim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"sync"
)

// Fleet is a set of replicas started together.
type Fleet struct {
	cfg      Config
	tl       *Timeline
	replicas []*Replica
	stop     func() bool

	closeOnce sync.Once
	closeErr  error
}

// Start validates cfg, binds every replica's listener (replica i on
// Host:(Port+i), or an ephemeral port when Port is 0) and KV-event sockets
// (see Config.KVEvents), and starts them. The fleet stops when ctx ends or Close or Shutdown is
// called; either way Close/Shutdown waits for all its goroutines.
func Start(ctx context.Context, cfg Config) (*Fleet, error) {
	cfg = cfg.withDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	f := &Fleet{cfg: cfg, tl: NewTimeline(cfg.Clock, cfg.TimeScale, cfg.Elastic)}
	for i := range cfg.Replicas {
		port := 0
		if cfg.Port > 0 {
			port = cfg.Port + i
		}
		var lc net.ListenConfig
		ln, err := lc.Listen(ctx, "tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(port)))
		if err != nil {
			f.closeStarted()
			return nil, fmt.Errorf("sim: replica %d: %w", i, err)
		}
		r, err := newReplica(ctx, cfg.forReplica(i), i, ln, f.tl)
		if err != nil {
			_ = ln.Close()
			f.closeStarted()
			return nil, err
		}
		f.replicas = append(f.replicas, r)
	}
	for _, r := range f.replicas {
		r.run()
	}
	f.stop = context.AfterFunc(ctx, func() { _ = f.Close() })
	return f, nil
}

// closeStarted undoes a partial Start: replicas built but not running.
func (f *Fleet) closeStarted() {
	for _, r := range f.replicas {
		r.sideCancel()
		_ = r.ln.Close()
		_ = r.closeKVEvents()
	}
}

// Timeline is the fleet's model time, which a load generator in the same
// process paces itself by (see Timeline).
func (f *Fleet) Timeline() *Timeline { return f.tl }

// Replicas are the fleet's replicas in index order.
func (f *Fleet) Replicas() []*Replica { return f.replicas }

// URLs are the replicas' base URLs in index order.
func (f *Fleet) URLs() []string {
	out := make([]string, len(f.replicas))
	for i, r := range f.replicas {
		out[i] = r.URL()
	}
	return out
}

// KVEndpoints are the replicas' KV-event endpoints in index order, each
// its rank 0's (Replica.KVEndpoint; empty strings without KV events and in
// connect mode).
func (f *Fleet) KVEndpoints() []string {
	out := make([]string, len(f.replicas))
	for i, r := range f.replicas {
		out[i] = r.KVEndpoint()
	}
	return out
}

// KVReplayEndpoints are the replicas' replay endpoints in index order, each
// its rank 0's (Replica.KVReplayEndpoint; empty strings without replay
// sockets).
func (f *Fleet) KVReplayEndpoints() []string {
	out := make([]string, len(f.replicas))
	for i, r := range f.replicas {
		out[i] = r.KVReplayEndpoint()
	}
	return out
}

// Config is the fleet's effective configuration (defaults filled); a
// replica's own, with its PerReplica override, is Replica.Config.
func (f *Fleet) Config() Config { return f.cfg }

// Shutdown stops the fleet gracefully: listeners close at once, in-flight
// requests run to completion until ctx ends, then everything is cut. It
// waits for every goroutine.
func (f *Fleet) Shutdown(ctx context.Context) error {
	f.closeOnce.Do(func() {
		if f.stop != nil {
			f.stop()
		}
		errs := make([]error, len(f.replicas))
		var wg sync.WaitGroup
		for i, r := range f.replicas {
			wg.Go(func() { errs[i] = r.shutdown(ctx) })
		}
		wg.Wait()
		f.closeErr = errors.Join(errs...)
	})
	return f.closeErr
}

// Close stops the fleet at once, cutting in-flight requests.
func (f *Fleet) Close() error {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return f.Shutdown(ctx)
}
