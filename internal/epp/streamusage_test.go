package epp

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/epp/standin"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// Behind the endpoint picker, a tenant's stream that did not ask for its
// usage is asked for it, as kvgate serve asks (the quota is charged the
// output the replica reports, not the estimate: 0 without max_tokens),
// and the usage chunk is taken out of what the client gets, in both body
// modes. Before, the picker left the body alone: the stream generated for
// free.
func TestStreamUsageThroughThePicker(t *testing.T) {
	fl := startSims(t, 1)
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			rc := &recorder{}
			cfg := gatewayConfig(fl, "ttft")
			cfg.Replicas = []gateway.ReplicaConfig{{URL: rc.start(t, fl.URLs()[0])}}
			cfg.Tenants = []gateway.TenantConfig{{Name: "gold", APIKeys: []string{"k-gold"}, OutputTokensPerMinute: 1 << 20}}
			r := startRig(t, cfg, fl, standin.Config{RequestMode: m.mode, ResponseMode: m.mode, MessageTimeout: time.Minute})
			body := `{"model":"` + sim.DefaultModel + `","messages":[{"role":"user","content":"hi"}],"stream":true,` +
				`"stream_options":{"continuous_usage_stats":false}}`
			resp := testutil.Post(t, http.DefaultClient, r.front.URL+"/v1/chat/completions", body, "Authorization", "Bearer k-gold")
			if resp.Status != http.StatusOK || !strings.Contains(resp.Body, "data: [DONE]") || strings.Contains(resp.Body, `"usage":{`) {
				t.Fatalf("%d: want a whole stream without the usage the client did not ask for: %s", resp.Status, resp.Body)
			}
			rc.mu.Lock()
			sent := rc.bodies[len(rc.bodies)-1]
			rc.mu.Unlock()
			if !strings.Contains(sent, `"include_usage":true`) || !strings.Contains(sent, `"continuous_usage_stats":false`) {
				t.Fatalf("the replica got %s: want the usage asked for, the client's options kept", sent)
			}
			out := strings.Count(resp.Body, `"delta"`) - 1 // the first chunk names the role
			testutil.Eventually(t, 10*time.Second, "the output charged from the usage", func() bool {
				return gauge(t, r, "kvgate_quota_used_tokens", map[string]string{"tenant": "gold", "kind": "output"}) >= float64(out) && out > 0
			})
		})
	}
}

// gauge is the sum of a gauge's series whose labels include want.
func gauge(t *testing.T, r *rig, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				if labelsMatch(m, want) {
					sum += m.GetGauge().GetValue()
				}
			}
		}
	}
	return sum
}
