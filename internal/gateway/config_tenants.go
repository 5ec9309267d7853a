package gateway

import (
	"fmt"
	"math"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// Tenants (the config's tenants:) and flow control (flow_control:):
// several tenants on one fleet (docs/tenants.md). A request's tenant comes
// from its API key; the top-level api_keys: are keys of no tenant. With
// tenants configured the router's flow controller runs (router/flow.go):
// priority bands, each tenant's weighted share of GPU work within a band,
// deadlines, bounded queues; each tenant may have a token quota per
// minute, shared by the gateways of one shared_state: (quota.go), and an
// isolated prefix cache (cache_salt). Without tenants (and without
// flow_control.enabled), none of it runs: the gateway behaves as before.
// Tenants are fixed at start (a reload does not change them).

// TenantConfig is one entry of tenants:.
type TenantConfig struct {
	Name string `json:"name"`
	// APIKeys are the bearer tokens of the tenant's clients.
	APIKeys []string `json:"api_keys"`
	// Priority is the band of its requests that name no priority (vLLM's
	// priority: lower is earlier; default 0); MaxPriority the most urgent
	// band they may ask for (default: Priority). A request asking for a
	// more urgent band gets MaxPriority.
	Priority    int  `json:"priority"`
	MaxPriority *int `json:"max_priority,omitempty"`
	// Weight is its share of the GPU work within a band (default 1).
	Weight float64 `json:"weight"`
	// TokensPerMinute caps its prompt + output tokens per minute; the
	// prompt and output ones cap each apart (0: no cap).
	TokensPerMinute       int64 `json:"tokens_per_minute,omitempty"`
	PromptTokensPerMinute int64 `json:"prompt_tokens_per_minute,omitempty"`
	OutputTokensPerMinute int64 `json:"output_tokens_per_minute,omitempty"`
	// IsolateCache gives its requests a cache_salt of their own, so that
	// no replica shares their KV with another tenant's and the index never
	// credits another tenant's prefix to them.
	IsolateCache bool `json:"isolate_cache,omitempty"`
}

// FlowControlConfig is flow_control:, the router's flow controller's
// settings (on with tenants; Enabled turns it on without).
type FlowControlConfig struct {
	Enabled bool `json:"enabled,omitempty"`
	// QueueMs, Waiting and KVUsage say when a replica is saturated: its
	// queued prefill would take longer than QueueMs (by the cost model),
	// more than Waiting requests wait there, or its KV cache is fuller
	// than KVUsage. While every replica is, requests wait in the gateway.
	QueueMs float64 `json:"queue_ms"`
	Waiting int     `json:"waiting"`
	KVUsage float64 `json:"kv_usage"`
	// TTL and MaxQueued bound every band's wait and queue, MaxQueuedTotal
	// the whole queue of a pool; Bands set them apart for some priorities,
	// and make a band sheddable.
	TTL            Duration         `json:"ttl"`
	MaxQueued      int              `json:"max_queued"`
	MaxQueuedTotal int              `json:"max_queued_total"`
	Bands          []BandFlowConfig `json:"bands,omitempty"`
	// EnginePriority sends each request's band to its replica as vLLM's
	// priority field (for vLLM run with --scheduling-policy priority;
	// kvgate sim's flag of that name); off, the gateway removes a
	// client's priority field, which only it may set.
	EnginePriority bool        `json:"engine_priority,omitempty"`
	Quota          QuotaConfig `json:"quota"`
}

// BandFlowConfig is one entry of flow_control.bands:.
type BandFlowConfig struct {
	Priority  int      `json:"priority"`
	TTL       Duration `json:"ttl,omitempty"`
	MaxQueued int      `json:"max_queued,omitempty"`
	// Sheddable: refused at once (429) while the fleet is saturated,
	// never queued.
	Sheddable bool `json:"sheddable,omitempty"`
	// Reserve: a sheddable band's requests are also refused while no more
	// than this many replicas have room, kept for the bands that queue
	// (router.Band.Reserve; absent: router.DefaultReserve, 0: none).
	Reserve *int `json:"reserve,omitempty"`
}

// QuotaConfig is flow_control.quota:: how tenants' token quotas are kept
// across gateways (quota.go).
type QuotaConfig struct {
	// SyncInterval is how often a gateway adds its tenants' tokens to the
	// shared budgets in Redis and reads them back.
	SyncInterval Duration `json:"sync_interval"`
	// Fallback is what a gateway enforces while Redis does not answer:
	// local_share (each gateway its share of the quota, by the gateways
	// last seen: never over the quota), local_full (each gateway the
	// whole quota: up to one quota per gateway) or reject (the tenant's
	// requests are refused until Redis answers).
	Fallback string `json:"fallback"`
	// ExpectedGateways is how many gateways share the budgets (0: only
	// those seen). local_share divides a quota by the larger of this and
	// the gateways live at the last sync, so a gateway that starts while
	// Redis is down, having seen no peer, still keeps to its share.
	ExpectedGateways int `json:"expected_gateways,omitempty"`
}

// maxExpectedGateways bounds flow_control.quota.expected_gateways, and
// maxBandReserve a band's reserve (replicas).
const (
	maxExpectedGateways = 1024
	maxBandReserve      = 1 << 16
)

// Quota fallbacks.
const (
	QuotaLocalShare = "local_share"
	QuotaLocalFull  = "local_full"
	QuotaReject     = "reject"
)

// DefaultFlowControl is flow_control:'s defaults: the router's.
func DefaultFlowControl() FlowControlConfig {
	return FlowControlConfig{
		QueueMs: router.DefaultQueueMs, Waiting: router.DefaultSatWaiting, KVUsage: router.DefaultSatKVUsage,
		TTL: Duration(router.DefaultFlowTTL), MaxQueued: router.DefaultBandMaxQueued, MaxQueuedTotal: router.DefaultPoolMaxQueued,
		Quota: QuotaConfig{SyncInterval: Duration(time.Second), Fallback: QuotaLocalShare},
	}
}

// Bounds of tenants:.
const (
	maxTenants      = 1024
	maxTenantName   = 64
	maxTenantWeight = 1e6
	maxTenantTokens = 1 << 40
)

// flowOn reports whether the flow controller runs: tenants are
// configured, or flow_control.enabled.
func (c *Config) flowOn() bool { return len(c.Tenants) > 0 || c.FlowControl.Enabled }

// validateTenants checks tenants: and flow_control:, each problem with
// its key path (config_errors.go).
func (c *Config) validateTenants() []error {
	var errs []error
	if len(c.Tenants) > maxTenants {
		errs = append(errs, keyErr("tenants", "%d tenants, at most %d", len(c.Tenants), maxTenants))
	}
	names, keys := map[string]bool{}, map[string]string{}
	for _, k := range c.APIKeys {
		keys[k] = "api_keys"
	}
	for i, t := range c.Tenants {
		where := fmt.Sprintf("tenants[%d]", i)
		errs = append(errs, t.validate(where)...)
		if names[t.Name] {
			errs = append(errs, keyErr(where+".name", "tenant %q is configured twice", t.Name))
		}
		names[t.Name] = true
		for j, k := range t.APIKeys {
			if other, dup := keys[k]; dup {
				errs = append(errs, keyErr(fmt.Sprintf("%s.api_keys[%d]", where, j), "also a key of %s: a key names one tenant", other))
			}
			keys[k] = where
		}
	}
	return append(errs, c.FlowControl.validate()...)
}

// validate checks one tenant (where: its key path).
func (t *TenantConfig) validate(where string) []error {
	var errs []error
	switch {
	case t.Name == "" || len(t.Name) > maxTenantName:
		errs = append(errs, keyErr(where+".name", "give the tenant a name of 1 to %d bytes", maxTenantName))
	case len(t.APIKeys) == 0:
		errs = append(errs, keyErr(where+".api_keys", "empty; a tenant's requests are told by their keys"))
	}
	for j, k := range t.APIKeys {
		if k == "" {
			errs = append(errs, keyErr(fmt.Sprintf("%s.api_keys[%d]", where, j), "an empty API key"))
		}
	}
	if t.Weight < 0 || t.Weight > maxTenantWeight || math.IsNaN(t.Weight) {
		errs = append(errs, keyErr(where+".weight", "%g: want 0 (1) to %g", t.Weight, float64(maxTenantWeight)))
	}
	if abs(t.Priority) > prompt.MaxPriority || t.MaxPriority != nil && abs(*t.MaxPriority) > prompt.MaxPriority {
		errs = append(errs, keyErr(where+".priority", "priorities must be within ±%d", prompt.MaxPriority))
	}
	if t.MaxPriority != nil && *t.MaxPriority > t.Priority {
		errs = append(errs, keyErr(where+".max_priority", "%d is less urgent than priority %d (lower is more urgent): "+
			"max_priority is the most urgent band its requests may ask for", *t.MaxPriority, t.Priority))
	}
	for _, q := range []struct {
		key string
		n   int64
	}{{"tokens_per_minute", t.TokensPerMinute}, {"prompt_tokens_per_minute", t.PromptTokensPerMinute},
		{"output_tokens_per_minute", t.OutputTokensPerMinute}} {
		if q.n < 0 || q.n > maxTenantTokens {
			errs = append(errs, keyErr(where+"."+q.key, "%d: want 0 (none) to %d per minute", q.n, int64(maxTenantTokens)))
		}
	}
	return errs
}

func abs(n int) int { return max(n, -n) }

// validate checks flow_control:.
func (f *FlowControlConfig) validate() []error {
	var errs []error
	if !(f.QueueMs > 0) || math.IsInf(f.QueueMs, 0) {
		errs = append(errs, keyErr("flow_control.queue_ms", "%g: want a positive number of milliseconds", f.QueueMs))
	}
	if f.Waiting < 1 {
		errs = append(errs, keyErr("flow_control.waiting", "%d: want at least 1", f.Waiting))
	}
	if !(f.KVUsage > 0) || f.KVUsage > 1 {
		errs = append(errs, keyErr("flow_control.kv_usage", "%g: want a fraction in (0, 1]", f.KVUsage))
	}
	if f.TTL <= 0 {
		errs = append(errs, keyErr("flow_control.ttl", "%v: want a positive duration", f.TTL.D()))
	}
	if f.MaxQueued < 1 || f.MaxQueuedTotal < 1 {
		errs = append(errs, keyErr("flow_control.max_queued", "max_queued %d and max_queued_total %d: want at least 1",
			f.MaxQueued, f.MaxQueuedTotal))
	}
	seen := map[int]bool{}
	for i, b := range f.Bands {
		where := fmt.Sprintf("flow_control.bands[%d]", i)
		if seen[b.Priority] {
			errs = append(errs, keyErr(where+".priority", "priority %d is configured twice", b.Priority))
		}
		seen[b.Priority] = true
		if b.MaxQueued < 0 || b.TTL < 0 {
			errs = append(errs, keyErr(where, "max_queued %d, ttl %v: want ≥ 0 (0: flow_control's)", b.MaxQueued, b.TTL.D()))
		}
		if r := b.Reserve; r != nil && (*r < 0 || *r > maxBandReserve || !b.Sheddable) {
			errs = append(errs, keyErr(where+".reserve", "%d: want 0 to %d, on a sheddable band", *r, maxBandReserve))
		}
		if abs(b.Priority) > prompt.MaxPriority {
			errs = append(errs, keyErr(where+".priority", "priorities must be within ±%d", prompt.MaxPriority))
		}
	}
	if d := f.Quota.SyncInterval.D(); d < 10*time.Millisecond || d > time.Minute {
		errs = append(errs, keyErr("flow_control.quota.sync_interval", "%v: want 10ms to 1m", d))
	}
	if g := f.Quota.ExpectedGateways; g < 0 || g > maxExpectedGateways {
		errs = append(errs, keyErr("flow_control.quota.expected_gateways", "%d: want 0 to %d", g, maxExpectedGateways))
	}
	switch f.Quota.Fallback {
	case QuotaLocalShare, QuotaLocalFull, QuotaReject:
	default:
		errs = append(errs, keyErr("flow_control.quota.fallback", "%q: want %s, %s or %s", f.Quota.Fallback,
			QuotaLocalShare, QuotaLocalFull, QuotaReject))
	}
	return errs
}

// routerFlow is the router's flow configuration (off without tenants and
// flow_control.enabled).
func (c *Config) routerFlow(prof costmodel.Profile) router.FlowConfig {
	if !c.flowOn() {
		return router.FlowConfig{}
	}
	f := c.FlowControl
	fc := router.FlowConfig{Enabled: true, Tenants: map[string]router.FlowTenant{},
		Saturation: router.SaturationRule{QueueMs: f.QueueMs, Waiting: f.Waiting, KVUsage: f.KVUsage},
		Band:       router.Band{TTL: f.TTL.D(), MaxQueued: f.MaxQueued}, MaxQueued: f.MaxQueuedTotal,
		Profile: prof, MaxBatchTokens: c.MaxBatchTokens}
	for _, b := range f.Bands {
		fc.Bands = append(fc.Bands, router.Band{Priority: b.Priority, TTL: b.TTL.D(), MaxQueued: b.MaxQueued, Sheddable: b.Sheddable,
			Reserve: reserveOf(b.Reserve)})
	}
	for _, t := range c.Tenants {
		ft := router.FlowTenant{Weight: t.Weight, Priority: t.Priority, MaxPriority: t.Priority}
		if t.MaxPriority != nil {
			ft.MaxPriority = *t.MaxPriority
		}
		fc.Tenants[t.Name] = ft
	}
	return fc
}

// reserveOf is the router's Band.Reserve for a band's reserve: (absent)
// the default, 0 none (the router's negative).
func reserveOf(r *int) int {
	switch {
	case r == nil:
		return 0
	case *r == 0:
		return -1
	}
	return *r
}
