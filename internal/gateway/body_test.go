package gateway

import (
	"encoding/json"
	"testing"
)

// editObject changes the members it names and keeps every other member's
// bytes: number formatting, escapes, nesting, order.
func TestEditObject(t *testing.T) {
	tests := []struct {
		name, in string
		edits    []fieldEdit
		want     string
	}{
		{"set and add", `{"model":"m","stream":true}`,
			[]fieldEdit{{key: "stream", value: []byte("false")}, {key: "max_tokens", value: []byte("1")}},
			`{"model":"m","stream":false,"max_tokens":1}`},
		{"other bytes kept", `{ "temperature" : 0.70, "prompt":"caf\u00e9 \"q\"", "x": [1, {"y" :2}] ,"stream":true }`,
			[]fieldEdit{{key: "stream", value: []byte("false")}},
			`{"temperature" : 0.70,"prompt":"caf\u00e9 \"q\"","x": [1, {"y" :2}],"stream":false}`},
		{"remove", `{"a":1,"stream_options":{"include_usage":true},"b":2}`,
			[]fieldEdit{{key: "stream_options"}}, `{"a":1,"b":2}`},
		{"duplicates all go", `{"stream":true,"a":1,"stream":true}`,
			[]fieldEdit{{key: "stream", value: []byte("false")}}, `{"a":1,"stream":false}`},
		{"escaped key matched", `{"kv\u005ftransfer_params":{"do_remote_prefill":true},"a":1}`,
			[]fieldEdit{{key: "kv_transfer_params"}}, `{"a":1}`},
		{"ifPresent absent", `{"max_tokens":9}`,
			[]fieldEdit{{key: "max_tokens", value: []byte("1")}, {key: "max_completion_tokens", value: []byte("1"), ifPresent: true}},
			`{"max_tokens":1}`},
		{"ifPresent present", `{"max_completion_tokens":null}`,
			[]fieldEdit{{key: "max_completion_tokens", value: []byte("1"), ifPresent: true}}, `{"max_completion_tokens":1}`},
		{"empty", `{}`, []fieldEdit{{key: "a", value: []byte("true")}}, `{"a":true}`},
		{"nested key untouched", `{"m":{"stream":true}}`, []fieldEdit{{key: "stream", value: []byte("false")}},
			`{"m":{"stream":true},"stream":false}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := editObject([]byte(tc.in), tc.edits...)
			if err != nil || string(got) != tc.want {
				t.Fatalf("got %s, %v\nwant %s", got, err, tc.want)
			}
			if !json.Valid(got) {
				t.Fatalf("not JSON: %s", got)
			}
		})
	}
	for _, bad := range []string{`[1]`, `{"a":1`, `{"a":1} {}`, `{"a":1}}`, `"x"`, ``} {
		if got, err := editObject([]byte(bad), fieldEdit{key: "a"}); err == nil {
			t.Errorf("%q: no error, %s", bad, got)
		}
	}
}

// The prefill step's body is vLLM's proxy's; the decode step's is the
// client's with the prefill's kv_transfer_params, and never the client's own.
func TestPrefillAndDecodeBodies(t *testing.T) {
	in := `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},` +
		`"max_completion_tokens":50,"min_tokens":5,"temperature":0.30,"kv_transfer_params":{"remote_host":"evil"}}`
	got, err := prefillBody([]byte(in))
	want := `{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0.30,"kv_transfer_params":` +
		string(prefillKVParams) + `,"stream":false,"max_tokens":1,"max_completion_tokens":1}`
	if err != nil || string(got) != want {
		t.Fatalf("prefill body\n got %s\nwant %s", got, want)
	}
	kv := []byte(`{"do_remote_prefill":true,"remote_block_ids":[1,2]}`)
	got, err = decodeBody([]byte(in), kv)
	want = `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},` +
		`"max_completion_tokens":50,"min_tokens":5,"temperature":0.30,"kv_transfer_params":` + string(kv) + `}`
	if err != nil || string(got) != want {
		t.Fatalf("decode body\n got %s\nwant %s", got, want)
	}
	got, _ = decodeBody([]byte(in), nil)
	if want := `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},` +
		`"max_completion_tokens":50,"min_tokens":5,"temperature":0.30}`; string(got) != want {
		t.Fatalf("decode body without KV\n got %s\nwant %s", got, want)
	}
	plain := `{"model":"m", "prompt":"x"}`
	if got, _ := decodeBody([]byte(plain), nil); string(got) != plain {
		t.Fatalf("a body without kv_transfer_params changed: %s", got)
	}
}

func FuzzEditObject(f *testing.F) {
	f.Add([]byte(`{"a":1,"stream":true,"b":[{"stream":1}]}`))
	f.Add([]byte(`{"kv\u005ftransfer_params":null}`))
	f.Fuzz(func(t *testing.T, in []byte) {
		out, err := editObject(in, fieldEdit{key: "stream", value: []byte("false")}, fieldEdit{key: "kv_transfer_params"})
		if err != nil {
			return
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("%q → %q: %v", in, out, err)
		}
		if string(m["stream"]) != "false" || m["kv_transfer_params"] != nil {
			t.Fatalf("%q → %q", in, out)
		}
	})
}

// withMember appends a member to a valid object, whatever its spacing, and
// a reader that keeps a repeated key's last value reads it.
func TestWithMember(t *testing.T) {
	for in, want := range map[string]string{
		`{}`:                            `{"k":1}`,
		` { } `:                         ` {"k":1} `,
		`{"a":"}"}`:                     `{"a":"}","k":1}`,
		"{\"a\":[1,{}] \n}\n":           "{\"a\":[1,{}],\"k\":1}\n",
		`{"k":null,"s":"x"}`:            `{"k":null,"s":"x","k":1}`,
		`{"stream":true,"prompt":"hi"}`: `{"stream":true,"prompt":"hi","k":1}`,
	} {
		got := string(withMember([]byte(in), "k", []byte("1")))
		var m map[string]any
		if got != want || json.Unmarshal([]byte(got), &m) != nil || m["k"] != 1.0 {
			t.Errorf("withMember(%q) = %q, want %q", in, got, want)
		}
	}
}
