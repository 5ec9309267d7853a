package sim

import (
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

// errorCase is a request the sim answers with an OpenAI error.
type errorCase struct {
	name, path, body string
	status           int
	code, param      string
}

// validationCases are vLLM's 400s for the fields the sim reads, on a
// replica whose max_model_len is 128; long is a 120-token prompt.
func validationCases(long string) []errorCase {
	const cmpl, chat = "/v1/completions", "/v1/chat/completions"
	c := func(extra string) string { return `{"model":"sim-llama-8b","prompt":"x",` + extra + `}` }
	m := func(extra string) string {
		return `{"model":"sim-llama-8b","messages":[{"role":"user","content":"x"}],` + extra + `}`
	}
	const ctx = "context_length_exceeded"
	return []errorCase{
		{"max_tokens 0", cmpl, c(`"max_tokens":0`), 400, "", "max_tokens"},
		{"max_tokens negative", cmpl, c(`"max_tokens":-1`), 400, "", "max_tokens"},
		{"max_tokens fraction", cmpl, c(`"max_tokens":1.5`), 400, "", "max_tokens"},
		{"max_tokens string", cmpl, c(`"max_tokens":"5"`), 400, "", "max_tokens"},
		{"max_tokens bool", cmpl, c(`"max_tokens":true`), 400, "", "max_tokens"},
		{"max_tokens object", cmpl, c(`"max_tokens":{}`), 400, "", "max_tokens"},
		{"max_tokens int64 max", cmpl, c(`"max_tokens":9223372036854775807`), 400, ctx, "max_tokens"},
		{"max_tokens beyond int64", cmpl, c(`"max_tokens":92233720368547758070`), 400, ctx, "max_tokens"},
		{"max_tokens 1e30", cmpl, c(`"max_tokens":1e30`), 400, ctx, "max_tokens"},
		{"max_tokens -1e30", cmpl, c(`"max_tokens":-1e30`), 400, "", "max_tokens"},
		{"max_completion_tokens int64 max", chat, m(`"max_completion_tokens":9223372036854775807`), 400, ctx,
			"max_completion_tokens"},
		{"max_completion_tokens 0", chat, m(`"max_completion_tokens":0`), 400, "", "max_completion_tokens"},
		{"max_completion_tokens on completions", cmpl, c(`"max_completion_tokens":-3`), 400, "",
			"max_completion_tokens"},
		{"prompt + max_tokens", cmpl, `{"model":"sim-llama-8b","prompt":` + long + `,"max_tokens":9}`, 400, ctx,
			"max_tokens"},
		{"prompt + default max_tokens", cmpl, `{"model":"sim-llama-8b","prompt":` + long + `}`, 400, ctx, "prompt"},
		{"prompt alone", cmpl, `{"model":"sim-llama-8b","prompt":` + jsonString(words("lng", 128)) +
			`,"max_tokens":1}`, 400, ctx, "prompt"},
		{"messages alone", chat, `{"model":"sim-llama-8b","messages":[{"role":"user","content":` +
			jsonString(words("lng", 130)) + `}]}`, 400, ctx, "messages"},
		{"n 0", cmpl, c(`"n":0`), 400, "", "n"},
		{"n negative", cmpl, c(`"n":-1`), 400, "", "n"},
		{"n too many", cmpl, c(`"n":129`), 400, "", "n"},
		{"n beyond int64", cmpl, c(`"n":1e300`), 400, "", "n"},
		{"n string", cmpl, c(`"n":"2"`), 400, "", "n"},
		{"n × prompts", cmpl, `{"model":"sim-llama-8b","prompt":["a","b","c"],"n":64}`, 400, "", "n"},
		{"min_tokens negative", cmpl, c(`"min_tokens":-1`), 400, "", "min_tokens"},
		{"min_tokens beyond int64", cmpl, c(`"min_tokens":1e30`), 400, "", "min_tokens"},
		{"min_tokens fraction", cmpl, c(`"min_tokens":0.5`), 400, "", "min_tokens"},
		{"seed beyond int64", cmpl, c(`"seed":9223372036854775808`), 400, "", "seed"},
		{"seed fraction", cmpl, c(`"seed":1.5`), 400, "", "seed"},
		{"logprobs too many", cmpl, c(`"logprobs":21`), 400, "", "logprobs"},
		{"logprobs negative", cmpl, c(`"logprobs":-1`), 400, "", "logprobs"},
		{"logprobs bool on completions", cmpl, c(`"logprobs":true`), 400, "", "logprobs"},
		{"logprobs int on chat", chat, m(`"logprobs":2`), 400, "", "logprobs"},
		{"top_logprobs without logprobs", chat, m(`"top_logprobs":2`), 400, "", "top_logprobs"},
		{"top_logprobs too many", chat, m(`"logprobs":true,"top_logprobs":21`), 400, "", "top_logprobs"},
		{"prompt_logprobs beyond int64", cmpl, c(`"prompt_logprobs":1e30`), 400, "", "prompt_logprobs"},
		{"stream not a bool", cmpl, c(`"stream":"yes"`), 400, "", "stream"},
		// vLLM refuses a priority under its default fcfs scheduling.
		{"priority under fcfs", cmpl, c(`"priority":1`), 400, "", "priority"},
		{"priority a string", cmpl, c(`"priority":"1"`), 400, "", "priority"},
		{"ignore_eos not a bool", cmpl, c(`"ignore_eos":1`), 400, "", "ignore_eos"},
		{"stream_options not an object", cmpl, c(`"stream":true,"stream_options":"x"`), 400, "", "stream_options"},
		{"include_usage not a bool", cmpl, c(`"stream":true,"stream_options":{"include_usage":1}`), 400, "",
			"stream_options.include_usage"},
		// Keys are case-sensitive, as in vLLM: these are unknown fields.
		{"MODEL", cmpl, `{"MODEL":"sim-llama-8b","prompt":"x"}`, 400, "", "model"},
		{"Prompt", cmpl, `{"model":"sim-llama-8b","Prompt":"x"}`, 400, "", "prompt"},
		{"Messages", chat, `{"model":"sim-llama-8b","Messages":[{"role":"user","content":"x"}]}`, 400, "",
			"messages"},
		{"Role", chat, `{"model":"sim-llama-8b","messages":[{"Role":"user","content":"x"}]}`, 400, "",
			"messages[0].role"},
	}
}

// Fields are read by their exact keys: a differently cased key is an
// unknown field, ignored, and never overrides the real one. Null is
// absent; an integral float is an integer.
func TestRequestFieldsExact(t *testing.T) {
	f := startFleet(t, fast())
	c := testClient(t)
	url := f.URLs()[0]
	tests := []struct {
		name, path, body string
		tokens           int
		text             string // "" or the prompt's tokens' check
	}{
		{"cased duplicates ignored", "/v1/completions",
			`{"model":"sim-llama-8b","Model":"gpt-5","prompt":"x","max_tokens":2,"MAX_TOKENS":-5,` +
				`"Stream":"nonsense","N":0,"ignore_eos":true,"Ignore_EOS":false}`, 2, ""},
		{"nulls are absent", "/v1/completions",
			`{"model":"sim-llama-8b","prompt":"x","max_tokens":null,"n":null,"seed":null,"stream":null,` +
				`"min_tokens":null,"ignore_eos":true}`, DefaultCompletionMaxTokens, ""},
		{"integral float", "/v1/completions",
			`{"model":"sim-llama-8b","prompt":"x","max_tokens":3.0,"n":1e0,"ignore_eos":true}`, 3, ""},
		{"chat content part keys", "/v1/chat/completions",
			`{"model":"sim-llama-8b","messages":[{"role":"user","content":[{"type":"text","text":"hello",` +
				`"TEXT":"ignored words here"}]}],"max_completion_tokens":1,"max_tokens":50,"ignore_eos":true}`, 1, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := decodeCompletion(t, testutil.Post(t, c, url+tc.path, tc.body))
			if got.Usage.CompletionTokens != tc.tokens || len(got.Choices) != 1 {
				t.Errorf("%d tokens in %d choices, want %d in 1", got.Usage.CompletionTokens, len(got.Choices), tc.tokens)
			}
		})
	}
	// The cased TEXT was not rendered: the prompt is the lone "hello" part.
	want := prompt.Approx{}.Count(prompt.RenderChat([]string{"user"}, []string{"hello"}))
	got := decodeCompletion(t, testutil.Post(t, c, url+"/v1/chat/completions", tests[3].body))
	if got.Usage.PromptTokens != want {
		t.Errorf("prompt tokens %d, want %d", got.Usage.PromptTokens, want)
	}
	tok := testutil.Post(t, c, url+"/tokenize", `{"MODEL":"nope","prompt":"hello world"}`)
	if tok.Status != 200 || !strings.Contains(tok.Body, `"count":3`) {
		t.Errorf("tokenize with a cased key: %d %s", tok.Status, tok.Body)
	}
}

