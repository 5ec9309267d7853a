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

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// pdSims starts 2 prefill and 2 decode simulated replicas: prefill URLs
// first.
func pdSims(t *testing.T) (pre, dec []string, fl *sim.Fleet) {
	t.Helper()
	fl = startSim(t, sim.Config{Replicas: 4,
		Roles: []engine.Role{engine.RolePrefill, engine.RolePrefill, engine.RoleDecode, engine.RoleDecode}})
	urls := fl.URLs()
	return urls[:2], urls[2:], fl
}

// pdConfig is a gateway configuration of decode replicas dec and prefill
// replicas pre, as the flags --replicas and --prefill-replicas make it.
func pdConfig(t *testing.T, policy string, pre, dec []string) Config {
	t.Helper()
	cfg := simConfig(policy)
	rs, err := ParseReplicaList(strings.Join(dec, ","), ReplicaLists{Prefill: strings.Join(pre, ",")})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Replicas = rs
	return cfg
}

// waitPD waits until every replica is scraped and lists its models: a
// prefill replica not yet listed is no candidate, and requests would go to
// the decode replicas alone.
func waitPD(t *testing.T, gw *testGW) {
	t.Helper()
	waitHealthy(t, gw)
	rt := gw.g.Router()
	eventually(t, "every replica's models listed", func() bool {
		for i := range rt.Replicas() {
			if rt.Replica(i).Served() == nil {
				return false
			}
		}
		return true
	})
}

// pdHeaders checks a disaggregated answer's headers: the decode replica
// that answered, and the prefill replica whose KV it pulled.
func pdHeaders(t *testing.T, what string, h http.Header, pre, dec []string) {
	t.Helper()
	if r, p := h.Get("X-Kvgate-Replica"), h.Get(headerPrefill); !slices.Contains(dec, r) || !slices.Contains(pre, p) {
		t.Fatalf("%s: X-Kvgate-Replica %q (want one of %v), X-Kvgate-Prefill %q (want one of %v)", what, r, dec, p, pre)
	}
	if pull := h.Get(sim.HeaderKVPull); pull != "pulled" {
		t.Fatalf("%s: the decode replica did not pull the prompt's KV: %s %q", what, sim.HeaderKVPull, pull)
	}
}

// The official OpenAI client works through a gateway in front of 2
// prefill and 2 decode replicas, streamed and not, chat and completions:
// each request is prefilled on a prefill replica, whose KV the decode
// replica pulls, and both are named in the headers.
func TestPDOpenAIClient(t *testing.T) {
	pre, dec, _ := pdSims(t)
	gw := startGateway(t, pdConfig(t, "ttft", pre, dec))
	waitPD(t, gw)
	ctx := context.Background()
	c := client(gw.srv.URL)
	ignoreEOS := option.WithJSONSet("ignore_eos", true)
	long := func(s string) string { return s + strings.Repeat(" Tell me more about "+s+".", 20) }
	var raw *http.Response
	comp, err := c.Completions.New(ctx, openai.CompletionNewParams{Model: sim.DefaultModel,
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(long("caches"))}, MaxTokens: openai.Int(5)},
		ignoreEOS, option.WithResponseInto(&raw))
	if err != nil || comp.Usage.CompletionTokens != 5 || len(comp.Choices) != 1 {
		t.Fatalf("completion %v %+v", err, comp)
	}
	pdHeaders(t, "completion", raw.Header, pre, dec)
	if want := comp.Usage.PromptTokens - 1; comp.Usage.PromptTokensDetails.CachedTokens != want {
		t.Fatalf("completion: cached_tokens %d, want %d (all pulled but the last token)", comp.Usage.PromptTokensDetails.CachedTokens, want)
	}
	st := c.Completions.NewStreaming(ctx, openai.CompletionNewParams{Model: sim.DefaultModel,
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(long("streams"))},
		MaxTokens: openai.Int(6), StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}},
		ignoreEOS, option.WithResponseInto(&raw))
	text := ""
	for st.Next() {
		for _, ch := range st.Current().Choices {
			text += ch.Text
		}
	}
	if err := st.Err(); err != nil || (prompt.Approx{}).Count(text) != 6 {
		t.Fatalf("stream: %v %q", err, text)
	}
	st.Close()
	pdHeaders(t, "streamed completion", raw.Header, pre, dec)
	msgs := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(long("Be brief.")), openai.UserMessage("Hi")}
	chat, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: sim.DefaultModel, Messages: msgs,
		MaxCompletionTokens: openai.Int(4)}, ignoreEOS, option.WithResponseInto(&raw))
	if err != nil || chat.Usage.CompletionTokens != 4 || chat.Choices[0].Message.Role != "assistant" {
		t.Fatalf("chat %v %+v", err, chat)
	}
	pdHeaders(t, "chat", raw.Header, pre, dec)
	msgs = []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(long("Be long.")), openai.UserMessage("Hi")}
	cs := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{Model: sim.DefaultModel, Messages: msgs,
		MaxTokens: openai.Int(7)}, ignoreEOS, option.WithResponseInto(&raw))
	var acc openai.ChatCompletionAccumulator
	for cs.Next() {
		acc.AddChunk(cs.Current())
	}
	if err := cs.Err(); err != nil || (prompt.Approx{}).Count(acc.Choices[0].Message.Content) != 7 {
		t.Fatalf("chat stream %v %+v", err, acc.Choices)
	}
	cs.Close()
	pdHeaders(t, "streamed chat", raw.Header, pre, dec)
	waitIdle(t, gw)
	if n := counterValue(t, gw.g.reg, "kvgate_pd_attempts_total", map[string]string{"step": "prefill", "verdict": "served"}); n != 4 {
		t.Fatalf("%v prefill steps served, want 4", n)
	}
	// Observed as the handler ends, a moment after the counts go down.
	eventually(t, "the time to first token of the 2 streamed requests (the whole path)", func() bool {
		return histogramCount(t, gw, "kvgate_time_to_first_token_seconds") == 2
	})
	if n := histogramCount(t, gw, "kvgate_prefill_step_seconds"); n != 4 {
		t.Fatalf("%d prefill step durations observed, want 4", n)
	}
}

