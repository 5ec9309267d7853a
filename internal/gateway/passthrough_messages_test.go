package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/prompt"
)

// messagesReplica is a replica of vLLM's Anthropic Messages API
// (vllm/entrypoints/anthropic/serving.py): /v1/messages answers a message,
// or its stream of named events (message_start, content blocks,
// message_delta with the usage, message_stop, no [DONE]); count_tokens
// answers input_tokens. usage is the usage object it reports.
type messagesReplica struct {
	srv   *httptest.Server
	usage string
	cut   atomic.Bool // a stream ends before message_stop

	mu     sync.Mutex
	bodies [][]byte
}

func newMessagesReplica(t *testing.T, usage string) *messagesReplica {
	t.Helper()
	f := &messagesReplica{usage: usage}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *messagesReplica) serve(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/health":
		return
	case "/metrics":
		_, _ = io.WriteString(w, "vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n")
		return
	case "/v1/models":
		_, _ = io.WriteString(w, defaultModels)
		return
	}
	body, _ := io.ReadAll(r.Body)
	f.mu.Lock()
	f.bodies = append(f.bodies, body)
	f.mu.Unlock()
	var req struct {
		Stream bool `json:"stream"`
	}
	_ = json.Unmarshal(body, &req)
	switch {
	case r.URL.Path == "/tokenize": // 40 token ids: 2 full blocks of 16
		_, _ = io.WriteString(w, `{"count":40,"max_model_len":4096,"tokens":[`+strings.TrimSuffix(strings.Repeat("7,", 40), ",")+`]}`)
	case r.URL.Path == "/v1/messages/count_tokens":
		_, _ = io.WriteString(w, `{"input_tokens":12,"context_management":{"original_input_tokens":12}}`)
	case !req.Stream:
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"chatcmpl-1","type":"message","role":"assistant","content":[{"type":"text","text":"usage \"usage\": 1"}],`+
			`"model":"m","stop_reason":"end_turn","stop_sequence":null,"usage":%s,"kv_transfer_params":null}`, f.usage)
	default:
		f.stream(w)
	}
}

func (f *messagesReplica) stream(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	ev := func(name, data string) { // each flushed, as vLLM streams (no Content-Length)
		fmt.Fprintf(w, "event: %s\ndata: %s\n\n", name, data)
		w.(http.Flusher).Flush()
	}
	ev("message_start", `{"type":"message_start","message":{"id":"chatcmpl-1","type":"message","role":"assistant","content":[],`+
		`"model":"m","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":7,"output_tokens":0}}}`)
	ev("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}`)
	ev("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}`)
	if f.cut.Load() {
		return
	}
	ev("content_block_stop", `{"type":"content_block_stop","index":0}`)
	ev("message_delta", `{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":`+f.usage+`}`)
	ev("message_stop", `{"type":"message_stop"}`)
}

func (f *messagesReplica) requests() [][]byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.bodies)
}

// claudeTurn is the body of turn n (1, 2 …) of a Claude Code–like
// conversation conv: a long system prompt behind the per-request billing
// header (bill), then its turns: a question, the assistant's tool call,
// its result, the next question.
func claudeTurn(conv string, n int, bill string) string {
	msgs := []string{fmt.Sprintf(`{"role":"user","content":[{"type":"text","text":"task %s: %s"}]}`, conv, strings.Repeat("fix the bug ", 40))}
	for i := 1; i < n; i++ {
		msgs = append(msgs,
			fmt.Sprintf(`{"role":"assistant","content":[{"type":"text","text":"looking"},{"type":"tool_use","id":"t%d","name":"bash","input":{"cmd":"ls %d"}}]}`, i, i),
			fmt.Sprintf(`{"role":"user","content":[{"type":"tool_result","tool_use_id":"t%d","content":"%s"},{"type":"text","text":"go on %d"}]}`,
				i, strings.Repeat("file.go ", 30), i))
	}
	return `{"model":"m","max_tokens":64,"system":[{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.3; cch=` + bill + `;"},` +
		`{"type":"text","text":"You are Claude Code ` + conv + `. ` + strings.Repeat("Follow the rules. ", 60) + `"}],` +
		`"metadata":{"user_id":"user_ab12_account__session_` + conv + `"},"messages":[` + strings.Join(msgs, ",") + `]}`
}

