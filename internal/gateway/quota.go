package gateway

import (
	"context"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/sharedstate"
)

// Token quotas per tenant per minute (tokens_per_minute, and prompt_ and
// output_tokens_per_minute apart). The minute is a sliding window,
// approximated from fixed minutes as Cloudflare's rate limiter does: the
// tokens of this minute plus those of the minute before weighted by the
// part of it still inside the window. A request is admitted when its
// tokens known at admission — its prompt (as the gateway counted it) and
// its max_tokens — fit beside what the tenant used; when its usage comes
// back the charge is corrected to it (a request that was never sent is
// refunded; one whose usage is not seen keeps its estimate).
//
// Across gateways (shared_state:), each tenant has one budget per minute
// and kind in Redis (sharedstate.SyncQuotas): every sync_interval each
// gateway adds the tokens it charged since its last sync and reads the
// totals back, never on a request's path. A gateway decides on the totals
// of its last sync plus its own tokens since. Error bound with Redis up:
// what the other gateways admitted since their last sync is not seen, so
// a minute may exceed the quota by up to the tokens the other gateways
// admit in one sync_interval (plus the round trip), and by the outputs of
// requests admitted without max_tokens until their usage comes back.
// While Redis does not answer (no sync for three intervals), the fallback
// holds: local_share counts this gateway's own tokens as many times as
// there are gateways — the larger of quota.expected_gateways and those
// live at the last sync — (every gateway enforcing its share: at most the
// quota), local_full counts them once (up to one quota per gateway),
// reject refuses the tenant's requests. Without expected_gateways, a
// gateway that starts while Redis is down has seen no peer and counts
// itself alone: up to one quota per gateway until Redis answers.

// Token kinds of a quota.
const (
	kindTotal = iota
	kindPrompt
	kindOutput
	nKinds
)

var kindNames = [nKinds]string{"total", "prompt", "output"}

// quotaSyncer is what quotas need of the shared state (sharedstate.Syncer).
type quotaSyncer interface {
	SyncQuotas(ctx context.Context, deltas map[sharedstate.QuotaKey]int64) (map[sharedstate.QuotaKey]int64, error)
	LiveGateways() int
}

// quotas are the tenants' token quotas on this gateway.
type quotas struct {
	mu       sync.Mutex
	clk      clock.Clock
	log      *slog.Logger
	byName   map[string]*tenantQuota // fixed at start: read without the lock
	shared   quotaSyncer             // nil: this gateway alone
	fallback string
	every    time.Duration
	lastOK   time.Time     // the last sync that succeeded (the start before any)
	expected int           // quota.expected_gateways (0: none)
	gateways int           // max(expected, live gateways at the last sync, this one included)
	down     bool          // logged as down
	syncsOK  atomic.Uint64 // syncs that succeeded (kvgate_quota_syncs_total)
	syncsErr atomic.Uint64 // and failed
}

// tenantQuota is one tenant's counts, by kind, in the minute before ([0])
// and this minute ([1]).
type tenantQuota struct {
	name    string
	limit   [nKinds]int64 // 0: none
	minute  int64         // Unix minute of [1]
	global  [2][nKinds]int64
	pending [2][nKinds]int64 // this gateway's, not yet added to Redis
}

// quotaCharge is what one request was charged, to be corrected.
type quotaCharge struct {
	q      *tenantQuota
	minute int64
	tokens [nKinds]int64
}

// newQuotas keeps the quotas of the configured tenants (nil when none has one).
func newQuotas(cfg Config, clk clock.Clock, log *slog.Logger, shared quotaSyncer) *quotas {
	qs := &quotas{clk: clk, log: log, byName: map[string]*tenantQuota{}, fallback: cfg.FlowControl.Quota.Fallback,
		every: cfg.FlowControl.Quota.SyncInterval.D(), lastOK: clk.Now(), expected: cfg.FlowControl.Quota.ExpectedGateways}
	qs.gateways = max(qs.expected, 1)
	for _, t := range cfg.Tenants {
		lim := [nKinds]int64{t.TokensPerMinute, t.PromptTokensPerMinute, t.OutputTokensPerMinute}
		if lim != [nKinds]int64{} {
			qs.byName[t.Name] = &tenantQuota{name: t.Name, limit: lim}
		}
	}
	if len(qs.byName) == 0 {
		return nil
	}
	if shared != nil {
		qs.shared = shared
	}
	return qs
}