// histogramCount is the number of observations of a histogram.
func histogramCount(t *testing.T, gw *testGW, name string) uint64 {
	t.Helper()
	fams, err := gw.g.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n uint64
	for _, f := range fams {
		if f.GetName() == name {
			for _, m := range f.GetMetric() {
				n += m.GetHistogram().GetSampleCount()
			}
		}
	}
	return n
}

// conversation is a chat's history as a request body.
type conversation struct{ msgs []map[string]string }

func (c *conversation) add(role, content string) {
	c.msgs = append(c.msgs, map[string]string{"role": role, "content": content})
}

func (c *conversation) body(maxTokens int) string {
	b, _ := json.Marshal(map[string]any{"model": sim.DefaultModel, "max_tokens": maxTokens, "ignore_eos": true, "messages": c.msgs})
	return string(b)
}

// usageOfBody reads a non-streamed answer's usage.
func usageOfBody(t *testing.T, body string) openai.CompletionUsage {
	t.Helper()
	var ans struct {
		Usage openai.CompletionUsage `json:"usage"`
	}
	if err := json.Unmarshal([]byte(body), &ans); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	return ans.Usage
}

// A conversation's later turns use what its first turn left: either the
// prefill step goes to the prefill replica holding the conversation
// (whose prefix cache hits), or it is skipped and the decode replica
// holding the conversation computes the new part itself (its own cache
// hits). Both show in the headers and the usage.
func TestPDConversation(t *testing.T) {
	pre, dec, fl := pdSims(t)
	cfg := pdConfig(t, "ttft", pre, dec)
	cfg.RouteReceipts = true
	gw := startGateway(t, cfg)
	waitPD(t, gw)
	replica := map[string]*sim.Replica{}
	for _, r := range fl.Replicas() {
		replica[r.URL()] = r
	}
	var conv conversation
	conv.add("system", strings.Repeat("You are a helpful assistant who answers at length. ", 30))
	var holderP, holderD string
	lastPrompt, hits, skips := 0, 0, 0
	for turn := range 6 {
		if turn == 5 {
			// Regenerate: the same conversation again, as chat UIs do. The
			// decode replica lacks at most one block: the step is skipped.
			conv.msgs = conv.msgs[:len(conv.msgs)-1]
		} else {
			conv.add("user", fmt.Sprintf("Question %d: %s", turn, strings.Repeat("and why is that so? ", 10+turn*turn)))
		}
		var before int64
		if holderP != "" {
			before = replica[holderP].Stats().PrefixHits
		}
		resp, body := post(t, gw.srv.URL+"/v1/chat/completions", conv.body(4))
		if resp.StatusCode != 200 {
			t.Fatalf("turn %d: %d %s", turn, resp.StatusCode, body)
		}
		u := usageOfBody(t, body)
		p, d := resp.Header.Get(headerPrefill), resp.Header.Get("X-Kvgate-Replica")
		// The receipt tells the request's cache hit, its prefill step's: the
		// decode replica's usage counts the pulled prompt as cached.
		if pc, ok := ReceiptPrefillCached(resp.Header); ok != (p != "") || ok && int64(pc) > u.PromptTokens {
			t.Fatalf("turn %d (prefill %q): prefill_cached_tokens %d %v in %q", turn, p, pc, ok, resp.Header.Get(headerRoute))
		}
		switch {
		case turn == 0:
			pdHeaders(t, "first turn", resp.Header, pre, dec)
			holderP, holderD = p, d
			if pc, _ := ReceiptPrefillCached(resp.Header); pc != 0 {
				t.Fatalf("first turn: its prefill step reported %d cached tokens", pc)
			}
		case p != "":
			// Prefilled again: on the replica holding the conversation, whose
			// cache held the previous turn's prompt (its full blocks).
			pdHeaders(t, fmt.Sprintf("turn %d", turn), resp.Header, pre, dec)
			got := replica[holderP].Stats().PrefixHits - before
			if p != holderP || got < int64(lastPrompt/16*16-16) {
				t.Fatalf("turn %d prefilled on %s (first turn: %s), its cache hit %d tokens; the previous prompt had %d",
					turn, p, holderP, got, lastPrompt)
			}
			if pc, _ := ReceiptPrefillCached(resp.Header); int64(pc) != got {
				t.Fatalf("turn %d: the receipt says the prefill step hit %d tokens, its replica %d", turn, pc, got)
			}
			hits++
		default:
			// Skipped: the decode replica holding the conversation computed
			// the rest (its own cache hit), nothing pulled.
			if d != holderD || resp.Header.Get(sim.HeaderKVPull) != "" || u.PromptTokensDetails.CachedTokens < int64(lastPrompt/16*16-16) {
				t.Fatalf("turn %d skipped the prefill on %s (first turn: %s), pull %q, cached %d of %d; the previous prompt had %d",
					turn, d, holderD, resp.Header.Get(sim.HeaderKVPull), u.PromptTokensDetails.CachedTokens, u.PromptTokens, lastPrompt)
			}
			skips++
		}
		lastPrompt, holderD = int(u.PromptTokens), d
		conv.add("assistant", "Because caches are fast.")
		waitIdle(t, gw) // the user reads the answer: the gateway has settled it
	}
	t.Logf("later turns: %d prefilled on the conversation's prefill replica, %d skipped", hits, skips)
	if skips == 0 {
		t.Fatalf("no later turn skipped the prefill step (%d prefilled on the holder)", hits)
	}
	waitIdle(t, gw)
	if n := counterValue(t, gw.g.reg, "kvgate_prefill_skipped_total", map[string]string{"reason": "threshold"}); int(n) != skips {
		t.Fatalf("kvgate_prefill_skipped_total{reason=threshold} %v, %d turns skipped", n, skips)
	}
}

