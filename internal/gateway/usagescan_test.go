package gateway

import (
	"bytes"
	"encoding/json"
	"reflect"
	"testing"

	"github.com/kvgate/kvgate/internal/openai"
)

// usageCases are usage objects scanUsage takes (true) or leaves to
// json.Unmarshal (false).
var usageCases = []struct {
	in   string
	fast bool
}{
	{`{"prompt_tokens":300,"completion_tokens":1,"total_tokens":301,"prompt_tokens_details":{"cached_tokens":256}}`, true},
	{" {\n \"prompt_tokens\" : 5 ,\t\"completion_tokens\":0, \"prompt_tokens_details\" : { } }\r\n", true},
	{`{}`, true},
	{`{"prompt_tokens":1,"prompt_tokens":2}`, true},
	{`{"prompt_tokens_details":{"cached_tokens":3},"prompt_tokens_details":{}}`, true},
	{`{"prompt_tokens_details":null}`, false},
	{`{"prompt_tokens":null}`, false},
	{`{"Prompt_Tokens":7}`, false},
	{`{"prompt\u005ftokens":7}`, false},
	{`{"prompt_tokens":1.5}`, false},
	{`{"prompt_tokens":1e3}`, false},
	{`{"prompt_tokens":-1}`, false},
	{`{"prompt_tokens":01}`, false},
	{`{"prompt_tokens":123456789012345678901}`, false},
	{`{"prompt_tokens":5,"extra":{"a":[1,2]}}`, false},
	{`{"prompt_tokens":5,}`, false},
	{`{"prompt_tokens":5`, false},
	{`{"prompt_tokens":5}}`, false},
	{`[1]`, false},
	{``, false},
}

// TestScanUsage: scanUsage takes the shape vLLM writes and gives what
// json.Unmarshal gives; anything else it leaves to json.Unmarshal, and
// usageOf's answer is json.Unmarshal's.
func TestScanUsage(t *testing.T) {
	for _, c := range usageCases {
		got, ok := scanUsage([]byte(c.in))
		if ok != c.fast {
			t.Errorf("%q: scanned %v, want %v", c.in, ok, c.fast)
		}
		var want openai.Usage
		werr := json.Unmarshal([]byte(c.in), &want)
		if ok && (werr != nil || !reflect.DeepEqual(got, want)) {
			t.Errorf("%q: scanned %+v, json.Unmarshal %+v (%v)", c.in, got, want, werr)
		}
		// usageOf decodes the object the "usage" key starts (usageValue):
		// as json.Unmarshal of that object.
		obj := usageValue(bytes.TrimLeft([]byte(c.in), " \t\r\n"))
		var old openai.Usage
		oerr := json.Unmarshal(obj, &old)
		u := usageOf([]byte(`{"id":"x","usage":` + c.in))
		if (u == nil) != (oerr != nil) || u != nil && !reflect.DeepEqual(*u, old) {
			t.Errorf("%q: usageOf %+v, json.Unmarshal %+v (%v)", c.in, u, old, oerr)
		}
	}
}

// FuzzScanUsage: whatever scanUsage takes, json.Unmarshal decodes alike.
func FuzzScanUsage(f *testing.F) {
	for _, c := range usageCases {
		f.Add(c.in)
	}
	f.Fuzz(func(t *testing.T, in string) {
		got, ok := scanUsage([]byte(in))
		if !ok {
			return
		}
		var want openai.Usage
		if err := json.Unmarshal([]byte(in), &want); err != nil || !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: scanned %+v, json.Unmarshal %+v (%v)", in, got, want, err)
		}
	})
}

// BenchmarkUsage compares scanUsage with json.Unmarshal on the usage
// object of a vLLM answer.
func BenchmarkUsage(b *testing.B) {
	in := []byte(usageCases[0].in)
	b.Run("scan", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := scanUsage(in); !ok {
				b.Fatal("not scanned")
			}
		}
	})
	b.Run("json", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var u openai.Usage
			if err := json.Unmarshal(in, &u); err != nil {
				b.Fatal(err)
			}
		}
	})
}