// A conversation's turns are routed by cache: each turn goes to the
// replica that holds the previous one's blocks, and its routing key
// begins with them. Claude Code's billing header, which changes with every
// request, does not change the key. Routed by load (before: the path was
// prompt.Other), turns scattered over the replicas.
func TestMessagesTurnsFollowTheirBlocks(t *testing.T) {
	var urls []string
	for range 3 {
		urls = append(urls, newMessagesReplica(t, `{"input_tokens":10,"output_tokens":2}`).srv.URL)
	}
	gw := startGateway(t, baseConfig(urls...))
	allListed(t, gw)
	ctx := context.Background()
	for c := range 4 {
		conv := fmt.Sprintf("conv-%d", c)
		_, k1, err1 := gw.g.prepare(ctx, prompt.Messages, []byte(claudeTurn(conv, 1, "aaaa")), nil, nil)
		_, k1b, err1b := gw.g.prepare(ctx, prompt.Messages, []byte(claudeTurn(conv, 1, "bbbb")), nil, nil)
		_, k2, err2 := gw.g.prepare(ctx, prompt.Messages, []byte(claudeTurn(conv, 2, "cccc")), nil, nil)
		if err1 != nil || err1b != nil || err2 != nil {
			t.Fatal(err1, err1b, err2)
		}
		if len(k1.Blocks) < 8 || !slices.Equal(k1.Blocks, k1b.Blocks) {
			t.Fatalf("%s: turn 1 has %d blocks; another billing header changed them: %v", conv, len(k1.Blocks), !slices.Equal(k1.Blocks, k1b.Blocks))
		}
		if len(k2.Blocks) <= len(k1.Blocks) || !slices.Equal(k2.Blocks[:len(k1.Blocks)], k1.Blocks) {
			t.Fatalf("%s: turn 2's key does not begin with turn 1's %d blocks", conv, len(k1.Blocks))
		}
		var at []string
		for n := 1; n <= 3; n++ {
			resp, body := post(t, gw.srv.URL+"/v1/messages", claudeTurn(conv, n, fmt.Sprintf("h%d%d", c, n)))
			if resp.StatusCode != 200 || !strings.Contains(body, `"type":"message"`) {
				t.Fatalf("%s turn %d: %d %s", conv, n, resp.StatusCode, body)
			}
			at = append(at, resp.Header.Get("X-Kvgate-Replica"))
		}
		if at[0] == "" || at[1] != at[0] || at[2] != at[0] {
			t.Fatalf("%s: turns went to %v, not to the replica holding the previous turn", conv, at)
		}
	}
	waitIdle(t, gw)
}