// pdFake is a replica serving the sim's model whose completions answer
// status (when not 0; -1: no answer until the request is cancelled) or a
// prefill answer without kv_transfer_params (a replica that is not a KV
// producer); it keeps the bodies it got.
type pdFake struct {
	srv    *httptest.Server
	status atomic.Int64
	mu     sync.Mutex
	bodies []string
}

func newPDFake(t *testing.T, status int) *pdFake {
	f := &pdFake{}
	f.status.Store(int64(status))
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("/metrics", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"+
			"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")
	})
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"`+sim.DefaultModel+`","object":"model"}]}`)
	})
	mux.HandleFunc("/v1/", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.bodies = append(f.bodies, string(b))
		f.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		if f.status.Load() < 0 {
			<-r.Context().Done()
			return
		}
		if s := f.status.Load(); s != 0 {
			w.WriteHeader(int(s))
			fmt.Fprintf(w, `{"error":{"message":"status %d","type":"x","code":"y"}}`, s)
			return
		}
		_, _ = io.WriteString(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}],`+
			`"usage":{"prompt_tokens":90,"completion_tokens":1,"total_tokens":91},"kv_transfer_params":null}`)
	})
	f.srv = httptest.NewServer(mux)
	t.Cleanup(f.srv.Close)
	return f
}

