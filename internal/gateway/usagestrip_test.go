package gateway

import (
	"strings"
	"testing"
)

// A stream passing through the endpoint picker in chunks cut anywhere
// (inside an event, inside its blank line) reaches the client whole, less
// the usage chunk the gateway asked for; a chunk of usage among choices
// (continuous_usage_stats) is the client's and stays.
func TestUsageStripAnyCut(t *testing.T) {
	const (
		tok   = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}],\"usage\":{\"prompt_tokens\":3}}\n\n"
		usage = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n"
		done  = "data: [DONE]\n\n"
	)
	stream, want := tok+tok+usage+done, tok+tok+done
	for _, crlf := range []bool{false, true} {
		s, w := stream, want
		if crlf {
			s, w = strings.ReplaceAll(s, "\n", "\r\n"), strings.ReplaceAll(w, "\n", "\r\n")
		}
		for i := 0; i <= len(s); i++ {
			for j := i; j <= len(s); j += 7 {
				f := &usageStrip{maxLine: 1 << 10}
				got := string(f.pass([]byte(s[:i]), false)) + string(f.pass([]byte(s[i:j]), false)) + string(f.pass([]byte(s[j:]), true))
				if got != w {
					t.Fatalf("crlf %v, cut at %d and %d: %q, want %q", crlf, i, j, got, w)
				}
			}
		}
	}
}
