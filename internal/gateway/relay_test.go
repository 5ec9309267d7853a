package gateway

import (
	"net/http"
	"strings"
	"testing"
)

// usageOf finds the usage object of a JSON answer by its last "usage" key
// and decodes it alone: braces and quotes inside strings do not end it,
// keys after it are ignored, and an answer without usage has none.
func TestUsageOf(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		want       int // prompt tokens; -1: no usage
	}{
		{"plain", `{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1}}`, 7},
		{"keys after it", `{"usage":{"prompt_tokens":8},"kv_transfer_params":null}`, 8},
		{"strings with braces", `{"choices":[{"text":"} { \"usage\": {"}],"usage":{"prompt_tokens":9,"x":"}\\\"{"}}`, 9},
		{"details nested", `{"usage":{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":4}}}`, 10},
		{"none", `{"choices":[{"text":"usage"}]}`, -1},
		{"null", `{"usage":null}`, -1},
		{"cut short", `{"usage":{"prompt_tokens":11`, -1},
	} {
		u := usageOf([]byte(tc.body))
		switch {
		case tc.want < 0 && u != nil:
			t.Errorf("%s: usage %+v, want none", tc.name, *u)
		case tc.want >= 0 && (u == nil || u.PromptTokens != tc.want):
			t.Errorf("%s: usage %+v, want prompt_tokens %d", tc.name, u, tc.want)
		}
	}
}

// dropHopHeaders deletes hopHeaders by their names as written: each must
// be canonical, as net/http keys a received header.
func TestHopHeadersCanonical(t *testing.T) {
	for _, h := range hopHeaders {
		if c := http.CanonicalHeaderKey(h); c != h {
			t.Errorf("hop header %q is not canonical (%q)", h, c)
		}
	}
}

// isKvgateHeader's shortcut (length and first letter) answers as the
// canonical name's prefix does, whatever the case.
func TestIsKvgateHeader(t *testing.T) {
	for _, k := range []string{"X-Kvgate-Replica", "x-kvgate-route", "X-KVGATE-PREFILL", "X-Kvgate-", "X-Kvgate", "x-kvgat",
		"Content-Type", "XKvgate-Foo", "X-Request-Id", "", "x", "Y-Kvgate-Replica"} {
		want := strings.HasPrefix(http.CanonicalHeaderKey(k), "X-Kvgate-")
		if got := isKvgateHeader(k); got != want {
			t.Errorf("isKvgateHeader(%q) = %v, want %v", k, got, want)
		}
	}
}
