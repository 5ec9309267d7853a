package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/prompt"
)

// RecordConfig: `kvgate serve --record FILE` writes a trace of the traffic it
// serves, which `kvgate replay --trace FILE` replays against every policy:
// a bake-off on the user's own traffic. It holds block hashes and lengths,
// never text.
//
// The file is JSON lines in Mooncake's trace format (shared/traces/README.md)
// and a superset of it. One line per request a replica served (verdict
// served), written when it completed:
//
//	{"timestamp":1520.25,"input_length":812,"output_length":128,"hash_ids":[0,1,2,...,50],"block_size":16,"model":"llama-3-8b","session":3,"chat":true}
//
// The fields:
//
//   - timestamp: the request's arrival at the gateway, in milliseconds
//     (to the microsecond) since the file was started. A request in flight
//     across a rotation is stamped 0.
//   - input_length: the prompt's tokens as the gateway counted them (its
//     tokenizer: approx, or the replicas' own with tokenizer: remote).
//   - output_length: the usage's completion_tokens, else max_tokens, at least 1.
//   - hash_ids: the prompt's blocks of block_size tokens, ceil(input_length /
//     block_size) of them, as small integers: the gateway's chained block
//     hashes (model, adapter and cache_salt at the root) numbered in order of
//     first appearance in the file, so that two requests whose first k ids are
//     equal share their first k × block_size tokens, and only then. A
//     partial last block gets an id of its own that nothing else shares
//     (engines cache full blocks only).
//   - block_size: tokens per hash id: the gateway's block_size (16 by
//     default; Mooncake's is 512). Readers take 512 when it is absent.
//   - model: the model the request named (an adapter is served under its own name).
//   - session: the request's program (prompt_cache_key, a session header,
//     its Responses chain: program.go), else the body's "user", as a
//     number per distinct session in the file; absent when none. A replay
//     of the file takes it as the program id (as X-Session-Id).
//   - chat: true for /v1/chat/completions and /v1/messages (which vLLM runs
//     as the chat it converts the call to), false for /v1/completions.
//   - tenant, priority: the request's tenant (from its key) and its
//     priority band, with tenants configured; absent when none and 0.
//
// Lines are in completion order, not arrival order; readers sort them by
// timestamp. Ids and session numbers are per file: the tables are reset
// when the file rotates (past max_bytes, or when they hold max_ids
// entries), so every file is a trace on its own. FILE is the current file,
// FILE.1 the one before, up to FILE.keep; an existing FILE is rotated away
// at start, never appended to. Files are created with mode 0600.
//
// Lines are written off the request path: settle hands each served request
// to a bounded queue that one writer drains; when the queue is full the
// record is dropped and counted (kvgate_record_dropped_total{reason="full"}),
// and a request never waits. The queue holds each request's block hashes
// (8 bytes per block: about 1 MiB for an 8 MiB prompt) until they are
// written, so it is bounded twice: buffer records, and buffer_bytes of them
// (recordEntry.size); without the second a stalled writer held 4,096 long
// prompts' blocks, about 4 GiB. The writer flushes every second and when
// the gateway stops (Run's context ends, after the drain in `kvgate serve`).
//
// RecordConfig configures the recording (config key "record"; the flag
// --record FILE sets its path).
type RecordConfig struct {
	// Path is the trace file ("": no recording).
	Path string `json:"path,omitempty"`
	// MaxBytes rotates the file before it passes this size (0: never).
	MaxBytes int64 `json:"max_bytes"`
	// Keep is how many rotated files are kept: FILE.1 … FILE.keep.
	Keep int `json:"keep"`
	// Buffer is how many records may wait for the writer; past it they are dropped.
	Buffer int `json:"buffer"`
	// BufferBytes is how many bytes the records waiting for the writer may
	// hold (their block hashes, 8 bytes a block); past it they are dropped
	// (0: DefaultRecord's).
	BufferBytes int64 `json:"buffer_bytes"`
	// MaxIDs bounds the file's tables of block hashes and sessions: at the
	// bound the file rotates, so that ids stay per file.
	MaxIDs int `json:"max_ids"`
}

