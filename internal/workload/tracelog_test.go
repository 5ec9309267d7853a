package workload

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
)

// A trace recorded by `kvgate serve --record`: 16-token ids, the superset's
// fields, lines in completion order.
const recorded = `{"timestamp":1000,"input_length":48,"output_length":7,"hash_ids":[0,1,3],"block_size":16,"model":"m","session":1,"chat":false}
{"timestamp":1.5,"input_length":40,"output_length":5,"hash_ids":[0,1,2],"block_size":16,"model":"m","session":0,"chat":true}

{"timestamp":500,"input_length":32,"output_length":1,"hash_ids":[0,4],"block_size":16,"model":"m","session":"alice","chat":false}
`

func TestReadRecordedTrace(t *testing.T) {
	recs, err := ReadTrace(strings.NewReader(recorded))
	if err != nil {
		t.Fatal(err)
	}
	want := []TraceRecord{
		{Timestamp: 1500 * time.Microsecond, InputLength: 40, OutputLength: 5, HashIDs: []int{0, 1, 2}, BlockSize: 16, Model: "m", Session: "0", Chat: true},
		{Timestamp: 500 * time.Millisecond, InputLength: 32, OutputLength: 1, HashIDs: []int{0, 4}, BlockSize: 16, Model: "m", Session: "alice"},
		{Timestamp: time.Second, InputLength: 48, OutputLength: 7, HashIDs: []int{0, 1, 3}, BlockSize: 16, Model: "m", Session: "1"},
	}
	if len(recs) != len(want) {
		t.Fatalf("%d records", len(recs))
	}
	for i := range want {
		if got := recs[i]; got.Timestamp != want[i].Timestamp || got.InputLength != want[i].InputLength ||
			got.OutputLength != want[i].OutputLength || got.BlockSize != 16 || got.Model != want[i].Model ||
			got.Session != want[i].Session || got.Chat != want[i].Chat || len(got.HashIDs) != len(want[i].HashIDs) {
			t.Fatalf("record %d: %+v, want %+v (sorted by timestamp)", i, got, want[i])
		}
	}
	reqs, err := FromTrace(recs, 2)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range reqs {
		if r.HashIDs != nil || r.BlockIDs == nil || r.BlockTokens != 16 || !r.Timed || r.Session != recs[i].Session {
			t.Fatalf("request %d: %+v", i, r)
		}
		if text := r.Text(); len(text) != 4*r.InputTokens || string(r.AppendText(nil)) != text {
			t.Fatalf("request %d: %d bytes of text for %d tokens", i, len(text), r.InputTokens)
		}
	}
	if reqs[2].At != 500*time.Millisecond {
		t.Fatalf("speedup 2: %v", reqs[2].At)
	}
	// Equal leading ids are equal 16-token blocks, and only those: the
	// kvgate blocks of the synthesised prompts share what the ids share.
	root := prompt.Key{Model: "m"}.Root()
	a := prompt.ApproxBlockHashes(nil, root, reqs[0].Text(), 16) // ids 0 1 2(partial)
	b := prompt.ApproxBlockHashes(nil, root, reqs[2].Text(), 16) // ids 0 1 3
	c := prompt.ApproxBlockHashes(nil, root, reqs[1].Text(), 16) // ids 0 4
	if len(a) != 2 || len(b) != 3 || a[0] != b[0] || a[1] != b[1] || c[0] != a[0] || c[1] == a[1] {
		t.Fatalf("blocks %x %x %x", a, b, c)
	}
	// Arrivals keeps a trace's own times.
	Arrivals(reqs, 1000, 1)
	if reqs[2].At != 500*time.Millisecond {
		t.Fatal("Arrivals moved a recorded request")
	}
}

func TestReadRecordedTraceErrors(t *testing.T) {
	for _, c := range []struct{ name, line, want string }{
		{"zero block size", `{"timestamp":0,"input_length":16,"output_length":1,"hash_ids":[0],"block_size":0}`, "block_size 0"},
		{"ids for another size", `{"timestamp":0,"input_length":40,"output_length":1,"hash_ids":[0],"block_size":16}`, "1 hash_ids for input_length 40, want ceil(40/16) = 3"},
		{"bad session", `{"timestamp":0,"input_length":16,"output_length":1,"hash_ids":[0],"block_size":16,"session":[1]}`, "session [1]"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := ReadTrace(strings.NewReader(recorded + c.line + "\n"))
			var te *TraceError
			if !errors.As(err, &te) || te.Line != 5 || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want line 5: %s", err, c.want)
			}
		})
	}
	// Plain Mooncake lines stay strictly in order.
	_, err := ReadTrace(strings.NewReader(`{"timestamp":5,"input_length":1,"output_length":1,"hash_ids":[0]}
{"timestamp":4,"input_length":1,"output_length":1,"hash_ids":[0]}`))
	if err == nil || !strings.Contains(err.Error(), "before the previous") {
		t.Fatalf("unsorted Mooncake trace: %v", err)
	}
}