// minuteOf is t's Unix minute and the part of it elapsed.
func minuteOf(t time.Time) (int64, float64) {
	s := t.Unix()
	m := s / 60
	if s < 0 && s%60 != 0 {
		m--
	}
	frac := (float64(s-m*60) + float64(t.Nanosecond())/1e9) / 60
	return m, frac
}

// roll moves tq's minutes on to minute.
func (tq *tenantQuota) roll(minute int64) {
	switch d := minute - tq.minute; {
	case d == 0:
	case d == 1:
		tq.global[0], tq.pending[0] = tq.global[1], tq.pending[1]
		tq.global[1], tq.pending[1] = [nKinds]int64{}, [nKinds]int64{}
	case d > 1:
		tq.global, tq.pending = [2][nKinds]int64{}, [2][nKinds]int64{}
	default:
		return // the clock went back: keep counting in the later minute
	}
	tq.minute = minute
}

// used is the window's tokens of kind k, this gateway's own counted scale
// times.
func (tq *tenantQuota) used(k int, frac float64, scale int64) float64 {
	prev := float64(tq.global[0][k] + scale*tq.pending[0][k])
	return prev*(1-frac) + float64(tq.global[1][k]+scale*tq.pending[1][k])
}

// admit charges a request of tq its tokens known now, or refuses it.
func (qs *quotas) admit(tq *tenantQuota, prompt, output int) (*quotaCharge, error) {
	est := [nKinds]int64{int64(prompt + output), int64(prompt), int64(output)}
	now := qs.clk.Now()
	minute, frac := minuteOf(now)
	qs.mu.Lock()
	defer qs.mu.Unlock()
	tq.roll(minute)
	scale, reject := qs.outage(now)
	if reject {
		return nil, &apiError{Status: errQuota.Status, Type: errQuota.Type, Code: errQuota.Code, RetryAfter: qs.every,
			Message: "the shared quota state cannot be reached and quotas fail closed (flow_control.quota.fallback: reject); retry later"}
	}
	for k := range nKinds {
		if tq.limit[k] > 0 && tq.used(k, frac, scale)+float64(scale*est[k]) > float64(tq.limit[k]) {
			after := time.Duration((1 - frac) * float64(time.Minute))
			q := *errQuota
			q.RetryAfter = after
			q.Message = "the tenant's " + kindNames[k] + " token quota for this minute is spent; retry later"
			return nil, &q
		}
	}
	for k := range nKinds {
		tq.pending[1][k] += est[k]
	}
	return &quotaCharge{q: tq, minute: minute, tokens: est}, nil
}

// outage is how this gateway counts its own tokens while the shared
// state does not answer (scale) and whether it refuses instead.
func (qs *quotas) outage(now time.Time) (scale int64, reject bool) {
	if qs.shared == nil || now.Sub(qs.lastOK) <= 3*qs.every {
		return 1, false
	}
	switch qs.fallback {
	case QuotaReject:
		return 1, true
	case QuotaLocalShare:
		return int64(max(qs.gateways, 1)), false
	}
	return 1, false
}

// settle corrects a charge to the usage the replica reported (known), or
// refunds it (never sent), or keeps it (usage not seen).
func (qs *quotas) settle(c *quotaCharge, known, sent bool, prompt, output int) {
	if !known && sent {
		return
	}
	actual := [nKinds]int64{}
	if known {
		actual = [nKinds]int64{int64(prompt + output), int64(prompt), int64(output)}
	}
	minute, _ := minuteOf(qs.clk.Now())
	qs.mu.Lock()
	defer qs.mu.Unlock()
	tq := c.q
	tq.roll(minute)
	slot := c.minute - (tq.minute - 1)
	if slot < 0 || slot > 1 {
		return // its minute has left the window
	}
	for k := range nKinds {
		tq.pending[slot][k] += actual[k] - c.tokens[k]
	}
}

// run syncs the budgets with the other gateways every interval until ctx ends.
func (qs *quotas) run(ctx context.Context) {
	if qs == nil || qs.shared == nil {
		return
	}
	t := qs.clk.NewTicker(qs.every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			qs.sync(ctx)
		}
	}
}