// DefaultRecord is the recording's defaults: rotate at 256 MiB, keep 4
// rotated files, 4096 records queued and 64 MiB of them (4,096 prompts of
// 32k tokens; 64 of 8 MiB of text), 2M ids per file (about 50 MB of table).
func DefaultRecord() RecordConfig {
	return RecordConfig{MaxBytes: 256 << 20, Keep: 4, Buffer: 4096, BufferBytes: 64 << 20, MaxIDs: 1 << 21}
}

// maxRecordBuffer and maxRecordKeep bound the queue and the rotated files.
const (
	maxRecordBuffer = 1 << 20
	maxRecordKeep   = 1000
)

func (c *RecordConfig) validate() []error {
	if c.Path == "" {
		return nil
	}
	var errs []error
	if c.MaxBytes < 0 {
		errs = append(errs, keyErr("record.max_bytes", "%d: want ≥ 0 (0: never rotate)", c.MaxBytes))
	}
	if c.Keep < 0 || c.Keep > maxRecordKeep {
		errs = append(errs, keyErr("record.keep", "%d: want 0 to %d", c.Keep, maxRecordKeep))
	}
	if c.Buffer < 1 || c.Buffer > maxRecordBuffer {
		errs = append(errs, keyErr("record.buffer", "%d: want 1 to %d", c.Buffer, maxRecordBuffer))
	}
	if c.BufferBytes < 0 {
		errs = append(errs, keyErr("record.buffer_bytes", "%d: want ≥ 0 (0: the default, %d)", c.BufferBytes, DefaultRecord().BufferBytes))
	}
	if c.MaxIDs < 1 {
		errs = append(errs, keyErr("record.max_ids", "%d: want ≥ 1", c.MaxIDs))
	}
	return errs
}

// recordEntry is what settle hands the writer: no text, only the routing
// key's hashes and lengths.
type recordEntry struct {
	at        time.Time
	tokens    int
	output    int
	maxTokens int
	blocks    []uint64
	model     string
	// session is the hash of the request's session (sessionKey; 0: none):
	// a client's string (a body's user, up to the body's size) is not kept
	// in the queue or the file's table.
	session uint64
	chat    bool
	// tenant and priority are the request's tenant and band (tenants.go;
	// "" and 0 without tenants), written when set.
	tenant   string
	priority int
}

// recordEntryBytes is what a recordEntry holds beyond its strings and blocks.
const recordEntryBytes = 96

// size is the memory e keeps while it waits for the writer: its blocks'
// array (shared with the request, kept alive whole), its strings and
// itself.
func (e *recordEntry) size() int64 {
	return int64(cap(e.blocks))*8 + int64(len(e.model)+len(e.tenant)) + recordEntryBytes
}

// Reasons of kvgate_record_dropped_total.
const (
	dropFull       = "full"        // the writer's queue was full
	dropClosed     = "closed"      // the recording had ended (the gateway stopped)
	dropWriteError = "write_error" // the file could not be written
	dropEmpty      = "empty"       // a prompt of no tokens (no trace line can hold it)
)

// recordFlushEvery is how often the writer flushes its buffer.
const recordFlushEvery = time.Second

// recordRetryAfter is how long the writer waits, after a failed write, before
// it opens a new file.
const recordRetryAfter = 10 * time.Second

// recorder writes the recording. record runs on the request path; every
// other method runs in the writer goroutine (run), or before it starts.
type recorder struct {
	cfg       RecordConfig
	blockSize int
	clock     clock.Clock
	log       *slog.Logger

	ch     chan recordEntry
	mu     sync.RWMutex // closed, against sends after the final drain
	closed bool
	// queued is the bytes the records in ch hold (recordEntry.size), at
	// most cfg.BufferBytes.
	queued atomic.Int64

	written                             prometheus.Counter
	full, late, writeErrors, emptyDrops prometheus.Counter

	// The writer's own state.
	f        *os.File
	w        *bufio.Writer
	size     int64
	origin   time.Time
	ids      map[uint64]int
	sessions map[uint64]int
	nextID   int
	models   map[string][]byte // JSON-quoted model names
	line     []byte
	failedAt time.Time // the last write error (zero: none since the file opened)
}

