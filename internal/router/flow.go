package router

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/policy"
)

// Flow control: the router's queue (queue.go) grown into an admission
// layer, one per pool, shared by the gateway and the replay.
//
// When a request waits. Fairness and priority act only on what waits in
// the router: what an engine has admitted runs first come first served,
// so a flood already sent hides a well-behaved tenant's request behind it.
// The controller therefore holds requests back while the pool is
// saturated, and keeps the engines' own queues short. A replica is
// saturated when the prefill queued on it (its uncached prompt tokens
// without a first token, and what its scrape shows waiting beyond the
// requests the gateways had there without a first token when it was taken)
// would take longer than SaturationRule.QueueMs by the cost model, or more than
// SaturationRule.Waiting requests wait there, or its KV cache is fuller than
// SaturationRule.KVUsage; a pool is saturated when every candidate replica is.
// It is llm-d's saturation detector (the Gateway API inference
// extension's pkg/epp/saturationdetector: a pod has capacity while its
// waiting queue is at most 5 and its KV cache at most 80 % full; the pool
// is saturated when no pod has), with the queue measured in time, as the
// ttft policy measures it, rather than in requests alone.
//
// Order. Bands by priority, strictly (vLLM's priority: lower is earlier).
// Within a band, tenants by weighted fair share of GPU work, with the
// Virtual Token Counter (VTC, Sheng et al., "Fairness in Serving Large
// Language Models", OSDI 2024): each tenant has a counter of the work it
// was served divided by its weight, and the band's next request is the
// tenant's with the least counter (ties by name). The work is what the
// GPU computes: the prompt tokens the chosen replica lacks (Ticket's
// uncached) plus the output tokens (expected at dispatch, corrected when
// the request ends); a tenant whose prompts hit the cache costs less. A
// tenant that becomes active (its first request in flight or waiting after
// none) is lifted to the least counter of the other active tenants, so that
// being idle earns no credit (VTC's counter lift). Within a tenant's band:
// Request.Rank (lower first), then the earliest deadline (EDF; a request
// without one is due at its TTL), then arrival.
//
// Bounds. Each band has a TTL and a cap, the pool a cap in all. A request
// whose wait, estimated from the work ahead of it in this order and the
// queue's measured drain rate, would pass its deadline or its TTL is shed
// at once rather than after waiting; one still waiting at its deadline or
// TTL is shed then; one whose band is full is refused, and when the pool's
// queue is full it displaces the newest request of the least urgent band
// below it (the lowest band is shed first under overload). A sheddable
// band's requests are refused at once while the pool is saturated (llm-d's
// sheddable requests), and also while no more than Band.Reserve of its
// replicas have room (trunk reservation, as telephone exchanges keep their
// last free circuits for priority calls: Ott and Krishnan, 1985): a flood
// of sheddable requests otherwise takes every replica that frees, and an
// urgent request arriving then waits in the queue for a prefill to end:
// most of what priority 0's TTFT lost under a 2x overload (docs/tenants.md;
// its p90 against its p90 alone: 1.18x in the replay, 1.21-1.27x live; with
// a reserve of one replica of four, 1.03x and 1.06-1.07x, for 8 % more of
// the sheddable band refused). Every refusal is a *ShedError before
// anything was sent.
//
// Off (FlowConfig.Enabled false), the queue is late binding's alone: no
// gate but the policy's deferral, no bounds, no accounting; its order is
// Less's without bands and tenants (queue.go).

// FlowConfig configures the flow controller of every pool (Config.Flow);
// the zero value is off.
type FlowConfig struct {
	Enabled bool
	// Tenants are the tenants' shares and priority ranges (a tenant not
	// listed, or "": weight 1, priority 0, at most 0).
	Tenants map[string]FlowTenant
	// Saturation says when a replica is saturated.
	Saturation SaturationRule
	// Band holds every band's settings but those Bands list.
	Band Band
	// Bands override Band for their priorities.
	Bands []Band
	// MaxQueued caps a pool's queue, every band (0: DefaultPoolMaxQueued).
	MaxQueued int
	// Profile and MaxBatchTokens turn prefill tokens into time
	// (SaturationRule.QueueMs); the zero profile is costmodel.Default.
	Profile        costmodel.Profile
	MaxBatchTokens int
}

