package chaos

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// cutReader yields data, then fails as a connection reset does.
type cutReader struct{ r io.Reader }

func (c *cutReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if errors.Is(err, io.EOF) {
		return n, errors.New("read: connection reset by peer")
	}
	return n, err
}

func response(status int, body io.Reader) *http.Response {
	return &http.Response{StatusCode: status, Header: http.Header{}, Body: io.NopCloser(body)}
}

func TestClassify(t *testing.T) {
	const chunk = `data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":" the","finish_reason":null}]}` + "\n\n"
	const role = `data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}` + "\n\n"
	const chatChunk = `data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" and"}}]}` + "\n\n"
	const done = "data: [DONE]\n\n"
	const reasoning = `data: {"choices":[{"index":0,"delta":{"reasoning_content":"hm"}}]}` + "\n\n"
	const tool = `data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{"}}]}}]}` + "\n\n"
	const errEvent = `data: {"error":{"message":"the replica's stream broke","type":"server_error","code":"upstream_stream_error"}}` + "\n\n"
	tests := []struct {
		name      string
		status    int
		body      io.Reader
		stream    bool
		want      Class
		streamErr bool
	}{
		{"complete completion", 200, strings.NewReader(`{"choices":[{"text":" the and"}],"usage":{"completion_tokens":2}}`), false, Succeeded, false},
		{"complete chat", 200, strings.NewReader(`{"choices":[{"message":{"role":"assistant","content":" a b"}}],"usage":{"completion_tokens":2}}`), false, Succeeded, false},
		{"short answer", 200, strings.NewReader(`{"choices":[{"text":" the"}],"usage":{"completion_tokens":1}}`), false, Lost, false},
		{"no usage", 200, strings.NewReader(`{"choices":[{"text":" the and"}]}`), false, Lost, false},
		{"malformed 200", 200, strings.NewReader(`{"choices":[`), false, Lost, false},
		{"body cut", 200, &cutReader{strings.NewReader(`{"choices":[{"text":" the and"}],"usage":{"completion_tokens":2}}`)}, false, Lost, false},
		{"openai error 502", 502, strings.NewReader(`{"error":{"message":"upstream: refused","type":"server_error","code":"upstream_error"}}`), false, FailedClear, false},
		{"openai error 429 on a stream request", 429, strings.NewReader(`{"error":{"message":"slow down","type":"rate_limit_error"}}`), true, FailedClear, false},
		{"html error page", 502, strings.NewReader(`<html>Bad Gateway</html>`), false, Lost, false},
		{"error without a message", 500, strings.NewReader(`{"error":{"type":"server_error"}}`), false, Lost, false},
		{"redirect", 302, strings.NewReader(``), false, Lost, false},
		{"complete stream", 200, strings.NewReader(chunk + chunk + done), true, Succeeded, false},
		{"complete chat stream", 200, strings.NewReader(role + chatChunk + chatChunk + done), true, Succeeded, false},
		{"stream with an error event", 200, strings.NewReader(chunk + errEvent), true, FailedClear, true},
		{"stream error event, then [DONE]", 200, strings.NewReader(chunk + errEvent + done), true, FailedClear, true},
		{"stream error event not OpenAI-shaped", 200, strings.NewReader(chunk + `data: {"error":"x"}` + "\n\n"), true, Lost, false},
		{"stream ending without [DONE]", 200, strings.NewReader(chunk + chunk), true, Lost, false},
		{"stream cut", 200, &cutReader{strings.NewReader(chunk)}, true, Lost, false},
		{"stream short with [DONE]", 200, strings.NewReader(chunk + done), true, Lost, false},
		{"stream with a malformed chunk", 200, strings.NewReader(chunk + "data: {nope\n\n" + chunk + done), true, Lost, false},
		// openai.Chunk.HasToken: reasoning and tool-call deltas are tokens.
		{"reasoning and tool-call chunks", 200, strings.NewReader(role + reasoning + tool + done), true, Succeeded, false},
		{"vLLM's flat error event", 200, strings.NewReader(chunk + `data: {"object":"error","message":"x","type":"y"}` + "\n\n"), true, Lost, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			v := classify(response(tc.status, tc.body), tc.stream, 2, nil)
			if v.class != tc.want || v.streamErr != tc.streamErr {
				t.Fatalf("got %v (stream error %v, %q), want %v (stream error %v)", v.class, v.streamErr, v.reason, tc.want, tc.streamErr)
			}
			if v.class != Succeeded && v.reason == "" {
				t.Fatal("no reason given")
			}
		})
	}
}

