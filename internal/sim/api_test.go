package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

// fast is a fleet config whose requests finish in well under a second.
func fast() Config { return Config{TimeScale: 1000, Seed: 7} }

// words makes a prompt of about n tokens (4 bytes each), distinct per tag.
func words(tag string, n int) string {
	var sb strings.Builder
	for i := 0; sb.Len() < 4*n; i++ {
		fmt.Fprintf(&sb, "%s%03d ", tag[:min(3, len(tag))], i%1000)
	}
	return sb.String()[:4*n]
}

func TestCompletionsNonStreamed(t *testing.T) {
	f := startFleet(t, fast())
	c := testClient(t)
	url := f.URLs()[0]
	text := words("abc", 100)
	tests := []struct {
		name, path, body    string
		wantTokens          int
		wantObject, wantFin string
	}{
		{"completion ignore_eos", "/v1/completions",
			`{"model":"sim-llama-8b","prompt":` + jsonString(text) + `,"max_tokens":37,"ignore_eos":true}`,
			37, "text_completion", "length"},
		{"completion default max_tokens 16", "/v1/completions",
			`{"model":"sim-llama-8b","prompt":` + jsonString(text) + `,"ignore_eos":true}`,
			16, "text_completion", "length"},
		{"chat ignore_eos", "/v1/chat/completions",
			`{"model":"sim-llama-8b","messages":[{"role":"user","content":` + jsonString(text) + `}],"max_tokens":5,"ignore_eos":true}`,
			5, "chat.completion", "length"},
		{"chat default max_tokens 256", "/v1/chat/completions",
			`{"model":"sim-llama-8b","messages":[{"role":"user","content":"x"}],"ignore_eos":true}`,
			256, "chat.completion", "length"},
		{"max_completion_tokens", "/v1/chat/completions",
			`{"model":"sim-llama-8b","messages":[{"role":"user","content":"x"}],"max_completion_tokens":3,"ignore_eos":true}`,
			3, "chat.completion", "length"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := decodeCompletion(t, testutil.Post(t, c, url+tc.path, tc.body))
			if got.Object != tc.wantObject || got.Model != "sim-llama-8b" || len(got.Choices) != 1 {
				t.Fatalf("object %q model %q choices %d", got.Object, got.Model, len(got.Choices))
			}
			ch := got.Choices[0]
			out := ch.Text
			if ch.Message != nil {
				if ch.Message.Role != "assistant" {
					t.Errorf("role %q", ch.Message.Role)
				}
				out = ch.Message.Content
			}
			if got.Usage.CompletionTokens != tc.wantTokens || (prompt.Approx{}).Count(out) != tc.wantTokens {
				t.Errorf("completion tokens %d, text of %d tokens, want %d", got.Usage.CompletionTokens,
					(prompt.Approx{}).Count(out), tc.wantTokens)
			}
			if ch.FinishReason != tc.wantFin {
				t.Errorf("finish_reason %q, want %q", ch.FinishReason, tc.wantFin)
			}
			if got.Usage.TotalTokens != got.Usage.PromptTokens+got.Usage.CompletionTokens {
				t.Errorf("usage %+v", got.Usage)
			}
		})
	}
}