// FlowTenant is one tenant's part in flow control.
type FlowTenant struct {
	// Weight is its share of the GPU work in a band (0: 1).
	Weight float64
	// Priority is its requests' band when they name none; MaxPriority the
	// most urgent (lowest) band they may name: a request asking for more
	// is clamped to it. A request may always ask for less.
	Priority, MaxPriority int
}

// BandOf is the band of a request of tenant asking for priority requested
// (given: the request named one): the tenant's default, or the request's
// clamped to the tenant's range, from its MaxPriority to the least urgent
// band configured (Lowest): the bands, and so the queues and the series
// labelled by band, are the configuration's, whatever clients ask.
func (c *FlowConfig) BandOf(tenant string, requested int, given bool) int {
	t := c.Tenants[tenant]
	if !given {
		return t.Priority
	}
	return min(max(requested, t.MaxPriority), max(c.Lowest(), t.MaxPriority))
}

// Lowest is the least urgent band configured: the largest of 0, the
// tenants' priorities and the bands'.
func (c *FlowConfig) Lowest() int {
	low := 0
	for _, t := range c.Tenants {
		low = max(low, t.Priority)
	}
	for _, b := range c.Bands {
		low = max(low, b.Priority)
	}
	return low
}

// Band is the settings of one priority band.
type Band struct {
	Priority int
	// TTL bounds a request's wait (0: DefaultFlowTTL).
	TTL time.Duration
	// MaxQueued caps the band's queue (0: DefaultBandMaxQueued).
	MaxQueued int
	// Sheddable: refused at once while the pool is saturated, never queued.
	Sheddable bool
	// Reserve is, for a sheddable band, how many replicas with room it
	// leaves to the bands that queue: its request is refused while no more
	// than Reserve candidates have room (at most all but one: a pool of
	// one replica reserves none). 0: DefaultReserve; negative: none.
	Reserve int
}

// SaturationRule is when a replica counts as saturated, for admission
// (zero fields: the defaults; a criterion is turned off by a bound it
// never reaches). The pools' scaling gauge is Saturation (saturation.go).
type SaturationRule struct {
	// QueueMs: the prefill queued on the replica would take longer, ms.
	QueueMs float64
	// Waiting: more requests wait there without a first token.
	Waiting int
	// KVUsage: its KV cache is fuller (0..1], by its scrape.
	KVUsage float64
}

// Defaults of FlowConfig: TTL and band cap are llm-d's flow control's
// (60 s, 5,000 requests per band); Waiting and KVUsage are its saturation
// detector's (5, 0.8); QueueMs keeps about one step of an 8B model's
// prefill queued in each engine (measured in the replay: docs/tenants.md).
const (
	DefaultFlowTTL       = 60 * time.Second
	DefaultBandMaxQueued = 5000
	DefaultPoolMaxQueued = 20000
	DefaultQueueMs       = 50
	DefaultSatWaiting    = 5
	DefaultSatKVUsage    = 0.8
	// DefaultReserve is a sheddable band's Reserve: one replica's room
	// kept for the urgent bands (the priority figures of docs/tenants.md).
	DefaultReserve = 1
	// defaultOutput is the output expected of a tenant's request before
	// any of its requests ended and without max_tokens.
	defaultOutput = 256
	// maxFlowTenants bounds the tenants a pool keeps counters for; the
	// rest share one (tenants come from configuration: it never fills).
	maxFlowTenants = 1 << 12
	overflowTenant = "\x00other"
)

// Reasons of a ShedError.
const (
	ShedQueueFull = "queue_full" // its band's queue, or the pool's, is full
	ShedTTL       = "ttl"        // it waited, or would wait, past its band's TTL
	ShedDeadline  = "deadline"   // its first token would come after its deadline
	ShedSaturated = "saturated"  // a sheddable band's request while the pool is saturated
	ShedDisplaced = "displaced"  // a more urgent request took its place in the pool's full queue
)

// ErrShed matches every *ShedError.
var ErrShed = errors.New("router: request shed by flow control")

// ShedError is the flow controller's refusal of a request: nothing was
// sent, and the client may try again after RetryAfter (the gateway's 429).
type ShedError struct {
	Reason     string
	RetryAfter time.Duration
}

func (e *ShedError) Error() string {
	return fmt.Sprintf("router: request shed (%s); retry after %s", e.Reason, e.RetryAfter)
}

