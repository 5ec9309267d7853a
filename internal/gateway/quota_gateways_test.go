package gateway

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/testutil"
)

// The shape of TestQuotaTwoGatewaysRedis: a tenant's quota, and what each
// of its requests asks (max_tokens) and uses (the upstream's usage).
const (
	qgQuota     = 60_000 // tokens a minute, prompt + output
	qgPrompt    = 1000   // prompt tokens the upstream reports
	qgOutput    = 500    // output tokens the upstream reports
	qgMaxTokens = 600    // charged at admission, corrected to qgOutput
	qgUsed      = qgPrompt + qgOutput
	qgEvery     = 500 * time.Millisecond // one request, through each gateway in turn
)

// usageReplica is an upstream that answers every completion with the
// same usage (qgPrompt, qgOutput), as a replica reports what it computed.
func usageReplica(t *testing.T) *httptest.Server {
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model"}]}`)
	})
	mux.HandleFunc("/v1/completions", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],`+
			`"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`, qgPrompt, qgOutput, qgUsed)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// quotaPair is two whole gateways sharing one Redis and one fake clock,
// and the load the test sends through them.
type quotaPair struct {
	t    *testing.T
	clk  *clock.Fake
	gws  [2]*testGW
	body string
	step int // requests sent
}

// synced waits until each gateway has ended a quota sync (either result)
// beyond its count in before: the clock only moves on once both did, so
// that no sync tick is dropped and each decision sees the totals.
func (p *quotaPair) synced(before [2]uint64) {
	p.t.Helper()
	eventually(p.t, "both gateways' quota sync", func() bool {
		for i := range p.gws {
			if p.syncs(i) <= before[i] {
				return false
			}
		}
		return true
	})
}

func (p *quotaPair) syncs(i int) uint64 {
	qs := p.gws[i].g.ten.quotas
	return qs.syncsOK.Load() + qs.syncsErr.Load()
}

// minute sends a minute of requests at three times the quota, one every
// qgEvery through each gateway in turn, moving the clock on after each
// and waiting for the syncs that fall due. It returns the tokens each
// gateway admitted (as the upstream reported them).
func (p *quotaPair) minute() [2]int {
	p.t.Helper()
	var got [2]int
	for range time.Minute / qgEvery {
		i := p.step % 2
		p.step++
		resp, body := post(p.t, p.gws[i].srv.URL+"/v1/completions", p.body, bearerHdr("k")...)
		switch {
		case resp.StatusCode == http.StatusOK:
			got[i] += qgUsed
		case resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(body, `"quota_exceeded"`) || resp.Header.Get("Retry-After") == "":
			p.t.Fatalf("gateway %d: %d %s (Retry-After %q)", i, resp.StatusCode, body, resp.Header.Get("Retry-After"))
		}
		before := [2]uint64{p.syncs(0), p.syncs(1)}
		prev := p.clk.Now()
		p.clk.Advance(qgEvery)
		if p.clk.Now().Truncate(time.Second) != prev.Truncate(time.Second) {
			p.synced(before)
		}
	}
	return got
}

// Two whole gateways sharing a real Redis on loopback, on one fake clock,
// in front of an upstream that reports usage: a tenant with 60,000 tokens
// a minute sends three times that (180,000 tokens a minute), alternately
// through both. Each of three minutes, the tokens admitted are within
// 10 % of the quota. Then Redis is stopped: after three sync intervals
// local_share holds, each gateway within its share (30,000) and both
// within the quota; Redis started again, the syncs succeed again. The
// count of gateways is quota.expected_gateways': the live count comes
// from heartbeats, which the fake clock's jumps outrun (expire).
func TestQuotaTwoGatewaysRedis(t *testing.T) {
	rd := testutil.NewRedis(t)
	up := usageReplica(t)
	cfg := baseConfig(up.URL)
	cfg.ScrapeInterval, cfg.HealthInterval = Duration(time.Second), Duration(time.Second)
	cfg.SharedState = rd.URL()
	cfg.Tenants = []TenantConfig{{Name: "t", APIKeys: []string{"k"}, TokensPerMinute: qgQuota}}
	cfg.FlowControl.Quota.ExpectedGateways = 2
	start := time.Unix(6000-10, 0) // 10 s before a minute's start
	p := &quotaPair{t: t, clk: clock.NewFake(start),
		body: fmt.Sprintf(`{"model":"m","prompt":%q,"max_tokens":%d}`, strings.Repeat("word ", 800), qgMaxTokens)}
	for i := range p.gws {
		p.gws[i] = startGatewayWith(t, cfg, Options{Clock: p.clk, Registry: prometheus.NewRegistry()})
		eventually(t, "models listed", func() bool { return len(p.gws[i].g.Fleet().Models()) > 0 })
	}
	// Each gateway's sync loop arms its ticker when it starts: move the
	// clock a second at a time until both have synced once, then to the
	// next minute's start.
	eventually(t, "both quota loops running", func() bool {
		p.clk.Advance(time.Second)
		return p.syncs(0) > 0 && p.syncs(1) > 0
	})
	before := [2]uint64{p.syncs(0), p.syncs(1)}
	p.clk.Set(p.clk.Now().Truncate(time.Minute).Add(time.Minute))
	p.synced(before)
	for m := range 3 {
		got := p.minute()
		total := got[0] + got[1]
		t.Logf("minute %d: %d + %d = %d tokens admitted of a %d quota, %d offered", m, got[0], got[1], total, qgQuota, 3*qgQuota)
		if total < qgQuota*9/10 || total > qgQuota*11/10 {
			t.Fatalf("minute %d: %d tokens admitted, want within 10 %% of %d", m, total, qgQuota)
		}
	}
	rd.Stop()
	got := p.minute()
	t.Logf("Redis stopped: %d + %d tokens admitted, each gateway's share %d", got[0], got[1], qgQuota/2)
	for i, n := range got {
		if n > qgQuota/2 || n < qgQuota/2*8/10 {
			t.Errorf("Redis stopped: gateway %d admitted %d tokens, want at most its share %d (and near it)", i, n, qgQuota/2)
		}
	}
	for i, gw := range p.gws {
		if gw.g.ten.quotas.syncsErr.Load() == 0 {
			t.Errorf("gateway %d: no quota sync failed with Redis stopped", i)
		}
	}
	rd.Start()
	ok := [2]uint64{p.gws[0].g.ten.quotas.syncsOK.Load(), p.gws[1].g.ten.quotas.syncsOK.Load()}
	eventually(t, "quota syncs succeed again", func() bool {
		before := [2]uint64{p.syncs(0), p.syncs(1)}
		p.clk.Advance(time.Second)
		p.synced(before)
		return p.gws[0].g.ten.quotas.syncsOK.Load() > ok[0] && p.gws[1].g.ten.quotas.syncsOK.Load() > ok[1]
	})
}
