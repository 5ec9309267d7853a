package sim

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// BenchmarkFleet16 measures what one process of simulated replicas sustains:
// 16 replicas at --time-scale 1000, 64 concurrent keep-alive clients (a
// bounded pool), each request a 256-token prompt sharing a 128-token system
// prefix with others, 16 output tokens (ignore_eos), spread round robin.
// It reports requests/s in total. Run with e.g. -benchtime=4000x. The
// kv-events case publishes every step's events (with no subscriber the
// publisher still encodes each batch).
func BenchmarkFleet16(b *testing.B) {
	for _, tc := range []struct {
		name             string
		stream, kvEvents bool
	}{
		{"non-streamed", false, false},
		{"streamed", true, false},
		{"streamed+kv-events", true, true},
	} {
		stream := tc.stream
		b.Run(tc.name, func(b *testing.B) {
			const replicas, clients = 16, 64
			f := startFleet(b, Config{Replicas: replicas, TimeScale: 1000, Seed: 1, KVEvents: tc.kvEvents})
			tr := &http.Transport{MaxIdleConnsPerHost: clients, MaxIdleConns: 2 * clients}
			defer tr.CloseIdleConnections()
			c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
			urls := f.URLs()
			bodies := make([]string, 256)
			for i := range bodies {
				text := words(fmt.Sprintf("s%02d", i%8), 128) + words(fmt.Sprintf("u%02d", i%100), 128)
				bodies[i] = fmt.Sprintf(`{"model":"sim-llama-8b","prompt":%s,"max_tokens":16,"ignore_eos":true,"stream":%v}`,
					jsonString(text), stream)
			}
			var next, failed atomic.Int64
			var firstErr atomic.Value
			b.ResetTimer()
			start := time.Now()
			var wg sync.WaitGroup
			for range clients {
				wg.Go(func() {
					for {
						i := next.Add(1) - 1
						if i >= int64(b.N) {
							return
						}
						r, err := c.Post(urls[i%replicas]+"/v1/completions", "application/json",
							strings.NewReader(bodies[i%int64(len(bodies))]))
						if err == nil {
							_, err = io.Copy(io.Discard, r.Body)
							r.Body.Close()
							if err == nil && r.StatusCode != http.StatusOK {
								err = fmt.Errorf("status %d", r.StatusCode)
							}
						}
						if err != nil {
							failed.Add(1)
							firstErr.CompareAndSwap(nil, err)
						}
					}
				})
			}
			wg.Wait()
			elapsed := time.Since(start)
			b.StopTimer()
			if n := failed.Load(); n > 0 {
				b.Fatalf("%d requests failed, first: %v", n, firstErr.Load())
			}
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "req/s")
		})
	}
}
