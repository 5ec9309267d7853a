package workload

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
)

// TraceRecord is one line of a Mooncake trace (see shared/traces/README.md):
// arrival time, prompt and output lengths in tokens, and the prompt's
// 512-token blocks as remapped prefix hashes; or of a trace recorded by
// `kvgate serve --record`, a superset (see the gateway's recorder): blocks of
// BlockSize tokens, the model, the session and the endpoint.
type TraceRecord struct {
	Timestamp                 time.Duration
	InputLength, OutputLength int
	HashIDs                   []int
	// BlockSize is the tokens per hash id ("block_size"; 0: absent, Mooncake's 512).
	BlockSize int
	// Model ("model") and Chat ("chat") describe the recorded request;
	// Session ("session", a string or a number) is its session, "" if none.
	Model   string
	Session string
	Chat    bool
	// Tenant ("tenant") and Priority ("priority") are the recorded
	// request's tenant and priority band ("" and 0: none).
	Tenant   string
	Priority int
}

// blockTokens is the record's tokens per hash id.
func (r *TraceRecord) blockTokens() int {
	if r.BlockSize > 0 {
		return r.BlockSize
	}
	return BlockTokens
}

// Bounds of the trace reader. A line is at most MaxTraceLine bytes; a request
// reads or writes at most MaxTraceTokens tokens (16 MiB of synthesised text;
// the Mooncake traces peak at 191,378); timestamps are at most
// MaxTraceTimestamp (about 31 years, well inside a Duration).
const (
	MaxTraceLine      = 16 << 20
	MaxTraceTokens    = 1 << 22
	MaxTraceTimestamp = 1e12 * time.Millisecond
	// MaxTenantName bounds a tenant's name, MaxPriority a priority's size.
	MaxTenantName = 128
	MaxPriority   = 1 << 20
)

var (
	// ErrTrace matches every *TraceError.
	ErrTrace = errors.New("bad trace")
	// ErrLineTooLong: a line longer than MaxTraceLine.
	ErrLineTooLong = errors.New("line too long")
)

// TraceError is a fault in a trace, at a 1-based line number.
type TraceError struct {
	Line int
	Err  error
}

func (e *TraceError) Error() string        { return fmt.Sprintf("trace line %d: %v", e.Line, e.Err) }
func (e *TraceError) Unwrap() error        { return e.Err }
func (e *TraceError) Is(target error) bool { return target == ErrTrace }

// ReadTrace reads a Mooncake trace, strictly: every line is a JSON object with
// timestamp (ms, ≥ 0, not before the previous line's), input_length and
// output_length (1..MaxTraceTokens) and hash_ids (non-negative, exactly
// ceil(input_length/block_size) of them, block_size 512 unless the line
// gives it); blank lines are skipped. Every error is a *TraceError carrying
// the line number.
//
// A recorded trace (its first record gives block_size) is written as
// requests complete, not as they arrive: its records are sorted by
// timestamp (stably) instead of having to be in order.
func ReadTrace(r io.Reader) ([]TraceRecord, error) {
	return readTrace(r, MaxTraceLine)
}

