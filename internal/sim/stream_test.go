package sim

import (
	"bufio"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

type chunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Index int     `json:"index"`
		Text  *string `json:"text"`
		Delta *struct {
			Role    *string `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
}

// The SSE stream is vLLM's: one chunk per token with the same id, chat's
// role chunk first, finish_reason on each choice's last token, the usage
// chunk only when asked for, then [DONE].
func TestStreamFormat(t *testing.T) {
	f := startFleet(t, fast())
	c := testClient(t)
	url := f.URLs()[0]
	text := jsonString(words("str", 50))
	tests := []struct {
		name, path, body string
		chat, usage      bool
		choices, tokens  int
	}{
		{"completion", "/v1/completions",
			`{"model":"sim-llama-8b","prompt":` + text + `,"max_tokens":6,"ignore_eos":true,"stream":true}`,
			false, false, 1, 6},
		{"completion usage", "/v1/completions",
			`{"model":"sim-llama-8b","prompt":` + text + `,"max_tokens":6,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`,
			false, true, 1, 6},
		{"chat usage", "/v1/chat/completions",
			`{"model":"sim-llama-8b","messages":[{"role":"user","content":` + text + `}],"max_tokens":4,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`,
			true, true, 1, 4},
		{"chat n=3", "/v1/chat/completions",
			`{"model":"sim-llama-8b","messages":[{"role":"user","content":` + text + `}],"n":3,"max_tokens":5,"ignore_eos":true,"stream":true}`,
			true, false, 3, 5},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := testutil.Post(t, c, url+tc.path, tc.body)
			if r.Status != 200 {
				t.Fatalf("status %d: %s", r.Status, r.Body)
			}
			evs := sseEvents(t, r.Body)
			if evs[len(evs)-1] != "[DONE]" {
				t.Fatalf("last event %q", evs[len(evs)-1])
			}
			evs = evs[:len(evs)-1]
			var id string
			tokens := make([]int, tc.choices)
			roles := make([]int, tc.choices)
			finished := make([]bool, tc.choices)
			sawUsage := false
			for i, e := range evs {
				var ch chunk
				if err := json.Unmarshal([]byte(e), &ch); err != nil {
					t.Fatalf("chunk %d %q: %v", i, e, err)
				}
				// The gateway and bench read chunks through internal/openai:
				// only a chunk with a token has one for them.
				oc, err := openai.ParseChunk([]byte(e))
				if err != nil {
					t.Fatalf("chunk %d: openai.ParseChunk: %v", i, err)
				}
				isToken := ch.Usage == nil && !strings.Contains(e, `"role":"assistant"`)
				if oc.HasToken() != isToken {
					t.Errorf("chunk %d: HasToken %v: %s", i, oc.HasToken(), e)
				}
				if i == 0 {
					id = ch.ID
				}
				wantObj := "text_completion"
				if tc.chat {
					wantObj = "chat.completion.chunk"
				}
				if ch.ID != id || ch.Object != wantObj || ch.Model != "sim-llama-8b" || ch.Created == 0 {
					t.Fatalf("chunk %d header: %+v", i, ch)
				}
				if ch.Usage != nil {
					if len(ch.Choices) != 0 || i != len(evs)-1 {
						t.Errorf("usage chunk %d of %d has %d choices", i, len(evs), len(ch.Choices))
					}
					if ch.Usage.CompletionTokens != tc.choices*tc.tokens || ch.Usage.PromptTokens == 0 {
						t.Errorf("usage %+v", *ch.Usage)
					}
					sawUsage = true
					continue
				}
				if len(ch.Choices) != 1 {
					t.Fatalf("chunk %d: %d choices", i, len(ch.Choices))
				}
				cc := ch.Choices[0]
				if finished[cc.Index] {
					t.Errorf("choice %d: chunk after finish_reason", cc.Index)
				}
				var piece string
				if tc.chat {
					if cc.Delta == nil || cc.Delta.Content == nil {
						t.Fatalf("chunk %d: no delta content: %s", i, e)
					}
					if cc.Delta.Role != nil {
						// vLLM's bytes: the role with an empty content.
						if *cc.Delta.Role != "assistant" || *cc.Delta.Content != "" || tokens[cc.Index] != 0 ||
							!strings.Contains(e, `"delta":{"role":"assistant","content":""}`) {
							t.Errorf("role chunk %s", e)
						}
						roles[cc.Index]++
						continue
					}
					piece = *cc.Delta.Content
				} else {
					if cc.Text == nil {
						t.Fatalf("chunk %d: no text", i)
					}
					piece = *cc.Text
				}
				if (prompt.Approx{}).Count(piece) != 1 || len(piece) != 4 {
					t.Errorf("token %q is not one 4-byte token", piece)
				}
				tokens[cc.Index]++
				if cc.FinishReason != nil {
					if *cc.FinishReason != "length" || tokens[cc.Index] != tc.tokens {
						t.Errorf("choice %d: finish_reason %q after %d tokens", cc.Index, *cc.FinishReason, tokens[cc.Index])
					}
					finished[cc.Index] = true
				}
			}
			for i := range tc.choices {
				if tokens[i] != tc.tokens || !finished[i] || (tc.chat && roles[i] != 1) {
					t.Errorf("choice %d: %d tokens, finished %v, %d role chunks", i, tokens[i], finished[i], roles[i])
				}
			}
			if sawUsage != tc.usage {
				t.Errorf("usage chunk %v, want %v", sawUsage, tc.usage)
			}
		})
	}
}

// A client that goes away mid-stream aborts its engine request.
func TestAbortOnDisconnect(t *testing.T) {
	f := startFleet(t, Config{TimeScale: 1, Seed: 1})
	c := testClient(t)
	url := f.URLs()[0]
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "POST", url+"/v1/completions", strings.NewReader(
		`{"model":"sim-llama-8b","prompt":"tell me a long story","max_tokens":100000,"ignore_eos":true,"stream":true}`))
	r, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(r.Body)
	line, err := br.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "data: {") {
		t.Fatalf("first line %q: %v", line, err)
	}
	if n, _ := metricValue(scrape(t, c, url), MetricRunning, nil); n != 1 {
		t.Fatalf("running %v, want 1", n)
	}
	cancel()
	r.Body.Close()
	testutil.Eventually(t, 10*time.Second, "the abort", func() bool {
		fams := scrape(t, c, url)
		aborted, _ := metricValue(fams, MetricRequestSuccess, map[string]string{"finished_reason": "abort"})
		running, _ := metricValue(fams, MetricRunning, nil)
		return aborted == 1 && running == 0
	})
	if st := f.Replicas()[0].Stats(); st.RequestsAborted != 1 || st.KVUsage != 0 {
		t.Errorf("stats %+v", st)
	}
}