// TestClassifyHangUp: a client that hangs up does so at the first chunk
// with a token (not at a role-only chunk); before any token, the answer is
// judged as usual.
func TestClassifyHangUp(t *testing.T) {
	const role = `data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}` + "\n\n"
	const chunk = `data: {"choices":[{"index":0,"text":" the"}]}` + "\n\n"
	calls := 0
	hang := func() bool { calls++; return true }
	v := classify(response(200, strings.NewReader(role+chunk+chunk+"data: [DONE]\n\n")), true, 2, hang)
	if v.class != HungUp || calls != 1 {
		t.Fatalf("got %v after %d calls, want hung-up after 1", v.class, calls)
	}
	v = classify(response(502, strings.NewReader(`{"error":{"message":"m","type":"server_error"}}`)), true, 2, hang)
	if v.class != FailedClear || calls != 1 {
		t.Fatalf("got %v after %d calls, want failed-clear with no hang-up", v.class, calls)
	}
}

// TestClientPlan: the misbehaving requests are where the plan puts them,
// the hang-up draws are seeded per request and near their share.
func TestClientPlan(t *testing.T) {
	p := clientPlan{hangUp: 0.5, slow: 2, overflowEvery: 20, poison: true, poisonAt: 60, adapterEvery: 3}
	want := map[int]behaviour{0: slowRead, 1: slowRead, 10: overflow, 30: overflow, 60: poison, 3: onAdapter, 99: onAdapter}
	for i, b := range want {
		if got := p.behaviour(i, 1); got != b {
			t.Errorf("request %d: behaviour %d, want %d", i, got, b)
		}
	}
	hung := 0
	for i := range 1000 {
		b := p.behaviour(i, 1)
		if b != p.behaviour(i, 1) {
			t.Fatalf("request %d: behaviour not deterministic", i)
		}
		if b == hangUp {
			hung++
		}
	}
	// 1000 − 2 slow − 50 overflow − 1 poison − 316 adapter leave 631 draws at 0.5.
	if hung < 260 || hung > 370 {
		t.Fatalf("%d hang-ups of 631 draws at 0.5", hung)
	}
	if (clientPlan{}).behaviour(0, 1) != ordinary {
		t.Fatal("the zero plan misbehaves")
	}
}

func TestCountdown(t *testing.T) {
	c := newCountdown(2)
	c.done()
	select {
	case <-c.open:
		t.Fatal("open after 1 of 2")
	default:
	}
	c.done()
	<-c.open
	<-newCountdown(0).open
}

func TestLostNetErr(t *testing.T) {
	if v := lostNetErr(context.DeadlineExceeded); v.class != Lost || !strings.Contains(v.reason, "deadline") {
		t.Fatalf("%+v", v)
	}
	if v := lostNetErr(errors.New("connection reset")); v.class != Lost || !strings.Contains(v.reason, "without an answer") {
		t.Fatalf("%+v", v)
	}
}

func TestRuleViolation(t *testing.T) {
	a, b, c, d := "http://a", "http://b", "http://c", "http://d"
	tests := []struct {
		name string
		as   []attempt
		ok   bool
	}{
		{"one attempt", []attempt{{target: a, status: 200}}, true},
		{"refused, then elsewhere", []attempt{{target: a, err: "connection refused"}, {target: b, status: 200}}, true},
		{"503 then 429 then elsewhere", []attempt{{target: a, status: 503}, {target: b, status: 429}, {target: c, status: 200}}, true},
		{"failed before sending, then elsewhere", []attempt{{target: a, err: "broken pipe"}, {target: b, status: 200}}, true},
		// Sent, then cut before any byte: the replica may be generating it,
		// or it may be a query of death.
		{"cut after sending, then elsewhere", []attempt{{target: a, wrote: true, err: "EOF"}, {target: b, status: 200}}, false},
		{"first-byte timeout, then elsewhere", []attempt{{target: a, wrote: true, err: "timeout awaiting response headers"}, {target: b, status: 200}}, false},
		{"again after a 200", []attempt{{target: a, status: 200}, {target: b, status: 200}}, false},
		{"again after a 500", []attempt{{target: a, status: 500}, {target: b, status: 200}}, false},
		{"same replica twice", []attempt{{target: a, status: 503}, {target: a, status: 200}}, false},
		{"past the budget", []attempt{{target: a, status: 503}, {target: b, status: 503}, {target: c, status: 503}, {target: d, status: 200}}, false},
		{"no attempt", nil, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			why := ruleViolation(tc.as, 2)
			if (why == "") != tc.ok {
				t.Fatalf("violation %q, want ok=%v", why, tc.ok)
			}
		})
	}
}

