package gateway

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// A request's quota charge at admission counts every sequence it asks
// for: n samples of max_tokens for each prompt of a batch. Before, n and
// a batch's other prompts were not counted until the usage came back, so
// a tenant's concurrent requests could each spend n × prompts times what
// was charged: its minute's quota, 1,000 tokens here, admitted requests
// asking for 5,000. n outside [1, 4096] is refused (400, param n).
func TestQuotaCountsSamplesAndBatches(t *testing.T) {
	f := newFakeReplica(t)
	cfg := baseConfig(f.srv.URL)
	cfg.Tenants = []TenantConfig{{Name: "t", APIKeys: []string{"k"}, TokensPerMinute: 1000}}
	gw := startGatewayWith(t, cfg, Options{Clock: clock.NewFake(time.Unix(6000, 0))})
	allListed(t, gw)
	batch := `["hi"` + strings.Repeat(`,"hi"`, 99) + `]`
	for _, c := range []struct {
		body, want string
	}{
		{`{"model":"m","prompt":"hi","max_tokens":50,"n":100}`, "429 quota_exceeded"},
		{`{"model":"m","prompt":` + batch + `,"max_tokens":50}`, "429 quota_exceeded"},
		{`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":50,"n":100}`, "429 quota_exceeded"},
		{`{"model":"m","prompt":"hi","max_tokens":50,"n":0}`, `400 "n"`},
		{`{"model":"m","prompt":"hi","max_tokens":50,"n":5000}`, `400 "n"`},
		{`{"model":"m","prompt":"hi","max_tokens":50,"n":"2"}`, `400 "n"`},
		{`{"model":"m","prompt":"hi","max_tokens":50,"n":2}`, "200"},
	} {
		path := "/v1/completions"
		if strings.Contains(c.body, "messages") {
			path = "/v1/chat/completions"
		}
		resp, b := post(t, gw.srv.URL+path, c.body, bearerHdr("k")...)
		code, what, _ := strings.Cut(c.want, " ")
		if fmt.Sprint(resp.StatusCode) != code || !strings.Contains(b, what) {
			t.Errorf("%s: %d %s, want %s", c.body[:min(len(c.body), 90)], resp.StatusCode, b, c.want)
		}
	}
	waitIdle(t, gw)
}
