package prompt

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// A Messages conversation is routed as the chat vLLM converts it to: its
// text is that chat's rendering.
func TestMessagesRenderedAsChat(t *testing.T) {
	chat, err := Parse(Chat, []byte(`{"model":"m","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"hello"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	msg, err := Parse(Messages, []byte(`{"model":"m","max_tokens":7,"system":"Be brief.","messages":[{"role":"user","content":"hello"}],
		"cache_salt":"s","priority":3,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	if msg.Text != chat.Text || msg.KeyText != "hello" || msg.System != "Be brief." || !msg.Messages || msg.MaxTokens != 7 || !msg.Stream {
		t.Fatalf("messages parsed as %+v, chat text %q", msg, chat.Text)
	}
	// vLLM's Messages request takes no cache_salt: it reaches no engine.
	if msg.CacheSalt != "" || msg.Priority != 3 || msg.Kind != Messages {
		t.Fatalf("salt %q priority %v kind %v", msg.CacheSalt, msg.Priority, msg.Kind)
	}
}

// Claude Code's billing header (a hash per request) is dropped, as vLLM
// drops it, so that it never changes the routing text.
func TestMessagesBillingHeaderDropped(t *testing.T) {
	body := func(hash string) string {
		return `{"model":"m","max_tokens":9,"system":[{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1; cch=` + hash +
			`;"},{"type":"text","text":"You are Claude Code."},{"type":"text","text":" Be careful."}],"messages":[{"role":"user","content":"hi"}]}`
	}
	a, errA := Parse(Messages, []byte(body("aaaa")))
	b, errB := Parse(Messages, []byte(body("bbbb")))
	if errA != nil || errB != nil {
		t.Fatal(errA, errB)
	}
	want := RenderChat([]string{"system", "user"}, []string{"You are Claude Code. Be careful.", "hi"})
	if a.Text != want || b.Text != want {
		t.Fatalf("texts %q / %q, want %q", a.Text, b.Text, want)
	}
}

// A conversation's next turn (the assistant's tool call, the user's tool
// result and a new question) extends the previous turn's text.
func TestMessagesTurnsExtend(t *testing.T) {
	turn1 := `{"model":"m","max_tokens":9,"system":"S","messages":[{"role":"user","content":[{"type":"text","text":"list files"}]}]}`
	turn2 := `{"model":"m","max_tokens":9,"system":"S","messages":[{"role":"user","content":[{"type":"text","text":"list files"}]},
		{"role":"assistant","content":[{"type":"thinking","thinking":"use ls","signature":"x"},{"type":"text","text":"Running ls."},
			{"type":"tool_use","id":"t1","name":"bash","input":{"cmd":"ls -l","é":[1,2.5]}}]},
		{"role":"ctx","content":[{"type":"tool_result","tool_use_id":"t1","content":[{"type":"text","text":"a.go"},{"type":"text","text":"b.go"}]},
			{"type":"text","text":"which is bigger?"}]}]}`
	p1, err1 := Parse(Messages, []byte(turn1))
	p2, err2 := Parse(Messages, []byte(turn2))
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	if !strings.HasPrefix(p2.Text, p1.Text) || len(p2.Text) <= len(p1.Text) {
		t.Fatalf("turn 2 does not extend turn 1:\n%q\n%q", p1.Text, p2.Text)
	}
	msgs, _, err := AnthropicChatOf([]byte(turn2))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(msgs)
	want := `[{"role":"system","content":"S"},{"role":"user","content":"list files"},` +
		`{"role":"assistant","content":"Running ls.","reasoning":"use ls","tool_calls":[{"id":"t1","type":"function",` +
		`"function":{"name":"bash","arguments":"{\"cmd\": \"ls -l\", \"\\u00e9\": [1, 2.5]}"}}]},` +
		`{"role":"tool","content":"a.go\nb.go","tool_call_id":"t1"},{"role":"user","content":"which is bigger?"}]`
	if string(got) != want {
		t.Fatalf("converted\n%s\nwant\n%s", got, want)
	}
}

// A system message inside messages joins the system prompt; a user
// message holding only tool results is dropped after its tool message.
func TestMessagesSystemAndToolOnly(t *testing.T) {
	msgs, _, err := AnthropicChatOf([]byte(`{"model":"m","max_tokens":1,"system":"A","messages":[{"role":"system","content":"B"},
		{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"ok"},
			{"type":"tool_result","tool_use_id":"u","content":[{"type":"image","source":{"type":"url","url":"http://i/x.png"}}]}]}]}`))
	if err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(msgs)
	want := `[{"role":"system","content":"AB"},{"role":"tool","content":"ok","tool_call_id":"t"},` +
		`{"role":"tool","content":"","tool_call_id":"u"},{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://i/x.png"}}]}]`
	if string(got) != want {
		t.Fatalf("converted\n%s\nwant\n%s", got, want)
	}
}

// metadata.user_id names Claude Code's session in both of its forms.
func TestMessagesMetadataSession(t *testing.T) {
	for _, c := range []struct{ user, session string }{
		{"user_5dd0_account__session_d2e70091-3007", "d2e70091-3007"},
		{`{\"device_id\":\"3f4a\",\"account_uuid\":\"\",\"session_id\":\"2c4e1cf0\"}`, "2c4e1cf0"},
		{"plain-user", ""},
	} {
		p, err := Parse(Messages, []byte(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"x"}],"metadata":{"user_id":"`+c.user+`"}}`))
		if err != nil {
			t.Fatal(err)
		}
		if p.PromptCacheKey != c.session || p.User == "" {
			t.Fatalf("%s: session %q user %q, want session %q", c.user, p.PromptCacheKey, p.User, c.session)
		}
	}
}

func TestMessagesMalformed(t *testing.T) {
	const msgs = `"messages":[{"role":"user","content":"x"}]`
	for _, c := range []struct {
		kind  Kind
		body  string
		param string
	}{
		{Messages, `{"model":"m",` + msgs + `}`, "max_tokens"},
		{Messages, `{"model":"m","max_tokens":0,` + msgs + `}`, "max_tokens"},
		{Messages, `{"model":"m","max_tokens":16777217,` + msgs + `}`, "max_tokens"},
		{Messages, `{"model":"m","max_tokens":"5",` + msgs + `}`, "max_tokens"},
		{Messages, `{"model":"m","max_tokens":1.5,` + msgs + `}`, "max_tokens"},
		{Messages, `{"max_tokens":1,` + msgs + `}`, "model"},
		{Messages, `{"model":5,"max_tokens":1,` + msgs + `}`, "model"},
		{Messages, `{"model":"m","max_tokens":1,"messages":"hi"}`, "messages"},
		{Messages, `{"model":"m","max_tokens":1,"messages":[]}`, "messages"},
		{Messages, `{"model":"m","max_tokens":1,"messages":[1]}`, "messages"},
		{Messages, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":5}]}`, "messages[0].content"},
		{Messages, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[]}]}`, "messages[0].content"},
		{Messages, `{"model":"m","max_tokens":1,"messages":[{"role":"user"}]}`, "messages[0].content"},
		{Messages, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"video"}]}]}`, "messages[0].content[0].type"},
		{Messages, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":["x"]}]}`, "messages[0].content"},
		{Messages, `{"model":"m","max_tokens":1,"messages":[{"role":"tool","content":"x"}]}`, "messages[0].role"},
		{Messages, `{"model":"m","max_tokens":1,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":[1]}]}]}`,
			"messages[0].content[0].input"},
		{Messages, `{"model":"m","max_tokens":1,"system":5,` + msgs + `}`, "system"},
		{Messages, `{"model":"m","max_tokens":1,"metadata":"x",` + msgs + `}`, "metadata"},
		{Messages, `{"model":"m","max_tokens":1,"metadata":{"user_id":7},` + msgs + `}`, "metadata.user_id"},
		{Messages, `{"model":"m","max_tokens":1,"tools":{},` + msgs + `}`, "tools"},
		{Messages, `{"model":"m","max_tokens":1,"tools":[{"name":"f"}],` + msgs + `}`, "tools[0]"},
		{CountTokens, `{"model":"m","messages":[]}`, "messages"},
	} {
		_, err := Parse(c.kind, []byte(c.body))
		var re *RequestError
		if !errors.As(err, &re) || re.Param != c.param {
			t.Errorf("%s: error %v, want one naming %s", c.body, err, c.param)
		}
	}
	// count_tokens generates nothing: no max_tokens needed.
	if p, err := Parse(CountTokens, []byte(`{"model":"m",`+msgs+`}`)); err != nil || p.Text == "" || p.MaxTokens != 0 {
		t.Fatalf("count_tokens: %+v %v", p, err)
	}
}

