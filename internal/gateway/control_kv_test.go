package gateway

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

// The precise index's state is observable: batches, drops by reason (each
// cause logged once), gaps, sync and size, per replica.
func TestKVEventMetrics(t *testing.T) {
	cfg := baseConfig("http://127.0.0.1:1")
	cfg.Replicas[0].KVEvents = "tcp://127.0.0.1:2"
	cfg.Tokenizer = "remote"
	var logs bytes.Buffer
	g, err := New(cfg, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	url := g.rt.URL(0)
	ids := prompt.Approx{}.Encode(nil, strings.Repeat("abcd", 32)) // 32 tokens: 2 blocks of 16
	seq := uint64(0)
	stored := func(bs int, parent *uint64) kvevents.Message {
		defer func() { seq++ }()
		return kvevents.Message{Topic: "kv@127.0.0.1:1@m", Seq: seq, Batch: kvevents.Batch{Events: []kvevents.Event{
			&kvevents.BlockStored{BlockHashes: []uint64{1, 2}[:max(32/bs, 1)], ParentBlockHash: parent, TokenIDs: ids, BlockSize: bs}}}}
	}
	ctx := context.Background()
	ctlOf(g).onKVMessage(ctx, 0, stored(16, nil)) // from the start: in sync
	if counterValue(t, g.reg, "kvgate_kv_events_synced", nil) != 1 || counterValue(t, g.reg, "kvgate_precise_index_blocks", nil) != 2 {
		t.Fatal("a stream followed from its first batch must be in sync, with its 2 blocks indexed")
	}
	unknown := uint64(99)
	for range 3 {
		ctlOf(g).onKVMessage(ctx, 0, stored(24, nil))      // 24-token blocks under an index of 16
		ctlOf(g).onKVMessage(ctx, 0, stored(16, &unknown)) // a child of a block stored before we listened
	}
	seq += 3 // three batches lost
	ctlOf(g).onKVMessage(ctx, 0, kvevents.Message{Topic: "kv@127.0.0.1:1@m", Seq: seq})
	reg := g.reg
	if n := counterValue(t, reg, "kvgate_kv_events_batches_total", map[string]string{"replica": url}); n != 8 {
		t.Fatalf("%v batches, want 8", n)
	}
	for reason, want := range map[string]float64{"block_size": 3, "unknown_parent": 3} {
		if n := counterValue(t, reg, "kvgate_kv_events_dropped_total", map[string]string{"replica": url, "reason": reason}); n != want {
			t.Fatalf("%v drops for %s, want %v", n, reason, want)
		}
		if c := strings.Count(logs.String(), "reason="+reason); c != 1 {
			t.Fatalf("%s logged %d times, want once:\n%s", reason, c, logs.String())
		}
	}
	if n := counterValue(t, reg, "kvgate_kv_events_gaps_total", nil); n != 1 {
		t.Fatalf("%v gaps", n)
	}
	if n := counterValue(t, reg, "kvgate_kv_events_synced", nil); n != 0 {
		t.Fatalf("synced %v after a gap, want 0", n)
	}
	if n := counterValue(t, reg, "kvgate_precise_index_blocks", nil); n != 2 {
		t.Fatalf("%v precise blocks after the gap, want the 2 reported before it", n)
	}
}

// A replica configured for KV events that sends none for a minute is
// warned about once; when its events come back, that is noted once.
func TestKVSilenceWarnedOnce(t *testing.T) {
	cfg := baseConfig("http://127.0.0.1:1")
	cfg.Replicas[0].KVEvents = "tcp://127.0.0.1:2"
	cfg.Tokenizer = "remote"
	var logs syncLog
	clk := clock.NewFake(time.Time{})
	g, err := New(cfg, Options{Clock: clk, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	g.rt.Replica(0).KVStart(clk.Now())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); ctlOf(g).watchKVSilence(ctx) }()
	defer func() { cancel(); <-done }()
	step := func(d time.Duration) { // the watcher has armed its ticker: advance
		t.Helper()
		if !clk.WaitTimers(1, 5*time.Second) {
			t.Fatal("watcher not waiting")
		}
		clk.Advance(d)
	}
	step(45 * time.Second)
	if strings.Contains(logs.String(), "none received") {
		t.Fatal("warned before a minute of silence")
	}
	for range 8 { // two minutes more: one warning only
		step(15 * time.Second)
	}
	testutil.Eventually(t, 5*time.Second, "the warning", func() bool { return strings.Contains(logs.String(), "none received") })
	ctlOf(g).onKVMessage(ctx, 0, kvevents.Message{Topic: "kv@127.0.0.1:1@m", Seq: 7})
	step(15 * time.Second)
	testutil.Eventually(t, 5*time.Second, "the note", func() bool { return strings.Contains(logs.String(), "arriving again") })
	if n := strings.Count(logs.String(), "none received"); n != 1 {
		t.Fatalf("warned %d times", n)
	}
}

// syncLog is a log sink safe for the watcher's goroutine and the test.
type syncLog struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *syncLog) Write(p []byte) (int, error) { l.mu.Lock(); defer l.mu.Unlock(); return l.b.Write(p) }
func (l *syncLog) String() string              { l.mu.Lock(); defer l.mu.Unlock(); return l.b.String() }