func readTrace(r io.Reader, maxLine int) ([]TraceRecord, error) {
	sc := bufio.NewScanner(r)
	// Room for the line and its "\r\n"; the length is checked exactly below.
	sc.Buffer(make([]byte, 0, min(64<<10, maxLine+2)), maxLine+2)
	var recs []TraceRecord
	line := 0
	for sc.Scan() {
		line++
		b := sc.Bytes()
		if len(b) > maxLine {
			return nil, &TraceError{line, fmt.Errorf("%w: more than %d bytes", ErrLineTooLong, maxLine)}
		}
		b = bytes.TrimSpace(b)
		if len(b) == 0 {
			continue
		}
		if len(recs) == MaxRequests {
			return nil, &TraceError{line, fmt.Errorf("more than %d records", MaxRequests)}
		}
		rec, err := parseRecord(b)
		if err != nil {
			return nil, &TraceError{line, err}
		}
		if n := len(recs); n > 0 && rec.Timestamp < recs[n-1].Timestamp && recs[0].BlockSize == 0 {
			return nil, &TraceError{line, fmt.Errorf("timestamp %v is before the previous record's %v: records must be sorted by time",
				rec.Timestamp, recs[n-1].Timestamp)}
		}
		recs = append(recs, rec)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, &TraceError{line + 1, fmt.Errorf("%w: more than %d bytes", ErrLineTooLong, maxLine)}
		}
		return nil, &TraceError{line + 1, fmt.Errorf("read: %w", err)}
	}
	if len(recs) > 0 && recs[0].BlockSize != 0 {
		slices.SortStableFunc(recs, func(a, b TraceRecord) int { return cmp.Compare(a.Timestamp, b.Timestamp) })
	}
	return recs, nil
}

// traceLine has pointer (and raw) fields so that a missing field is told
// apart from a zero.
type traceLine struct {
	Timestamp    json.RawMessage `json:"timestamp"`
	InputLength  *int            `json:"input_length"`
	OutputLength *int            `json:"output_length"`
	HashIDs      *[]int          `json:"hash_ids"`
	// The recorded superset (kvgate serve --record).
	BlockSize *int            `json:"block_size"`
	Model     string          `json:"model"`
	Session   json.RawMessage `json:"session"`
	Chat      bool            `json:"chat"`
	Tenant    string          `json:"tenant"`
	Priority  int             `json:"priority"`
}

func parseRecord(b []byte) (TraceRecord, error) {
	if b[0] != '{' {
		return TraceRecord{}, errors.New("not a JSON object")
	}
	var l traceLine
	if err := json.Unmarshal(b, &l); err != nil {
		return TraceRecord{}, fmt.Errorf("not a trace record: %v", err)
	}
	switch {
	case l.Timestamp == nil || string(l.Timestamp) == "null":
		return TraceRecord{}, errors.New("missing timestamp")
	case l.InputLength == nil:
		return TraceRecord{}, errors.New("missing input_length")
	case l.OutputLength == nil:
		return TraceRecord{}, errors.New("missing output_length")
	case l.HashIDs == nil:
		return TraceRecord{}, errors.New("missing hash_ids")
	}
	ts, err := parseMillis(l.Timestamp)
	if err != nil {
		return TraceRecord{}, err
	}
	in, out, ids := *l.InputLength, *l.OutputLength, *l.HashIDs
	if in < 1 || in > MaxTraceTokens {
		return TraceRecord{}, fmt.Errorf("input_length %d is outside [1, %d]", in, MaxTraceTokens)
	}
	if out < 1 || out > MaxTraceTokens {
		return TraceRecord{}, fmt.Errorf("output_length %d is outside [1, %d]", out, MaxTraceTokens)
	}
	rec := TraceRecord{Timestamp: ts, InputLength: in, OutputLength: out, HashIDs: ids, Model: l.Model, Chat: l.Chat}
	if l.BlockSize != nil {
		if bs := *l.BlockSize; bs < 1 || bs > MaxTraceTokens {
			return TraceRecord{}, fmt.Errorf("block_size %d is outside [1, %d]", bs, MaxTraceTokens)
		}
		rec.BlockSize = *l.BlockSize
	}
	bt := rec.blockTokens()
	if want := (in + bt - 1) / bt; len(ids) != want {
		return TraceRecord{}, fmt.Errorf("%d hash_ids for input_length %d, want ceil(%d/%d) = %d",
			len(ids), in, in, bt, want)
	}
	for i, id := range ids {
		if id < 0 {
			return TraceRecord{}, fmt.Errorf("hash_ids[%d] = %d is negative", i, id)
		}
	}
	if rec.Session, err = sessionOf(l.Session); err != nil {
		return TraceRecord{}, err
	}
	if err := checkTenant(l.Tenant, l.Priority); err != nil {
		return TraceRecord{}, err
	}
	rec.Tenant, rec.Priority = l.Tenant, l.Priority
	return rec, nil
}

