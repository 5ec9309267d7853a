package openai

import (
	"errors"
	"io"
	"strings"
	"testing"
	"testing/iotest"
)

func TestHasToken(t *testing.T) {
	cases := []struct {
		data string
		want bool
	}{
		{`{"choices":[{"index":0,"text":"Hi"}]}`, true},
		{`{"choices":[{"index":0,"text":""}]}`, false},
		{`{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}`, false},
		{`{"choices":[{"index":0,"delta":{"content":"x"}}]}`, true},
		{`{"choices":[{"index":0,"delta":{"reasoning_content":"hmm"}}]}`, true},
		{`{"choices":[{"index":0,"delta":{"reasoning":"hmm"}}]}`, true},
		{`{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"name":"f"}}]}}]}`, true},
		{`{"choices":[{"index":0,"delta":{"tool_calls":[]}}]}`, false},
		{`{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`, false},
		{`{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}`, false},
	}
	for _, c := range cases {
		ch, err := ParseChunk([]byte(c.data))
		if err != nil {
			t.Fatalf("%s: %v", c.data, err)
		}
		if got := ch.HasToken(); got != c.want {
			t.Errorf("HasToken(%s) = %v, want %v", c.data, got, c.want)
		}
	}
}

func TestUsageCached(t *testing.T) {
	u := ParseUsage([]byte(`{"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":8}}}`))
	if u == nil || u.Cached() != 8 || u.CompletionTokens != 2 {
		t.Fatalf("usage %+v", u)
	}
	if ParseUsage([]byte(`{"usage":{"prompt_tokens":10}}`)).Cached() != -1 {
		t.Fatal("absent details must read -1")
	}
	if ParseUsage([]byte(`not json`)) != nil || (*Usage)(nil).Cached() != -1 {
		t.Fatal("no usage must read nil / -1")
	}
}

func TestParseErrorBothShapes(t *testing.T) {
	e, ok := ParseError(ErrorJSON("too long", "invalid_request_error", "context_length", "messages"))
	if !ok || e.Message != "too long" || e.Param == nil || *e.Param != "messages" {
		t.Fatalf("nested: %+v %v", e, ok)
	}
	e, ok = ParseError([]byte(`{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}`))
	if !ok || e.Message != "bad" || e.Type != "BadRequestError" {
		t.Fatalf("flat: %+v %v", e, ok)
	}
	if _, ok := ParseError([]byte(`{"choices":[]}`)); ok {
		t.Fatal("a response parsed as an error")
	}
}

func readAll(t *testing.T, r *EventReader) ([]Event, error) {
	t.Helper()
	var out []Event
	for range 1000 {
		ev, err := r.Next()
		if err != nil {
			return out, err
		}
		ev.Raw, ev.Data = append([]byte(nil), ev.Raw...), append([]byte(nil), ev.Data...)
		out = append(out, ev)
	}
	t.Fatal("reader did not end")
	return nil, nil
}

func TestEventReader(t *testing.T) {
	in := "data: {\"a\":1}\n\n\n: comment\ndata: x\ndata:y\r\n\r\ndata: [DONE]\n\n"
	evs, err := readAll(t, NewEventReader(iotest.OneByteReader(strings.NewReader(in)), 0))
	if !errors.Is(err, io.EOF) {
		t.Fatalf("err %v", err)
	}
	if len(evs) != 3 {
		t.Fatalf("%d events: %+v", len(evs), evs)
	}
	if string(evs[0].Data) != `{"a":1}` || string(evs[0].Raw) != "data: {\"a\":1}\n\n" {
		t.Fatalf("event 0: %q %q", evs[0].Data, evs[0].Raw)
	}
	if string(evs[1].Data) != "x\ny" || !strings.HasPrefix(string(evs[1].Raw), ": comment\n") {
		t.Fatalf("event 1: %q %q", evs[1].Data, evs[1].Raw)
	}
	if !IsDone(evs[2].Data) {
		t.Fatalf("event 2: %q", evs[2].Data)
	}
}

func TestEventReaderUnterminated(t *testing.T) {
	evs, err := readAll(t, NewEventReader(strings.NewReader("data: a\n\ndata: b"), 0))
	if !errors.Is(err, io.EOF) || len(evs) != 2 || !evs[1].Unterminated || string(evs[1].Data) != "b" {
		t.Fatalf("%v %+v", err, evs)
	}
}

// A line with no end must not be held whole: the reader gives up at its
// bound, having buffered about that much.
func TestEventReaderBoundsLine(t *testing.T) {
	endless := io.MultiReader(strings.NewReader("data: "), infinite('x'))
	_, err := readAll(t, NewEventReader(endless, 4096))
	if !errors.Is(err, ErrLineTooLong) {
		t.Fatalf("err %v, want ErrLineTooLong", err)
	}
	// Many short lines in one event are bounded too.
	many := io.MultiReader(infiniteLines("data: x\n"))
	_, err = readAll(t, NewEventReader(many, 4096))
	if !errors.Is(err, ErrLineTooLong) {
		t.Fatalf("err %v, want ErrLineTooLong for an endless event", err)
	}
}

type repeatReader struct{ pat []byte }

func (r repeatReader) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = r.pat[i%len(r.pat)]
	}
	return len(p) - len(p)%len(r.pat), nil
}

func infinite(c byte) io.Reader           { return repeatReader{[]byte{c}} }
func infiniteLines(line string) io.Reader { return repeatReader{[]byte(line)} }

func TestSSEErrorEvent(t *testing.T) {
	ev := string(SSEErrorEvent("broke", "server_error", "upstream_stream_error"))
	if !strings.HasPrefix(ev, "data: {\"error\":") || !strings.HasSuffix(ev, "\n\n") {
		t.Fatalf("%q", ev)
	}
}