func TestAppendTraceTextN(t *testing.T) {
	for _, bt := range []int{1, 16, 100, 512, 1000} {
		ids := []int{7, 8, 9}
		in := 2*bt + 1
		text := string(AppendTraceTextN([]byte("p"), ids, in, bt))
		if len(text) != 1+4*in {
			t.Fatalf("block %d: %d bytes", bt, len(text))
		}
		if want := string(AppendBlockTextN(nil, 7, bt)); text[1:1+4*bt] != want {
			t.Fatalf("block %d: the first block is not id 7's text", bt)
		}
		if full := string(AppendBlockTextN(nil, 9, bt)); !strings.HasPrefix(full, text[1+8*bt:]) {
			t.Fatalf("block %d: the partial block is not a prefix of its full text", bt)
		}
	}
	if string(AppendTraceTextN(nil, []int{3, 4}, 600, 512)) != TraceText([]int{3, 4}, 600) {
		t.Fatal("512-token blocks are Mooncake's text")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a block size of 0 did not panic")
		}
	}()
	AppendTraceTextN(nil, []int{1}, 1, 0)
}

const requestLog = `{"timestamp": "2025-05-01T12:00:01.5Z", "body": {"model": "m", "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}], "max_tokens": 20, "user": "u1"}, "response": {"usage": {"prompt_tokens": 9, "completion_tokens": 12}}}
{"timestamp": 1746100800, "model": "m", "prompt": "Once upon a time", "max_tokens": 16}

{"created": 1746100800250, "request": "{\"model\": \"m\", \"prompt\": [\"first of a batch\", \"second\"]}", "session_id": "s9"}
{"timestamp": "2025-05-01 12:00:00.100", "request": {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}], "tools": [{"type": "function"}], "max_completion_tokens": 4}, "completion_tokens": 3}
`

func TestReadRequestLog(t *testing.T) {
	reqs, err := ReadRequestLog(strings.NewReader(requestLog))
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 4 {
		t.Fatalf("%d requests", len(reqs))
	}
	// Sorted by time: 12:00:00.000 (line 2), .100 (line 5), .250 (line 4), 01.500 (line 1).
	wantAt := []time.Duration{0, 100 * time.Millisecond, 250 * time.Millisecond, 1500 * time.Millisecond}
	for i, r := range reqs {
		if r.At != wantAt[i] || r.Index != i || r.Prev != -1 || !r.Timed {
			t.Fatalf("request %d: at %v, index %d: %+v", i, r.At, r.Index, r)
		}
		if r.InputTokens != (prompt.Approx{}).Count(r.Text()) {
			t.Fatalf("request %d: %d tokens for %q", i, r.InputTokens, r.Text())
		}
	}
	if r := reqs[0]; r.Chat || r.Prompt != "Once upon a time" || r.MaxTokens != 16 || r.Session != "" {
		t.Fatalf("completion: %+v", r)
	}
	// Tools render ahead of the messages: kept as the routing text.
	if r := reqs[1]; r.Chat || !strings.HasPrefix(r.Prompt, "<|tools|>") || !strings.Contains(r.Prompt, "parts") || r.MaxTokens != 3 {
		t.Fatalf("chat with tools: %+v", r)
	}
	if r := reqs[2]; r.Prompt != "first of a batch" || r.MaxTokens != DefaultLogOutputTokens || r.Session != "s9" {
		t.Fatalf("batch under request as a string: %+v", r)
	}
	r := reqs[3]
	roles, contents := parts(&r)
	if !r.Chat || strings.Join(roles, ",") != "system,user" || contents[1] != "Hello there" || r.MaxTokens != 12 || r.Session != "u1" {
		t.Fatalf("chat: %+v", r)
	}
	if r.Text() != prompt.RenderChat(roles, contents) {
		t.Fatal("chat text")
	}
}

