package gateway

import (
	"context"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

// tokenizeReplica is a replica whose first POST /tokenize waits for
// release (the others answer at once); started is closed when it arrives.
type tokenizeReplica struct {
	calls            atomic.Int64
	started, release chan struct{}
}

// startTokenizeGateway starts a replica as above and a gateway with the
// remote tokenizer in front of it, whose requests signal joined once they
// have started or joined the lookup of their prompt.
func startTokenizeGateway(t *testing.T, joined chan<- struct{}) (*testGW, *tokenizeReplica) {
	t.Helper()
	rep := &tokenizeReplica{started: make(chan struct{}), release: make(chan struct{})}
	s := newStub(t, "", okStream(1))
	mux := http.NewServeMux()
	mux.Handle("/", s.srv.Config.Handler)
	mux.HandleFunc("/tokenize", func(w http.ResponseWriter, r *http.Request) {
		if rep.calls.Add(1) == 1 {
			close(rep.started)
			select {
			case <-rep.release:
			case <-r.Context().Done():
				return
			}
		}
		_, _ = io.WriteString(w, `{"tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`)
	})
	s.srv.Config.Handler = mux
	cfg := baseConfig(s.srv.URL)
	cfg.Tokenizer = "remote"
	cfg.TokenizeTimeout = Duration(time.Minute) // the release decides, never this clock
	gw := startGateway(t, cfg)
	t.Cleanup(func() { // before the gateway's and the replica's (cleanups run last first)
		select {
		case <-rep.release:
		default:
			close(rep.release) // a failed test's blocked call
		}
	})
	eventually(t, "models listed", func() bool { return len(gw.g.Fleet().Models()) > 0 })
	gw.g.tok.testHookJoined = func() { joined <- struct{}{} }
	return gw, rep
}

// postAsync sends a completion request with ctx and reports its status (0:
// no response) on the returned channel.
func postAsync(ctx context.Context, url, body string) <-chan int {
	out := make(chan int, 1)
	go func() {
		status := 0
		defer func() { out <- status }()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
		if err != nil {
			return
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		status = resp.StatusCode
	}()
	return out
}

// waitN receives n signals from ch, bounded generously.
func waitN(t *testing.T, ch <-chan struct{}, n int, what string) {
	t.Helper()
	for i := range n {
		select {
		case <-ch:
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d %s", i, n, what)
		}
	}
}

// N concurrent requests with one prompt ask the replica once (singleflight):
// the first /tokenize call waits until every request has joined its lookup.
func TestRemoteTokenizeOnceForConcurrentPrompts(t *testing.T) {
	const n = 8
	joined := make(chan struct{}, n)
	gw, rep := startTokenizeGateway(t, joined)
	statuses := make([]<-chan int, n)
	for i := range n {
		statuses[i] = postAsync(t.Context(), gw.srv.URL, `{"model":"m","prompt":"one prompt, many clients"}`)
	}
	waitN(t, joined, n, "requests joined a lookup")
	close(rep.release)
	for i, st := range statuses {
		if s := <-st; s != http.StatusOK {
			t.Errorf("request %d: status %d", i, s)
		}
	}
	if c := rep.calls.Load(); c != 1 {
		t.Fatalf("%d /tokenize calls for %d concurrent identical prompts, want 1", c, n)
	}
	checkTokenizeResults(t, gw, map[string]float64{"remote": 1, "shared": n - 1, "fallback": 0})
}

// The client whose request started a lookup hangs up: it alone falls back;
// the requests that joined the lookup still get the replica's tokens.
func TestRemoteTokenizeLeaderHangUpFailsNoOther(t *testing.T) {
	const n = 4
	joined := make(chan struct{}, n)
	gw, rep := startTokenizeGateway(t, joined)
	const body = `{"model":"m","prompt":"the first client leaves"}`
	ctx, hangUp := context.WithCancel(t.Context())
	first := postAsync(ctx, gw.srv.URL, body)
	waitN(t, joined, 1, "first request joined")
	waitN(t, rep.started, 1, "first /tokenize call")
	others := make([]<-chan int, n-1)
	for i := range others {
		others[i] = postAsync(t.Context(), gw.srv.URL, body)
	}
	waitN(t, joined, n-1, "requests joined the first one's lookup")
	hangUp()
	<-first
	eventually(t, "the first request's fallback", func() bool {
		return counterValue(t, gw.g.reg, "kvgate_remote_tokenize_total", map[string]string{"result": "fallback"}) >= 1
	})
	close(rep.release)
	for i, st := range others {
		if s := <-st; s != http.StatusOK {
			t.Errorf("request %d: status %d", i+1, s)
		}
	}
	if c := rep.calls.Load(); c != 1 {
		t.Fatalf("%d /tokenize calls, want 1", c)
	}
	checkTokenizeResults(t, gw, map[string]float64{"remote": 0, "shared": n - 1, "fallback": 1})
}

// checkTokenizeResults compares kvgate_remote_tokenize_total by result.
func checkTokenizeResults(t *testing.T, gw *testGW, want map[string]float64) {
	t.Helper()
	for result, w := range want {
		if got := counterValue(t, gw.g.reg, "kvgate_remote_tokenize_total", map[string]string{"result": result}); got != w {
			t.Errorf("kvgate_remote_tokenize_total{result=%q} = %v, want %v", result, got, w)
		}
	}
}

// Finding 11: remote tokenization is spread over the healthy replicas and
// bounded by tokenize_timeout, falling back to the approximate tokenizer.
func TestRemoteTokenizerSpreadAndFallback(t *testing.T) {
	var slowCalls, fastCalls atomic.Int64
	tokenizer := func(calls *atomic.Int64, delay chan struct{}) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			calls.Add(1)
			if delay != nil {
				select {
				case <-delay:
				case <-r.Context().Done():
					return
				}
			}
			_, _ = io.WriteString(w, `{"tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`)
		}
	}
	never := make(chan struct{})
	defer close(never)
	mk := func(h http.HandlerFunc) *stub {
		s := newStub(t, "", okStream(1))
		mux := http.NewServeMux()
		mux.Handle("/", s.srv.Config.Handler)
		mux.HandleFunc("/tokenize", h)
		s.srv.Config.Handler = mux
		return s
	}
	slow, fast := mk(tokenizer(&slowCalls, never)), mk(tokenizer(&fastCalls, nil))
	cfg := baseConfig(slow.srv.URL, fast.srv.URL)
	cfg.Tokenizer = "remote"
	cfg.TokenizeTimeout = Duration(50 * time.Millisecond)
	gw := startGateway(t, cfg)
	eventually(t, "models listed", func() bool { return len(gw.g.Fleet().Models()) > 0 })
	for i := range 6 {
		r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"distinct prompt `+strings.Repeat("z", i)+`"}`)
		if r.Status != 200 {
			t.Fatalf("%d %s", r.Status, r.Body)
		}
	}
	if slowCalls.Load() == 0 || fastCalls.Load() != 6 {
		t.Fatalf("tokenize calls: slow %d, fast %d; want spread, every request answered by the fast one", slowCalls.Load(), fastCalls.Load())
	}
	// Both replicas slow: the approximate tokenizer routes, within the bound.
	cfg2 := baseConfig(slow.srv.URL)
	cfg2.Tokenizer = "remote"
	cfg2.TokenizeTimeout = Duration(20 * time.Millisecond)
	gw2 := startGateway(t, cfg2)
	if r := testutil.Post(t, nil, gw2.srv.URL+"/v1/completions", `{"model":"m","prompt":"fallback"}`); r.Status != 200 {
		t.Fatalf("fallback: %d %s", r.Status, r.Body)
	}
	if n := counterValue(t, gw2.g.reg, "kvgate_remote_tokenize_total", map[string]string{"result": "fallback"}); n != 1 {
		t.Fatalf("%v fallbacks, want 1", n)
	}
}

// The remote tokenizer gets a chat with what else its template renders:
// the tools, chat_template_kwargs (a thinking switch), a continued final
// message. Without them the engine's tokens, and the blocks its KV events
// report, are not the ones looked up, and precise mode never matches a
// tool-using agent's calls. Two chats that differ only there are two
// lookups, never one cached answer; a null field is as absent.
func TestChatTokenizeBodyRendersTools(t *testing.T) {
	body := []byte(`{"model":"m","messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":"bash"}}],` +
		`"chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":false,"continue_final_message":true,"chat_template":null,"max_tokens":3}`)
	p, err := prompt.Parse(prompt.Chat, body)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tokenizeBody(prompt.Chat, p, body)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"add_generation_prompt":false,"chat_template_kwargs":{"enable_thinking":false},"continue_final_message":true,` +
		`"messages":[{"role":"user","content":"q"}],"model":"m","tools":[{"type":"function","function":{"name":"bash"}}]}`
	if string(got) != want {
		t.Fatalf("tokenize body %s\nwant %s", got, want)
	}
	plain := []byte(`{"model":"m","messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":"bash"}}],"max_tokens":3}`)
	q, err := prompt.Parse(prompt.Chat, plain)
	if err != nil {
		t.Fatal(err)
	}
	if tokenizeKey(prompt.Chat, p) == tokenizeKey(prompt.Chat, q) {
		t.Fatal("chats rendered differently share a tokenizer cache key")
	}
	null := []byte(`{"model":"m","messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":"bash"}}],"chat_template_kwargs":null}`)
	r, err := prompt.Parse(prompt.Chat, null)
	if err != nil {
		t.Fatal(err)
	}
	if tokenizeKey(prompt.Chat, q) != tokenizeKey(prompt.Chat, r) {
		t.Fatal("a null field keyed apart from an absent one")
	}
}

// The tokenizer's cache key keeps each field apart whatever bytes it
// holds: a salt ending in NUL and a text starting after it are not another
// salt and text that spell the same bytes. Before, fields were separated
// by NUL, which a salt or a text may hold.
func TestTokenizeKeyFieldsApart(t *testing.T) {
	a := &prompt.Parsed{Model: "m", CacheSalt: "s\x00x", Text: "t"}
	b := &prompt.Parsed{Model: "m", CacheSalt: "s", Text: "x\x00t"}
	if tokenizeKey(prompt.Chat, a) == tokenizeKey(prompt.Chat, b) {
		t.Fatal("two salts and texts share a tokenizer cache key")
	}
}