// checkTenant bounds a record's tenant and priority.
func checkTenant(tenant string, priority int) error {
	if len(tenant) > MaxTenantName {
		return fmt.Errorf("tenant is %d bytes, at most %d", len(tenant), MaxTenantName)
	}
	if priority < -MaxPriority || priority > MaxPriority {
		return fmt.Errorf("priority %d is outside [%d, %d]", priority, -MaxPriority, MaxPriority)
	}
	return nil
}

// sessionOf reads a record's session: a string, or a number (a recorder's
// session id), kept as its decimal text; absent or null is "".
func sessionOf(raw json.RawMessage) (string, error) {
	s := string(bytes.TrimSpace(raw))
	switch {
	case s == "" || s == "null":
		return "", nil
	case s[0] == '"':
		var v string
		if err := json.Unmarshal(raw, &v); err != nil {
			return "", fmt.Errorf("session: %v", err)
		}
		return v, nil
	case s[0] == '-' || (s[0] >= '0' && s[0] <= '9'):
		return s, nil
	}
	return "", fmt.Errorf("session %s is neither a string nor a number", s)
}

// parseMillis reads a timestamp in milliseconds: an integer exactly, a
// fraction rounded to the nanosecond. Strings are refused.
func parseMillis(raw json.RawMessage) (time.Duration, error) {
	s := string(raw)
	if s[0] != '-' && (s[0] < '0' || s[0] > '9') {
		return 0, fmt.Errorf("timestamp %s is not a number", s)
	}
	if ms, err := strconv.ParseInt(s, 10, 64); err == nil {
		if ms < 0 || ms > int64(MaxTraceTimestamp/time.Millisecond) {
			return 0, fmt.Errorf("timestamp %d ms is outside [0, %d]", ms, int64(MaxTraceTimestamp/time.Millisecond))
		}
		return time.Duration(ms) * time.Millisecond, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) {
		return 0, fmt.Errorf("timestamp %s is not a number of milliseconds", s)
	}
	ns := math.Round(f * float64(time.Millisecond))
	if !(ns >= 0 && ns <= float64(MaxTraceTimestamp)) {
		return 0, fmt.Errorf("timestamp %s ms is outside [0, %d]", s, int64(MaxTraceTimestamp/time.Millisecond))
	}
	return time.Duration(ns), nil
}