func TestReadRequestLogErrors(t *testing.T) {
	ok := `{"timestamp": 1, "model": "m", "prompt": "x"}`
	for _, c := range []struct{ name, line, want string }{
		{"not json", `timestamp 5`, "not a JSON object"},
		{"broken", `{"timestamp": 1, "model": `, "not a logged request"},
		{"no time", `{"model": "m", "prompt": "x"}`, `missing "timestamp"`},
		{"bad time", `{"timestamp": "yesterday", "model": "m", "prompt": "x"}`, `timestamp "yesterday"`},
		{"negative time", `{"timestamp": -5, "model": "m", "prompt": "x"}`, "not a non-negative Unix time"},
		{"no prompt", `{"timestamp": 1, "model": "m"}`, "prompt"},
		{"no model", `{"timestamp": 1, "prompt": "x"}`, "model"},
		{"token ids", `{"timestamp": 1, "model": "m", "prompt": [1, 2, 3]}`, "token ids"},
		{"empty prompt", `{"timestamp": 1, "model": "m", "prompt": ""}`, "empty"},
		{"body not an object", `{"timestamp": 1, "body": [1]}`, "not a JSON object"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := ReadRequestLog(strings.NewReader(ok + "\n\n" + c.line + "\n"))
			var te *TraceError
			if !errors.As(err, &te) || te.Line != 3 || !strings.Contains(err.Error(), c.want) || !errors.Is(err, ErrTrace) {
				t.Fatalf("got %v, want trace line 3: %s", err, c.want)
			}
		})
	}
}

func TestParseLogTime(t *testing.T) {
	want := time.Date(2025, 5, 1, 12, 0, 0, 0, time.UTC)
	for _, s := range []string{`1746100800`, `1746100800000`, `1746100800000000`, `1746100800000000000`,
		`1746100800.0`, `"1746100800"`, `"2025-05-01T12:00:00Z"`, `"2025-05-01T14:00:00+02:00"`, `"2025-05-01T12:00:00"`,
		`"2025-05-01 12:00:00"`, `1.7461008e12`} {
		got, err := parseLogTime([]byte(s))
		if err != nil || !got.Equal(want) {
			t.Errorf("%s: %v, %v", s, got, err)
		}
	}
	if got, err := parseLogTime([]byte(`1746100800.25`)); err != nil || got.Sub(want) != 250*time.Millisecond {
		t.Errorf("fractional seconds: %v, %v", got, err)
	}
}

func TestDetectTraceFormat(t *testing.T) {
	for _, c := range []struct {
		in   string
		want TraceFormat
		err  string
	}{
		{"", FormatMooncake, ""},
		{"\n" + recorded, FormatMooncake, ""},
		{`{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}`, FormatMooncake, ""},
		{requestLog, FormatRequestLog, ""},
		{"\n\n" + `{"timestamp": 1, "messages": []}`, FormatRequestLog, ""},
		{"\n" + `{"timestamp": 1}`, "", "trace line 2: neither a trace record"},
		{"hello", "", "trace line 1: not a JSON object"},
	} {
		got, err := DetectTraceFormat(strings.NewReader(c.in))
		if got != c.want || (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%.30q: %q, %v; want %q, %q", c.in, got, err, c.want, c.err)
		}
	}
}

// The trace workload (replay --trace, bench --workload trace:FILE) reads
// every format, told by the first line.
func TestGenerateTraceFormats(t *testing.T) {
	dir := t.TempDir()
	rec := filepath.Join(dir, "recorded.jsonl")
	log := filepath.Join(dir, "requests.jsonl")
	bad := filepath.Join(dir, "bad.jsonl")
	for p, data := range map[string]string{rec: recorded, log: requestLog, bad: requestLog + `{"timestamp": 2}` + "\n"} {
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	reqs, err := Generate(Spec{Name: TraceName, Path: rec})
	if err != nil || len(reqs) != 3 || reqs[0].BlockTokens != 16 {
		t.Fatalf("recorded: %d requests, %v", len(reqs), err)
	}
	s := Spec{Name: TraceName, Path: log, Requests: 3}
	if err := s.SetParam("speedup=2"); err != nil {
		t.Fatal(err)
	}
	reqs, err = Generate(s)
	if err != nil || len(reqs) != 3 || reqs[2].At != 125*time.Millisecond {
		t.Fatalf("request log: %v, %v", reqs, err)
	}
	if _, err := Generate(Spec{Name: TraceName, Path: log, Requests: 9}); !errors.Is(err, ErrBadParam) {
		t.Fatalf("more requests than logged: %v", err)
	}
	if _, err := Generate(Spec{Name: TraceName, Path: bad}); err == nil || !strings.Contains(err.Error(), "bad.jsonl: trace line 6") {
		t.Fatalf("a malformed line: %v", err)
	}
	if f, err := TraceFormatOf(log); err != nil || f != FormatRequestLog {
		t.Fatalf("format %q, %v", f, err)
	}
}
