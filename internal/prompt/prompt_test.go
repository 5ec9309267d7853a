package prompt

import (
	"errors"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

func TestApproxBlockHashesEqualsTokenPath(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		text := rapid.String().Draw(t, "text")
		bs := rapid.IntRange(1, 40).Draw(t, "bs")
		root := Key{Model: "m"}.Root()
		want := BlockHashes(nil, root, TokenBytes(nil, Approx{}.Encode(nil, text)), bs)
		got := ApproxBlockHashes(nil, root, text, bs)
		if len(got) != len(want) {
			t.Fatalf("len %d want %d", len(got), len(want))
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("block %d differs", i)
			}
		}
		if n := (Approx{}).Count(text); n != len(Approx{}.Encode(nil, text)) {
			t.Fatalf("count %d", n)
		}
		if len(got) != (Approx{}).Count(text)/bs {
			t.Fatalf("full blocks %d for %d tokens", len(got), (Approx{}).Count(text))
		}
	})
}

func TestBlockHashesPrefixProperty(t *testing.T) {
	root := Key{Model: "m"}.Root()
	a := strings.Repeat("shared system prompt. ", 40)
	h1 := ApproxBlockHashes(nil, root, a+"question one?", 16)
	h2 := ApproxBlockHashes(nil, root, a+"a different question", 16)
	shared := len(a) / 64
	for i := 0; i < shared; i++ {
		if h1[i] != h2[i] {
			t.Fatalf("block %d of a shared prefix differs", i)
		}
	}
	if len(h1) > shared && len(h2) > shared && h1[shared] == h2[shared] {
		t.Fatalf("first block after the shared prefix collides")
	}
	// Same block content at another position gets another hash (chained).
	rep := ApproxBlockHashes(nil, root, strings.Repeat("x", 64*3), 16)
	if rep[0] == rep[1] || rep[1] == rep[2] {
		t.Fatal("chained hashes repeat for repeated content")
	}
}

func TestPartitionsNeverMatch(t *testing.T) {
	text := strings.Repeat("abcd", 64)
	keys := []Key{{Model: "a"}, {Model: "b"}, {Model: "a", Adapter: "lora1"}, {Model: "a", Salt: "s"},
		{Model: "a", Adapter: "s"}, {Model: "as"}}
	seen := map[uint64]Key{}
	for _, k := range keys {
		h := ApproxBlockHashes(nil, k.Root(), text, 16)[0]
		if prev, ok := seen[h]; ok {
			t.Fatalf("%+v and %+v share a first block", prev, k)
		}
		seen[h] = k
	}
	if RootOf("engine", keys[0]) == keys[0].Root() {
		t.Fatal("namespaces share a root")
	}
}