// Claude Code sends one session id (metadata.user_id, and its session
// header) on every request of a session, its subagents' and side calls'
// included. A session's turns are one program; a subagent (its own system
// prompt and task) is a program of its own, as Dynamo's session headers
// make it. A session header of kvgate's or Dynamo's names the program
// as it is, whatever the prompt. Before, a subagent was a turn of its
// parent's program: its context taken for the parent's, its home the
// parent's.
func TestClaudeCodeSubagentsArePrograms(t *testing.T) {
	gw := startGateway(t, baseConfig(newMessagesReplica(t, `{"input_tokens":10,"output_tokens":2}`).srv.URL))
	allListed(t, gw)
	ctx := context.Background()
	program := func(kind prompt.Kind, body string, h http.Header) uint64 {
		t.Helper()
		_, req, err := gw.g.prepare(ctx, kind, []byte(body), h, nil)
		if err != nil || req.Program.ID == 0 {
			t.Fatalf("%.80s: no program (%v)", body, err)
		}
		return req.Program.ID
	}
	main1 := program(prompt.Messages, claudeTurn("s1", 1, "aaaa"), nil)
	if main3 := program(prompt.Messages, claudeTurn("s1", 3, "bbbb"), nil); main3 != main1 {
		t.Fatal("a session's turns are not one program")
	}
	sub := `{"model":"m","max_tokens":64,"system":"You are a search subagent.","metadata":{"user_id":"user_ab12_account__session_s1"},` +
		`"messages":[{"role":"user","content":"find where the bug is"}]}`
	if program(prompt.Messages, sub, nil) == main1 {
		t.Fatal("a subagent of the session is a turn of its main program")
	}
	chat := func(system string) string {
		return fmt.Sprintf(`{"model":"m","max_tokens":4,"messages":[{"role":"system","content":%q},{"role":"user","content":"go"}]}`, system)
	}
	cc := http.Header{"X-Claude-Code-Session-Id": {"s2"}}
	if program(prompt.Chat, chat("main agent"), cc) == program(prompt.Chat, chat("subagent"), cc) {
		t.Fatal("Claude Code's session header: a subagent is a turn of its main program")
	}
	own := http.Header{"X-Session-Id": {"s3"}}
	if program(prompt.Chat, chat("main agent"), own) != program(prompt.Chat, chat("subagent"), own) {
		t.Fatal("X-Session-Id names one program whatever the prompt")
	}
	// A metadata.user_id whose session is empty names no session: the
	// header names the program, as it is (before, the empty session still
	// scoped it by the prompt's start).
	empty := func(system string) string {
		return fmt.Sprintf(`{"model":"m","max_tokens":4,"system":%q,"metadata":{"user_id":"user_ab12_account__session_"},`+
			`"messages":[{"role":"user","content":"go"}]}`, system)
	}
	if program(prompt.Messages, empty("main agent"), own) != program(prompt.Messages, empty("subagent"), own) {
		t.Fatal("an empty metadata session: X-Session-Id does not name one program")
	}
}

// The Messages usage corrects the tenant's quota and counts the tokens,
// streamed or not; vLLM's cache report (cache_read_input_tokens, input_
// tokens then the uncached ones) adds up to the prompt; counts are bounded
// as any replica's usage is.
func TestMessagesUsageCounted(t *testing.T) {
	cases := []struct {
		name, usage            string
		prompt, cached, output float64
	}{
		{"vllm", `{"input_tokens":40,"output_tokens":2}`, 40, 0, 2},
		{"with cache", `{"input_tokens":10,"output_tokens":3,"cache_read_input_tokens":30,"cache_creation_input_tokens":0}`, 40, 30, 3},
		{"bounded", `{"input_tokens":9000000000000000,"output_tokens":-4,"cache_read_input_tokens":9000000000000000}`,
			maxUsageTokens, maxUsageTokens, 0},
	}
	for _, tc := range cases {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s stream=%v", tc.name, stream), func(t *testing.T) {
				f := newMessagesReplica(t, tc.usage)
				cfg := baseConfig(f.srv.URL)
				cfg.Tenants = []TenantConfig{{Name: "t", APIKeys: []string{"k"}, TokensPerMinute: 1 << 30}}
				reg := prometheus.NewRegistry()
				gw := startGatewayWith(t, cfg, Options{Clock: clock.NewFake(time.Unix(6000, 0)), Registry: reg})
				allListed(t, gw)
				body := `{"model":"m","max_tokens":500,"messages":[{"role":"user","content":"hello there"}]}`
				if stream {
					body = strings.Replace(body, `"max_tokens"`, `"stream":true,"max_tokens"`, 1)
				}
				resp, out := post(t, gw.srv.URL+"/v1/messages", body, bearerHdr("k")...)
				if resp.StatusCode != 200 || strings.Contains(out, `"error"`) {
					t.Fatalf("%d %s", resp.StatusCode, out)
				}
				waitIdle(t, gw)
				want := [4]float64{tc.prompt, tc.cached, tc.output, tc.prompt + tc.output}
				var got [4]float64
				rep := map[string]string{"replica": f.srv.URL}
				counted := func() bool {
					got = [4]float64{counterValue(t, reg, "kvgate_tenant_tokens_total", map[string]string{"tenant": "t", "kind": "prompt"}),
						counterValue(t, reg, "kvgate_replica_cached_tokens_total", rep),
						counterValue(t, reg, "kvgate_tenant_tokens_total", map[string]string{"tenant": "t", "kind": "output"}),
						counterValue(t, reg, "kvgate_quota_used_tokens", map[string]string{"tenant": "t", "kind": "total"})}
					return got == want
				}
				if !counted() {
					eventually(t, fmt.Sprintf("prompt, cached, output tokens and the quota's use %v (now %v)", want, got), counted)
				}
			})
		}
	}
}