func (f *pdFake) got() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.bodies)
}

// longPrompt is a completions body whose prompt no replica holds.
func longPrompt(i int, extra string) string {
	return fmt.Sprintf(`{"model":%q,"prompt":"request %d %s","max_tokens":3,"ignore_eos":true%s}`,
		sim.DefaultModel, i, strings.Repeat("tell me about prefill and decode. ", 12), extra)
}

// A prefill replica that refuses (503) is retried on the other prefill
// replica: every request succeeds through the good one, and the refusals
// count against the refusing replica only. The refusing replica got
// vLLM's prefill request: the client's body with the proxy's parameters.
func TestPDPrefillRefusedIsRetried(t *testing.T) {
	pre, dec, _ := pdSims(t)
	bad := newPDFake(t, http.StatusServiceUnavailable)
	cfg := pdConfig(t, "round_robin", []string{bad.srv.URL, pre[0]}, dec)
	cfg.EjectAfter = 1000 // keep it in rotation: only the retry saves the requests
	gw := startGateway(t, cfg)
	waitPD(t, gw)
	for i := range 6 {
		resp, body := post(t, gw.srv.URL+"/v1/completions", longPrompt(i, `,"stream":true,"stream_options":{"include_usage":true},"seed":7`))
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
		pdHeaders(t, fmt.Sprintf("request %d", i), resp.Header, pre[:1], dec)
	}
	got := bad.got()
	if len(got) == 0 {
		t.Fatal("round robin never picked the refusing prefill replica")
	}
	// The client's body as sent, less stream, stream_options and
	// max_tokens, then the proxy's members.
	i := strings.Index(got[0], "request ")
	n := got[0][i+len("request ") : i+len("request 0")]
	want := `{"model":"` + sim.DefaultModel + `","prompt":"request ` + n + " " + strings.Repeat("tell me about prefill and decode. ", 12) +
		`","ignore_eos":true,"seed":7,"kv_transfer_params":` + string(prefillKVParams) + `,"stream":false,"max_tokens":1}`
	if i < 0 || got[0] != want {
		t.Fatalf("the prefill step's body\n got %s\nwant %s", got[0], want)
	}
	waitIdle(t, gw)
	refused := counterValue(t, gw.g.reg, "kvgate_pd_attempts_total", map[string]string{"step": "prefill", "replica": bad.srv.URL, "verdict": "refused"})
	if int(refused) != len(got) || counterValue(t, gw.g.reg, "kvgate_retries_total", nil) != refused {
		t.Fatalf("%v refusals counted, %d sent; %v retries", refused, len(got), counterValue(t, gw.g.reg, "kvgate_retries_total", nil))
	}
}

// Every prefill replica refusing: the decode replica computes the prompt
// itself once no retry is left; a prefill replica answering without
// kv_transfer_params (not a KV producer) counts against it, and the
// decode replica computes the prompt at once.
func TestPDPrefillFallback(t *testing.T) {
	_, dec, _ := pdSims(t)
	a, b := newPDFake(t, http.StatusServiceUnavailable), newPDFake(t, http.StatusServiceUnavailable)
	cfg := pdConfig(t, "ttft", []string{a.srv.URL, b.srv.URL}, dec)
	cfg.Retries, cfg.EjectAfter = 1, 1000
	gw := startGateway(t, cfg)
	waitPD(t, gw)
	resp, body := post(t, gw.srv.URL+"/v1/completions", longPrompt(0, ""))
	if resp.StatusCode != 200 || resp.Header.Get(headerPrefill) != "" || !slices.Contains(dec, resp.Header.Get("X-Kvgate-Replica")) {
		t.Fatalf("every prefill refusing: %d %v %s", resp.StatusCode, resp.Header, body)
	}
	if len(a.got()) != 1 || len(b.got()) != 1 {
		t.Fatalf("prefill steps sent: %d and %d, want 1 each (retries 1)", len(a.got()), len(b.got()))
	}
	if n := counterValue(t, gw.g.reg, "kvgate_prefill_fallbacks_total", map[string]string{"reason": "prefill_failed"}); n != 1 {
		t.Fatalf("prefill_failed fallbacks %v", n)
	}
	a.status.Store(0)
	b.status.Store(0)
	resp, body = post(t, gw.srv.URL+"/v1/completions", longPrompt(1, ""))
	if resp.StatusCode != 200 || resp.Header.Get(headerPrefill) != "" || usageOfBody(t, body).CompletionTokens != 3 {
		t.Fatalf("prefill without kv_transfer_params: %d %v %s", resp.StatusCode, resp.Header, body)
	}
	waitIdle(t, gw)
	if n := counterValue(t, gw.g.reg, "kvgate_prefill_fallbacks_total", map[string]string{"reason": "no_kv_transfer_params"}); n != 1 {
		t.Fatalf("no_kv_transfer_params fallbacks %v", n)
	}
	if n := counterValue(t, gw.g.reg, "kvgate_pd_attempts_total", map[string]string{"step": "prefill", "verdict": "failed"}); n != 1 {
		t.Fatalf("a prefill answer without kv_transfer_params counted %v failures, want 1", n)
	}
}

