package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
)

// usageStub streams 50 tokens and, as vLLM does, the usage chunk only
// when stream_options.include_usage asks for it; it keeps each body.
func usageStub(t *testing.T) (*stub, func() []string) {
	var mu sync.Mutex
	var bodies []string
	s := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		bodies = append(bodies, string(b))
		mu.Unlock()
		var req struct {
			Options struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		_ = json.Unmarshal(b, &req)
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 50 {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"text\":\"t%d\"}]}\n\n", i)
		}
		if req.Options.IncludeUsage {
			fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":50,\"total_tokens\":60}}\n\n")
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	})
	return s, func() []string { mu.Lock(); defer mu.Unlock(); return append([]string(nil), bodies...) }
}

// With flow control (tenants), a streamed completion or chat asks its
// replica for the usage even when the client did not: a tenant's quota
// and its fair share are corrected by the usage, and a stream without it
// (vLLM sends none unless stream_options.include_usage) generated for
// free: 0 output tokens charged without max_tokens, and the fair share
// refunded what it expected. The usage chunk goes to the client only if
// it asked for it; the client's other stream_options are kept.
func TestStreamUsageAskedForTenants(t *testing.T) {
	s, bodies := usageStub(t)
	cfg := baseConfig(s.srv.URL)
	cfg.Tenants = []TenantConfig{{Name: "t", APIKeys: []string{"k"}, OutputTokensPerMinute: 120}}
	reg := prometheus.NewRegistry()
	gw := startGatewayWith(t, cfg, Options{Clock: clock.NewFake(time.Unix(6000, 0)), Registry: reg})
	allListed(t, gw)
	codes := []int{}
	for k := range 4 {
		body := `{"model":"m","prompt":"hi","stream":true,"stream_options":{"continuous_usage_stats":false}}`
		if k%2 == 1 {
			body = `{"model":"m","prompt":"hi","stream":true}`
		}
		resp, b := post(t, gw.srv.URL+"/v1/completions", body, bearerHdr("k")...)
		codes = append(codes, resp.StatusCode)
		if resp.StatusCode == 200 && (strings.Contains(b, `"usage"`) || !strings.Contains(b, "[DONE]")) {
			t.Fatalf("the client did not ask for the usage: %s", b)
		}
		// The charge is corrected as the exchange ends: wait for it (on
		// main it never comes: the usage was not asked for).
		used := func() bool {
			return counterValue(t, reg, "kvgate_quota_used_tokens", map[string]string{"tenant": "t", "kind": "output"}) == float64(50*min(k+1, 3))
		}
		if !used() {
			eventually(t, "the output charged corrected to the usage", used)
		}
	}
	// 50 output tokens a request, corrected after each: 0, 50, 100 admitted
	// under 120; the fourth (150 used) refused.
	if fmt.Sprint(codes) != "[200 200 200 429]" {
		t.Errorf("codes %v, want [200 200 200 429]", codes)
	}
	for k, b := range bodies() {
		var got struct {
			Options map[string]bool `json:"stream_options"`
		}
		if json.Unmarshal([]byte(b), &got) != nil || !got.Options["include_usage"] || len(got.Options) != 2-k%2 {
			t.Errorf("the replica got %s, want include_usage added to the client's stream_options", b)
		}
	}
	resp, b := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"hi","stream":true,"stream_options":{"include_usage":true}}`,
		bearerHdr("k")...)
	if resp.StatusCode != 429 && !strings.Contains(b, `"usage"`) {
		t.Errorf("a client that asked for the usage did not get it: %d %s", resp.StatusCode, b)
	}
	if resp, b := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"hi","stream":true,"stream_options":"yes"}`,
		bearerHdr("k")...); resp.StatusCode != 400 || !strings.Contains(b, "stream_options") {
		t.Errorf("stream_options not an object: %d %s, want 400", resp.StatusCode, b)
	}
	waitIdle(t, gw)
}