// An isolate_cache tenant's /v1/messages is refused (403, saying why):
// vLLM's Messages request takes no cache_salt, so its KV would be shared.
// Nothing reaches the replica. Another tenant's call goes, without the
// priority its band has (vLLM's Messages request takes none), and an
// isolated tenant may still count tokens (count_tokens shares no KV).
func TestMessagesIsolatedTenantRefused(t *testing.T) {
	f := newMessagesReplica(t, `{"input_tokens":4,"output_tokens":1}`)
	cfg := tenantsConfig(f.srv.URL)
	cfg.FlowControl.EnginePriority = true
	gw := startGateway(t, cfg)
	allListed(t, gw)
	body := `{"model":"m","max_tokens":5,"priority":-3,"messages":[{"role":"user","content":"secret"}]}`
	resp, out := post(t, gw.srv.URL+"/v1/messages", body, bearerHdr("k-gold")...)
	if resp.StatusCode != http.StatusForbidden || !strings.Contains(out, `"type":"permission_error"`) || !strings.Contains(out, "cache_salt") {
		t.Fatalf("an isolated tenant's Messages call: %d %s", resp.StatusCode, out)
	}
	if n := len(f.requests()); n != 0 {
		t.Fatalf("%d requests reached the replica", n)
	}
	if resp, out := post(t, gw.srv.URL+"/v1/messages", body, bearerHdr("k-bulk")...); resp.StatusCode != 200 {
		t.Fatalf("another tenant's call: %d %s", resp.StatusCode, out)
	}
	if got := string(f.requests()[0]); strings.Contains(got, "priority") || strings.Contains(got, "cache_salt") {
		t.Fatalf("the replica got %s", got)
	}
	count := `{"model":"m","messages":[{"role":"user","content":"secret"}]}`
	if resp, out := post(t, gw.srv.URL+"/v1/messages/count_tokens", count, bearerHdr("k-gold")...); resp.StatusCode != 200 {
		t.Fatalf("an isolated tenant's count_tokens: %d %s", resp.StatusCode, out)
	}
	waitIdle(t, gw)
}

// A malformed Messages body is the client's fault: 400 naming the field
// (Anthropic's error shape has no param: the message starts with it),
// nothing sent.
func TestMessagesMalformedBodies(t *testing.T) {
	f := newMessagesReplica(t, `{"input_tokens":4,"output_tokens":1}`)
	gw := startGateway(t, baseConfig(f.srv.URL))
	allListed(t, gw)
	const msgs = `"messages":[{"role":"user","content":"x"}]`
	for body, param := range map[string]string{
		`{"model":"m",` + msgs + `}`:                                                           "max_tokens",
		`{"model":"m","max_tokens":0,` + msgs + `}`:                                            "max_tokens",
		`{"model":"m","max_tokens":99999999,` + msgs + `}`:                                     "max_tokens",
		`{"max_tokens":3,` + msgs + `}`:                                                        "model",
		`{"model":["m"],"max_tokens":3,` + msgs + `}`:                                          "model",
		`{"model":"m","max_tokens":3,"messages":{}}`:                                           "messages",
		`{"model":"m","max_tokens":3,"messages":[{"role":"user","content":{}}]}`:               "messages[0].content",
		`{"model":"m","max_tokens":3,"messages":[{"role":"user","content":[{"type":"x"}]}]}`:   "messages[0].content[0].type",
		`{"model":"m","max_tokens":3,"messages":[{"role":"robot","content":"x"}]}`:             "messages[0].role",
		`{"model":"m","max_tokens":3,"system":{"text":"x"},` + msgs + `}`:                      "system",
		`{"model":"m","max_tokens":3,"metadata":{"user_id":["u"]},` + msgs + `}`:               "metadata.user_id",
		`{"model":"m","max_tokens":3,"messages":[{"role":"user","content":"x"}],"stream":"1"}`: "stream",
	} {
		resp, out := post(t, gw.srv.URL+"/v1/messages", body)
		if resp.StatusCode != 400 || !strings.HasPrefix(out, `{"type":"error","error":{"type":"invalid_request_error","message":"`+param+": ") {
			t.Errorf("%s: %d %s, want 400 naming %s", body, resp.StatusCode, out, param)
		}
	}
	if n := len(f.requests()); n != 0 {
		t.Fatalf("%d malformed requests reached the replica", n)
	}
}