// PyJSON writes what Python's json.dumps writes.
func TestPyJSON(t *testing.T) {
	for in, want := range map[string]string{
		`{"a":"é","b":[1,2.5,null,true,false],"c":{"d":"😀\n\u0001\"\\"}}`: `{"a": "\u00e9", "b": [1, 2.5, null, true, false], "c": {"d": "\ud83d\ude00\n\u0001\"\\"}}`,
		`{}`: `{}`, `[]`: `[]`, ` {"x" : [ ] } `: `{"x": []}`, `"/~\u007f"`: `"/~\u007f"`,
	} {
		if got := PyJSON([]byte(in)); got != want {
			t.Errorf("PyJSON(%s) = %s, want %s", in, got, want)
		}
	}
}

// FuzzParseMessages: any body parses or is refused with a RequestError,
// never a panic; a parsed one converts for /tokenize.
func FuzzParseMessages(f *testing.F) {
	f.Add([]byte(`{"model":"m","max_tokens":1,"system":[{"type":"text","text":"s"}],"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":[{"type":"image","source":{"type":"base64","data":"AA"}}]}]}]}`))
	f.Add([]byte(`{"model":"m","max_tokens":1,"messages":[{"role":"assistant","content":[{"type":"tool_use","input":{"a":[1,{"b":"\u00e9"}]}}]}]}`))
	f.Add([]byte(`{"model":"m","max_tokens":1,"metadata":{"user_id":"{\"session_id\":1}"},"messages":[{"role":"msg","content":""}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		p, err := Parse(Messages, data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("%s: %v is not a RequestError", data, err)
			}
			return
		}
		msgs, _, err := AnthropicChatOf(data)
		if err != nil || (len(msgs) > 0) != (p.Text != "") {
			t.Fatalf("%s parsed, but converts to %d messages with %v (text %q)", data, len(msgs), err, p.Text)
		}
	})
}

// BenchmarkParseAgentTurn: an agent's late turn of about 100k tokens
// (a system prompt, 40 tool calls with 10 KB results), as a Messages call
// and as the chat vLLM converts it to.
func BenchmarkParseAgentTurn(b *testing.B) {
	result := strings.Repeat("src/file.go:12: func f() {} ", 360) // ≈ 10 KB
	var anth, chat []string
	for i := range 40 {
		anth = append(anth,
			fmt.Sprintf(`{"role":"assistant","content":[{"type":"text","text":"step %d"},{"type":"tool_use","id":"t%d","name":"bash","input":{"cmd":"grep -rn f ."}}]}`, i, i),
			fmt.Sprintf(`{"role":"user","content":[{"type":"tool_result","tool_use_id":"t%d","content":%q}]}`, i, result))
		chat = append(chat,
			fmt.Sprintf(`{"role":"assistant","content":"step %d","tool_calls":[{"id":"t%d","type":"function","function":{"name":"bash","arguments":"{\"cmd\": \"grep -rn f .\"}"}}]}`, i, i),
			fmt.Sprintf(`{"role":"tool","tool_call_id":"t%d","content":%q}`, i, result))
	}
	sys := strings.Repeat("Follow the rules. ", 500)
	bodies := map[string]struct {
		kind Kind
		body string
	}{
		"messages": {Messages, `{"model":"m","max_tokens":4096,"system":[{"type":"text","text":"x-anthropic-billing-header: cch=1;"},{"type":"text","text":"` + sys +
			`"}],"messages":[{"role":"user","content":"go"},` + strings.Join(anth, ",") + `]}`},
		"chat": {Chat, `{"model":"m","max_tokens":4096,"messages":[{"role":"system","content":"` + sys + `"},{"role":"user","content":"go"},` +
			strings.Join(chat, ",") + `]}`},
	}
	for _, name := range []string{"chat", "messages"} {
		c := bodies[name]
		b.Run(name, func(b *testing.B) {
			data := []byte(c.body)
			b.SetBytes(int64(len(data)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Parse(c.kind, data); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// AnthropicChatOf reads a client's body on its own (the remote
// tokenizer's path): nesting past MaxNesting is refused before a decoder
// (PyJSON's included) recurses into it, as Parse refuses it.
func TestAnthropicChatOfBoundsNesting(t *testing.T) {
	deep := strings.Repeat(`{"a":`, MaxNesting+1) + "1" + strings.Repeat("}", MaxNesting+1)
	data := []byte(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"x"},
		{"type":"tool_use","id":"t","name":"f","input":` + deep + `}]}]}`)
	if _, _, err := AnthropicChatOf(data); err == nil {
		t.Fatal("a body nested past MaxNesting was read")
	}
}