// newRecorder opens the recording (rotating an existing file away) and
// registers its metrics. The writer starts with run.
func newRecorder(cfg RecordConfig, blockSize int, clk clock.Clock, log *slog.Logger, reg prometheus.Registerer) (*recorder, error) {
	if cfg.BufferBytes <= 0 {
		cfg.BufferBytes = DefaultRecord().BufferBytes
	}
	r := &recorder{cfg: cfg, blockSize: blockSize, clock: clk, log: log, ch: make(chan recordEntry, cfg.Buffer),
		models: map[string][]byte{}}
	if err := r.open(); err != nil {
		return nil, fmt.Errorf("record: %w", err)
	}
	dropped := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_record_dropped_total",
		Help: "Served requests left out of the recording (--record), by reason: full (the writer's queue held record.buffer " +
			"records or record.buffer_bytes of them), " +
			"closed (the recording had ended), write_error, empty (a prompt of no tokens)."}, []string{"reason"})
	r.written = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_record_written_total",
		Help: "Requests written to the recording (--record)."})
	r.full, r.late = dropped.WithLabelValues(dropFull), dropped.WithLabelValues(dropClosed)
	r.writeErrors, r.emptyDrops = dropped.WithLabelValues(dropWriteError), dropped.WithLabelValues(dropEmpty)
	queued := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvgate_record_queued_bytes",
		Help: "Bytes the records waiting for the recording's writer hold (their block hashes), at most record.buffer_bytes."},
		func() float64 { return float64(r.queued.Load()) })
	reg.MustRegister(dropped, r.written, queued)
	return r, nil
}

// settled is the recording's sink: a served request (a disaggregated
// one's decode step, never its prefill step) is recorded.
func (r *recorder) settled(s *settledAttempt) {
	if s.a.step != stepPrefill {
		r.record(s.x, s.a)
	}
}

// record hands a served attempt to the writer, never waiting: a full queue
// (its records, or their bytes) drops it. Nil-safe (no recording) and a
// no-op for other verdicts.
func (r *recorder) record(x *exchange, a *attempt) {
	if r == nil || a.v != served || (x.kind != prompt.Completion && x.kind != prompt.Chat && x.kind != prompt.Messages) {
		return // the trace is of generation requests: embeddings, scores … are not replayed
	}
	e := recordEntry{at: x.start, tokens: x.req.Tokens, output: a.output, maxTokens: x.req.MaxTokens,
		blocks: x.req.Blocks, model: x.req.Model, session: sessionKey(x.req.Session), chat: x.kind != prompt.Completion,
		tenant: x.req.Tenant, priority: x.req.Priority}
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closed {
		r.late.Inc()
		return
	}
	n := e.size()
	if r.queued.Add(n) > r.cfg.BufferBytes {
		r.queued.Add(-n)
		r.full.Inc()
		return
	}
	select {
	case r.ch <- e:
	default:
		r.queued.Add(-n)
		r.full.Inc()
	}
}

// dequeued writes e, taken from the queue, whose bytes it frees.
func (r *recorder) dequeued(e recordEntry) {
	r.queued.Add(-e.size())
	r.write(e)
}

// sessionKey numbers a session in the recording: its 64-bit hash (0 for
// none; two sessions whose hashes meet, about one pair in 2^32 among 2^16
// sessions, share a number).
func sessionKey(session string) uint64 {
	if session == "" {
		return 0
	}
	return max(prompt.Chain(0, []byte(session)), 1)
}

