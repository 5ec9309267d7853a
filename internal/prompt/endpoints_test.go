package prompt

import (
	"errors"
	"strings"
	"testing"
)

func TestParseOtherEndpoints(t *testing.T) {
	chatText := RenderChat([]string{"system", "user"}, []string{"Be brief.", "hello"})
	cases := []struct {
		name     string
		kind     Kind
		body     string
		text     string
		ids      []uint32
		key      string
		system   string
		prev     string
		max      int
		messages bool
	}{
		{name: "embedding string", kind: Embedding, body: `{"model":"m","input":"hello"}`, text: "hello", key: "hello"},
		{name: "embedding batch", kind: Embedding, body: `{"model":"m","input":["a","b"]}`, text: "a", key: "a"},
		{name: "embedding ids", kind: Embedding, body: `{"model":"m","input":[[1,2],[3]]}`, ids: []uint32{1, 2}},
		{name: "embedding messages", kind: Embedding, messages: true, text: chatText, key: "hello", system: "Be brief.",
			body: `{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hello"}]}`},
		{name: "embedding without input", kind: Embedding, body: `{"model":"m"}`},
		{name: "responses string", kind: Responses, text: chatText, key: "hello", system: "Be brief.", max: 9,
			body: `{"model":"m","instructions":"Be brief.","input":"hello","max_output_tokens":9}`},
		{name: "responses items", kind: Responses, text: chatText, key: "hello", system: "Be brief.",
			body: `{"model":"m","input":[{"role":"system","content":"Be brief."},{"type":"message","role":"user","content":[{"type":"input_text","text":"hello"}]}]}`},
		{name: "responses follow-up", kind: Responses, prev: "resp_1",
			body: `{"model":"m","previous_response_id":"resp_1"}`},
		{name: "responses tool output", kind: Responses, prev: "resp_1",
			text: "<|function_call_output|>\n" + `{"type":"function_call_output","call_id":"c","output":"42"}` + "\n",
			key:  "<|function_call_output|>\n" + `{"type":"function_call_output","call_id":"c","output":"42"}` + "\n",
			body: `{"model":"m","previous_response_id":"resp_1","input":[{"type":"function_call_output","call_id":"c","output":"42"}]}`},
		{name: "tokenize prompt", kind: Tokenize, body: `{"model":"m","prompt":"hi there"}`, text: "hi there", key: "hi there"},
		{name: "tokenize messages", kind: Tokenize, messages: true, text: RenderChat([]string{"user"}, []string{"x"}), key: "x",
			body: `{"messages":[{"role":"user","content":"x"}]}`},
		{name: "other", kind: Other, body: `{"model":"m","text_1":"a","text_2":"b","stream":false}`},
	}
	for _, c := range cases {
		p, err := Parse(c.kind, []byte(c.body))
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if p.Text != c.text || p.KeyText != c.key || p.System != c.system || p.PreviousResponseID != c.prev ||
			p.MaxTokens != c.max || p.Messages != c.messages || len(p.TokenIDs) != len(c.ids) {
			t.Fatalf("%s: %+v", c.name, p)
		}
	}
	// The same conversation through chat and Responses shares its routing text.
	chat, _ := Parse(Chat, []byte(`{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hello"}]}`))
	if chat.Text != chatText {
		t.Fatalf("chat renders %q", chat.Text)
	}
	for _, bad := range []struct {
		kind       Kind
		body, want string
	}{
		{Embedding, `{"model":"m","input":{"a":1}}`, "input"},
		{Responses, `{"model":"m","input":7}`, "input"},
		{Responses, `{"model":"m","input":[{"content":"x"}]}`, "input[0]"},
		{Responses, `{"model":"m","input":"x","max_output_tokens":-1}`, "max_output_tokens"},
		{Responses, `{"model":"m","instructions":3}`, "instructions"},
		{Tokenize, `{"prompt":5}`, "prompt"},
		{Completion, `{"prompt":"x"}`, "model"},
	} {
		_, err := Parse(bad.kind, []byte(bad.body))
		var re *RequestError
		if !errors.As(err, &re) || !strings.HasPrefix(re.Param, bad.want) {
			t.Fatalf("%s %s: %v, want an error on %s", bad.kind, bad.body, err, bad.want)
		}
	}
}

// Responses' content parts (input_text, input_image with a plain URL)
// render as chat's do.
func TestContentTextResponsesParts(t *testing.T) {
	got, err := ContentText([]byte(`[{"type":"input_text","text":"look: "},{"type":"input_image","image_url":"https://x/i.png"},` +
		`{"type":"image_url","image_url":{"url":"https://x/j.png"}},{"type":"input_file","file_id":"file-1"}]`))
	if err != nil || got != "look: <|image|>https://x/i.png<|image|>https://x/j.png<|file|>file-1" {
		t.Fatalf("%q %v", got, err)
	}
}
