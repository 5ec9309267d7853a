package gateway

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/sharedstate"
)

// memBudgets is the shared budgets of several gateways in memory, as
// Redis keeps them (sharedstate.SyncQuotas); down: it does not answer.
type memBudgets struct {
	mu     sync.Mutex
	totals map[sharedstate.QuotaKey]int64
	down   bool
	live   int
}

func (m *memBudgets) SyncQuotas(_ context.Context, d map[sharedstate.QuotaKey]int64) (map[sharedstate.QuotaKey]int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.down {
		return nil, errors.New("down")
	}
	out := map[sharedstate.QuotaKey]int64{}
	for k, v := range d {
		m.totals[k] += v
		out[k] = m.totals[k]
	}
	return out, nil
}

func (m *memBudgets) LiveGateways() int { return m.live }

func quotaConfig(fallback string) Config {
	cfg := Defaults()
	cfg.Tenants = []TenantConfig{{Name: "t", APIKeys: []string{"k"}, TokensPerMinute: 1000, OutputTokensPerMinute: 300}}
	cfg.FlowControl.Quota.Fallback = fallback
	return cfg
}

// One gateway: requests are admitted while their tokens fit the minute
// (each kind apart), refused with the time to the next minute, corrected
// to their usage, refunded when never sent; the minute slides.
func TestQuotaLocal(t *testing.T) {
	clk := clock.NewFake(time.Unix(6000, 0)) // a minute's start
	qs := newQuotas(quotaConfig(QuotaLocalShare), clk, slog.New(slog.DiscardHandler), nil)
	tq := qs.byName["t"]
	admit := func(prompt, out int) error {
		_, err := qs.admit(tq, prompt, out)
		return err
	}
	if err := admit(500, 100); err != nil {
		t.Fatal(err)
	}
	err := admit(300, 250) // 350 output > 300
	var ae *apiError
	if !errors.As(err, &ae) || ae.Status != 429 || ae.Code != "quota_exceeded" || ae.RetryAfter != time.Minute {
		t.Fatalf("over the output quota: %v", err)
	}
	c, err := qs.admit(tq, 300, 100) // 1000 in all
	if err != nil {
		t.Fatal(err)
	}
	if err := admit(1, 0); err == nil {
		t.Fatal("over the total quota")
	}
	qs.settle(c, true, true, 300, 20) // it generated 20, not 100: 80 back
	if err := admit(50, 10); err != nil {
		t.Fatalf("after the correction: %v", err)
	}
	c2, _ := qs.admit(tq, 0, 0)
	qs.settle(c2, false, false, 0, 0) // a refund of nothing is nothing
	// 30 s into the next minute half of the last one (980) still counts:
	clk.Advance(90 * time.Second)
	if err := admit(600, 0); err == nil {
		t.Fatal("half the last minute still counts")
	}
	if err := admit(400, 0); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Minute) // the 400 weighs half: 200
	if err := admit(800, 0); err != nil || admit(1, 0) == nil {
		t.Fatalf("a minute on: %v", err)
	}
}

// Several gateways share one budget through the sync: a gateway sees the
// others' tokens after a sync; while the budgets do not answer the
// fallback holds: local_share counts its own as many times as gateways
// were seen, local_full once, reject refuses.
func TestQuotaSharedAndFallback(t *testing.T) {
	for _, fb := range []string{QuotaLocalShare, QuotaLocalFull, QuotaReject} {
		t.Run(fb, func(t *testing.T) {
			clk := clock.NewFake(time.Unix(6000, 0))
			mem := &memBudgets{totals: map[sharedstate.QuotaKey]int64{}, live: 2}
			a := newQuotas(quotaConfig(fb), clk, slog.New(slog.DiscardHandler), mem)
			b := newQuotas(quotaConfig(fb), clk, slog.New(slog.DiscardHandler), mem)
			if _, err := a.admit(a.byName["t"], 600, 0); err != nil {
				t.Fatal(err)
			}
			a.sync(context.Background())
			b.sync(context.Background())
			if _, err := b.admit(b.byName["t"], 500, 0); err == nil {
				t.Fatal("b admitted past the shared quota")
			}
			if _, err := b.admit(b.byName["t"], 400, 0); err != nil {
				t.Fatal(err)
			}
			// The budgets go down; two minutes on, the window is empty.
			mem.down = true
			clk.Advance(121 * time.Second)
			b.sync(context.Background())
			_, err := b.admit(b.byName["t"], 300, 0)
			_, err2 := b.admit(b.byName["t"], 300, 0)
			switch fb {
			case QuotaLocalShare: // 2 gateways: 300 counts 600, 600 more would make 1,200
				if err != nil || err2 == nil {
					t.Fatalf("local_share: %v, %v", err, err2)
				}
			case QuotaLocalFull:
				if err != nil || err2 != nil {
					t.Fatalf("local_full: %v, %v", err, err2)
				}
			case QuotaReject:
				if err == nil {
					t.Fatal("reject admitted with the budgets down")
				}
			}
			mem.down = false
			b.sync(context.Background())
			if _, err := b.admit(b.byName["t"], 1, 0); err != nil && fb == QuotaReject {
				t.Fatalf("back up: %v", err)
			}
		})
	}
}