func TestBodyInteger(t *testing.T) {
	tests := []struct {
		raw       string
		want      int64
		set, sat  bool
		wantError bool
	}{
		{`null`, 0, false, false, false},
		{`5`, 5, true, false, false},
		{`-5`, -5, true, false, false},
		{`5.0`, 5, true, false, false},
		{`1e3`, 1000, true, false, false},
		{`1E-400`, 0, true, false, false},
		{`9223372036854775807`, math.MaxInt64, true, false, false},
		{`9223372036854775808`, math.MaxInt64, true, true, false},
		{`-9223372036854775809`, math.MinInt64, true, true, false},
		{`9.3e18`, math.MaxInt64, true, true, false},
		{`1e400`, math.MaxInt64, true, true, false},
		{`-1e400`, math.MinInt64, true, true, false},
		{`1.5`, 0, false, false, true},
		{`"5"`, 0, false, false, true},
		{`true`, 0, false, false, true},
		{`[5]`, 0, false, false, true},
	}
	for _, tc := range tests {
		b := body{"k": json.RawMessage(tc.raw)}
		got, err := b.integer("k")
		var ae *APIError
		switch {
		case tc.wantError:
			if !errors.As(err, &ae) || ae.Param != "k" || ae.Status != 400 {
				t.Errorf("%s: error %v, want a 400 on k", tc.raw, err)
			}
		case err != nil || got.v != tc.want || got.set != tc.set || got.saturated != tc.sat:
			t.Errorf("%s: %+v %v, want %d set %v saturated %v", tc.raw, got, err, tc.want, tc.set, tc.sat)
		}
	}
}

