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
	"os"
	"slices"
	"strconv"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
)

// TraceFormat is the kind of a trace file, told by its first line.
type TraceFormat string

const (
	// FormatMooncake: Mooncake's JSON lines (timestamp, input_length,
	// output_length, hash_ids), or the superset `kvgate serve --record`
	// writes (block_size, model, session, chat besides).
	FormatMooncake TraceFormat = "mooncake"
	// FormatRequestLog: JSON lines of OpenAI request bodies with timestamps,
	// as gateways and proxies (LiteLLM) log them; see ReadRequestLog.
	FormatRequestLog TraceFormat = "openai"
)

// DefaultLogOutputTokens is the output length of a logged request that
// carries neither its usage nor max_tokens (max_completion_tokens).
const DefaultLogOutputTokens = 256

// DetectTraceFormat reads up to the first non-blank line of r: a line with
// "hash_ids" is a Mooncake (or recorded) trace; one with "body",
// "request", "messages" or "prompt" a request log. An empty input is
// Mooncake (and has no records).
func DetectTraceFormat(r io.Reader) (TraceFormat, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), MaxTraceLine+2)
	for line := 1; sc.Scan(); line++ {
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var keys map[string]json.RawMessage
		if b[0] != '{' || json.Unmarshal(b, &keys) != nil {
			return "", &TraceError{line, errors.New("not a JSON object: neither a trace record nor a logged request")}
		}
		if _, ok := keys["hash_ids"]; ok {
			return FormatMooncake, nil
		}
		for _, k := range []string{"body", "request", "messages", "prompt"} {
			if _, ok := keys[k]; ok {
				return FormatRequestLog, nil
			}
		}
		return "", &TraceError{line, errors.New(`neither a trace record (no "hash_ids") nor a logged OpenAI request ` +
			`(no "body", "request", "messages" or "prompt")`)}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			err = fmt.Errorf("%w: more than %d bytes", ErrLineTooLong, MaxTraceLine)
		}
		return "", &TraceError{1, err}
	}
	return FormatMooncake, nil
}

// TraceFormatOf is DetectTraceFormat of a file; errors name the file.
func TraceFormatOf(path string) (TraceFormat, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	format, err := DetectTraceFormat(f)
	if err != nil {
		return "", fmt.Errorf("%s: %w", path, err)
	}
	return format, nil
}

// ReadRequestLog reads a JSONL log of OpenAI requests, one object per line
// (blank lines skipped), in either of two shapes:
//
//	{"timestamp": "2025-05-01T12:00:00.250Z", "body": {"model": "m", "messages": [...]}, "response": {...}}
//	{"timestamp": 1746100800250, "model": "m", "prompt": "...", "max_tokens": 64}
//
// The request is under "body" or "request" (an object, or a string holding
// one), else the line is the request itself. Its time is "timestamp", else
// "created": RFC 3339 (a space for the T and no zone, UTC, are taken too),
// or a Unix time whose unit is read from its size (below 1e11 seconds, then
// milliseconds, microseconds, nanoseconds). A request with "messages" is a
// chat, otherwise a completion; it is parsed as the gateway parses it
// (prompt.Parse: a batch routes as its first prompt; token-id prompts are
// refused, having no text) and tokenized with the approximate tokenizer. The
// output length is the usage's completion_tokens ("usage", "response.usage"
// or "completion_tokens" on the line) if logged, else max_tokens, else
// DefaultLogOutputTokens. The session is "session_id" (or "session") on
// the line, else the body's "user".
//
// Lines may be out of order (logged as requests complete): requests are
// sorted by time, stably, and At counts from the earliest. Every request is
// Timed. Every error is a *TraceError with the line number.
func ReadRequestLog(r io.Reader) ([]Request, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), MaxTraceLine+2)
	var reqs []Request
	var times []time.Time
	line := 0
	for sc.Scan() {
		line++
		b := sc.Bytes()
		if len(b) > MaxTraceLine {
			return nil, &TraceError{line, fmt.Errorf("%w: more than %d bytes", ErrLineTooLong, MaxTraceLine)}
		}
		if b = bytes.TrimSpace(b); len(b) == 0 {
			continue
		}
		if len(reqs) == MaxRequests {
			return nil, &TraceError{line, fmt.Errorf("more than %d requests", MaxRequests)}
		}
		req, at, err := parseLogged(b)
		if err != nil {
			return nil, &TraceError{line, err}
		}
		reqs, times = append(reqs, req), append(times, at)
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			return nil, &TraceError{line + 1, fmt.Errorf("%w: more than %d bytes", ErrLineTooLong, MaxTraceLine)}
		}
		return nil, &TraceError{line + 1, fmt.Errorf("read: %w", err)}
	}
	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return times[a].Compare(times[b]) })
	out := make([]Request, len(reqs))
	for k, i := range order {
		out[k] = reqs[i]
		out[k].Index, out[k].At = k, times[i].Sub(times[order[0]])
	}
	return out, nil
}