func TestQuantile(t *testing.T) {
	ms := func(v ...int) []time.Duration {
		out := make([]time.Duration, len(v))
		for i, x := range v {
			out[i] = time.Duration(x) * time.Millisecond
		}
		return out
	}
	tests := []struct {
		in   []time.Duration
		q    float64
		want time.Duration
	}{
		{nil, 0.5, 0},
		{ms(5), 0.99, 5 * time.Millisecond},
		{ms(4, 1, 3, 2), 0.5, 2 * time.Millisecond},
		{ms(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), 0.99, 10 * time.Millisecond},
		{ms(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), 0.9, 9 * time.Millisecond},
	}
	for _, tc := range tests {
		if got := quantile(tc.in, tc.q); got != tc.want {
			t.Errorf("quantile(%v, %v) = %v, want %v", tc.in, tc.q, got, tc.want)
		}
	}
}

func TestParseKinds(t *testing.T) {
	all, err := ParseKinds("all")
	if err != nil || len(all) != len(Kinds()) {
		t.Fatalf("all: %v %v", all, err)
	}
	got, err := ParseKinds(" refuse, overload ,")
	if err != nil || len(got) != 2 || got[0] != Refuse || got[1] != Overload {
		t.Fatalf("%v %v", got, err)
	}
	if _, err := ParseKinds("refuse,meteor"); !errors.Is(err, ErrUnknownKind) {
		t.Fatalf("unknown kind accepted: %v", err)
	}
}

// TestRunLoad: both loops send each index once, bound the requests in
// flight, and stop sending when the context ends.
func TestRunLoad(t *testing.T) {
	tests := []struct {
		name string
		spec loadSpec
	}{
		{"closed loop", loadSpec{first: 10, n: 50, concurrency: 4}},
		{"open loop", loadSpec{first: 0, n: 50, rate: 5000, maxInFlight: 3, seed: 7}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			seen := map[int]int{}
			var inFlight, peak atomic.Int64
			runLoad(context.Background(), tc.spec, func(_ context.Context, i int) {
				n := inFlight.Add(1)
				for {
					p := peak.Load()
					if n <= p || peak.CompareAndSwap(p, n) {
						break
					}
				}
				mu.Lock()
				seen[i]++
				mu.Unlock()
				inFlight.Add(-1)
			})
			if len(seen) != tc.spec.n {
				t.Fatalf("%d distinct requests, want %d", len(seen), tc.spec.n)
			}
			for i, c := range seen {
				if c != 1 || i < tc.spec.first || i >= tc.spec.first+tc.spec.n {
					t.Fatalf("request %d sent %d times", i, c)
				}
			}
			bound := int64(tc.spec.concurrency)
			if bound == 0 {
				bound = int64(tc.spec.maxInFlight)
			}
			if peak.Load() > bound {
				t.Fatalf("%d in flight, bound %d", peak.Load(), bound)
			}
		})
	}
	t.Run("cancelled", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		var sent atomic.Int64
		runLoad(ctx, loadSpec{n: 1000, rate: 0.01, maxInFlight: 10}, func(context.Context, int) {
			if sent.Add(1) == 1 {
				cancel() // the next arrival is minutes away: the loop must stop on ctx
			}
		})
		if sent.Load() != 1 {
			t.Fatalf("%d sent after the cancel", sent.Load())
		}
	})
}
