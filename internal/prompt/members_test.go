package prompt

import (
	"bytes"
	"encoding/json"
	"testing"
)

// FuzzMembers holds readMembers to encoding/json's reading of the same body:
// it answers exactly when Unmarshal into a map of raw members finds an
// object, with the same keys and the same values.
func FuzzMembers(f *testing.F) {
	for _, s := range []string{
		`{"model":"m","prompt":"x","stream":true,"max_tokens":1}`,
		` { "a" : [1,{"b":"]}"}] , "a":null, "\u0063":"\"q\"" } `,
		`{"k\xff":"v\xfe"}`, `{}`, `[]`, `null`, `{"a":1}x`, `{"a":}`, `{"a":"\\"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var want map[string]json.RawMessage
		werr := json.Unmarshal(data, &want)
		ms, ok := readMembers(data)
		got := make(map[string]json.RawMessage, len(ms))
		for _, m := range ms {
			got[string(m.key)] = m.val
		}
		if ok != (werr == nil && want != nil) {
			t.Fatalf("members ok %v, encoding/json err %v (nil map %v)", ok, werr, want == nil)
		}
		if !ok {
			return
		}
		if len(got) != len(want) {
			t.Fatalf("%d members, encoding/json %d", len(got), len(want))
		}
		for k, v := range want {
			if !bytes.Equal(got[k], v) {
				t.Fatalf("member %q: %q, encoding/json %q", k, got[k], v)
			}
		}
		for k, v := range want {
			if g, _ := ms.get(k); !bytes.Equal(g, v) {
				t.Fatalf("get(%q) = %q, encoding/json %q", k, g, v)
			}
		}
		for _, tok := range got {
			if s, simple := simpleString(tok); simple {
				var w string
				if err := json.Unmarshal(tok, &w); err != nil || w != s {
					t.Fatalf("simpleString(%q) = %q, encoding/json %q (%v)", tok, s, w, err)
				}
			}
		}
	})
}

// BenchmarkParse: the proxy's per-request parse of a completion (the
// make bench-proxy body) and of a chat.
func BenchmarkParse(b *testing.B) {
	for _, c := range []struct {
		name string
		kind Kind
		body string
	}{
		{"completion", Completion, `{"model":"static","prompt":"Hello there, how are you?","max_tokens":1}`},
		{"chat", Chat, `{"model":"m","stream":true,"messages":[{"role":"system","content":"You are terse."},{"role":"user","content":"Hello there, how are you?"}]}`},
	} {
		b.Run(c.name, func(b *testing.B) {
			data := []byte(c.body)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Parse(c.kind, data); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