// run writes records until ctx ends, then writes what is queued, flushes and
// closes the file. It returns at once if the recording has ended.
func (r *recorder) run(ctx context.Context) {
	r.mu.RLock()
	closed := r.closed
	r.mu.RUnlock()
	if closed {
		return
	}
	tick := r.clock.NewTicker(recordFlushEvery)
	defer tick.Stop()
	for {
		select {
		case e := <-r.ch:
			r.dequeued(e)
		case <-tick.C():
			r.flush()
		case <-ctx.Done():
			r.close()
			return
		}
	}
}

// close ends the recording: later records are dropped; the queued ones are
// written and the file is flushed and closed.
func (r *recorder) close() {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	for {
		select {
		case e := <-r.ch:
			r.dequeued(e)
			continue
		default:
		}
		break
	}
	r.closeFile()
}

// write appends one record's line, rotating first when the file or the id
// tables would pass their bounds.
func (r *recorder) write(e recordEntry) {
	if e.tokens < 1 {
		r.emptyDrops.Inc()
		return
	}
	if r.f == nil && !r.reopen() {
		r.writeErrors.Inc()
		return
	}
	if len(r.ids)+len(r.sessions)+len(e.blocks)+1 > r.cfg.MaxIDs && r.size > 0 {
		if !r.rotate() {
			r.writeErrors.Inc()
			return
		}
	}
	line := r.encode(e)
	if r.cfg.MaxBytes > 0 && r.size > 0 && r.size+int64(len(line)) > r.cfg.MaxBytes {
		if !r.rotate() {
			r.writeErrors.Inc()
			return
		}
		line = r.encode(e) // ids and time restart in the new file
	}
	if _, err := r.w.Write(line); err != nil {
		r.fail(err)
		r.writeErrors.Inc()
		return
	}
	r.size += int64(len(line))
	r.written.Inc()
}

// encode renders a record as one JSON line (see the format above),
// numbering its blocks and session in the file's tables.
func (r *recorder) encode(e recordEntry) []byte {
	b := append(r.line[:0], `{"timestamp":`...)
	b = appendMillis(b, max(e.at.Sub(r.origin), 0))
	b = append(b, `,"input_length":`...)
	b = strconv.AppendInt(b, int64(e.tokens), 10)
	b = append(b, `,"output_length":`...)
	out := e.output
	if out <= 0 {
		out = e.maxTokens
	}
	b = strconv.AppendInt(b, int64(max(out, 1)), 10)
	b = append(b, `,"hash_ids":[`...)
	want := (e.tokens + r.blockSize - 1) / r.blockSize
	for i := range want {
		if i > 0 {
			b = append(b, ',')
		}
		var id int
		if i < len(e.blocks) {
			var ok bool
			if id, ok = r.ids[e.blocks[i]]; !ok {
				id = r.nextID
				r.nextID++
				r.ids[e.blocks[i]] = id
			}
		} else {
			// The partial last block: an id of its own.
			id = r.nextID
			r.nextID++
		}
		b = strconv.AppendInt(b, int64(id), 10)
	}
	b = append(b, `],"block_size":`...)
	b = strconv.AppendInt(b, int64(r.blockSize), 10)
	b = append(b, `,"model":`...)
	b = append(b, r.quotedModel(e.model)...)
	if e.session != 0 {
		s, ok := r.sessions[e.session]
		if !ok {
			s = len(r.sessions)
			r.sessions[e.session] = s
		}
		b = append(b, `,"session":`...)
		b = strconv.AppendInt(b, int64(s), 10)
	}
	b = append(b, `,"chat":`...)
	b = strconv.AppendBool(b, e.chat)
	if e.tenant != "" {
		b = append(b, `,"tenant":`...)
		b = append(b, jsonString(e.tenant)...)
	}
	if e.priority != 0 {
		b = append(b, `,"priority":`...)
		b = strconv.AppendInt(b, int64(e.priority), 10)
	}
	b = append(b, "}\n"...)
	r.line = b
	return b
}