func (e *ShedError) Is(target error) bool { return target == ErrShed }

// minRetryAfter and maxRetryAfter bound a ShedError's RetryAfter.
const (
	minRetryAfter = time.Second
	maxRetryAfter = 5 * time.Minute
)

func shed(reason string, wait time.Duration) *ShedError {
	return &ShedError{Reason: reason, RetryAfter: min(max(wait, minRetryAfter), maxRetryAfter)}
}

// withDefaults fills the zero fields and checks the rest.
func (c FlowConfig) withDefaults() (FlowConfig, error) {
	if c.Profile == (costmodel.Profile{}) {
		c.Profile = costmodel.MustLookup(costmodel.Default)
	}
	if err := c.Profile.Validate(); err != nil {
		return c, err
	}
	if c.MaxBatchTokens <= 0 {
		c.MaxBatchTokens = 8192
	}
	if c.MaxQueued <= 0 {
		c.MaxQueued = DefaultPoolMaxQueued
	}
	s := &c.Saturation
	if s.QueueMs == 0 {
		s.QueueMs = DefaultQueueMs
	}
	if s.Waiting == 0 {
		s.Waiting = DefaultSatWaiting
	}
	if s.KVUsage == 0 {
		s.KVUsage = DefaultSatKVUsage
	}
	if !(s.QueueMs > 0) || s.Waiting < 0 || !(s.KVUsage > 0) || math.IsInf(s.QueueMs, 0) {
		return c, fmt.Errorf("router: flow saturation: queue_ms %g and kv_usage %g must be positive and finite, waiting %d ≥ 0",
			s.QueueMs, s.KVUsage, s.Waiting)
	}
	c.Band = c.Band.withDefaults()
	c.Bands = slices.Clone(c.Bands)
	for i := range c.Bands {
		c.Bands[i] = c.Bands[i].withDefaults()
	}
	c.Tenants = maps.Clone(c.Tenants)
	for name, t := range c.Tenants {
		if t.Weight == 0 {
			t.Weight = 1
		}
		if !(t.Weight > 0) || math.IsInf(t.Weight, 0) {
			return c, fmt.Errorf("router: flow: tenant %q has weight %g, want a positive finite number", name, t.Weight)
		}
		if t.MaxPriority > t.Priority {
			return c, fmt.Errorf("router: flow: tenant %q: max_priority %d is less urgent than its priority %d (lower is more urgent)",
				name, t.MaxPriority, t.Priority)
		}
		c.Tenants[name] = t
	}
	return c, nil
}

func (b Band) withDefaults() Band {
	if b.TTL <= 0 {
		b.TTL = DefaultFlowTTL
	}
	if b.MaxQueued <= 0 {
		b.MaxQueued = DefaultBandMaxQueued
	}
	switch {
	case !b.Sheddable || b.Reserve < 0:
		b.Reserve = 0
	case b.Reserve == 0:
		b.Reserve = DefaultReserve
	}
	return b
}

// band is the settings of priority p.
func (c *FlowConfig) band(p int) Band {
	for _, b := range c.Bands {
		if b.Priority == p {
			return b
		}
	}
	b := c.Band
	b.Priority = p
	return b
}

// flow is one pool's flow-control state (its queue's mutex guards it).
type flow struct {
	cfg     *FlowConfig
	tenants map[string]*tenant
	// meanPrompt is the mean uncached prompt of the requests dispatched
	// (tokens, EWMA): what a request the scrape shows waiting, which the
	// router did not send, is taken to cost.
	meanPrompt float64
	// rate is the queue's measured drain, estimated work per second,
	// measured while requests wait (0: not measured yet); win* is the
	// window being measured.
	rate     float64
	winStart time.Time
	winWork  float64
	// floor is the counter of the last tenant to become inactive: a tenant
	// becoming active while no other is is lifted to it (VTC lifts to the
	// last client to leave the queue).
	floor float64
}

// tenant is one tenant's VTC counter and activity.
type tenant struct {
	name    string
	weight  float64
	vtime   float64 // GPU work served / weight
	queued  int     // requests waiting (every band)
	active  int     // requests waiting or in flight
	meanOut float64 // EWMA of its requests' output tokens (0: none ended yet)
}