// A Messages stream ends at message_stop (it has no [DONE]): whole, it is
// relayed as sent, its first content block its first token; cut before,
// it ends with an event named error.
func TestMessagesStreamEnd(t *testing.T) {
	f := newMessagesReplica(t, `{"input_tokens":4,"output_tokens":1}`)
	gw := startGateway(t, baseConfig(f.srv.URL))
	allListed(t, gw)
	body := `{"model":"m","max_tokens":5,"stream":true,"messages":[{"role":"user","content":"x"}]}`
	if resp, out := post(t, gw.srv.URL+"/v1/messages", body); resp.StatusCode != 200 ||
		!strings.HasSuffix(out, "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n") {
		t.Fatalf("a whole stream: %d %q", resp.StatusCode, out)
	}
	waitIdle(t, gw) // its first content block was its first token
	eventually(t, "the stream's time to first token observed", func() bool {
		return histogramCount(t, gw, "kvgate_time_to_first_token_seconds") == 1
	})
	f.cut.Store(true)
	if resp, out := post(t, gw.srv.URL+"/v1/messages", body); resp.StatusCode != 200 ||
		!strings.Contains(out, "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"api_error\",") || strings.Contains(out, "message_stop") {
		t.Fatalf("a stream cut short: %d %q", resp.StatusCode, out)
	}
	waitIdle(t, gw)
}

// The remote tokenizer gets a Messages call as the chat vLLM converts it
// to, tools included, so the token ids are those the engine computes.
func TestMessagesTokenizeBody(t *testing.T) {
	body := []byte(`{"model":"m","max_tokens":3,"system":[{"type":"text","text":"x-anthropic-billing-header: cch=1;"},{"type":"text","text":"S"}],` +
		`"tools":[{"name":"bash","description":"runs","input_schema":{"type":"object"}}],"messages":[{"role":"user","content":[{"type":"text","text":"q"}]}]}`)
	p, err := prompt.Parse(prompt.Messages, body)
	if err != nil {
		t.Fatal(err)
	}
	got, err := tokenizeBody(prompt.Messages, p, body)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q"}],"model":"m",` +
		`"tools":[{"type":"function","function":{"name":"bash","description":"runs","parameters":{"type":"object"}}}]}`
	if string(got) != want {
		t.Fatalf("tokenize body %s, want %s", got, want)
	}
}

// With the remote tokenizer, a Messages call is keyed by the engine's own
// token ids: the replica's /tokenize gets the converted chat, and the
// call's key is those ids' blocks.
func TestMessagesRemoteTokenizer(t *testing.T) {
	f := newMessagesReplica(t, `{"input_tokens":40,"output_tokens":1}`)
	cfg := baseConfig(f.srv.URL)
	cfg.Tokenizer = "remote"
	gw := startGateway(t, cfg)
	allListed(t, gw)
	body := `{"model":"m","max_tokens":5,"system":"S","messages":[{"role":"ctx","content":"q"}]}`
	if resp, out := post(t, gw.srv.URL+"/v1/messages", body); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	reqs := f.requests()
	if len(reqs) != 2 || string(reqs[0]) != `{"messages":[{"role":"system","content":"S"},{"role":"user","content":"q"}],"model":"m"}` ||
		string(reqs[1]) != body {
		t.Fatalf("the replica got %q", reqs)
	}
	_, key, err := gw.g.prepare(context.Background(), prompt.Messages, []byte(body), nil, nil)
	if err != nil || key.Tokens != 40 || len(key.Blocks) != 2 {
		t.Fatalf("key: %d tokens, %d blocks, %v", key.Tokens, len(key.Blocks), err)
	}
	waitIdle(t, gw)
}