// fuzzReplica is a replica with no listener or driver, enough to parse
// requests: max_model_len 1024 (64 blocks of 16), two adapters.
// Under --scheduling-policy priority a request's priority goes to its
// engine requests; priority 0 is always accepted.
func TestPriorityField(t *testing.T) {
	r := fuzzReplica(t)
	if j, err := r.parseJob(prompt.Completion, []byte(`{"model":"sim-llama-8b","prompt":"x","priority":0}`)); err != nil || j.priority != 0 {
		t.Fatalf("priority 0 under fcfs: %v", err)
	}
	r.cfg.SchedulingPolicy = SchedulingPriority
	j, err := r.parseJob(prompt.Completion, []byte(`{"model":"sim-llama-8b","prompt":"x","priority":-3}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, reqs := r.newCall(j); reqs[0].Priority != -3 {
		t.Fatalf("engine request priority %d", reqs[0].Priority)
	}
}

func fuzzReplica(tb testing.TB) *Replica {
	cfg := Config{Replicas: 1, KVBlocks: 64, Adapters: []string{"lora-a", "lora-b"}, Faults: Faults{}}.withDefaults()
	if err := cfg.validate(); err != nil {
		tb.Fatal(err)
	}
	return &Replica{cfg: cfg}
}

// FuzzParseJob sends any body through job parsing into the engine's
// admission: parsing never panics, a rejection is a 4xx in OpenAI's shape,
// an accepted job respects every bound (choices, max_tokens, context), and
// the engine admits and runs its requests with no negative or overflowed
// counter.
func FuzzParseJob(f *testing.F) {
	for _, s := range []string{
		`{"model":"sim-llama-8b","prompt":"hello","max_tokens":4}`,
		`{"model":"lora-a","prompt":["a b c","d e f"],"n":3,"max_tokens":2,"min_tokens":1,"seed":-7}`,
		`{"model":"sim-llama-8b","prompt":[[1,2,3],[4,5]],"max_tokens":9223372036854775807}`,
		`{"model":"sim-llama-8b","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":1e30}`,
		`{"model":"sim-llama-8b","messages":[{"role":"system","content":[{"type":"text","text":"x"}]}],"n":128}`,
		`{"model":"sim-llama-8b","prompt":"x","stream":true,"stream_options":{"include_usage":true},"logprobs":3}`,
		`{"MODEL":"sim-llama-8b","Prompt":"x","max_tokens":-9223372036854775808,"min_tokens":9223372036854775807}`,
	} {
		f.Add(s, false)
		f.Add(s, true)
	}
	r := fuzzReplica(f)
	f.Fuzz(func(t *testing.T, data string, chat bool) {
		kind := prompt.Completion
		if chat {
			kind = prompt.Chat
		}
		j, err := r.parseJob(kind, []byte(data))
		if err != nil {
			if ae := toAPIError(err); ae.Status < 400 || ae.Status >= 500 || ae.Message == "" {
				t.Fatalf("rejection %d %q", ae.Status, ae.Message)
			}
			return
		}
		checkJob(t, r, j)
		admit(t, r, j)
	})
}

func checkJob(t *testing.T, r *Replica, j *job) {
	t.Helper()
	if j.n < 1 || len(j.prompts) < 1 || j.n*len(j.prompts) > maxN {
		t.Fatalf("n %d × %d prompts", j.n, len(j.prompts))
	}
	if j.maxTokens < 1 || j.minTokens < 0 || j.minTokens > j.maxTokens {
		t.Fatalf("max_tokens %d min_tokens %d", j.maxTokens, j.minTokens)
	}
	for _, in := range j.prompts {
		if in.tokens < 1 || in.tokens+j.maxTokens > r.cfg.MaxModelLen || len(in.hashes) > in.tokens/r.cfg.BlockSize {
			t.Fatalf("prompt of %d tokens, %d hashes, max_tokens %d, max_model_len %d",
				in.tokens, len(in.hashes), j.maxTokens, r.cfg.MaxModelLen)
		}
	}
}

// admit adds the job's requests to an engine of the replica's size and
// steps it a bounded number of times.
func admit(t *testing.T, r *Replica, j *job) {
	t.Helper()
	eng, err := engine.New(engine.Config{NumBlocks: r.cfg.KVBlocks, BlockSize: r.cfg.BlockSize})
	if err != nil {
		t.Fatal(err)
	}
	_, reqs := r.newCall(j)
	for i := range reqs {
		reqs[i].ID = uint64(i + 1)
		if err := eng.Add(&reqs[i], 0); err != nil {
			t.Fatalf("request %d (prompt %d, max_tokens %d): %v", i, reqs[i].PromptTokens, reqs[i].MaxTokens, err)
		}
	}
	for range 64 {
		if !eng.HasWork() {
			break
		}
		eng.Step(0)
	}
	st := eng.Stats()
	if st.Running < 0 || st.Waiting < 0 || st.KVUsage < 0 || st.KVUsage > 1 || st.PrefixQueries < 0 ||
		st.PrefixHits < 0 || st.PrefixHits > st.PrefixQueries || st.PromptTokens < 0 || st.GenerationTokens < 0 ||
		st.Running+st.Waiting+int(st.RequestsFinished) != len(reqs) {
		t.Fatalf("stats %+v after %d requests", st, len(reqs))
	}
}