// Drain-rate measurement: a window of at least rateWindow, EWMA weight rateAlpha.
const (
	rateWindow = time.Second
	rateAlpha  = 0.3
	meanAlpha  = 0.05
)

func newFlow(cfg *FlowConfig) *flow {
	return &flow{cfg: cfg, tenants: map[string]*tenant{}}
}

// tenant is name's state, made on first use.
func (f *flow) tenant(name string) *tenant {
	if t, ok := f.tenants[name]; ok {
		return t
	}
	if len(f.tenants) >= maxFlowTenants {
		name = overflowTenant
		if t, ok := f.tenants[name]; ok {
			return t
		}
	}
	w := 1.0
	if ft, ok := f.cfg.Tenants[name]; ok {
		w = ft.Weight
	}
	t := &tenant{name: name, weight: w}
	f.tenants[name] = t
	return t
}

// activate counts one more request of t waiting or in flight; a tenant
// becoming active is lifted to the least counter of the other active
// tenants, or to the floor when none is (VTC's lift: no credit for idle
// time).
func (f *flow) activate(t *tenant) {
	t.active++
	if t.active > 1 {
		return
	}
	least := f.floor
	found := false
	for _, u := range f.tenants {
		if u != t && u.active > 0 && (!found || u.vtime < least) {
			least, found = u.vtime, true
		}
	}
	t.vtime = max(t.vtime, least)
}

// deactivate counts one request of t less waiting or in flight.
func (f *flow) deactivate(t *tenant) {
	if t.active <= 0 {
		return
	}
	if t.active--; t.active == 0 {
		f.floor = t.vtime
	}
}

// expectedOutput is the output tokens a request of t is expected to
// generate: its mean so far (or defaultOutput), at most maxTokens when set.
func (t *tenant) expectedOutput(maxTokens int) float64 {
	out := t.meanOut
	if out <= 0 {
		out = defaultOutput
	}
	if maxTokens > 0 {
		out = min(out, float64(maxTokens))
	}
	return out
}

// saturated reports whether every candidate (Healthy) of views is
// saturated — for a request of a band that reserves replicas (Band.Reserve),
// all but that many — and otherwise takes the saturated ones out of views
// (Healthy false): a request the controller lets go joins an engine with
// room, not the queue it was held back from. keep (≥ 0: a pinned
// request's replica, policy.Pinner) stays in: the request can go nowhere
// else. False when there is no candidate (routing then answers why).
func (f *flow) saturated(views []policy.ReplicaView, prio, keep int) bool {
	candidates, full := 0, 0
	for i := range views {
		if !views[i].Healthy {
			continue
		}
		candidates++
		if f.replicaSaturated(&views[i]) {
			full++
		}
	}
	reserve := 0
	if full > 0 && candidates > 1 {
		reserve = min(f.cfg.band(prio).Reserve, candidates-1)
	}
	if full >= candidates-reserve {
		return candidates > 0
	}
	if full > 0 {
		for i := range views {
			if i != keep && views[i].Healthy && f.replicaSaturated(&views[i]) {
				views[i].Healthy = false
			}
		}
	}
	return false
}

// replicaSaturated is the saturation detector for one replica.
func (f *flow) replicaSaturated(v *policy.ReplicaView) bool {
	s := &f.cfg.Saturation
	waiting := max(v.PendingCount, 0)
	tokens := float64(max(v.PendingPrefill, 0))
	if v.HaveMetrics {
		tokens += float64(max(v.WaitingUnseen, 0)) * f.meanPrompt
		waiting += max(v.WaitingUnseen, 0)
		if v.KVUsage > s.KVUsage {
			return true
		}
	}
	if waiting > s.Waiting {
		return true
	}
	if tokens < 1 {
		return false
	}
	// Past QueueMs/c1 tokens (and two chunks) the time surely exceeds
	// QueueMs: no need to count the chunks of a huge queue.
	limit := s.QueueMs/f.cfg.Profile.C1 + 2*float64(f.cfg.MaxBatchTokens)
	return f.cfg.Profile.PrefillMs(int(min(tokens, limit)), 0, f.cfg.MaxBatchTokens) > s.QueueMs
}