// ReadRequestLogFile is ReadRequestLog of a file; errors name the file.
func ReadRequestLogFile(path string) ([]Request, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	reqs, err := ReadRequestLog(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return reqs, nil
}

// logLine is what ReadRequestLog reads of a line besides the request.
type logLine struct {
	Timestamp        json.RawMessage `json:"timestamp"`
	Created          json.RawMessage `json:"created"`
	Body             json.RawMessage `json:"body"`
	Request          json.RawMessage `json:"request"`
	Response         json.RawMessage `json:"response"`
	Usage            json.RawMessage `json:"usage"`
	CompletionTokens *int            `json:"completion_tokens"`
	SessionID        string          `json:"session_id"`
	Session          string          `json:"session"`
	Tenant           string          `json:"tenant"`
}

func parseLogged(b []byte) (Request, time.Time, error) {
	if b[0] != '{' {
		return Request{}, time.Time{}, errors.New("not a JSON object")
	}
	var l logLine
	if err := json.Unmarshal(b, &l); err != nil {
		return Request{}, time.Time{}, fmt.Errorf("not a logged request: %v", err)
	}
	ts := l.Timestamp
	if isAbsent(ts) {
		ts = l.Created
	}
	if isAbsent(ts) {
		return Request{}, time.Time{}, errors.New(`missing "timestamp" (or "created")`)
	}
	at, err := parseLogTime(ts)
	if err != nil {
		return Request{}, time.Time{}, err
	}
	body := b
	for _, raw := range []json.RawMessage{l.Body, l.Request} {
		if isAbsent(raw) {
			continue
		}
		if body, err = objectOrString(raw); err != nil {
			return Request{}, time.Time{}, fmt.Errorf("the request: %v", err)
		}
		break
	}
	req, user, err := loggedRequest(body)
	if err != nil {
		return Request{}, time.Time{}, err
	}
	if out := loggedOutput(l); out > 0 {
		req.MaxTokens = out
	}
	// The program as the gateway names it (router.ProgramOf): the body's
	// prompt_cache_key (in req.Session) first, the log's session after;
	// else the body's user.
	req.Session = cmp.Or(req.Session, l.SessionID, l.Session, user)
	if err := checkTenant(l.Tenant, req.Priority); err != nil {
		return Request{}, time.Time{}, err
	}
	req.Tenant = l.Tenant
	return req, at, nil
}

// loggedRequest parses an OpenAI request body into a Request (its Session
// the body's prompt_cache_key) and the body's user.
func loggedRequest(body []byte) (Request, string, error) {
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(body, &keys); err != nil || keys == nil {
		return Request{}, "", errors.New("the request is not a JSON object")
	}
	kind := prompt.Completion
	if _, ok := keys["messages"]; ok {
		kind = prompt.Chat
	}
	p, err := prompt.Parse(kind, body)
	if err != nil {
		return Request{}, "", fmt.Errorf("the request: %v", err)
	}
	if p.TokenIDs != nil {
		return Request{}, "", errors.New("the prompt is token ids: a request log must carry text")
	}
	if p.Text == "" {
		return Request{}, "", errors.New("the prompt is empty")
	}
	req := Request{Prev: -1, Session: p.PromptCacheKey, Timed: true, MaxTokens: p.MaxTokens, Priority: p.Priority}
	if p.MaxTokens == 0 {
		req.MaxTokens = DefaultLogOutputTokens
	}
	req.Prompt = p.Text
	if kind == prompt.Chat {
		// Kept as messages when they render to the gateway's routing text
		// (no tools or tool calls), so that prefix-key policies see the
		// system prompt and first user message as the gateway does.
		if roles, contents, ok := chatMessages(keys["messages"]); ok && prompt.RenderChat(roles, contents) == p.Text {
			req.Chat, req.Messages, req.Prompt = true, make([]Message, len(roles)), ""
			for i := range roles {
				req.Messages[i] = heldMsg(roles[i], contents[i])
			}
		}
	}
	req.InputTokens = prompt.Approx{}.Count(p.Text)
	if req.InputTokens > MaxTraceTokens || req.MaxTokens > MaxTraceTokens {
		return Request{}, "", fmt.Errorf("%d prompt tokens and %d output tokens: at most %d each", req.InputTokens, req.MaxTokens, MaxTraceTokens)
	}
	return req, p.User, nil
}

// chatMessages are the roles and text contents of a chat's messages.
func chatMessages(raw json.RawMessage) (roles, contents []string, ok bool) {
	var msgs []prompt.Message
	if json.Unmarshal(raw, &msgs) != nil {
		return nil, nil, false
	}
	for _, m := range msgs {
		text, err := prompt.ContentText(m.Content)
		if err != nil {
			return nil, nil, false
		}
		roles, contents = append(roles, m.Role), append(contents, text)
	}
	return roles, contents, true
}

type logUsage struct {
	CompletionTokens *int `json:"completion_tokens"`
}

// loggedOutput is the logged completion tokens (0: not logged).
func loggedOutput(l logLine) int {
	if l.CompletionTokens != nil && *l.CompletionTokens > 0 {
		return *l.CompletionTokens
	}
	usage := l.Usage
	if isAbsent(usage) && !isAbsent(l.Response) {
		if resp, err := objectOrString(l.Response); err == nil {
			var r struct {
				Usage json.RawMessage `json:"usage"`
			}
			if json.Unmarshal(resp, &r) == nil {
				usage = r.Usage
			}
		}
	}
	var u logUsage
	if isAbsent(usage) || json.Unmarshal(usage, &u) != nil || u.CompletionTokens == nil {
		return 0
	}
	return max(*u.CompletionTokens, 0)
}

func isAbsent(raw json.RawMessage) bool {
	s := bytes.TrimSpace(raw)
	return len(s) == 0 || string(s) == "null"
}

// objectOrString is a JSON object, or the object a JSON string holds
// (logs that store bodies as text).
func objectOrString(raw json.RawMessage) ([]byte, error) {
	raw = bytes.TrimSpace(raw)
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, err
		}
		raw = bytes.TrimSpace([]byte(s))
	}
	if len(raw) == 0 || raw[0] != '{' {
		return nil, errors.New("not a JSON object")
	}
	return raw, nil
}

