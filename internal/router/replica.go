package router

import (
	"cmp"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

// Spec is how a replica is reached: its URL (or name, in the replay), the
// bearer key it wants, its KV-event publisher and replay endpoint for
// precise mode, and, for one data-parallel rank of a server, the rank.
type Spec struct {
	URL      string
	APIKey   string
	KVEvents string
	KVReplay string
	// Ranked: the target is data-parallel rank Rank of the server at URL
	// (sent as X-Data-Parallel-Rank); several targets share the URL, one
	// per rank. Not ranked: the whole server.
	Ranked bool
	Rank   int
	// Role is the replica's part in prefill/decode disaggregation
	// (policy.RoleBoth, the zero value: an aggregated replica). Route
	// ignores it; RoutePD takes prefill steps to prefill and both
	// replicas, decode steps to decode and both replicas.
	Role policy.Role
	// Pool names the pool the replica belongs to (Config.Pools; "" when
	// none is configured).
	Pool string
}

// Replica is kvgate's one home for what it knows of one replica: where it
// is and its key, the gateway's own load counts (hot, in atomics), the last
// scrape and its age, the models and adapters it serves, its health and
// circuit breaker, and whether its KV events are in sync. The fleet's
// probes, the request path and the KV-event follower all write here; the
// policies read it through Views.
type Replica struct {
	index int
	// spec is where the replica is reached: replaced whole when a
	// discovery source changes it (a key, a role), read on every decision.
	spec atomic.Pointer[Spec]
	name string
	// removed: a discovery source dropped the replica. It gets no new
	// requests; those in flight finish (drain). Adding its name again
	// revives it with its state (index, breaker, scrapes).
	removed atomic.Bool
	// draining: removed with requests still in flight; cleared (once) when
	// the last ends, which Config.OnDrained hears.
	draining atomic.Bool
	// removedAt is when it was last removed (SetReplicas; memMu guards it):
	// it is forgotten Config.ForgetAfter later, once drained.
	removedAt time.Time
	// vacant: a free slot, whose replica was forgotten (membership.go):
	// removed, no name, no state; the next replica added takes it.
	vacant bool
	// serial tells the replicas a slot held apart (Serial).
	serial uint64

	healthy        atomic.Bool // in rotation: health checks pass and the breaker is not open
	checked        atomic.Bool // a health check has passed at least once
	probed         atomic.Bool // a health check has ended at least once (passed or not)
	inFlight       atomic.Int64
	inFlightTokens atomic.Int64
	inFlightKV     atomic.Int64 // ReplicaView.InFlightKV, this gateway's
	pendingPrefill atomic.Int64
	pendingCount   atomic.Int64
	// pendingTransfer is the prompt tokens decode steps will pull
	// (ReplicaView.PendingTransfer).
	pendingTransfer atomic.Int64
	// burstPending is the burst followers sent without a first token yet
	// (ReplicaView.BurstPending, bursts.go).
	burstPending atomic.Int64
	// prefilled, prompted, decoded and routed count, for ever, the
	// uncached prompt tokens, the prompt tokens and the output tokens the
	// replica was sent, and the requests: the saturation's rates
	// (saturation.go).
	prefilled, prompted, decoded, routed atomic.Int64
	// remote is the other gateways' load (nil: none), added in Views.
	remote atomic.Pointer[Load]
	// preciseOK: the precise index is in sync for this replica.
	preciseOK atomic.Bool
	// preciseChecks and preciseUnder tally Ticket.Underpredicted.
	preciseChecks, preciseUnder atomic.Int64

	// scrape is the last good scrape (nil before the first): read on every
	// routing decision, so an atomic pointer rather than a lock.
	scrape atomic.Pointer[scrape]
	// served is what the replica serves (nil until first listed).
	served atomic.Pointer[Served]

	// back is called when the replica comes back in rotation, or is
	// listed serving other models (the router's queue release: requests
	// held meanwhile may go to it now; nil for a vacant slot).
	back func()

	// Breaker is the replica's circuit breaker (passive health).
	Breaker Breaker
	// kv is the replica's KV-event sync state (precise mode).
	kv kvFollow

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
	// pending is this gateway's requests to the replica without a first
	// token when the scrape was taken: those of m.Waiting it knows; the
	// other gateways' are read from their loads at routing, which reach
	// this one a heartbeat late (WaitingUnseen).
	pending int
}

// Index is the replica's slot.
func (r *Replica) Index() int { return r.index }

// Serial is unique among the replicas the router ever added (0: a vacant
// slot): a slot given again after its replica was forgotten holds another
// serial, so that what a caller keeps by slot (a stored response's home)
// can tell its replica is gone. A replica revived keeps its serial.
func (r *Replica) Serial() uint64 { return r.serial }

// URL is the replica's URL as configured.
func (r *Replica) URL() string { return r.sp().URL }

// APIKey is the bearer key the replica wants ("" for none). Never log it.
func (r *Replica) APIKey() string { return r.sp().APIKey }

// KVEvents is the replica's KV-event endpoint ("" for none).
func (r *Replica) KVEvents() string { return r.sp().KVEvents }

// KVReplay is the replica's KV-event replay endpoint ("" for none).
func (r *Replica) KVReplay() string { return r.sp().KVReplay }

// Rank is the data-parallel rank the target is (ok false: the whole server).
func (r *Replica) Rank() (rank int, ok bool) {
	sp := r.sp()
	return sp.Rank, sp.Ranked
}

// Role is the replica's part in prefill/decode disaggregation.
func (r *Replica) Role() policy.Role { return r.sp().Role }

// Name is the target's name in metrics, logs and headers: its URL, and
// for a data-parallel rank k, URL#k.
func (r *Replica) Name() string { return r.name }

// Vacant reports whether the slot is free: its replica was forgotten, and
// the next replica added takes it (a vacant slot is also Removed).
func (r *Replica) Vacant() bool { return r.vacant }

// Ready reports whether the replica is in rotation and has passed a health
// check (a replica starts in rotation, before its first check).
func (r *Replica) Ready() bool { return r.checked.Load() && r.healthy.Load() }

// Probed reports whether a health check of the replica has ended, passed
// or not.
func (r *Replica) Probed() bool { return r.probed.Load() }

// Healthy reports whether the replica is in rotation.
func (r *Replica) Healthy() bool { return r.healthy.Load() }

// InFlight is the requests in flight to the replica.
func (r *Replica) InFlight() int { return int(r.inFlight.Load()) }

// Served is what the replica serves (nil: not listed yet).
func (r *Replica) Served() *Served { return r.served.Load() }

// SetServed records the models and adapters the replica serves. A
// replica listed anew may take requests waiting in the router's queue (a
// replica not listed yet is a candidate only while no listed one is):
// they move at once (back).
func (r *Replica) SetServed(s *Served) {
	if old := r.served.Swap(s); !old.Equal(s) && r.back != nil {
		r.back()
	}
}

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
	// Card is the replica's listing of the model as it sent it (a JSON
	// object; "" when unknown): the gateway's /v1/models passes it on with
	// every field (permission, created, owned_by …). A string keeps Model
	// comparable.
	Card string `json:"-"`
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
	r.probed.Store(true)
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
	r.setHealthy(ok)
	return ok
}

// setHealthy puts the replica in or out of rotation. Coming back, it moves
// the router's queue (back): nothing else would while the fleet is idle
// (no first token, no end; a scrape at best seconds later).
func (r *Replica) setHealthy(ok bool) {
	if was := r.healthy.Swap(ok); ok && !was && r.back != nil {
		r.back()
	}
}

// MetricsAge is the age of the last good scrape at now (-1: never scraped).
func (r *Replica) MetricsAge(now time.Time) time.Duration {
	s := r.scrape.Load()
	if s == nil {
		return -1
	}
	return now.Sub(s.at)
}

// Underpredicted is how many requests the precise index was checked on
// (the engine reported its cache hit) and how many of them hit more than
// it predicted.
func (r *Replica) Underpredicted() (under, checks int64) {
	return r.preciseUnder.Load(), r.preciseChecks.Load()
}