// A gateway that starts while the shared state does not answer has seen
// no peer: local_share alone would let it admit a whole quota (as each of
// its peers). With quota.expected_gateways it keeps to its share from the
// start; a larger count seen live later wins over the expected one.
func TestQuotaOutageAtStart(t *testing.T) {
	for _, tc := range []struct {
		expected, live int
		admitted       int64 // of 1,000, in 100s, Redis down from the start
		afterLive      int64 // once it synced with live peers, then lost Redis
	}{{0, 1, 1000, 1000}, {2, 1, 500, 500}, {2, 4, 500, 200}} {
		t.Run(fmt.Sprintf("expected=%d,live=%d", tc.expected, tc.live), func(t *testing.T) {
			clk := clock.NewFake(time.Unix(6000, 0))
			mem := &memBudgets{totals: map[sharedstate.QuotaKey]int64{}, live: tc.live, down: true}
			cfg := quotaConfig(QuotaLocalShare)
			cfg.Tenants[0].OutputTokensPerMinute = 0
			cfg.FlowControl.Quota.ExpectedGateways = tc.expected
			qs := newQuotas(cfg, clk, slog.New(slog.DiscardHandler), mem)
			fill := func() int64 {
				n := int64(0)
				for range 20 {
					if _, err := qs.admit(qs.byName["t"], 100, 0); err == nil {
						n += 100
					}
				}
				return n
			}
			clk.Advance(4 * time.Second) // past three intervals: the fallback holds
			qs.sync(context.Background())
			if got := fill(); got != tc.admitted {
				t.Fatalf("Redis down from the start: %d admitted, want %d", got, tc.admitted)
			}
			mem.down = false
			clk.Advance(2 * time.Minute) // an empty window
			qs.sync(context.Background())
			mem.down = true
			clk.Advance(4 * time.Second)
			qs.sync(context.Background())
			if got := fill(); got != tc.afterLive {
				t.Fatalf("Redis lost after a sync: %d admitted, want %d", got, tc.afterLive)
			}
		})
	}
}

// Through the gateway: a tenant's requests are charged at admission and
// refused with 429 quota_exceeded (Retry-After: the minute's end) once
// its minute is spent, counted in kvgate_shed_total{reason="quota"}; the
// charge is corrected to the usage the replica reports.
func TestQuotaThroughGateway(t *testing.T) {
	f := newFakeReplica(t) // usage: 10 prompt, 3 output tokens
	cfg := baseConfig(f.srv.URL)
	cfg.Tenants = []TenantConfig{{Name: "t", APIKeys: []string{"k"}, TokensPerMinute: 80}}
	reg := prometheus.NewRegistry()
	clk := clock.NewFake(time.Unix(6000, 0))
	gw := startGatewayWith(t, cfg, Options{Clock: clk, Registry: reg})
	eventually(t, "models listed", func() bool { return len(gw.g.Fleet().Models()) > 0 })
	body := `{"model":"m","prompt":"` + strings.Repeat("word ", 20) + `","max_tokens":20}` // ≈ 25 + 20 at admission
	codes := []int{}
	for range 4 {
		resp, _ := post(t, gw.srv.URL+"/v1/completions", body, bearerHdr("k")...)
		codes = append(codes, resp.StatusCode)
		if resp.StatusCode == 429 && resp.Header.Get("Retry-After") != "60" {
			t.Fatalf("Retry-After %q, want the minute's end", resp.Header.Get("Retry-After"))
		}
	}
	// Each admitted request is charged ≈ 45 (25 + 20), then corrected to
	// its usage, 13: 45, 13 + 45, 26 + 45 fit in 80; 39 + 45 does not.
	if fmt.Sprint(codes) != "[200 200 200 429]" {
		t.Fatalf("codes %v", codes)
	}
	if n := counterValue(t, reg, "kvgate_shed_total", map[string]string{"reason": "quota", "tenant": "t"}); n != 1 {
		t.Fatalf("kvgate_shed_total{reason=quota} = %v", n)
	}
	if n := counterValue(t, reg, "kvgate_tenant_tokens_total", map[string]string{"tenant": "t", "kind": "output"}); n != 9 {
		t.Fatalf("t's output tokens %v, want 9", n)
	}
	waitIdle(t, gw)
}

// The rest of vLLM's API is charged too: a Responses call (its input and
// max_output_tokens at admission, corrected to the usage the replica
// reports: 40 input, 2 output tokens) and is refused quota_exceeded once
// the tenant's minute is spent.
func TestQuotaChargesResponses(t *testing.T) {
	f := newAPIReplica(t, "a", "m", "")
	cfg := baseConfig(f.srv.URL)
	cfg.Tenants = []TenantConfig{{Name: "t", APIKeys: []string{"k"}, TokensPerMinute: 150}}
	reg := prometheus.NewRegistry()
	gw := startGatewayWith(t, cfg, Options{Clock: clock.NewFake(time.Unix(6000, 0)), Registry: reg})
	eventually(t, "models listed", func() bool { return len(gw.g.Fleet().Models()) > 0 })
	body := `{"model":"m","input":"` + strings.Repeat("word ", 20) + `","max_output_tokens":20}`
	served := 0
	for range 6 {
		resp, b := post(t, gw.srv.URL+"/v1/responses", body, bearerHdr("k")...)
		switch resp.StatusCode {
		case 200:
			served++
		case 429:
			if !strings.Contains(b, "quota_exceeded") {
				t.Fatalf("429 without quota_exceeded: %s", b)
			}
		default:
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	if served == 0 || served == 6 {
		t.Fatalf("%d of 6 served: the quota of 150 tokens a minute holds some of 42 each, not all", served)
	}
	for kind, per := range map[string]float64{"prompt": 40, "output": 2} {
		if n := counterValue(t, reg, "kvgate_tenant_tokens_total", map[string]string{"tenant": "t", "kind": kind}); n != per*float64(served) {
			t.Errorf("t's %s tokens %v, want %v (the replica's usage of %d calls)", kind, n, per*float64(served), served)
		}
	}
	waitIdle(t, gw)
}
