package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/fleet"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/workload"
)

// Sample is one reading of a gateway's own process metrics during a soak.
type Sample struct {
	At         time.Duration `json:"at_ns"`
	Goroutines float64       `json:"goroutines"`
	HeapBytes  float64       `json:"heap_bytes"`
	RSSBytes   float64       `json:"rss_bytes"`
	Requests   int           `json:"requests"`
	Errors     int           `json:"errors"`
}

// Soak repeats rounds of requests (round k uses gen(k), so prompts keep
// changing and the gateway's structures keep being filled) until duration
// has passed, reading the target's /metrics (go_goroutines,
// go_memstats_heap_inuse_bytes, process_resident_memory_bytes) every
// interval. It returns the readings and every round's records.
func Soak(ctx context.Context, cfg Config, gen func(round int) ([]workload.Request, error), duration, interval time.Duration) ([]Sample, []report.Record, error) {
	if interval <= 0 {
		interval = 10 * time.Second
	}
	if cfg.Client == nil {
		// One client for every round: a gateway's connection count then
		// reflects its own behaviour, not abandoned client connections.
		cfg.Client = NewClient()
		defer cfg.Client.CloseIdleConnections()
	}
	cfg.MaxDuration = duration
	ctx, cancel := context.WithTimeout(ctx, duration)
	defer cancel()
	s := &soaker{cfg: cfg, start: time.Now()}
	s.sample()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() { s.sampleEvery(interval, stop) }) // a reading every interval, whatever the rounds do
	all, genErr := s.rounds(ctx, gen)
	close(stop)
	wg.Wait()
	s.sample()
	return s.samples, all, genErr
}

// soaker is one soak's readings and request counts.
type soaker struct {
	cfg        Config
	start      time.Time
	done, errs atomic.Int64

	mu      sync.Mutex
	samples []Sample
}

// sample takes one reading (none when the target's metrics do not answer).
func (s *soaker) sample() {
	x, err := scrape(s.cfg.Client, s.cfg.Target)
	if err != nil {
		return
	}
	x.At, x.Requests, x.Errors = time.Since(s.start), int(s.done.Load()), int(s.errs.Load())
	s.mu.Lock()
	s.samples = append(s.samples, x)
	s.mu.Unlock()
}

// sampleEvery takes a reading every interval until stop is closed.
func (s *soaker) sampleEvery(interval time.Duration, stop <-chan struct{}) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			s.sample()
		}
	}
}

// rounds runs round after round until ctx ends or gen fails, and returns
// every record but those cut by the end of the soak.
func (s *soaker) rounds(ctx context.Context, gen func(round int) ([]workload.Request, error)) ([]report.Record, error) {
	var all []report.Record
	for round := 0; ctx.Err() == nil; round++ {
		reqs, err := gen(round)
		if err != nil {
			return all, err
		}
		c := s.cfg
		c.Progress = func(int, int) { s.done.Add(1) }
		recs, _, _ := Run(ctx, c, reqs)
		for _, r := range recs {
			if r.Err && (r.ErrKind == "not_sent" || r.ErrKind == "canceled") {
				continue // cut by the end of the soak
			}
			if r.Err {
				s.errs.Add(1)
			}
			all = append(all, r)
		}
	}
	return all, nil
}

func scrape(c *http.Client, target string) (Sample, error) {
	if c == nil {
		c = http.DefaultClient
	}
	resp, err := c.Get(strings.TrimRight(target, "/") + "/metrics")
	if err != nil {
		return Sample{}, err
	}
	defer resp.Body.Close()
	fams, err := fleet.ParseText(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return Sample{}, fmt.Errorf("soak: %s/metrics: %w", target, err)
	}
	get := func(name string) float64 {
		f, ok := fams[name]
		if !ok || len(f.GetMetric()) == 0 {
			return 0
		}
		m := f.GetMetric()[0]
		switch {
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Untyped != nil:
			return m.Untyped.GetValue()
		}
		return 0
	}
	return Sample{Goroutines: get("go_goroutines"), HeapBytes: get("go_memstats_heap_inuse_bytes"),
		RSSBytes: get("process_resident_memory_bytes")}, nil
}

// WriteSoak prints the soak readings as a table.
func WriteSoak(w io.Writer, samples []Sample) {
	fmt.Fprintf(w, "%10s  %10s  %10s  %10s  %9s  %7s\n", "elapsed", "goroutines", "heap MiB", "rss MiB", "requests", "errors")
	for _, s := range samples {
		fmt.Fprintf(w, "%10s  %10.0f  %10.1f  %10.1f  %9d  %7d\n", s.At.Round(time.Second), s.Goroutines,
			s.HeapBytes/(1<<20), s.RSSBytes/(1<<20), s.Requests, s.Errors)
	}
}