func TestParse(t *testing.T) {
	tests := []struct {
		name  string
		kind  Kind
		body  string
		param string // expected error param; "-" for no error
		check func(t *testing.T, p *Parsed)
	}{
		{"completion string", Completion, `{"model":"m","prompt":"hello","max_tokens":5,"stream":true}`, "-", func(t *testing.T, p *Parsed) {
			if p.Text != "hello" || p.MaxTokens != 5 || !p.Stream || p.Prompts != 1 {
				t.Fatalf("%+v", p)
			}
		}},
		{"completion batch", Completion, `{"model":"m","prompt":["a","b"]}`, "-", func(t *testing.T, p *Parsed) {
			if p.Text != "a" || p.Prompts != 2 {
				t.Fatalf("%+v", p)
			}
		}},
		{"token ids", Completion, `{"model":"m","prompt":[1,2,3]}`, "-", func(t *testing.T, p *Parsed) {
			if len(p.TokenIDs) != 3 || p.Text != "" {
				t.Fatalf("%+v", p)
			}
		}},
		{"token id batch", Completion, `{"model":"m","prompt":[[1,2],[3]]}`, "-", func(t *testing.T, p *Parsed) {
			if len(p.TokenIDs) != 2 || p.Prompts != 2 {
				t.Fatalf("%+v", p)
			}
		}},
		{"chat", Chat, `{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":7,"cache_salt":"s","user":"u"}`, "-", func(t *testing.T, p *Parsed) {
			if p.Text != "<|system|>\nsys\n<|user|>\nhi\n" || p.System != "sys" || p.KeyText != "hi" || p.MaxTokens != 7 || p.CacheSalt != "s" || p.User != "u" {
				t.Fatalf("%+v", p)
			}
		}},
		{"prompt_cache_key", Chat, `{"model":"m","messages":[{"role":"user","content":"hi"}],"prompt_cache_key":"agent-7","user":"u"}`, "-", func(t *testing.T, p *Parsed) {
			if p.PromptCacheKey != "agent-7" || p.User != "u" {
				t.Fatalf("%+v", p)
			}
		}},
		{"prompt_cache_key not a string", Completion, `{"model":"m","prompt":"x","prompt_cache_key":7}`, "prompt_cache_key", nil},
		{"no model", Completion, `{"prompt":"x"}`, "model", nil},
		{"no prompt", Completion, `{"model":"m"}`, "prompt", nil},
		{"empty prompt list", Completion, `{"model":"m","prompt":[]}`, "prompt", nil},
		{"bad prompt type", Completion, `{"model":"m","prompt":5}`, "prompt", nil},
		{"negative token", Completion, `{"model":"m","prompt":[-1]}`, "prompt", nil},
		{"no messages", Chat, `{"model":"m","messages":[]}`, "messages", nil},
		{"no role", Chat, `{"model":"m","messages":[{"content":"x"}]}`, "messages[0].role", nil},
		{"bad content", Chat, `{"model":"m","messages":[{"role":"user","content":5}]}`, "messages[0].content", nil},
		{"malformed", Chat, `{"model":`, "", nil},
		{"trailing data", Chat, `{"model":"m"} {}`, "", nil},
		{"negative max_tokens", Completion, `{"model":"m","prompt":"x","max_tokens":-1}`, "max_tokens", nil},
		{"deep nesting", Completion, `{"model":"m","prompt":` + strings.Repeat("[", 100) + strings.Repeat("]", 100) + `}`, "", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Parse(tc.kind, []byte(tc.body))
			if tc.param == "-" {
				if err != nil {
					t.Fatal(err)
				}
				tc.check(t, p)
				return
			}
			var re *RequestError
			if !errors.As(err, &re) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("want RequestError, got %v", err)
			}
			if re.Param != tc.param {
				t.Fatalf("param %q want %q (%v)", re.Param, tc.param, err)
			}
		})
	}
}

