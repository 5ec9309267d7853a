package gateway

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// A replica's usage is an outside value: negative counts, cached tokens
// above the prompt's, or absurd sizes are bounded where the answer is
// read (attempt.noteUsage). Before, a negative completion_tokens made
// the token counters panic after the answer was relayed (the sinks behind
// them, the access log and the tenant's quota correction, never ran), and
// cached above prompt counted a hit rate over 100 %.
func TestReplicaUsageBounded(t *testing.T) {
	cases := []struct {
		name, usage            string
		prompt, cached, output float64
	}{
		{"negative output", `{"prompt_tokens":10,"completion_tokens":-3,"prompt_tokens_details":{"cached_tokens":4}}`, 10, 4, 0},
		{"cached above prompt", `{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":900}}`, 10, 10, 2},
		{"negative cached", `{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":-7}}`, 10, 0, 2},
		{"huge", `{"prompt_tokens":9000000000000000,"completion_tokens":9000000000000000,"prompt_tokens_details":{"cached_tokens":9000000000000000}}`,
			maxUsageTokens, maxUsageTokens, maxUsageTokens},
	}
	for _, tc := range cases {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s stream=%v", tc.name, stream), func(t *testing.T) {
				s := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
					_, _ = io.ReadAll(r.Body)
					if !stream {
						w.Header().Set("Content-Type", "application/json")
						fmt.Fprintf(w, `{"choices":[{"index":0,"text":"ok"}],"usage":%s}`, tc.usage)
						return
					}
					w.Header().Set("Content-Type", "text/event-stream")
					fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"text\":\"t\"}]}\n\n")
					fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":%s}\n\ndata: [DONE]\n\n", tc.usage)
				})
				reg := prometheus.NewRegistry()
				cfg := tenantsConfig(s.srv.URL)
				cfg.Tenants[1].TokensPerMinute = 1000
				gw := startGatewayWith(t, cfg, Options{Registry: reg})
				body := `{"model":"m","prompt":"hello","max_tokens":2}`
				if stream {
					body = `{"model":"m","prompt":"hello","max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`
				}
				resp, b := post(t, gw.srv.URL+"/v1/completions", body, bearerHdr("k-bulk")...)
				if resp.StatusCode != 200 || !strings.Contains(b, `"usage"`) {
					t.Fatalf("%d %s", resp.StatusCode, b)
				}
				waitIdle(t, gw)
				// The sinks count after the answer's last byte: wait for them.
				rep := map[string]string{"replica": s.srv.URL}
				ten := map[string]string{"tenant": "bulk", "kind": "output"}
				want := [4]float64{tc.prompt, tc.cached, tc.output, tc.output}
				var got [4]float64
				counted := func() bool {
					got = [4]float64{counterValue(t, reg, "kvgate_replica_prompt_tokens_total", rep),
						counterValue(t, reg, "kvgate_replica_cached_tokens_total", rep),
						counterValue(t, reg, "kvgate_replica_generation_tokens_total", rep),
						counterValue(t, reg, "kvgate_tenant_tokens_total", ten)}
					return got == want
				}
				if !counted() {
					eventually(t, fmt.Sprintf("prompt, cached, generated and the tenant's output tokens %v counted (now %v)", want, got), counted)
				}
			})
		}
	}
}
