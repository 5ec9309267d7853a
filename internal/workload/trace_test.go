package workload

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

const tracesDir = "../../../shared/traces"

// tracePath returns a shared trace, or skips the test when ../shared is absent.
func tracePath(t *testing.T, name string) string {
	t.Helper()
	p := filepath.Join(tracesDir, name)
	if _, err := os.Stat(p); err != nil {
		t.Skipf("../shared/traces not found: %v (the traces live beside the repository, in shared/traces)", err)
	}
	return p
}

func TestReadTraceValid(t *testing.T) {
	in := "\n" +
		`{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}` + "\r\n" +
		"   \n" +
		`{"hash_ids": [0], "output_length": 1, "input_length": 512, "timestamp": 1.5, "extra": "kept out"}` + "\n" +
		`{"timestamp": 1e3, "input_length": 1, "output_length": 9, "hash_ids": [7]}`
	recs, err := ReadTrace(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	want := []TraceRecord{
		{Timestamp: 0, InputLength: 600, OutputLength: 5, HashIDs: []int{0, 1}},
		{Timestamp: 1500 * time.Microsecond, InputLength: 512, OutputLength: 1, HashIDs: []int{0}},
		{Timestamp: time.Second, InputLength: 1, OutputLength: 9, HashIDs: []int{7}},
	}
	if !reflect.DeepEqual(recs, want) {
		t.Fatalf("got %+v\nwant %+v", recs, want)
	}
	if recs, err := ReadTrace(strings.NewReader("")); err != nil || len(recs) != 0 {
		t.Fatalf("empty trace: %v, %v", recs, err)
	}
}

func TestReadTraceErrors(t *testing.T) {
	ok := `{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}`
	cases := []struct {
		name, line, want string
	}{
		{"not json", `timestamp 5`, "not a JSON object"},
		{"array", `[1, 2]`, "not a JSON object"},
		{"broken json", `{"timestamp": 5,`, "not a trace record"},
		{"trailing data", ok + ` {}`, "not a trace record"},
		{"missing timestamp", `{"input_length": 1, "output_length": 1, "hash_ids": [0]}`, "missing timestamp"},
		{"null timestamp", `{"timestamp": null, "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "missing timestamp"},
		{"missing input", `{"timestamp": 5, "output_length": 1, "hash_ids": [0]}`, "missing input_length"},
		{"missing output", `{"timestamp": 5, "input_length": 1, "hash_ids": [0]}`, "missing output_length"},
		{"missing ids", `{"timestamp": 5, "input_length": 1, "output_length": 1}`, "missing hash_ids"},
		{"string timestamp", `{"timestamp": "5", "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "not a number"},
		{"negative timestamp", `{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "outside"},
		{"huge timestamp", `{"timestamp": 1e300, "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "outside"},
		{"unsorted", `{"timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": [0]}`, "before the previous"},
		{"fractional length", `{"timestamp": 5, "input_length": 1.5, "output_length": 1, "hash_ids": [0]}`, "not a trace record"},
		{"zero input", `{"timestamp": 5, "input_length": 0, "output_length": 1, "hash_ids": []}`, "input_length 0"},
		{"negative output", `{"timestamp": 5, "input_length": 1, "output_length": -3, "hash_ids": [0]}`, "output_length -3"},
		{"huge input", `{"timestamp": 5, "input_length": 99999999999, "output_length": 1, "hash_ids": [0]}`, "input_length 99999999999"},
		{"too few ids", `{"timestamp": 5, "input_length": 513, "output_length": 1, "hash_ids": [0]}`, "1 hash_ids for input_length 513, want ceil(513/512) = 2"},
		{"too many ids", `{"timestamp": 5, "input_length": 512, "output_length": 1, "hash_ids": [0, 1]}`, "want ceil(512/512) = 1"},
		{"negative id", `{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0, -2]}`, "hash_ids[1] = -2 is negative"},
		{"id not integer", `{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0, "a"]}`, "not a trace record"},
		{"null", `null`, "not a JSON object"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// the bad line is line 4, after a blank line
			in := ok + "\n" + ok + "\n\n" + c.line + "\n" + ok + "\n"
			recs, err := ReadTrace(strings.NewReader(in))
			var te *TraceError
			if !errors.As(err, &te) || !errors.Is(err, ErrTrace) || recs != nil {
				t.Fatalf("got %d records, %v; want a *TraceError", len(recs), err)
			}
			if te.Line != 4 || !strings.HasPrefix(err.Error(), "trace line 4: ") || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("error %q (line %d), want line 4 and %q", err, te.Line, c.want)
			}
		})
	}
}

func TestReadTraceLongLine(t *testing.T) {
	ok := `{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}`
	for _, n := range []int{len(ok), len(ok) + 1} { // exactly the limit is fine, one more is not
		long := ok + strings.Repeat(" ", n-len(ok))
		_, err := readTrace(strings.NewReader(ok+"\n"+long+"\n"), len(ok))
		if n == len(ok) && err != nil {
			t.Fatalf("line of exactly the limit: %v", err)
		}
		if n > len(ok) && (!errors.Is(err, ErrLineTooLong) || !strings.HasPrefix(err.Error(), "trace line 2: ")) {
			t.Fatalf("line over the limit: %v", err)
		}
	}
	// The real limit, with a line far past it (and no newline at all).
	huge := io.MultiReader(strings.NewReader(ok+"\n"+ok+"\n{"), &spaces{n: MaxTraceLine + 10})
	_, err := ReadTrace(huge)
	var te *TraceError
	if !errors.As(err, &te) || te.Line != 3 || !errors.Is(err, ErrLineTooLong) {
		t.Fatalf("16 MiB line: %v", err)
	}
}

// spaces is a reader of n spaces.
type spaces struct{ n int }

func (s *spaces) Read(p []byte) (int, error) {
	if s.n == 0 {
		return 0, io.EOF
	}
	k := min(len(p), s.n)
	for i := range p[:k] {
		p[i] = ' '
	}
	s.n -= k
	return k, nil
}

// failing yields data, then an error.
type failing struct {
	r   io.Reader
	err error
}

func (f *failing) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if err == io.EOF {
		return n, f.err
	}
	return n, err
}

func TestReadTraceReadError(t *testing.T) {
	boom := errors.New("disk on fire")
	ok := `{"timestamp": 5, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}`
	_, err := ReadTrace(&failing{strings.NewReader(ok + "\n" + ok + "\n"), boom})
	var te *TraceError
	if !errors.As(err, &te) || te.Line != 3 || !errors.Is(err, boom) {
		t.Fatalf("got %v, want the read error at line 3", err)
	}
}

func TestReadTraceFile(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "t.jsonl")
	data := `{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [4]}` + "\n" +
		`{"timestamp": 100, "input_length": 1030, "output_length": 7, "hash_ids": [4, 5, 6]}` + "\n" +
		`{"timestamp": 250, "input_length": 1030, "output_length": 9, "hash_ids": [4, 5, 8]}` + "\n"
	if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := Parse("trace:" + p)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.SetParam("speedup=2"); err != nil {
		t.Fatal(err)
	}
	reqs, err := Generate(s)
	if err != nil {
		t.Fatal(err)
	}
	wantAt := []time.Duration{0, 50 * time.Millisecond, 125 * time.Millisecond}
	for i, r := range reqs {
		if r.At != wantAt[i] || r.Index != i || r.Prev != -1 || r.Chat || r.HashIDs == nil {
			t.Fatalf("request %d: %+v", i, r)
		}
		if len(r.Text()) != 4*r.InputTokens || string(r.AppendText(nil)) != r.Text() {
			t.Fatalf("request %d: text of %d bytes for %d tokens", i, len(r.Text()), r.InputTokens)
		}
	}
	if reqs[1].MaxTokens != 7 || reqs[2].InputTokens != 1030 {
		t.Fatalf("lengths not carried: %+v", reqs[1:])
	}
	// Arrivals leaves trace timestamps alone.
	Arrivals(reqs, 1000, 3)
	if reqs[2].At != wantAt[2] {
		t.Fatalf("Arrivals moved a trace request to %v", reqs[2].At)
	}
	// Requests 1 and 2 share ids 4, 5: 2·512 tokens = 64 kvgate blocks.
	if got := sharedBlocks(reqs[1].Text(), reqs[2].Text()); got != 64 {
		t.Fatalf("share %d blocks, want 64", got)
	}
	// Request 0 ends inside block 4: its 10 tokens are a prefix of request 1.
	if !strings.HasPrefix(reqs[1].Text(), reqs[0].Text()) {
		t.Fatal("a partial block is not a prefix of the full one")
	}

	s.Requests = 2
	if reqs, err := Generate(s); err != nil || len(reqs) != 2 {
		t.Fatalf("first 2 records: %d, %v", len(reqs), err)
	}
	s.Requests = 4
	if _, err := Generate(s); !errors.Is(err, ErrBadParam) {
		t.Fatalf("more requests than records: %v", err)
	}

	bad := filepath.Join(dir, "bad.jsonl")
	if err := os.WriteFile(bad, []byte(data+"{}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadTraceFile(bad); !errors.Is(err, ErrTrace) || !strings.Contains(err.Error(), "bad.jsonl: trace line 4: missing timestamp") {
		t.Fatalf("error %v should name the file and line", err)
	}
	if _, err := Generate(Spec{Name: "trace", Path: filepath.Join(dir, "absent.jsonl")}); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
	empty := filepath.Join(dir, "empty.jsonl")
	if err := os.WriteFile(empty, []byte("\n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := Generate(Spec{Name: "trace", Path: empty}); !errors.Is(err, ErrTrace) {
		t.Fatalf("empty trace: %v", err)
	}
}

func TestFromTraceSpeedup(t *testing.T) {
	recs := []TraceRecord{{Timestamp: 3 * time.Second, InputLength: 1, OutputLength: 1, HashIDs: []int{0}},
		{Timestamp: MaxTraceTimestamp, InputLength: 1, OutputLength: 1, HashIDs: []int{0}}}
	for _, c := range []struct {
		speedup float64
		want    time.Duration
	}{{1, 3 * time.Second}, {3, time.Second}, {0.5, 6 * time.Second}} {
		reqs, err := FromTrace(recs, c.speedup)
		if err != nil || reqs[0].At != c.want {
			t.Fatalf("speedup %v: %v, %v", c.speedup, reqs[0].At, err)
		}
	}
	reqs, err := FromTrace(recs, 1e-3) // 31 years × 1000 would overflow
	if err != nil || reqs[1].At <= reqs[0].At {
		t.Fatalf("slow-down saturates: %v, %v", reqs[1].At, err)
	}
	for _, s := range []float64{0, -2} {
		if _, err := FromTrace(recs, s); !errors.Is(err, ErrBadParam) {
			t.Fatalf("speedup %v: %v", s, err)
		}
	}
}

// The shared Mooncake traces parse, and their hash ids give the prefix-reuse
// bounds shared/traces/README.md states.
func TestRealTraces(t *testing.T) {
	cases := []struct {
		file  string
		n     int
		reuse float64 // README: share of blocks continuing a prefix seen before
	}{
		{"mooncake_conversation_trace.jsonl", 12031, 0.366},
		{"mooncake_synthetic_trace.jsonl", 3993, 0.640},
	}
	for _, c := range cases {
		t.Run(c.file, func(t *testing.T) {
			recs, err := ReadTraceFile(tracePath(t, c.file))
			if err != nil {
				t.Fatal(err)
			}
			if len(recs) != c.n {
				t.Fatalf("%d records, want %d", len(recs), c.n)
			}
			// Hash ids are remapped prefix hashes: a block continues a seen
			// prefix exactly when its id was seen.
			seen := map[int]bool{}
			reused, total := 0, 0
			for _, r := range recs {
				for _, id := range r.HashIDs {
					if seen[id] {
						reused++
					}
					seen[id] = true
					total++
				}
			}
			if got := float64(reused) / float64(total); got < c.reuse-0.0005 || got > c.reuse+0.0005 {
				t.Fatalf("prefix reuse %.4f, README says %.3f", got, c.reuse)
			}
		})
	}
}

// On the real conversation trace, the synthesised texts share exactly the
// kvgate blocks their hash ids say they share.
func TestRealTraceTextSharing(t *testing.T) {
	recs, err := ReadTraceFile(tracePath(t, "mooncake_conversation_trace.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	if recs[0].Timestamp != 0 || recs[0].InputLength != 6758 || recs[0].OutputLength != 500 || len(recs[0].HashIDs) != 14 {
		t.Fatalf("first record %+v", recs[0])
	}
	reqs, err := FromTrace(recs[:150], 1)
	if err != nil {
		t.Fatal(err)
	}
	texts := make([]string, len(reqs))
	for i := range reqs {
		texts[i] = reqs[i].Text()
		if len(texts[i]) != 4*recs[i].InputLength {
			t.Fatalf("record %d: %d bytes for %d tokens", i, len(texts[i]), recs[i].InputLength)
		}
	}
	pairs := 0
	for i := 0; i < len(reqs); i++ {
		for j := i + 1; j < len(reqs); j += 7 {
			a, b := recs[i].HashIDs, recs[j].HashIDs
			k := 0
			for k < min(len(a), len(b)) && a[k] == b[k] {
				k++
			}
			commonBytes := min(len(texts[i]), len(texts[j]))
			if k < min(len(a), len(b)) { // diverging ids: text shared through block k only
				commonBytes = min(commonBytes, k*BlockBytes)
			}
			if got, want := sharedBlocks(texts[i], texts[j]), commonBytes/64; got != want {
				t.Fatalf("records %d, %d: %d shared kvgate blocks, ids say %d", i, j, got, want)
			}
			if k > 0 {
				pairs++
			}
		}
	}
	if pairs == 0 {
		t.Fatal("no pair shared a prefix: the test checked nothing")
	}
}

func FuzzReadTrace(f *testing.F) {
	for _, s := range []string{
		`{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]}`,
		"{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n\n{\"timestamp\": 2.25, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [0, 9]}\r\n",
		`{"timestamp": 5, "input_length": 513, "output_length": 1, "hash_ids": [0]}`,
		`{"timestamp": -1e999, "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
		`{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [0]}` + "\n" + `{"timestamp": 0}`,
		`{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [-1]}`,
		`{"timestamp": "1", "input_length": 1, "output_length": 1, "hash_ids": [0]}`,
		`{"timestamp": 1, "input_length": 1, "output_length": 1, "hash_ids": [0]} x`,
		"\x00\xff{[",
		"[[[[[[[[[[[[[[[[",
		"",
		strings.Repeat(" ", 5000) + "{}",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		recs, err := readTrace(bytes.NewReader(data), 4096)
		if err != nil {
			var te *TraceError
			if !errors.As(err, &te) || te.Line < 1 || !errors.Is(err, ErrTrace) ||
				!strings.HasPrefix(err.Error(), fmt.Sprintf("trace line %d: ", te.Line)) {
				t.Fatalf("error without a line number: %v", err)
			}
			if recs != nil {
				t.Fatal("records with an error")
			}
			return
		}
		for i, r := range recs {
			if r.InputLength < 1 || r.InputLength > MaxTraceTokens || r.OutputLength < 1 ||
				len(r.HashIDs) != (r.InputLength+511)/512 || r.Timestamp < 0 ||
				i > 0 && r.Timestamp < recs[i-1].Timestamp {
				t.Fatalf("record %d breaks the format: %+v", i, r)
			}
			for _, id := range r.HashIDs {
				if id < 0 {
					t.Fatalf("record %d: negative id", i)
				}
			}
		}
		// What was read writes back and reads the same.
		var buf bytes.Buffer
		for _, r := range recs {
			ids := make([]string, len(r.HashIDs))
			for i, id := range r.HashIDs {
				ids[i] = fmt.Sprint(id)
			}
			ms := fmt.Sprintf("%d.%06d", r.Timestamp/time.Millisecond, r.Timestamp%time.Millisecond)
			fmt.Fprintf(&buf, `{"timestamp": %s, "input_length": %d, "output_length": %d, "hash_ids": [%s]}`+"\n",
				ms, r.InputLength, r.OutputLength, strings.Join(ids, ","))
		}
		again, err := ReadTrace(&buf)
		if err != nil || len(again) != len(recs) {
			t.Fatalf("rewritten trace: %d records, %v", len(again), err)
		}
		for i := range recs {
			d := again[i].Timestamp - recs[i].Timestamp
			if d < -time.Microsecond || d > time.Microsecond || again[i].InputLength != recs[i].InputLength ||
				again[i].OutputLength != recs[i].OutputLength || !reflect.DeepEqual(again[i].HashIDs, recs[i].HashIDs) {
				t.Fatalf("record %d: %+v rewritten as %+v", i, recs[i], again[i])
			}
		}
	})
}

func BenchmarkReadTrace(b *testing.B) {
	p := filepath.Join(tracesDir, "mooncake_conversation_trace.jsonl")
	data, err := os.ReadFile(p)
	if err != nil {
		b.Skipf("../shared/traces not found: %v", err)
	}
	b.SetBytes(int64(len(data)))
	for b.Loop() {
		if _, err := ReadTrace(bytes.NewReader(data)); err != nil {
			b.Fatal(err)
		}
	}
}

// spread moves each arrival of a coarse trace within the spread, seeded,
// in order: bursts at one instant become distinct instants.
func TestTraceSpread(t *testing.T) {
	recs := make([]TraceRecord, 300)
	for i := range recs {
		recs[i] = TraceRecord{Timestamp: time.Duration(i/10) * 3 * time.Second, InputLength: 512, OutputLength: 8, HashIDs: []int{i}}
	}
	a, b := spreadArrivals(recs, 3, 1), spreadArrivals(recs, 3, 1)
	if !slices.EqualFunc(a, b, func(x, y TraceRecord) bool { return x.Timestamp == y.Timestamp && x.HashIDs[0] == y.HashIDs[0] }) {
		t.Fatal("not reproducible")
	}
	seen := map[time.Duration]bool{}
	for i, r := range a {
		if i > 0 && r.Timestamp < a[i-1].Timestamp {
			t.Fatalf("record %d out of order", i)
		}
		orig := recs[r.HashIDs[0]].Timestamp
		if r.Timestamp+a[0].Timestamp < orig-3*time.Second || r.Timestamp > orig+3*time.Second {
			t.Fatalf("record %d moved from %v to %v", r.HashIDs[0], orig, r.Timestamp)
		}
		seen[r.Timestamp] = true
	}
	if len(seen) != len(recs) || a[0].Timestamp != 0 {
		t.Fatalf("%d distinct instants of %d, first at %v", len(seen), len(recs), a[0].Timestamp)
	}
}