func jsonString(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// Without ignore_eos the length is a seeded log-normal draw capped by
// max_tokens; the same request gets the same answer on any replica.
func TestOutputLengths(t *testing.T) {
	f := startFleet(t, Config{TimeScale: 1000, Seed: 3, Replicas: 2})
	c := testClient(t)
	var lengths []int
	stops := 0
	for i := range 60 {
		body := fmt.Sprintf(`{"model":"sim-llama-8b","prompt":"question %d","max_tokens":300}`, i)
		a := decodeCompletion(t, testutil.Post(t, c, f.URLs()[0]+"/v1/completions", body))
		b := decodeCompletion(t, testutil.Post(t, c, f.URLs()[1]+"/v1/completions", body))
		if a.Choices[0].Text != b.Choices[0].Text || a.Usage.CompletionTokens != b.Usage.CompletionTokens {
			t.Fatalf("request %d: replicas answered differently", i)
		}
		n := a.Usage.CompletionTokens
		switch fr := a.Choices[0].FinishReason; {
		case n < 300 && fr == "stop":
			stops++
		case n == 300 && fr == "length":
		default:
			t.Fatalf("request %d: %d tokens, finish_reason %q", i, n, fr)
		}
		lengths = append(lengths, n)
	}
	slices.Sort(lengths)
	if med := lengths[len(lengths)/2]; med < 90 || med > 180 || lengths[0] == lengths[len(lengths)-1] {
		t.Errorf("lengths %v: median %d, want about %d and spread", lengths, med, DefaultOutputMedian)
	}
	if stops < 50 {
		t.Errorf("only %d of 60 stopped before max_tokens 300", stops)
	}
	// Capped: a tiny max_tokens always ends by length.
	for i := range 10 {
		got := decodeCompletion(t, testutil.Post(t, c, f.URLs()[0]+"/v1/completions",
			fmt.Sprintf(`{"model":"sim-llama-8b","prompt":"q%d","max_tokens":2}`, i)))
		if got.Usage.CompletionTokens != 2 || got.Choices[0].FinishReason != "length" {
			t.Errorf("max_tokens 2: %d tokens, %q", got.Usage.CompletionTokens, got.Choices[0].FinishReason)
		}
	}
}

func TestBatchAndN(t *testing.T) {
	f := startFleet(t, fast())
	c := testClient(t)
	p0, p1 := words("one", 40), words("two", 70)
	body := `{"model":"sim-llama-8b","prompt":[` + jsonString(p0) + `,` + jsonString(p1) +
		`],"n":2,"max_tokens":4,"ignore_eos":true}`
	got := decodeCompletion(t, testutil.Post(t, c, f.URLs()[0]+"/v1/completions", body))
	if len(got.Choices) != 4 {
		t.Fatalf("%d choices, want 4", len(got.Choices))
	}
	for i, ch := range got.Choices {
		if ch.Index != i || (prompt.Approx{}).Count(ch.Text) != 4 {
			t.Errorf("choice %d: index %d text %q", i, ch.Index, ch.Text)
		}
	}
	if got.Usage.PromptTokens != 110 || got.Usage.CompletionTokens != 16 {
		t.Errorf("usage %+v, want 110 prompt and 16 completion tokens", got.Usage)
	}
	// Token-id prompts are counted as given.
	got = decodeCompletion(t, testutil.Post(t, c, f.URLs()[0]+"/v1/completions",
		`{"model":"sim-llama-8b","prompt":[[1,2,3],[4,5]],"max_tokens":1}`))
	if len(got.Choices) != 2 || got.Usage.PromptTokens != 5 {
		t.Errorf("token-id batch: %d choices, usage %+v", len(got.Choices), got.Usage)
	}
}

func TestRequestErrors(t *testing.T) {
	cfg := fast()
	cfg.KVBlocks, cfg.BlockSize = 8, 16 // max_model_len 128
	f := startFleet(t, cfg)
	c := testClient(t)
	url := f.URLs()[0]
	long := jsonString(words("lng", 120))
	tests := []errorCase{
		{"not json", "/v1/completions", `{`, 400, "", ""},
		{"not an object", "/v1/completions", `[1]`, 400, "", ""},
		{"null body", "/v1/completions", `null`, 400, "", ""},
		{"no model", "/v1/completions", `{"prompt":"x"}`, 400, "", "model"},
		{"model not a string", "/v1/completions", `{"model":5,"prompt":"x"}`, 400, "", "model"},
		{"unknown model", "/v1/completions", `{"model":"gpt-5","prompt":"x"}`, 404, "model_not_found", "model"},
		{"unknown model chat", "/v1/chat/completions",
			`{"model":"gpt-5","messages":[{"role":"user","content":"x"}]}`, 404, "model_not_found", "model"},
		{"no prompt", "/v1/completions", `{"model":"sim-llama-8b"}`, 400, "", "prompt"},
		{"empty prompt", "/v1/completions", `{"model":"sim-llama-8b","prompt":""}`, 400, "", "prompt"},
		{"no messages", "/v1/chat/completions", `{"model":"sim-llama-8b","messages":[]}`, 400, "", "messages"},
		{"stream_options without stream", "/v1/completions",
			`{"model":"sim-llama-8b","prompt":"x","stream_options":{"include_usage":true}}`, 400, "", "stream_options"},
		{"min_tokens above max_tokens", "/v1/completions",
			`{"model":"sim-llama-8b","prompt":"x","max_tokens":2,"min_tokens":3}`, 400, "", "min_tokens"},
	}
	tests = append(tests, validationCases(long)...)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := testutil.Post(t, c, url+tc.path, tc.body)
			if r.Status != tc.status {
				t.Fatalf("status %d, want %d: %s", r.Status, tc.status, r.Body)
			}
			var e struct {
				Error struct {
					Message string  `json:"message"`
					Type    string  `json:"type"`
					Param   *string `json:"param"`
					Code    *string `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal([]byte(r.Body), &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("not an OpenAI error: %s", r.Body)
			}
			if tc.code != "" && (e.Error.Code == nil || *e.Error.Code != tc.code) {
				t.Errorf("code %v, want %q", e.Error.Code, tc.code)
			}
			if tc.param != "" && (e.Error.Param == nil || *e.Error.Param != tc.param) {
				t.Errorf("param %v, want %q", e.Error.Param, tc.param)
			}
			if tc.code == "context_length_exceeded" && !strings.Contains(e.Error.Message, "context holds 128 tokens") {
				t.Errorf("message %q", e.Error.Message)
			}
		})
	}
	if r := get(t, c, url+"/v1/completions"); r.Status != http.StatusMethodNotAllowed {
		t.Errorf("GET /v1/completions: %d", r.Status)
	}
}

func TestModelsHealthTokenize(t *testing.T) {
	cfg := fast()
	cfg.Adapters = []string{"sql-lora"}
	f := startFleet(t, cfg)
	c := testClient(t)
	url := f.URLs()[0]
	if r := get(t, c, url+"/health"); r.Status != 200 {
		t.Errorf("/health %d", r.Status)
	}
	want := []modelCard{
		{ID: "sim-llama-8b", Object: "model", Root: "sim-llama-8b", MaxModelLen: DefaultMaxModelLen},
		{ID: "sql-lora", Object: "model", Root: "sql-lora", Parent: "sim-llama-8b", MaxModelLen: DefaultMaxModelLen},
	}
	if got := listModels(t, c, url); !slices.Equal(got, want) {
		t.Errorf("models %+v, want %+v", got, want)
	}

	msgs := `[{"role":"system","content":"be brief"},{"role":"user","content":"hello there, how are you?"}]`
	chat := decodeCompletion(t, testutil.Post(t, c, url+"/v1/chat/completions",
		`{"model":"sim-llama-8b","messages":`+msgs+`,"max_tokens":1}`))
	tests := []struct {
		name, body string
		want       int
	}{
		{"prompt", `{"prompt":"hello world"}`, 3},
		{"prompt with model", `{"model":"sim-llama-8b","prompt":"0123456789abcdef"}`, 4},
		{"token ids", `{"prompt":[5,6,7,8,9]}`, 5},
		{"messages like chat", `{"messages":` + msgs + `}`, chat.Usage.PromptTokens},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := testutil.Post(t, c, url+"/tokenize", tc.body)
			var tok struct {
				Count       int      `json:"count"`
				MaxModelLen int      `json:"max_model_len"`
				Tokens      []uint32 `json:"tokens"`
			}
			if r.Status != 200 || json.Unmarshal([]byte(r.Body), &tok) != nil {
				t.Fatalf("%d %s", r.Status, r.Body)
			}
			if tok.Count != tc.want || len(tok.Tokens) != tc.want || tok.MaxModelLen != DefaultMaxModelLen {
				t.Errorf("got %+v, want count %d", tok, tc.want)
			}
		})
	}
	if r := testutil.Post(t, c, url+"/tokenize", `{"model":"nope","prompt":"x"}`); r.Status != 404 {
		t.Errorf("tokenize unknown model: %d", r.Status)
	}
}

// A repeated prompt hits the prefix cache: cached_tokens covers all its full
// blocks but the last token's, and its TTFT (virtual, from /metrics) is the
// cost model's prefill of the uncached rest.
func TestPrefixCacheHit(t *testing.T) {
	f := startFleet(t, fast())
	c := testClient(t)
	url := f.URLs()[0]
	const n = 2000
	body := `{"model":"sim-llama-8b","prompt":` + jsonString(words("hit", n)) + `,"max_tokens":1}`
	prof := costmodel.MustLookup(costmodel.Default)
	var ttfts []float64
	prev := 0.0
	for i := range 3 {
		got := decodeCompletion(t, testutil.Post(t, c, url+"/v1/completions", body))
		cached := got.Usage.PromptTokensDetails.CachedTokens
		want := 0
		if i > 0 {
			want = (n - 1) / 16 * 16
		}
		if cached != want || got.Usage.PromptTokens != n {
			t.Fatalf("request %d: cached %d of %d, want %d", i, cached, got.Usage.PromptTokens, want)
		}
		sum, _ := metricValue(scrape(t, c, url), MetricTTFT, nil)
		ttfts = append(ttfts, sum-prev)
		prev = sum
		wantTTFT := prof.PrefillTime(n-want, want, 8192).Seconds()
		if d := ttfts[i] - wantTTFT; d < -1e-6 || d > 1e-6 {
			t.Errorf("request %d: TTFT %.6fs, cost model %.6fs", i, ttfts[i], wantTTFT)
		}
	}
	if !(ttfts[1] < ttfts[0]/3) {
		t.Errorf("TTFT %v: the cached request is not much faster", ttfts)
	}
	// Another partition (cache_salt, adapter) never hits.
	salted := decodeCompletion(t, testutil.Post(t, c, url+"/v1/completions",
		strings.Replace(body, `"max_tokens":1`, `"max_tokens":1,"cache_salt":"s"`, 1)))
	if salted.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Errorf("salted request hit %d tokens", salted.Usage.PromptTokensDetails.CachedTokens)
	}
	fams := scrape(t, c, url)
	q, _ := metricValue(fams, MetricPrefixQueries, nil)
	h, _ := metricValue(fams, MetricPrefixHits, nil)
	if q != 4*n || h != 2*float64((n-1)/16*16) {
		t.Errorf("prefix cache queries %v hits %v", q, h)
	}
}

func TestMetricsContract(t *testing.T) {
	cfg := fast()
	cfg.KVBlocks = 500
	f := startFleet(t, cfg)
	c := testClient(t)
	url := f.URLs()[0]
	decodeCompletion(t, testutil.Post(t, c, url+"/v1/completions", `{"model":"sim-llama-8b","prompt":"hi there","max_tokens":3,"ignore_eos":true}`))
	decodeCompletion(t, testutil.Post(t, c, url+"/v1/completions", `{"model":"sim-llama-8b","prompt":"hi there","max_tokens":500}`))
	fams := scrape(t, c, url)
	for _, name := range ContractMetrics {
		f := fams[name]
		if f == nil {
			t.Errorf("missing %s", name)
			continue
		}
		for _, m := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if name == MetricCacheConfig {
				if labels["block_size"] != "16" || labels["num_gpu_blocks"] != "500" || m.GetGauge().GetValue() != 1 {
					t.Errorf("%s labels %v", name, labels)
				}
			} else if labels["model_name"] != "sim-llama-8b" {
				t.Errorf("%s without model_name: %v", name, labels)
			}
		}
	}
	types := map[string]string{
		MetricRunning: "GAUGE", MetricWaiting: "GAUGE", MetricKVUsage: "GAUGE", MetricPrefixQueries: "COUNTER",
		MetricPrefixHits: "COUNTER", MetricTTFT: "HISTOGRAM", MetricE2E: "HISTOGRAM", MetricPromptTokens: "COUNTER",
		MetricGenTokens: "COUNTER", MetricRequestSuccess: "COUNTER", MetricCacheConfig: "GAUGE",
	}
	for name, typ := range types {
		if f := fams[name]; f != nil && f.GetType().String() != typ {
			t.Errorf("%s is %s, want %s", name, f.GetType(), typ)
		}
	}
	gen, _ := metricValue(fams, MetricGenTokens, nil)
	pt, _ := metricValue(fams, MetricPromptTokens, nil)
	length, _ := metricValue(fams, MetricRequestSuccess, map[string]string{"finished_reason": "length"})
	stop, _ := metricValue(fams, MetricRequestSuccess, map[string]string{"finished_reason": "stop"})
	if pt != 4 || length+stop != 2 || gen < 4 || histCount(fams, MetricTTFT) != 2 || histCount(fams, MetricE2E) != 2 {
		t.Errorf("prompt tokens %v gen %v length %v stop %v ttft n %d", pt, gen, length, stop, histCount(fams, MetricTTFT))
	}
}

func TestConfigErrors(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
	}{
		{"no replicas", Config{}},
		{"port range", Config{Replicas: 2, Port: 65535}},
		{"time scale", Config{Replicas: 1, TimeScale: -1}},
		{"time scale too high", Config{Replicas: 1, TimeScale: 1e9}},
		{"profile", Config{Replicas: 1, Profile: "h200-imaginary"}},
		{"max model len", Config{Replicas: 1, KVBlocks: 4, MaxModelLen: 100}},
		{"rate", Config{Replicas: 1, Faults: Faults{ErrorRate: 1.5}}},
		{"stall without duration", Config{Replicas: 1, Faults: Faults{StallRate: 0.5}}},
		{"refuse half", Config{Replicas: 1, Faults: Faults{RefuseAfter: 1}}},
		{"crash-on without crash-for", Config{Replicas: 1, Faults: Faults{CrashOn: "x"}}},
		{"crash-for without crash-on", Config{Replicas: 1, Faults: Faults{CrashFor: time.Second}}},
		{"fault replica", Config{Replicas: 2, FaultReplicas: []int{2}}},
		{"adapter is model", Config{Replicas: 1, Adapters: []string{DefaultModel}}},
		{"kv ports overlap", Config{Replicas: 2, Port: 9000, KVEvents: true, KVEventsPort: 9001}},
		{"served name twice", Config{Replicas: 1, ServedModelNames: []string{"a", "a"}}},
		{"adapter is a served name", Config{Replicas: 1, ServedModelNames: []string{"a"}, Adapters: []string{"a"}}},
		{"empty adapter", Config{Replicas: 1, Adapters: []string{""}}},
		{"override for no replica", Config{Replicas: 1, PerReplica: make([]ReplicaOverride, 2)}},
		{"override's adapter is its model", Config{Replicas: 2,
			PerReplica: []ReplicaOverride{{}, {Model: "m", Adapters: []string{"m"}}}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := Start(t.Context(), tc.cfg)
			if err == nil {
				_ = f.Close()
				t.Fatal("started")
			}
			if !errors.Is(err, ErrInvalidConfig) {
				t.Errorf("error %v is not ErrInvalidConfig", err)
			}
		})
	}
}

// A LoRA adapter is served beside the base model and is its own cache
// partition, as vLLM keys the first block by the adapter.
func TestAdapterPartition(t *testing.T) {
	cfg := fast()
	cfg.Adapters = []string{"sql-lora"}
	f := startFleet(t, cfg)
	c := testClient(t)
	text := jsonString(words("lor", 300))
	send := func(model string) completion {
		return decodeCompletion(t, testutil.Post(t, c, f.URLs()[0]+"/v1/completions",
			`{"model":"`+model+`","prompt":`+text+`,"max_tokens":1}`))
	}
	tests := []struct {
		model      string
		wantCached int
	}{
		{"sim-llama-8b", 0},
		{"sql-lora", 0}, // the base model's blocks do not match
		{"sql-lora", 288},
		{"sim-llama-8b", 288},
	}
	for i, tc := range tests {
		got := send(tc.model)
		if got.Model != tc.model || got.Usage.PromptTokensDetails.CachedTokens != tc.wantCached {
			t.Errorf("request %d to %s: model %q cached %d, want %d", i, tc.model, got.Model,
				got.Usage.PromptTokensDetails.CachedTokens, tc.wantCached)
		}
	}
}