// appendMillis appends d in milliseconds, to the microsecond, without
// trailing zeros: 1520.25, 7, 0.001.
func appendMillis(b []byte, d time.Duration) []byte {
	us := d.Microseconds()
	b = strconv.AppendInt(b, us/1000, 10)
	if frac := us % 1000; frac != 0 {
		digits := [4]byte{'.', byte('0' + frac/100), byte('0' + frac/10%10), byte('0' + frac%10)}
		n := len(digits)
		for digits[n-1] == '0' {
			n--
		}
		b = append(b, digits[:n]...)
	}
	return b
}

// maxQuotedModels bounds the cache of quoted model names.
const maxQuotedModels = 256

func (r *recorder) quotedModel(m string) []byte {
	if q, ok := r.models[m]; ok {
		return q
	}
	q, _ := json.Marshal(m) // a string always marshals
	if len(r.models) < maxQuotedModels {
		r.models[m] = q
	}
	return q
}

// open rotates an existing file away and starts a new one: empty tables,
// the time origin now.
func (r *recorder) open() error {
	if err := shiftFiles(r.cfg.Path, r.cfg.Keep); err != nil {
		return err
	}
	f, err := os.OpenFile(r.cfg.Path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	r.f, r.w, r.size = f, bufio.NewWriterSize(f, 64<<10), 0
	r.origin = r.clock.Now()
	r.ids, r.sessions, r.nextID = make(map[uint64]int, 1<<10), map[uint64]int{}, 0
	r.failedAt = time.Time{}
	return nil
}

// rotate closes the file and starts the next; it reports success.
func (r *recorder) rotate() bool {
	if !r.closeFile() {
		return false
	}
	if err := r.open(); err != nil {
		r.fail(err)
		return false
	}
	return true
}

// reopen starts a new file after a failure, at most every recordRetryAfter.
func (r *recorder) reopen() bool {
	if !r.failedAt.IsZero() && r.clock.Since(r.failedAt) < recordRetryAfter {
		return false
	}
	if err := r.open(); err != nil {
		r.fail(err)
		return false
	}
	r.log.Info("recording again", "path", r.cfg.Path)
	return true
}

// fail gives up the current file after an error; reopen tries a new one later.
func (r *recorder) fail(err error) {
	if r.f != nil {
		_ = r.f.Close()
		r.f, r.w = nil, nil
	}
	if r.failedAt.IsZero() {
		r.log.Error("recording: cannot write the trace; records are dropped (kvgate_record_dropped_total{reason=\"write_error\"}) "+
			"and a new file is tried every "+recordRetryAfter.String(), "path", r.cfg.Path, "err", err)
	}
	r.failedAt = r.clock.Now()
}

func (r *recorder) flush() {
	if r.w == nil {
		return
	}
	if err := r.w.Flush(); err != nil {
		r.fail(err)
	}
}

// closeFile flushes and closes the file; it reports success.
func (r *recorder) closeFile() bool {
	if r.f == nil {
		return true
	}
	err := r.w.Flush()
	if cerr := r.f.Close(); err == nil {
		err = cerr
	}
	r.f, r.w = nil, nil
	if err != nil {
		r.fail(err)
		return false
	}
	return true
}

// shiftFiles makes room for a new path: path.(k) → path.(k+1) from the
// oldest kept, path → path.1; with keep 0 the old file is removed.
func shiftFiles(path string, keep int) error {
	ignore := func(err error) error {
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		return err
	}
	if keep == 0 {
		return ignore(os.Remove(path))
	}
	for k := keep - 1; k >= 1; k-- {
		if err := ignore(os.Rename(rotated(path, k), rotated(path, k+1))); err != nil {
			return err
		}
	}
	return ignore(os.Rename(path, rotated(path, 1)))
}

// rotated is the name of the k-th file before path.
func rotated(path string, k int) string { return path + "." + strconv.Itoa(k) }
