package router

import (
	"cmp"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Spec is how a replica is reached: its URL (or name, in the replay), the
// bearer key it wants, and its KV-event publisher for precise mode.
type Spec struct {
	URL      string
	APIKey   string
	KVEvents string
}

// Replica is kvgate's one home for what it knows of one replica: where it
// is and its key, the gateway's own load counts (hot, in atomics), the last
// scrape and its age, the models and adapters it serves, its health and
// circuit breaker, and whether its KV events are in sync. The fleet's
// probes, the request path and the KV-event follower all write here; the
// policies read it through Views.
type Replica struct {
	index int
	spec  Spec

	healthy        atomic.Bool // in rotation: health checks pass and the breaker is not open
	checked        atomic.Bool // a health check has passed at least once
	inFlight       atomic.Int64
	inFlightTokens atomic.Int64
	pendingPrefill atomic.Int64
	pendingCount   atomic.Int64
	// preciseOK: the precise index is in sync for this replica.
	preciseOK atomic.Bool

	// scrape is the last good scrape (nil before the first): read on every
	// routing decision, so an atomic pointer rather than a lock.
	scrape atomic.Pointer[scrape]
	// served is what the replica serves (nil until first listed).
	served atomic.Pointer[Served]

	// Breaker is the replica's circuit breaker (passive health).
	Breaker Breaker
	// kv is the replica's KV-event sync state (precise mode).
	kv kvSync

	// probe is the fleet's record of its probes.
	probeMu     sync.Mutex
	healthOK    bool
	scrapeFails int
	lastScrape  time.Time // last successful scrape
	stale       bool      // last reported staleness (for logging transitions)
	blocks      int       // KV capacity last scraped, in the router's blocks
}

// SetCapacityBlocks records the replica's scraped KV capacity and reports
// whether it changed.
func (r *Replica) SetCapacityBlocks(n int) bool {
	r.probeMu.Lock()
	defer r.probeMu.Unlock()
	changed := n != r.blocks
	r.blocks = n
	return changed
}

type scrape struct {
	m  Metrics
	at time.Time
}

// Index is the replica's slot.
func (r *Replica) Index() int { return r.index }

// URL is the replica's URL as configured.
func (r *Replica) URL() string { return r.spec.URL }

// APIKey is the bearer key the replica wants ("" for none). Never log it.
func (r *Replica) APIKey() string { return r.spec.APIKey }

// KVEvents is the replica's KV-event endpoint ("" for none).
func (r *Replica) KVEvents() string { return r.spec.KVEvents }

// Ready reports whether the replica is in rotation and has passed a health
// check (a replica starts in rotation, before its first check).
func (r *Replica) Ready() bool { return r.checked.Load() && r.healthy.Load() }

// Healthy reports whether the replica is in rotation.
func (r *Replica) Healthy() bool { return r.healthy.Load() }

// InFlight is the requests in flight to the replica.
func (r *Replica) InFlight() int { return int(r.inFlight.Load()) }

// Served is what the replica serves (nil: not listed yet).
func (r *Replica) Served() *Served { return r.served.Load() }

// SetServed records the models and adapters the replica serves.
func (r *Replica) SetServed(s *Served) { r.served.Store(s) }

// Serves reports whether the replica serves model (true while it has not
// been listed yet: the replica judges).
func (r *Replica) Serves(model string) bool {
	s := r.served.Load()
	return s == nil || s.Has(model)
}

// Model is one model or LoRA adapter a replica serves, as vLLM's
// /v1/models lists it.
type Model struct {
	ID          string `json:"id"`
	Root        string `json:"root,omitempty"`
	Parent      string `json:"parent,omitempty"`
	MaxModelLen int    `json:"max_model_len,omitempty"`
}

// Served is the set of models and adapters a replica serves.
type Served struct {
	Models []Model // sorted by ID
	// Running are adapters the replica reported running or waiting
	// (vllm:lora_requests_info) that /v1/models did not list.
	Running []string
}

// NewServed builds a Served from a listing and the running adapters.
func NewServed(models []Model, running []string) *Served {
	ms := slices.Clone(models)
	slices.SortFunc(ms, func(a, b Model) int { return cmp.Compare(a.ID, b.ID) })
	ms = slices.CompactFunc(ms, func(a, b Model) bool { return a.ID == b.ID })
	var extra []string
	for _, a := range running {
		if _, ok := findModel(ms, a); !ok && !slices.Contains(extra, a) {
			extra = append(extra, a)
		}
	}
	slices.Sort(extra)
	return &Served{Models: ms, Running: extra}
}

func findModel(ms []Model, id string) (int, bool) {
	return slices.BinarySearchFunc(ms, id, func(m Model, id string) int { return cmp.Compare(m.ID, id) })
}

// Has reports whether the set holds model.
func (s *Served) Has(model string) bool {
	if _, ok := findModel(s.Models, model); ok {
		return true
	}
	_, ok := slices.BinarySearch(s.Running, model)
	return ok
}

// Model is the listing of id, if served.
func (s *Served) Model(id string) (Model, bool) {
	if i, ok := findModel(s.Models, id); ok {
		return s.Models[i], true
	}
	return Model{}, false
}

// Equal reports whether two sets are the same.
func (s *Served) Equal(o *Served) bool {
	if s == nil || o == nil {
		return s == o
	}
	return slices.Equal(s.Models, o.Models) && slices.Equal(s.Running, o.Running)
}

// ScrapeResult records a scrape attempt of the replica at `at`: err nil
// for a good one. It returns whether the replica's metrics went stale or
// fresh with this attempt (for the caller to log the transition once) and
// the number of consecutive failures.
func (r *Replica) ScrapeResult(at time.Time, err error, staleAfter time.Duration) (changed, stale bool, fails int) {
	r.probeMu.Lock()
	defer r.probeMu.Unlock()
	if err == nil {
		r.scrapeFails = 0
		r.lastScrape = at
	} else {
		r.scrapeFails++
	}
	stale = staleAfter > 0 && (r.lastScrape.IsZero() || at.Sub(r.lastScrape) > staleAfter)
	if err == nil {
		stale = false
	}
	changed = stale != r.stale
	r.stale = stale
	return changed, stale, r.scrapeFails
}

// SetHealthOK records the last active health check and returns whether the
// replica is now in rotation (health passes and the breaker is not open).
func (r *Replica) SetHealthOK(ok bool, now time.Time) bool {
	if ok {
		r.checked.Store(true)
	}
	r.probeMu.Lock()
	r.healthOK = ok
	r.probeMu.Unlock()
	return r.UpdateHealthy(now)
}

// UpdateHealthy recomputes whether the replica is in rotation.
func (r *Replica) UpdateHealthy(now time.Time) bool {
	r.probeMu.Lock()
	ok := r.healthOK
	r.probeMu.Unlock()
	ok = ok && !r.Breaker.Open(now)
	r.healthy.Store(ok)
	return ok
}

// MetricsAge is the age of the last good scrape at now (-1: never scraped).
func (r *Replica) MetricsAge(now time.Time) time.Duration {
	s := r.scrape.Load()
	if s == nil {
		return -1
	}
	return now.Sub(s.at)
}

// kvSync is how far the precise index can be trusted for a replica. The
// index only knows what was stored since kvgate subscribed: it is trusted
// when the stream was followed from the publisher's first message, or once
// the replica has stored as many blocks as its cache holds since the last
// gap (everything older has been evicted by then), or after ResyncAfter.
// Until then the approximate index answers for the replica.
type kvSync struct {
	mu          sync.Mutex
	seen        bool
	storedSince int
	since       time.Time
	last        time.Time // the last batch (or the start of following)
	silent      bool      // reported silent, not heard from since
}

// ResyncAfter bounds how long a replica whose event stream was joined late
// (or had a gap) stays on the approximate index.
const ResyncAfter = 2 * time.Minute

// PreciseSynced reports whether the precise index is trusted for the replica.
func (r *Replica) PreciseSynced() bool { return r.preciseOK.Load() }

// KVStart starts following the replica's KV events at now.
func (r *Replica) KVStart(now time.Time) {
	r.kv.mu.Lock()
	r.kv.since, r.kv.last = now, now
	r.kv.mu.Unlock()
}

// KVSilence reports a change in whether the replica's event stream has been
// silent for at least d at now: silent true the first time it is, false the
// first time it speaks again; changed false otherwise.
func (r *Replica) KVSilence(now time.Time, d time.Duration) (changed, silent bool) {
	r.kv.mu.Lock()
	defer r.kv.mu.Unlock()
	silent = now.Sub(r.kv.last) >= d
	changed = silent != r.kv.silent
	r.kv.silent = silent
	return changed, silent
}

// KVGap records a gap in the replica's KV-event stream at now: the precise
// index is not trusted for it until resynchronised.
func (r *Replica) KVGap(now time.Time) {
	r.kv.mu.Lock()
	r.kv.storedSince, r.kv.since = 0, now
	r.kv.mu.Unlock()
	r.preciseOK.Store(false)
}

// KVBatch records a batch of the replica's KV events (its sequence number
// and the blocks it stored) at now, against the replica's cache capacity in
// blocks, and reports whether the precise index is now in sync.
func (r *Replica) KVBatch(seq uint64, stored, capacity int, now time.Time) bool {
	r.kv.mu.Lock()
	first := !r.kv.seen
	r.kv.seen = true
	r.kv.last = now
	r.kv.storedSince += stored
	if first && seq == 0 {
		r.kv.storedSince = max(r.kv.storedSince, capacity) // followed from the start
	}
	synced := r.kv.storedSince >= capacity || now.Sub(r.kv.since) >= ResyncAfter
	r.kv.mu.Unlock()
	if synced {
		r.preciseOK.Store(true)
	}
	return synced
}