// A prefill step's 4xx is the client's answer: not retried, not counted
// against the replica (eject_after 1 ejects nothing), and the fleet serves
// the next request.
func TestPDPrefillClientError(t *testing.T) {
	pre, dec, _ := pdSims(t)
	cfg := pdConfig(t, "ttft", pre, dec)
	cfg.EjectAfter = 1
	gw := startGateway(t, cfg)
	waitPD(t, gw)
	// The sim, as vLLM's NixlConnector, transfers one sequence: n 2 is refused.
	resp, body := post(t, gw.srv.URL+"/v1/completions", longPrompt(0, `,"n":2`))
	var e errorBody
	if resp.StatusCode != 400 || json.Unmarshal([]byte(body), &e) != nil || e.Error.Message == "" {
		t.Fatalf("n 2: %d %s", resp.StatusCode, body)
	}
	if p := resp.Header.Get(headerPrefill); !slices.Contains(pre, p) || resp.Header.Get("X-Kvgate-Replica") != p {
		t.Fatalf("the prefill replica's answer names it: %v", resp.Header)
	}
	waitIdle(t, gw)
	reg := gw.g.reg
	if n := counterValue(t, reg, "kvgate_pd_attempts_total", nil); n != 1 || counterValue(t, reg, "kvgate_retries_total", nil) != 0 {
		t.Fatalf("%v attempts, %v retries: a client error was retried", n, counterValue(t, reg, "kvgate_retries_total", nil))
	}
	if n := counterValue(t, reg, "kvgate_pd_attempts_total", map[string]string{"verdict": "rejected"}); n != 1 {
		t.Fatalf("rejected %v", n)
	}
	for i := range gw.g.Router().Replicas() {
		if !gw.g.Router().Healthy(i) {
			t.Fatalf("replica %s ejected after a client error", gw.g.Router().Name(i))
		}
	}
	if resp, body := post(t, gw.srv.URL+"/v1/completions", longPrompt(1, "")); resp.StatusCode != 200 {
		t.Fatalf("next request: %d %s", resp.StatusCode, body)
	}
}