// ReadTraceFile reads a trace file (see ReadTrace); errors name the file.
func ReadTraceFile(path string) ([]TraceRecord, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	recs, err := ReadTrace(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return recs, nil
}

// FromTrace turns trace records into requests: At is the timestamp divided
// by speedup, MaxTokens the output length, Session the record's, and the
// text is synthesised from the hash ids on demand (Request.Text): HashIDs
// for 512-token ids, BlockIDs and BlockTokens for a recorded trace's other
// block sizes. Requests share the records' ids.
func FromTrace(recs []TraceRecord, speedup float64) ([]Request, error) {
	if !(speedup > 0) || math.IsInf(speedup, 0) {
		return nil, fmt.Errorf("%w: speedup %g must be a positive number", ErrBadParam, speedup)
	}
	reqs := make([]Request, len(recs))
	for i, rec := range recs {
		at := rec.Timestamp
		if speedup != 1 {
			at = seconds(rec.Timestamp.Seconds() / speedup)
		}
		reqs[i] = Request{Index: i, At: at, Prev: -1, MaxTokens: rec.OutputLength,
			InputTokens: rec.InputLength, Session: rec.Session, Timed: true, Tenant: rec.Tenant, Priority: rec.Priority}
		if bt := rec.blockTokens(); bt == BlockTokens {
			reqs[i].HashIDs = rec.HashIDs
		} else {
			reqs[i].BlockIDs, reqs[i].BlockTokens = rec.HashIDs, bt
		}
	}
	numberPrograms(reqs)
	return reqs, nil
}

// numberPrograms numbers the programs of a trace's requests (Program) by
// their distinct sessions, in order of first appearance; a request
// without a session has none.
func numberPrograms(reqs []Request) {
	seen := map[string]int{}
	for i := range reqs {
		s := reqs[i].Session
		if s == "" {
			continue
		}
		n, ok := seen[s]
		if !ok {
			n = len(seen) + 1
			seen[s] = n
		}
		reqs[i].Program = n
	}
}

func generateTrace(s Spec) ([]Request, error) {
	p, err := resolve(TraceName, traceParams, s.Params)
	if err != nil {
		return nil, err
	}
	if s.Path == "" {
		return nil, fmt.Errorf("%w: the trace workload needs a file (trace:PATH)", ErrBadParam)
	}
	format, err := TraceFormatOf(s.Path)
	if err != nil {
		return nil, err
	}
	if format == FormatRequestLog {
		return generateRequestLog(s, p.f("speedup"))
	}
	recs, err := ReadTraceFile(s.Path)
	if err != nil {
		return nil, err
	}
	if len(recs) == 0 {
		return nil, fmt.Errorf("%w: %s has no records", ErrTrace, s.Path)
	}
	if s.Requests > 0 {
		if s.Requests > len(recs) {
			return nil, fmt.Errorf("%w: %d requests but %s has only %d records", ErrBadParam, s.Requests, s.Path, len(recs))
		}
		recs = recs[:s.Requests:s.Requests]
	}
	text := 0.0
	for _, rec := range recs {
		text += float64(rec.InputLength * prompt.TokenBytesPer)
	}
	if err := checkSize(TraceName, float64(len(recs)), text); err != nil {
		return nil, err
	}
	if sp := p.f("spread"); sp > 0 {
		recs = spreadArrivals(recs, sp, s.Seed)
	}
	return FromTrace(recs, p.f("speedup"))
}

// spreadArrivals moves each record to a uniform instant up to spread
// seconds after its timestamp (seeded), in arrival order again. A trace
// whose timestamps are coarse has bursts of requests at one instant, which
// no router meets in practice: several gateways, whose shared view always
// lags, would all see the same replica as best for each of them.
func spreadArrivals(recs []TraceRecord, spread float64, seed uint64) []TraceRecord {
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	out := slices.Clone(recs)
	for i := range out {
		out[i].Timestamp += seconds(rng.Float64() * spread)
	}
	slices.SortStableFunc(out, func(a, b TraceRecord) int { return cmp.Compare(a.Timestamp, b.Timestamp) })
	base := out[0].Timestamp
	for i := range out {
		out[i].Timestamp -= base
	}
	return out
}

// generateRequestLog is the trace workload of a request log (ReadRequestLog).
func generateRequestLog(s Spec, speedup float64) ([]Request, error) {
	reqs, err := ReadRequestLogFile(s.Path)
	if err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, fmt.Errorf("%w: %s has no requests", ErrTrace, s.Path)
	}
	if s.Requests > 0 {
		if s.Requests > len(reqs) {
			return nil, fmt.Errorf("%w: %d requests but %s has only %d", ErrBadParam, s.Requests, s.Path, len(reqs))
		}
		reqs = reqs[:s.Requests:s.Requests]
	}
	text := 0.0
	for i := range reqs {
		text += float64(reqs[i].InputTokens * prompt.TokenBytesPer)
		if speedup != 1 {
			reqs[i].At = seconds(reqs[i].At.Seconds() / speedup)
		}
	}
	if err := checkSize(TraceName, float64(len(reqs)), text); err != nil {
		return nil, err
	}
	numberPrograms(reqs)
	return reqs, nil
}
