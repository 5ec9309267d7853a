package sharedstate

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/testutil"
)

// The red team's finding 7 at full size (KVGATE_HUGE=1: it puts 400 MiB in
// Redis, twice): a 400 MiB entry between two good ones, default caps, read
// by two gateways at their warm loads and then live, with both readers
// blocked on the stream when it comes. It reports how long the readers
// took to go past it and the most heap they held meanwhile (over the
// test's own copy of the entry).
func TestHugeEntryLive(t *testing.T) {
	if os.Getenv("KVGATE_HUGE") == "" {
		t.Skip("400 MiB in Redis: KVGATE_HUGE=1")
	}
	url := testutil.StartRedis(t)
	rc := adminClient(t, url)
	huge := bytes.Repeat([]byte{1}, 400<<20)
	add := func() {
		if err := rc.XAdd(context.Background(), &redis.XAddArgs{Stream: "t:batches", Values: []any{fieldBatch, huge}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	ghost(t, url, "t", "", ghostBatch("p", "http://r0", 1, 10))
	add()
	ghost(t, url, "t", "", ghostBatch("p", "http://r1", 1, 11))
	peak := heapPeak(t)
	reg := prometheus.NewRegistry()
	quietly := func(o *Options) { o.Log = slog.New(slog.DiscardHandler) }
	t0 := time.Now()
	a := newGateway(t, url, "t", true, withRegistry(reg, quietly))
	b := newGateway(t, url, "t", true, quietly)
	testutil.Eventually(t, time.Minute, "the entry after the huge one", func() bool {
		return a.rt.Index().Holds(1, 11) && b.rt.Index().Holds(1, 11)
	})
	t.Logf("warm loads: past a 400 MiB entry in %v (two Starts); peak heap %d MiB", time.Since(t0).Round(time.Millisecond), peak.Load()>>20)
	peak.Store(0)
	t1 := time.Now()
	add()
	ghost(t, url, "t", "", ghostBatch("p", "http://r2", 1, 12))
	testutil.Eventually(t, time.Minute, "the entry after the live huge one", func() bool {
		return a.rt.Index().Holds(2, 12) && b.rt.Index().Holds(2, 12)
	})
	t.Logf("live: both readers past a 400 MiB entry %v after it was written (the write included); peak heap %d MiB; dropped{entry_size} at a: %v",
		time.Since(t1).Round(time.Millisecond), peak.Load()>>20, dropped(t, reg, "entry_size"))
	runtime.KeepAlive(huge)
}

// heapPeak follows the heap in use above what it is now, every
// millisecond until the test ends, and keeps the largest.
func heapPeak(t *testing.T) *atomic.Uint64 {
	runtime.GC()
	var ms0 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	var peak atomic.Uint64
	stop, done := make(chan struct{}), make(chan struct{})
	t.Cleanup(func() { close(stop); <-done })
	go func() {
		defer close(done)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				if d := ms.HeapAlloc - min(ms.HeapAlloc, ms0.HeapAlloc); d > peak.Load() {
					peak.Store(d)
				}
			}
		}
	}()
	return &peak
}
