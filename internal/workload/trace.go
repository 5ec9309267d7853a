package workload

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strconv"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
)

// TraceRecord is one line of a Mooncake trace (see shared/traces/README.md):
// arrival time, prompt and output lengths in tokens, and the prompt's
// 512-token blocks as remapped prefix hashes.
type TraceRecord struct {
	Timestamp                 time.Duration
	InputLength, OutputLength int
	HashIDs                   []int
}

// Bounds of the trace reader. A line is at most MaxTraceLine bytes; a request
// reads or writes at most MaxTraceTokens tokens (16 MiB of synthesised text;
// the Mooncake traces peak at 191,378); timestamps are at most
// MaxTraceTimestamp (about 31 years, well inside a Duration).
const (
	MaxTraceLine      = 16 << 20
	MaxTraceTokens    = 1 << 22
	MaxTraceTimestamp = 1e12 * time.Millisecond
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
// ceil(input_length/512) of them); blank lines are skipped. Every error is a
// *TraceError carrying the line number.
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
		if n := len(recs); n > 0 && rec.Timestamp < recs[n-1].Timestamp {
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
	return recs, nil
}

// traceLine has pointer (and raw) fields so that a missing field is told
// apart from a zero.
type traceLine struct {
	Timestamp    json.RawMessage `json:"timestamp"`
	InputLength  *int            `json:"input_length"`
	OutputLength *int            `json:"output_length"`
	HashIDs      *[]int          `json:"hash_ids"`
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
	if want := (in + BlockTokens - 1) / BlockTokens; len(ids) != want {
		return TraceRecord{}, fmt.Errorf("%d hash_ids for input_length %d, want ceil(%d/%d) = %d",
			len(ids), in, in, BlockTokens, want)
	}
	for i, id := range ids {
		if id < 0 {
			return TraceRecord{}, fmt.Errorf("hash_ids[%d] = %d is negative", i, id)
		}
	}
	return TraceRecord{Timestamp: ts, InputLength: in, OutputLength: out, HashIDs: ids}, nil
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
// by speedup, MaxTokens the output length, and the text is synthesised from
// the hash ids on demand (Request.Text). Requests share the records' HashIDs.
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
			InputTokens: rec.InputLength, HashIDs: rec.HashIDs}
	}
	return reqs, nil
}

func generateTrace(s Spec) ([]Request, error) {
	p, err := resolve(TraceName, traceParams, s.Params)
	if err != nil {
		return nil, err
	}
	if s.Path == "" {
		return nil, fmt.Errorf("%w: the trace workload needs a file (trace:PATH)", ErrBadParam)
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
	return FromTrace(recs, p.f("speedup"))
}
