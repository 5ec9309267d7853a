package sim

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/testutil"
)

// messagesAnswer is what a test reads of a Messages answer.
type messagesAnswer struct {
	ID, Type, Role, Model string
	StopReason            *string `json:"stop_reason"`
	Content               []struct{ Type, Text string }
	Usage                 struct {
		InputTokens  int  `json:"input_tokens"`
		OutputTokens int  `json:"output_tokens"`
		CacheRead    *int `json:"cache_read_input_tokens"`
	}
}

// The sim serves /v1/messages as vLLM does: not streamed, one message
// with its text block, stop_reason from the finish reason, the usage in
// Anthropic's terms (input_tokens uncached, cache_read_input_tokens the
// replica's hit: a second identical call hits); the prompt counted as the
// chat vLLM converts it to (the same tokens as that chat's). Streamed:
// message_start with the input, a text_delta per token, message_delta
// with the stop reason and the output, message_stop, [DONE]. A request
// without max_tokens is refused as Anthropic's API requires.
func TestMessagesAPI(t *testing.T) {
	f := startFleet(t, fast())
	c := testClient(t)
	url := f.URLs()[0]
	text := words("msg", 200)
	body := func(stream bool) string {
		return `{"model":"sim-llama-8b","max_tokens":5,"ignore_eos":true,"stream":` + map[bool]string{false: "false", true: "true"}[stream] +
			`,"system":"You are terse.","messages":[{"role":"user","content":[{"type":"text","text":` + jsonString(text) + `}]}]}`
	}
	chat := decodeCompletion(t, testutil.Post(t, c, url+"/v1/chat/completions", `{"model":"sim-llama-8b","max_tokens":1,`+
		`"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":`+jsonString(text)+`}]}`))
	var m [2]messagesAnswer
	for i := range m {
		r := testutil.Post(t, c, url+"/v1/messages", body(false))
		if r.Status != http.StatusOK || json.Unmarshal([]byte(r.Body), &m[i]) != nil {
			t.Fatalf("call %d: %d %s", i, r.Status, r.Body)
		}
		a := m[i]
		if !strings.HasPrefix(a.ID, "chatcmpl-") || a.Type != "message" || a.Role != "assistant" || a.Model != "sim-llama-8b" ||
			len(a.Content) != 1 || a.Content[0].Type != "text" || a.Content[0].Text == "" || a.StopReason == nil || *a.StopReason != "max_tokens" ||
			a.Usage.OutputTokens != 5 || a.Usage.CacheRead == nil || a.Usage.InputTokens+*a.Usage.CacheRead != chat.Usage.PromptTokens {
			t.Fatalf("call %d: %s, want the chat's %d prompt tokens", i, r.Body, chat.Usage.PromptTokens)
		}
	}
	if *m[1].Usage.CacheRead == 0 {
		t.Errorf("the second identical call hit no cache: %+v", m[1].Usage)
	}
	r := testutil.Post(t, c, url+"/v1/messages", body(true))
	if r.Status != http.StatusOK {
		t.Fatalf("stream: %d %s", r.Status, r.Body)
	}
	checkMessagesStream(t, r.Body, chat.Usage.PromptTokens, 5)
	if r := testutil.Post(t, c, url+"/v1/messages", `{"model":"sim-llama-8b","messages":[{"role":"user","content":"x"}]}`); r.Status != http.StatusBadRequest ||
		!strings.Contains(r.Body, "max_tokens") {
		t.Errorf("no max_tokens: %d %s", r.Status, r.Body)
	}
}

// checkMessagesStream checks a Messages stream of n tokens of a prompt of
// prompt tokens: its events in order, as vLLM names them.
func checkMessagesStream(t *testing.T, body string, prompt, n int) {
	t.Helper()
	er := openai.NewEventReader(strings.NewReader(body), 0)
	var names []string
	var start struct {
		Message messagesAnswer `json:"message"`
	}
	var delta struct {
		Delta struct {
			StopReason string `json:"stop_reason"`
		} `json:"delta"`
		Usage struct {
			InputTokens  int  `json:"input_tokens"`
			OutputTokens int  `json:"output_tokens"`
			CacheRead    *int `json:"cache_read_input_tokens"`
		} `json:"usage"`
	}
	for {
		ev, err := er.Next()
		if err != nil {
			break
		}
		name, _, _ := strings.Cut(strings.TrimPrefix(string(ev.Raw), "event: "), "\n")
		if !strings.HasPrefix(string(ev.Raw), "event: ") {
			name = string(ev.Data)
		}
		names = append(names, name)
		switch name {
		case "message_start":
			_ = json.Unmarshal(ev.Data, &start)
		case "message_delta":
			_ = json.Unmarshal(ev.Data, &delta)
		}
	}
	want := []string{"message_start", "content_block_start"}
	for range n {
		want = append(want, "content_block_delta")
	}
	want = append(want, "content_block_stop", "message_delta", "message_stop", openai.DoneData)
	if strings.Join(names, ",") != strings.Join(want, ",") {
		t.Fatalf("events %v, want %v", names, want)
	}
	su, du := start.Message.Usage, delta.Usage
	if su.CacheRead == nil || su.InputTokens+*su.CacheRead != prompt || su.OutputTokens != 0 ||
		delta.Delta.StopReason != "max_tokens" || du.OutputTokens != n || du.CacheRead == nil || du.InputTokens+*du.CacheRead != prompt {
		t.Fatalf("message_start usage %+v, message_delta %+v: want %d prompt and %d output tokens", su, delta, prompt, n)
	}
}