// /debug/route shows a prefill/decode fleet's pair: the decode replica as
// replica_url, the prefill replica as prefill_url, or why it is skipped.
func TestPDDebugRoute(t *testing.T) {
	pre, dec, _ := pdSims(t)
	cfg := pdConfig(t, "ttft", pre, dec)
	cfg.AdminToken = "s3cret"
	gw := startGateway(t, cfg)
	waitPD(t, gw)
	route := func(body string) map[string]any {
		resp, out := post(t, gw.srv.URL+"/debug/route", body, "Authorization", "Bearer s3cret")
		var m map[string]any
		if resp.StatusCode != 200 || json.Unmarshal([]byte(out), &m) != nil {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
		return m
	}
	m := route(longPrompt(0, ""))
	if !slices.Contains(dec, fmt.Sprint(m["replica_url"])) || !slices.Contains(pre, fmt.Sprint(m["prefill_url"])) || m["skip_reason"] != nil {
		t.Fatalf("cold: %v", m)
	}
	reps, _ := m["replicas"].([]any)
	roles := map[string]string{}
	for _, r := range reps {
		r := r.(map[string]any)
		roles[fmt.Sprint(r["url"])] = fmt.Sprint(r["role"])
	}
	if len(reps) != 4 || roles[pre[0]] != "prefill" || roles[dec[0]] != "decode" {
		t.Fatalf("replicas: %v", m["replicas"])
	}
	if resp, body := post(t, gw.srv.URL+"/v1/completions", longPrompt(0, "")); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	waitIdle(t, gw)
	if m := route(longPrompt(0, "")); m["skip_reason"] != "threshold" || m["prefill_url"] != nil {
		t.Fatalf("the same prompt again: %v", m)
	}
}

// A decode replica that refuses before the decode step starts sends the
// decode step to another decode replica, pulling the same prefill's KV
// (pd_held_test.go); the refusing one got the client's request with the
// prefill's parameters.
func TestPDDecodeRefusedRoutesAgain(t *testing.T) {
	pre, dec, _ := pdSims(t)
	bad := newPDFake(t, http.StatusServiceUnavailable)
	cfg := pdConfig(t, "round_robin", pre, []string{bad.srv.URL, dec[0]})
	cfg.EjectAfter = 1000
	gw := startGateway(t, cfg)
	waitPD(t, gw)
	for i := range 4 {
		resp, body := post(t, gw.srv.URL+"/v1/completions", longPrompt(i, `,"stream":true`))
		if resp.StatusCode != 200 || !strings.HasSuffix(body, "data: [DONE]\n\n") {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
		pdHeaders(t, fmt.Sprintf("request %d", i), resp.Header, pre, dec[:1])
	}
	got := bad.got()
	if len(got) == 0 {
		t.Fatal("round robin never picked the refusing decode replica")
	}
	var req struct {
		Stream bool `json:"stream"`
		KV     struct {
			DoRemotePrefill bool    `json:"do_remote_prefill"`
			RemoteBlockIDs  []int64 `json:"remote_block_ids"`
			RemoteHost      string  `json:"remote_host"`
		} `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal([]byte(got[0]), &req); err != nil || !req.Stream || !req.KV.DoRemotePrefill ||
		len(req.KV.RemoteBlockIDs) == 0 || req.KV.RemoteHost == "" {
		t.Fatalf("the decode step's body: %v %s", err, got[0])
	}
	waitIdle(t, gw)
	refused := counterValue(t, gw.g.reg, "kvgate_pd_attempts_total", map[string]string{"step": "decode", "replica": bad.srv.URL, "verdict": "refused"})
	if int(refused) != len(got) {
		t.Fatalf("%v decode refusals counted, %d sent", refused, len(got))
	}
}

// A data-parallel replica's ranks keep its role.
func TestTargetsCarryRole(t *testing.T) {
	cfg := baseConfig("http://d:1", "http://p:1")
	cfg.Replicas[0].Role, cfg.Replicas[1].Role = "decode", "prefill"
	specs := targets(cfg.Replicas, []int{1, 2})
	if len(specs) != 3 || specs[0].Role != policy.RoleDecode || specs[1].Role != policy.RolePrefill ||
		specs[2].Role != policy.RolePrefill || !specs[2].Ranked || specs[2].Rank != 1 {
		t.Fatalf("%+v", specs)
	}
}

// A prefill replica that does not answer within first_byte_timeout fails
// its step (counted against it); with no retry left the decode replica
// computes the prompt.
func TestPDPrefillTimeout(t *testing.T) {
	_, dec, _ := pdSims(t)
	hung := newPDFake(t, -1)
	cfg := pdConfig(t, "ttft", []string{hung.srv.URL}, dec)
	cfg.Retries = 0
	gw, clk := gwWithClock(t, cfg)
	waitPD(t, gw)
	done := make(chan testutil.Response, 1)
	go func() { done <- testutil.Post(t, nil, gw.srv.URL+"/v1/completions", longPrompt(0, "")) }()
	eventually(t, "the prefill step at the hung replica", func() bool { return len(hung.got()) == 1 })
	clk.Advance(cfg.FirstByteTimeout.D())
	r := <-done
	if r.Status != 200 || r.Header.Get(headerPrefill) != "" || !slices.Contains(dec, r.Header.Get("X-Kvgate-Replica")) {
		t.Fatalf("%d %v %s", r.Status, r.Header, r.Body)
	}
	waitIdle(t, gw)
	if n := counterValue(t, gw.g.reg, "kvgate_pd_attempts_total", map[string]string{"replica": hung.srv.URL, "verdict": "failed"}); n != 1 {
		t.Fatalf("the hung prefill replica's failures: %v", n)
	}
}