// sync adds this gateway's pending tokens to the shared budgets and reads
// the totals back.
func (qs *quotas) sync(ctx context.Context) {
	deltas := qs.deltas()
	got, err := qs.shared.SyncQuotas(ctx, deltas)
	now := qs.clk.Now()
	minute, _ := minuteOf(now)
	qs.mu.Lock()
	defer qs.mu.Unlock()
	if err != nil {
		qs.syncsErr.Add(1)
		if !qs.down && now.Sub(qs.lastOK) > 3*qs.every {
			qs.down = true
			qs.log.Warn("tenant quotas: the shared state does not answer; enforcing the fallback", "fallback", qs.fallback, "err", err)
		}
		return
	}
	if qs.down {
		qs.down = false
		qs.log.Info("tenant quotas: the shared state answers again")
	}
	qs.syncsOK.Add(1)
	qs.lastOK, qs.gateways = now, max(qs.expected, qs.shared.LiveGateways())
	for key, d := range deltas {
		tq := qs.byName[key.Tenant]
		tq.roll(minute)
		slot := key.Minute - (tq.minute - 1)
		k := kindIndex(key.Kind)
		if slot < 0 || slot > 1 || k < 0 {
			continue
		}
		tq.pending[slot][k] -= d
		tq.global[slot][k] = got[key]
	}
}

// deltas are every budget's pending tokens (a 0 reads the total).
func (qs *quotas) deltas() map[sharedstate.QuotaKey]int64 {
	minute, _ := minuteOf(qs.clk.Now())
	qs.mu.Lock()
	defer qs.mu.Unlock()
	out := map[sharedstate.QuotaKey]int64{}
	for _, tq := range qs.byName {
		tq.roll(minute)
		for slot := range 2 {
			for k := range nKinds {
				if tq.limit[k] > 0 {
					out[sharedstate.QuotaKey{Tenant: tq.name, Minute: tq.minute - 1 + int64(slot), Kind: kindNames[k]}] = tq.pending[slot][k]
				}
			}
		}
	}
	return out
}

func kindIndex(name string) int {
	for k, n := range kindNames {
		if n == name {
			return k
		}
	}
	return -1
}

// quotaUsed collects kvgate_quota_used_tokens: each quota's window as
// this gateway counts it now (the shared totals of its last sync and its
// own tokens since).
type quotaUsed struct{ qs *quotas }

var quotaUsedDesc = prometheus.NewDesc("kvgate_quota_used_tokens",
	"Tokens a tenant used in its sliding minute, by kind (total, prompt, output), as this gateway counts them "+
		"(every gateway's at its last sync, and its own since); beside kvgate_quota_limit_tokens.", []string{"tenant", "kind"}, nil)

var quotaLimitDesc = prometheus.NewDesc("kvgate_quota_limit_tokens",
	"A tenant's token quota per minute, by kind.", []string{"tenant", "kind"}, nil)

var quotaSyncsDesc = prometheus.NewDesc("kvgate_quota_syncs_total",
	"Syncs of the tenants' token budgets with the shared state, by result (ok, error); while they fail "+
		"flow_control.quota.fallback holds.", []string{"result"}, nil)

func (q quotaUsed) Describe(ch chan<- *prometheus.Desc) {
	ch <- quotaUsedDesc
	ch <- quotaLimitDesc
	ch <- quotaSyncsDesc
}

func (q quotaUsed) Collect(ch chan<- prometheus.Metric) {
	qs := q.qs
	now := qs.clk.Now()
	minute, frac := minuteOf(now)
	qs.mu.Lock()
	defer qs.mu.Unlock()
	scale, _ := qs.outage(now)
	if qs.shared != nil {
		ch <- prometheus.MustNewConstMetric(quotaSyncsDesc, prometheus.CounterValue, float64(qs.syncsErr.Load()), "error")
		ch <- prometheus.MustNewConstMetric(quotaSyncsDesc, prometheus.CounterValue, float64(qs.syncsOK.Load()), "ok")
	}
	for _, tq := range qs.byName {
		tq.roll(minute)
		for k := range nKinds {
			if tq.limit[k] > 0 {
				ch <- prometheus.MustNewConstMetric(quotaUsedDesc, prometheus.GaugeValue, math.Round(tq.used(k, frac, scale)), tq.name, kindNames[k])
				ch <- prometheus.MustNewConstMetric(quotaLimitDesc, prometheus.GaugeValue, float64(tq.limit[k]), tq.name, kindNames[k])
			}
		}
	}
}