// errHeldAlone: the flow controller holds a request whose own candidates
// are all saturated while another replica of its pool in rotation has
// room (a retry excluding the replica that failed it, a model or adapter
// only some replicas list): it waits for its own, but the requests behind
// it in the queue need not (release), nor newcomers (Submit).
var errHeldAlone = fmt.Errorf("%w: its own replicas are saturated", policy.ErrDefer)

// gate is flow control's gate for req, which pol would place among views
// (pl's candidates): nil while some candidate has room (the saturated ones
// then leave views), else why it is held (heldOn). routeWith applies it,
// and Router.FlowHold reports it.
func (rt *Router) gate(pl *pool, fl *flow, pol policy.Policy, req *policy.Request, views []policy.ReplicaView) error {
	if fl.saturated(views, req.Priority, policy.PinnedTo(pol)) {
		return rt.heldOn(pl, fl, views, nil)
	}
	return nil
}

// heldOn is why the flow controller holds a request whose candidates
// (Healthy in views, every one saturated) are pl's: errHeldAlone when
// another replica of pl in rotation whose role ok accepts (nil: any) has
// room, else policy.ErrDefer. A pair held for its prefill side is held
// alone only while another replica that computes prompts has room, not a
// decode replica.
func (rt *Router) heldOn(pl *pool, fl *flow, views []policy.ReplicaView, ok func(policy.Role) bool) error {
	for i, r := range rt.reps()[:len(views)] {
		if !views[i].Healthy && (ok == nil || ok(views[i].Role)) && pl.has(r) && r.healthy.Load() && !r.removed.Load() &&
			!fl.replicaSaturated(&views[i]) {
			return errHeldAlone
		}
	}
	return policy.ErrDefer
}

// feasible checks a decision against req's deadline: a first token the
// policy estimates after it is shed now.
func (f *flow) feasible(req *policy.Request, d policy.Decision) error {
	if req.Deadline.IsZero() || d.EstTTFT <= 0 || !req.Now.Add(d.EstTTFT).After(req.Deadline) {
		return nil
	}
	return shed(ShedDeadline, 0)
}

// charge counts a dispatched request's GPU work against its tenant: the
// prompt the replica computing it lacks (uncached: the ticket's own, or a
// pair's prefill step's) and the output expected (corrected by settle,
// when t ends).
func (f *flow) charge(t *Ticket, ten *tenant, uncached int64) {
	f.activate(ten)
	t.ten = ten
	t.expOut = ten.expectedOutput(t.req.MaxTokens)
	ten.vtime += (float64(uncached) + t.expOut) / ten.weight
	f.meanPrompt += meanAlpha * (float64(uncached) - f.meanPrompt)
}

// settle corrects an ended request's charge with its output tokens and
// counts it out of its tenant's activity.
func (f *flow) settle(t *Ticket, out int) {
	ten := t.ten
	if out < 0 {
		out = 0
	}
	ten.vtime += (float64(out) - t.expOut) / ten.weight
	ten.vtime = max(ten.vtime, 0)
	if ten.meanOut <= 0 {
		ten.meanOut = float64(out)
	} else {
		ten.meanOut += meanAlpha * (float64(out) - ten.meanOut)
	}
	f.deactivate(ten)
}

// drained measures the drain rate: w left the queue, routed, at now.
func (f *flow) drained(now time.Time, work float64) {
	if f.winStart.IsZero() {
		f.winStart = now
	}
	f.winWork += work
	el := now.Sub(f.winStart)
	if el < rateWindow {
		return
	}
	r := f.winWork / el.Seconds()
	if f.rate == 0 {
		f.rate = r
	} else {
		f.rate += rateAlpha * (r - f.rate)
	}
	f.winStart, f.winWork = now, 0
}

// wait is the time the queue takes to drain work at the measured rate
// (0: not measured yet).
func (f *flow) wait(work float64) time.Duration {
	if f.rate <= 0 {
		return 0
	}
	return time.Duration(min(work/f.rate, maxRetryAfter.Seconds()*10) * float64(time.Second))
}

// BandOf is the band of a request of tenant asking for priority requested
// (given: it named one), by the router's flow configuration (FlowConfig.BandOf).
func (rt *Router) BandOf(tenant string, requested int, given bool) int {
	return rt.flow.BandOf(tenant, requested, given)
}

// FlowEnabled reports whether the router's flow control is on.
func (rt *Router) FlowEnabled() bool { return rt.flow.Enabled }