func TestChatTurnsShareBlocks(t *testing.T) {
	root := Key{Model: "m"}.Root()
	turn1 := RenderChat([]string{"system", "user"}, []string{strings.Repeat("s", 500), "first question"})
	turn2 := RenderChat([]string{"system", "user", "assistant", "user"},
		[]string{strings.Repeat("s", 500), "first question", "an answer", "second"})
	if !strings.HasPrefix(turn2, turn1) {
		t.Fatal("rendering is not append-only")
	}
	h1 := ApproxBlockHashes(nil, root, turn1, 16)
	h2 := ApproxBlockHashes(nil, root, turn2, 16)
	for i := range h1 {
		if h1[i] != h2[i] {
			t.Fatalf("turn 2 does not extend turn 1 at block %d", i)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add([]byte(`{"model":"m","prompt":"x"}`), false)
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]}`), true)
	f.Add([]byte(`{"model":"m","prompt":[[1],[2,3]]}`), false)
	f.Fuzz(func(t *testing.T, data []byte, chat bool) {
		kind := Completion
		if chat {
			kind = Chat
		}
		p, err := Parse(kind, data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("untyped error %v", err)
			}
			return
		}
		n, hs := p.Blocks(nil, Approx{}, Key{Model: p.Model}.Root(), 16)
		if len(hs) != n/16 {
			t.Fatalf("%d blocks for %d tokens", len(hs), n)
		}
	})
}

func BenchmarkApproxBlockHashes32k(b *testing.B) {
	text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 32000/45+1)[:32000]
	root := Key{Model: "m"}.Root()
	dst := make([]uint64, 0, 600)
	b.SetBytes(int64(len(text)))
	for b.Loop() {
		dst = ApproxBlockHashes(dst[:0], root, text, 16)
	}
}

// RenderChat allocates its text once, however long the conversation, and
// renders each message as RenderMessage does.
func TestRenderChatAllocatesOnce(t *testing.T) {
	roles := []string{"system", "user", "assistant", "user", "tool"}
	contents := []string{strings.Repeat("s", 3000), "first", strings.Repeat("a", 9000), "", "é"}
	var want strings.Builder
	for i := range roles {
		RenderMessage(&want, roles[i], contents[i])
	}
	if got := RenderChat(roles, contents); got != want.String() {
		t.Fatalf("RenderChat %q, want %q", got, want.String())
	}
	if n := testing.AllocsPerRun(20, func() { _ = RenderChat(roles, contents) }); n != 1 {
		t.Fatalf("RenderChat allocates %v times, want 1", n)
	}
}

// ChatParsed gives the routing key Parse gives the same chat's body.
func TestChatParsedEqualsParse(t *testing.T) {
	roles := []string{"system", "user", "assistant", "user"}
	contents := []string{"be brief", "first", "an answer", "second"}
	body := `{"model":"m","max_tokens":9,"messages":[{"role":"system","content":"be brief"},{"role":"user","content":"first"},` +
		`{"role":"assistant","content":"an answer"},{"role":"user","content":"second"}]}`
	want, err := Parse(Chat, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	got := ChatParsed("m", roles, contents, RenderChat(roles, contents), 9)
	if got.Text != want.Text || got.System != want.System || got.KeyText != want.KeyText ||
		got.MaxTokens != want.MaxTokens || got.Kind != want.Kind || got.Prompts != want.Prompts {
		t.Fatalf("ChatParsed %+v, Parse %+v", got, *want)
	}
}

// Keys match exactly, as vLLM's do; integer fields are integers in range.
func TestParseStrictKeysAndTokenLimits(t *testing.T) {
	cases := []struct {
		name, body, param string
		kind              Kind
	}{
		{"MODEL is not model", `{"MODEL":"m","prompt":"x"}`, "model", Completion},
		{"overflow max_tokens", `{"model":"m","prompt":"x","max_tokens":9223372036854775807}`, "max_tokens", Completion},
		{"beyond int64", `{"model":"m","prompt":"x","max_tokens":99999999999999999999999}`, "max_tokens", Completion},
		{"above the limit", `{"model":"m","prompt":"x","max_completion_tokens":16777217}`, "max_completion_tokens", Completion},
		{"negative", `{"model":"m","prompt":"x","max_tokens":-1}`, "max_tokens", Completion},
		{"fraction", `{"model":"m","prompt":"x","max_tokens":1.5}`, "max_tokens", Completion},
		{"string", `{"model":"m","prompt":"x","max_tokens":"10"}`, "max_tokens", Completion},
		{"Role is not role", `{"model":"m","messages":[{"Role":"user","content":"hi"}]}`, "messages[0].role", Chat},
		{"stream not a bool", `{"model":"m","prompt":"x","stream":"yes"}`, "stream", Completion},
		{"priority a string", `{"model":"m","prompt":"x","priority":"1"}`, "priority", Completion},
		{"priority a fraction", `{"model":"m","prompt":"x","priority":0.5}`, "priority", Completion},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse(c.kind, []byte(c.body))
			var re *RequestError
			if !errors.As(err, &re) || re.Param != c.param {
				t.Fatalf("err %v, want a RequestError on %q", err, c.param)
			}
		})
	}
	p, err := Parse(Completion, []byte(`{"model":"m","prompt":"x","Stream":true,"max_tokens":16777216}`))
	if err != nil || p.Stream || p.MaxTokens != MaxTokensLimit {
		t.Fatalf("Stream must not set stream, the limit itself is valid: %+v %v", p, err)
	}
	if _, err := Parse(Completion, []byte(`[1,2]`)); err == nil {
		t.Fatal("a body that is not an object was accepted")
	}
	// vLLM's priority: any integer, saturated to ±MaxPriority.
	for body, want := range map[string]int{`-3`: -3, `7`: 7, `99999999999999999999`: MaxPriority, `-9223372036854775808`: -MaxPriority, `null`: 0} {
		p, err := Parse(Completion, []byte(`{"model":"m","prompt":"x","priority":`+body+`}`))
		if err != nil || p.Priority != want || p.PrioritySet != (body != "null") {
			t.Fatalf("priority %s: %+v %v, want %d", body, p, err, want)
		}
	}
}
