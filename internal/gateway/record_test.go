package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/workload"
)

var recordEpoch = time.Date(2025, 5, 1, 12, 0, 0, 0, time.UTC)

// testRecorder opens a recorder on a file in a temporary directory, on a
// fake clock, with 16-token blocks.
func testRecorder(t *testing.T, cfg RecordConfig) (*recorder, *clock.Fake, string) {
	t.Helper()
	if cfg.Path == "" {
		cfg.Path = filepath.Join(t.TempDir(), "trace.jsonl")
	}
	d := DefaultRecord()
	cfg.Buffer = max(cfg.Buffer, 1)
	if cfg.MaxIDs == 0 {
		cfg.MaxIDs = d.MaxIDs
	}
	clk := clock.NewFake(recordEpoch)
	r, err := newRecorder(cfg, 16, clk, slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	return r, clk, cfg.Path
}

// counted is a counter's value.
func counted(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

func entry(at time.Duration, tokens int, blocks ...uint64) recordEntry {
	return recordEntry{at: recordEpoch.Add(at), tokens: tokens, output: 5, blocks: blocks, model: "m"}
}

func readLines(t *testing.T, path string) []string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
}

// The line format is pinned: Mooncake's four fields first, then the
// superset; ids number the block hashes by first appearance, a partial last
// block gets an id of its own, sessions are numbered, lengths fall back.
func TestRecordFormat(t *testing.T) {
	r, _, path := testRecorder(t, RecordConfig{Buffer: 8})
	e1 := entry(1500*time.Microsecond, 40, 11, 12) // 2 full blocks and 8 tokens
	e1.session, e1.chat = sessionKey("alice@example.com"), true
	e2 := entry(time.Second, 48, 11, 12, 13) // shares 2 blocks with e1
	e2.output, e2.maxTokens, e2.session = 0, 7, sessionKey("bob")
	e2.tenant, e2.priority = "gold", -1
	e3 := entry(500*time.Millisecond, 32, 11, 14) // arrived before e2, completed after
	e3.output, e3.session, e3.model = 0, sessionKey("alice@example.com"), `m"x`
	e4 := entry(2*time.Second, 0) // no tokens: no line can hold it
	e5 := entry(-time.Second, 16, 11)
	for _, e := range []recordEntry{e1, e2, e3, e4, e5} {
		r.write(e)
	}
	r.close()
	want := []string{
		`{"timestamp":1.5,"input_length":40,"output_length":5,"hash_ids":[0,1,2],"block_size":16,"model":"m","session":0,"chat":true}`,
		`{"timestamp":1000,"input_length":48,"output_length":7,"hash_ids":[0,1,3],"block_size":16,"model":"m","session":1,"chat":false,"tenant":"gold","priority":-1}`,
		`{"timestamp":500,"input_length":32,"output_length":1,"hash_ids":[0,4],"block_size":16,"model":"m\"x","session":0,"chat":false}`,
		`{"timestamp":0,"input_length":16,"output_length":5,"hash_ids":[0],"block_size":16,"model":"m","chat":false}`,
	}
	got := readLines(t, path)
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("got\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	if n := counted(r.emptyDrops); n != 1 {
		t.Fatalf("empty drops %v, want 1", n)
	}
	if n := counted(r.written); n != 4 {
		t.Fatalf("written %v, want 4", n)
	}
	// Readers take it as a trace, sorted by arrival.
	recs, err := workload.ReadTraceFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var at []time.Duration
	for _, rec := range recs {
		at = append(at, rec.Timestamp)
	}
	if fmt.Sprint(at) != "[0s 1.5ms 500ms 1s]" {
		t.Fatalf("timestamps %v", at)
	}
	if rec := recs[1]; rec.BlockSize != 16 || rec.Model != "m" || rec.Session != "0" || !rec.Chat || rec.OutputLength != 5 {
		t.Fatalf("record %+v", rec)
	}
	if recs[3].Tenant != "gold" || recs[3].Priority != -1 {
		t.Fatalf("record %+v: want tenant gold, priority -1", recs[3])
	}
	if recs[2].Model != `m"x` {
		t.Fatalf("model %q", recs[2].Model)
	}
}

func TestAppendMillis(t *testing.T) {
	for d, want := range map[time.Duration]string{0: "0", time.Millisecond: "1", 1500 * time.Microsecond: "1.5",
		time.Microsecond: "0.001", 1520250 * time.Microsecond: "1520.25", 90 * time.Second: "90000", 999: "0"} {
		if got := string(appendMillis(nil, d)); got != want {
			t.Errorf("%v: %s, want %s", d, got, want)
		}
	}
}

// A file rotates before it passes max_bytes; FILE.1 … FILE.keep are kept;
// every file starts its ids and its time anew and reads as a trace alone;
// an existing file is rotated away at start, never appended to.
func TestRecordRotation(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "t.jsonl")
	if err := os.WriteFile(path, []byte("an older recording\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r, clk, _ := testRecorder(t, RecordConfig{Path: path, MaxBytes: 250, Keep: 2, Buffer: 8})
	if b, err := os.ReadFile(path + ".1"); err != nil || string(b) != "an older recording\n" {
		t.Fatalf("the existing file was not rotated to .1: %q, %v", b, err)
	}
	line := len(r.encode(entry(0, 40, 1, 2)))
	r.ids, r.nextID = map[uint64]int{}, 0 // encode numbered them: start clean
	if line*2 > 250 || line*3 <= 250 {
		t.Fatalf("a line is %d bytes: the test wants two per file", line)
	}
	for i := range 7 {
		clk.Advance(time.Second)
		r.write(entry(time.Duration(i+1)*time.Second, 40, uint64(100+i), uint64(200+i)))
	}
	r.close()
	// 7 lines, two per file: the current file holds the 7th, .1 the 5th
	// and 6th, .2 the 3rd and 4th; the first two and the older recording
	// went past keep.
	for k, wantLines := range map[string]int{"": 1, ".1": 2, ".2": 2} {
		recs, err := workload.ReadTraceFile(path + k)
		if err != nil {
			t.Fatal(err)
		}
		if len(recs) != wantLines {
			t.Fatalf("%s: %d records, want %d", k, len(recs), wantLines)
		}
		if fmt.Sprint(recs[0].HashIDs) != "[0 1 2]" {
			t.Fatalf("%s: ids %v: ids must restart in each file", k, recs[0].HashIDs)
		}
		if recs[0].Timestamp != 0 {
			t.Fatalf("%s: first timestamp %v: time restarts at the rotation", k, recs[0].Timestamp)
		}
		// Mode 0600, as docs/bench-replay.md says: the recording names
		// sessions and models, for the gateway's operator only.
		if st, err := os.Stat(path + k); err != nil || st.Mode().Perm() != 0o600 {
			t.Fatalf("%s: mode %v, %v; want 0600", k, st.Mode(), err)
		}
	}
	if _, err := os.Stat(path + ".3"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("keep 2 left a .3: %v", err)
	}
}

// The id table is bounded: when a record would take it past max_ids, the
// file rotates (ids are per file, so the table never has to forget).
func TestRecordMaxIDsRotates(t *testing.T) {
	r, _, path := testRecorder(t, RecordConfig{MaxIDs: 8, Keep: 1, Buffer: 8})
	r.write(entry(0, 48, 1, 2, 3))        // 3 ids
	r.write(entry(0, 48, 1, 2, 4))        // 4 ids
	r.write(entry(0, 48, 5, 6, 7))        // would make 7, plus this record's own: 8 ≤ 8
	r.write(entry(0, 48, 8, 9, 10))       // past 8: rotates
	r.write(entry(0, 40, 8, 9, 11))       // shares with the line before, in the new file
	r.write(entry(0, 16, 8))              // one block
	r.write(entry(0, 33, 8, 9))           // and a partial block
	r.write(entry(0, 64, 20, 21, 22, 23)) // past 8 again: rotates, and the first file is gone (keep 1)
	r.close()
	if len(r.ids) > 8 {
		t.Fatalf("%d ids held, max_ids 8", len(r.ids))
	}
	got := strings.Join(readLines(t, path+".1"), "\n")
	for _, want := range []string{`"hash_ids":[0,1,2]`, `"hash_ids":[0,1,3]`, `"hash_ids":[0]`, `"hash_ids":[0,1,4]`} {
		if !strings.Contains(got, want) {
			t.Fatalf("%s lacks %s", got, want)
		}
	}
	if got := readLines(t, path); len(got) != 1 || !strings.Contains(got[0], `"hash_ids":[0,1,2,3]`) {
		t.Fatalf("current file %q", got)
	}
}

// A full queue drops the record and counts it; a request never waits. After
// the recording ends, records are dropped as closed; the queued ones are
// written at close.
func TestRecordDropsWhenFull(t *testing.T) {
	r, _, path := testRecorder(t, RecordConfig{Buffer: 1})
	x := &exchange{start: recordEpoch, kind: prompt.Chat, req: &policy.Request{Tokens: 20, Blocks: []uint64{1}, Model: "m"}}
	ok := &attempt{v: served, output: 4}
	r.record(x, ok)
	r.record(x, ok) // the writer is not running: the queue holds one
	r.record(x, &attempt{v: failed})
	r.record(x, &attempt{v: clientGone})
	if n := counted(r.full); n != 1 {
		t.Fatalf("dropped (full) %v, want 1", n)
	}
	r.close()
	r.record(x, ok)
	if n := counted(r.late); n != 1 {
		t.Fatalf("dropped (closed) %v, want 1", n)
	}
	if got := readLines(t, path); len(got) != 1 || !strings.Contains(got[0], `"chat":true`) {
		t.Fatalf("lines %q", got)
	}
	var none *recorder
	none.record(x, ok) // no recording: nothing to do
	// run after close returns at once.
	r.run(context.Background())
}

// The queue is bounded by the bytes its records hold as well as by their
// count: each keeps its prompt's block list (8 bytes a block; ~1 MiB for
// an 8 MiB prompt) until the writer takes it, and 4,096 of those behind a
// stalled writer held ~4 GiB. Past buffer_bytes a record is dropped as
// full, and the writer taking one frees its bytes.
func TestRecordQueueBoundedByBytes(t *testing.T) {
	long := &exchange{start: recordEpoch, kind: prompt.Completion,
		req: &policy.Request{Tokens: 16 << 10, Blocks: make([]uint64, 1<<10), Model: "m"}} // 8 KiB of blocks
	e := recordEntry{blocks: long.req.Blocks, model: "m"}
	r, _, path := testRecorder(t, RecordConfig{Buffer: 100, BufferBytes: 3 * e.size()})
	ok := &attempt{v: served, output: 4}
	for range 4 {
		r.record(long, ok)
	}
	if n, q := counted(r.full), len(r.ch); n != 1 || q != 3 {
		t.Fatalf("4 records of %d bytes into %d: %d queued, %v dropped; want 3 queued, 1 dropped (full)", e.size(), r.cfg.BufferBytes, q, n)
	}
	if got := r.queued.Load(); got != 3*e.size() {
		t.Fatalf("queued bytes %d, want %d", got, 3*e.size())
	}
	r.dequeued(<-r.ch) // the writer takes one: room for one more
	r.record(long, ok)
	r.record(long, ok)
	if n, q := counted(r.full), len(r.ch); n != 2 || q != 3 {
		t.Fatalf("after the writer took one: %d queued, %v dropped; want 3 queued, 2 dropped", q, n)
	}
	r.close()
	if got, q := readLines(t, path), r.queued.Load(); len(got) != 4 || q != 0 {
		t.Fatalf("%d lines written, %d bytes still counted queued; want 4 and 0", len(got), q)
	}
	// 0 is the default bound.
	if r, _, _ := testRecorder(t, RecordConfig{}); r.cfg.BufferBytes != DefaultRecord().BufferBytes {
		t.Fatalf("buffer_bytes 0: %d, want the default", r.cfg.BufferBytes)
	}
}

// A file that cannot be written costs its records (counted), and the writer
// tries a new file after recordRetryAfter.
func TestRecordWriteErrorReopens(t *testing.T) {
	r, clk, path := testRecorder(t, RecordConfig{Buffer: 4, Keep: 3})
	r.write(entry(0, 16, 1))
	_ = r.f.Close() // the disk goes away under the writer
	r.flush()
	if r.f != nil {
		t.Fatal("a failed flush kept the file")
	}
	r.write(entry(0, 16, 2))
	if n := counted(r.writeErrors); n != 1 {
		t.Fatalf("write errors %v, want 1", n)
	}
	clk.Advance(recordRetryAfter)
	r.write(entry(0, 16, 3))
	r.close()
	if got := readLines(t, path); len(got) != 1 || !strings.Contains(got[0], `"hash_ids":[0]`) {
		t.Fatalf("after the reopen: %q", got)
	}
	if n := counted(r.written); n != 2 {
		t.Fatalf("written %v, want 2", n)
	}
}

func TestRecordConfig(t *testing.T) {
	cfg, err := ParseConfig([]byte("replicas: [{url: 'http://a:1'}]\nrecord: {path: /tmp/x.jsonl, keep: 2}\n"))
	if err != nil {
		t.Fatal(err)
	}
	d := DefaultRecord()
	if cfg.Record.Path != "/tmp/x.jsonl" || cfg.Record.Keep != 2 || cfg.Record.MaxBytes != d.MaxBytes || cfg.Record.Buffer != d.Buffer ||
		cfg.Record.BufferBytes != d.BufferBytes {
		t.Fatalf("record %+v: unset keys keep their defaults", cfg.Record)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"buffer: 0", "keep: -1", "max_bytes: -5", "max_ids: 0", "buffer_bytes: -1"} {
		c, err := ParseConfig([]byte("replicas: [{url: 'http://a:1'}]\nrecord: {path: x, " + bad + "}\n"))
		if err != nil {
			t.Fatal(err)
		}
		key := strings.SplitN(bad, ":", 2)[0]
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "record."+key) {
			t.Errorf("%s: %v", bad, err)
		}
	}
	// Without a path the rest is not checked: recording is off.
	c := baseConfig("http://a:1")
	c.Record.Buffer = 0
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	c.Record.Path = filepath.Join(t.TempDir(), "missing-dir", "x.jsonl")
	c.Record.Buffer = 8
	if _, err := New(c, Options{}); err == nil || !strings.Contains(err.Error(), "record:") {
		t.Fatalf("an unwritable path: %v", err)
	}
}

// Through the gateway: one line per request served, written by the writer
// Run owns and flushed when Run ends; the prompts' text is nowhere in it.
func TestRecordThroughGateway(t *testing.T) {
	a := newFakeReplica(t)
	path := filepath.Join(t.TempDir(), "traffic.jsonl")
	cfg := baseConfig(a.srv.URL)
	cfg.Record.Path = path
	cfg.Retries = 0
	reg := prometheus.NewRegistry()
	g, err := New(cfg, Options{Registry: reg})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(g.Handler())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); g.Run(ctx) }()
	defer func() { srv.Close(); cancel(); <-done }()
	eventually(t, "the replica in rotation", func() bool { return g.Router().Replica(0).Ready() })

	secret := "the quick brown fox jumps over the lazy dog while counting secret words "
	long := strings.Repeat(secret, 8) // 576 bytes: 144 tokens, 9 blocks
	bodies := []struct{ path, body, session string }{
		{"/v1/completions", `{"model":"m","prompt":"` + long + `","max_tokens":3}`, "s-1"},
		{"/v1/completions", `{"model":"m","prompt":"` + long + `tail","max_tokens":3,"stream":true}`, "s-1"},
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"system","content":"` + long + `"},{"role":"user","content":"hi"}]}`, ""},
	}
	for _, b := range bodies {
		var hdr []string
		if b.session != "" {
			hdr = []string{"X-Session-Id", b.session}
		}
		if resp, body := post(t, srv.URL+b.path, b.body, hdr...); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", b.path, resp.StatusCode, body)
		}
	}
	// Not served: not recorded.
	if resp, _ := post(t, srv.URL+"/v1/completions", `{"model":"nope","prompt":"x"}`); resp.StatusCode != 404 {
		t.Fatalf("unknown model: %d", resp.StatusCode)
	}
	a.status.Store(500)
	if resp, _ := post(t, srv.URL+"/v1/completions", `{"model":"m","prompt":"`+long+`"}`); resp.StatusCode != 500 {
		t.Fatalf("failing replica: %d", resp.StatusCode)
	}
	srv.Close()
	cancel()
	<-done // Run flushed and closed the recording

	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range strings.Fields(secret + " hi tail") {
		if strings.Contains(string(data), w) {
			t.Fatalf("the recording holds the prompt's word %q:\n%s", w, data)
		}
	}
	lines := readLines(t, path)
	if len(lines) != 3 {
		t.Fatalf("%d lines, want 3 (one per request served):\n%s", len(lines), data)
	}
	var recs []map[string]any
	for _, l := range lines {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatal(err)
		}
		recs = append(recs, m)
	}
	if recs[0]["input_length"] != 144.0 || recs[0]["output_length"] != 3.0 || recs[0]["session"] != 0.0 ||
		recs[0]["chat"] != false || recs[0]["model"] != "m" || recs[0]["block_size"] != 16.0 {
		t.Fatalf("first line %v", recs[0])
	}
	if fmt.Sprint(recs[0]["hash_ids"]) != "[0 1 2 3 4 5 6 7 8]" || fmt.Sprint(recs[1]["hash_ids"]) != "[0 1 2 3 4 5 6 7 8 9]" {
		t.Fatalf("the second prompt extends the first: %v then %v", recs[0]["hash_ids"], recs[1]["hash_ids"])
	}
	if recs[1]["session"] != 0.0 || recs[2]["chat"] != true {
		t.Fatalf("session and chat: %v, %v", recs[1], recs[2])
	}
	if _, ok := recs[2]["session"]; ok {
		t.Fatal("a request without a session has none recorded")
	}
	if _, err := workload.ReadTraceFile(path); err != nil {
		t.Fatal(err)
	}
	if n := counterValue(t, reg, "kvgate_record_written_total", nil); n != 3 {
		t.Fatalf("kvgate_record_written_total %v", n)
	}
	if n := counterValue(t, reg, "kvgate_record_dropped_total", map[string]string{"reason": "full"}); n != 0 {
		t.Fatalf("kvgate_record_dropped_total{reason=full} %v", n)
	}
}

// kvgate_record_queued_bytes is what the records waiting for the writer
// hold (the bound record.buffer_bytes applies to), back to 0 once written.
func TestRecordQueuedBytesGauge(t *testing.T) {
	reg := prometheus.NewRegistry()
	cfg := DefaultRecord()
	cfg.Path = filepath.Join(t.TempDir(), "trace.jsonl")
	r, err := newRecorder(cfg, 16, clock.NewFake(recordEpoch), slog.New(slog.DiscardHandler), reg)
	if err != nil {
		t.Fatal(err)
	}
	x := &exchange{start: recordEpoch, kind: prompt.Completion,
		req: &policy.Request{Tokens: 16 << 10, Blocks: make([]uint64, 1<<10), Model: "m"}}
	size := (&recordEntry{blocks: x.req.Blocks, model: "m"}).size()
	r.record(x, &attempt{v: served, output: 4})
	r.record(x, &attempt{v: served, output: 4})
	if got := counterValue(t, reg, "kvgate_record_queued_bytes", nil); got != float64(2*size) {
		t.Fatalf("kvgate_record_queued_bytes %v with 2 records of %d bytes queued", got, size)
	}
	r.close()
	if got := counterValue(t, reg, "kvgate_record_queued_bytes", nil); got != 0 {
		t.Fatalf("kvgate_record_queued_bytes %v once written", got)
	}
}