// Unix times below these are in seconds, milliseconds, microseconds;
// above the last, nanoseconds. 1e11 s is the year 5138; 1e11 ms, 1973.
const (
	unixMillisFrom = 1e11
	unixMicrosFrom = 1e14
	unixNanosFrom  = 1e17
)

// logTimeLayouts are the string timestamps accepted besides a number.
var logTimeLayouts = []string{
	time.RFC3339Nano,
	"2006-01-02 15:04:05.999999999Z07:00",
	"2006-01-02T15:04:05.999999999", // no zone: UTC
	"2006-01-02 15:04:05.999999999",
}

// parseLogTime reads a logged timestamp (see ReadRequestLog).
func parseLogTime(raw json.RawMessage) (time.Time, error) {
	s := string(bytes.TrimSpace(raw))
	if s[0] == '"' {
		if err := json.Unmarshal(raw, &s); err != nil {
			return time.Time{}, fmt.Errorf("timestamp: %v", err)
		}
		for _, layout := range logTimeLayouts {
			if t, err := time.Parse(layout, s); err == nil {
				return t, nil
			}
		}
		if _, err := strconv.ParseFloat(s, 64); err != nil {
			return time.Time{}, fmt.Errorf("timestamp %q is neither RFC 3339 nor a Unix time", s)
		}
	}
	if n, err := strconv.ParseInt(s, 10, 64); err == nil && n >= 0 {
		switch {
		case n < unixMillisFrom:
			return time.Unix(n, 0), nil
		case n < unixMicrosFrom:
			return time.UnixMilli(n), nil
		case n < unixNanosFrom:
			return time.UnixMicro(n), nil
		}
		return time.Unix(0, n), nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f < 0 || f >= math.MaxInt64 {
		return time.Time{}, fmt.Errorf("timestamp %s is not a non-negative Unix time", s)
	}
	// Whole units exactly, the fraction rounded to the nanosecond.
	whole, frac := math.Modf(f)
	w := int64(whole)
	switch {
	case f >= unixNanosFrom:
		return time.Unix(0, w), nil
	case f >= unixMicrosFrom:
		return time.UnixMicro(w).Add(time.Duration(math.Round(frac * 1e3))), nil
	case f >= unixMillisFrom:
		return time.UnixMilli(w).Add(time.Duration(math.Round(frac * 1e6))), nil
	}
	return time.Unix(w, int64(math.Round(frac*1e9))), nil
}
