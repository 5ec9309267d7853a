// Package replay runs request sequences (a Mooncake trace or a generated
// workload) through kvgate's routing policies and its replica engine model in
// virtual time: a discrete-event simulation with no HTTP, no goroutines and no
// sleeping, so that a whole trace replays in seconds and the same seed gives
// the same figures.
//
// One run is one policy on a fresh fleet:
//
//   - the gateway is a router.Router, the very code the live gateway uses: its
//     clock is the virtual clock, its in-flight counts are exact, its prefix
//     index learns from routing, and the replicas' scraped metrics reach it
//     every scrape interval, delivered Staleness late;
//   - with Config.Gateways > 1, several such routers (gateways.go): requests
//     reach them in turn, each scrapes every replica, and with SyncShared
//     each one's decisions and loads reach the others SyncDelay late,
//     through sharedstate.Peers, as the live gateways share them;
//   - each replica is an engine.Engine (the model `kvgate sim` serves), stepped
//     back to back while it has work: a step starts at its predecessor's end,
//     or at the instant an arrival wakes an idle engine, after every other
//     event of that instant;
//   - events (arrivals, step ends, metric deliveries, KV-event deliveries) sit
//     in one min-heap ordered by (virtual time, sequence number), so ties are
//     resolved in a fixed order and runs are deterministic.
//
// A request's text is made at its arrival and dropped when it ends: the router
// keeps only its hashes, the engine only its block hashes in its own "engine"
// namespace (prompt.RootOf), exactly as the simulated replicas hash prompts, so
// the router must learn the engine's blocks through routing or KV events, as it
// must with a real vLLM.
package replay

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/workload"
)

// Errors; test with errors.Is.
var (
	// ErrConfig reports an invalid Config.
	ErrConfig = errors.New("replay: invalid config")
	// ErrInput reports a request sequence that cannot be replayed (a
	// dependency on a later or missing request).
	ErrInput = errors.New("replay: invalid input")
	// ErrStalled reports an engine that has work but schedules nothing: a bug
	// in the engine model, reported instead of looping forever.
	ErrStalled = errors.New("replay: engine stalled")
)

// Defaults of Config.
const (
	DefaultReplicas       = 8
	DefaultScrapeInterval = 250 * time.Millisecond
	DefaultModel          = "sim-llama-8b"
)

// KVMode is when a replay follows the engines' KV events.
type KVMode string

// KV modes.
const (
	KVAuto KVMode = "auto"
	KVOn   KVMode = "on"
	KVOff  KVMode = "off"
)

// follows reports whether a run of pol follows KV events.
func (m KVMode) follows(pol policy.Policy) bool {
	return m == KVOn || (m != KVOff && policy.WantsKVEvents(pol))
}

// Config describes the fleet and the gateway of a replay.
type Config struct {
	// Replicas is the aggregated replicas (role both), each serving whole
	// requests (default 8 when the fleet has no prefill or decode replica).
	Replicas int
	// PrefillReplicas and DecodeReplicas make a prefill/decode fleet
	// (beside Replicas, which may be 0): each request is routed by
	// router.RoutePD to a pair, prefilled on one engine, its KV pulled by
	// the other, and decoded there (pd.go). Both or neither.
	PrefillReplicas, DecodeReplicas int
	// NonCachedTokens is RoutePD's threshold on a prefill/decode fleet: the
	// prefill step is skipped when the decode replica lacks fewer prompt
	// tokens (0: router.DefaultNonCachedTokens, llm-d's 16; negative:
	// never skipped).
	NonCachedTokens int
	Profile         costmodel.Profile // latency profile (default costmodel.Default)
	// ReplicaProfiles overrides the engine profile of some replicas (slot →
	// profile): a heterogeneous fleet. The policies still assume Profile,
	// as a gateway configured with one profile would.
	ReplicaProfiles map[int]costmodel.Profile
	KVBlocks        int // KV blocks per engine (default engine.DefaultNumBlocks)
	// OffloadBlocks is each engine's host (CPU) tier in blocks (vLLM's
	// OffloadingConnector, engine.Config.HostBlocks), also the router's
	// approximate host-tier index's size; 0: none.
	OffloadBlocks int
	// Pulls lets the engines pull a prefix from a peer when the router
	// names one (Decision.Pull: ttft's plan, or llm-d's
	// p2p-source-producer after the other policies' choice).
	Pulls          bool
	BlockSize      int    // tokens per block (default 16)
	MaxBatchTokens int    // engine token budget per step (default engine's)
	MaxSeqs        int    // engine running-sequence cap (default engine's)
	Model          string // model name: the root of both hash chains (default sim-llama-8b)
	// Speedup divides arrival and think times: 2 replays the trace twice as fast.
	Speedup float64
	// KVEvents is precise mode: whether the router follows the engines' KV
	// events (KVAuto, the default: for policies defined on them, such as
	// precise; KVOn: for every policy; KVOff: never).
	KVEvents KVMode
	// DataParallelSize is each replica's data-parallel ranks: Replicas ×
	// DataParallelSize engines, each a routing target (default 1).
	DataParallelSize int
	// Staleness delays every scrape (and every KV event, in precise mode)
	// by this much before the router sees it.
	Staleness time.Duration
	// ScrapeInterval is the period of the metric scrapes: 0 (the default)
	// is each policy's own where its upstream refreshes at its own period
	// (policy.MetricsRefresher: llm-d's 50 ms), else 250 ms, the gateway's.
	ScrapeInterval time.Duration
	// Seed seeds the policies (policy.Options.Seed) and the engines' jitter.
	Seed uint64

	// Gateways is the number of gateways in front of the fleet (default
	// 1): requests reach them in turn, by arrival; each has a router and a
	// policy of its own (built with the same options; with SyncShared the
	// seed mixed with the gateway's id, as the live gateway does), and
	// scrapes (and follows the KV events of) every replica itself.
	Gateways int
	// GatewaySync is how several gateways share their state: SyncShared
	// (the default) or SyncNone.
	GatewaySync GatewaySync
	// SyncDelay is how long a gateway's published batch (its decisions and
	// loads) takes to reach the others with SyncShared (0: at once, after
	// the sync tick that publishes it).
	SyncDelay time.Duration
	// SyncLoads is when a gateway publishes its loads (default
	// LoadsOnChange, the live gateway's rule).
	SyncLoads SyncLoads
	// Programs configures each gateway's program table (the zero value:
	// the router's defaults).
	Programs router.ProgramConfig

	// Flow is every gateway's flow control (router.FlowConfig; off by
	// default): requests carry their tenant, their band (their priority
	// clamped to their tenant's range) and their deadline, wait in the
	// router while the fleet is saturated, and are shed as the gateway
	// sheds them (recorded as errors "shed_<reason>").
	Flow router.FlowConfig
	// EnginePriority passes each request's band to its engine as vLLM's
	// priority, the engines scheduling by it (vLLM's --scheduling-policy
	// priority; engine.Config.PriorityScheduling).
	EnginePriority bool

	// observe, when set (tests, benchmarks), is called with every scrape
	// as it is taken and every ctxCheckEvery events.
	observe func(ev observation)
}

// observation is what Config.observe hears.
type observation struct {
	scrape *snapshot // a scrape as taken, or nil for a periodic call
	// kv is a KV-event batch about to reach the router, at virtual time
	// at; setting *drop loses it (a test's gap).
	kv   *kvBatch
	at   time.Duration
	drop *bool
}

// WithDefaults fills the zero fields.
func (c Config) WithDefaults() Config {
	if c.Replicas == 0 && c.PrefillReplicas == 0 && c.DecodeReplicas == 0 {
		c.Replicas = DefaultReplicas
	}
	if c.Profile == (costmodel.Profile{}) {
		c.Profile = costmodel.MustLookup(costmodel.Default)
	}
	if c.KVBlocks == 0 {
		c.KVBlocks = engine.DefaultNumBlocks
	}
	if c.BlockSize == 0 {
		c.BlockSize = prompt.DefaultBlockSize
	}
	if c.MaxBatchTokens == 0 {
		c.MaxBatchTokens = engine.DefaultMaxBatchTokens
	}
	if c.MaxSeqs == 0 {
		c.MaxSeqs = engine.DefaultMaxSeqs
	}
	if c.Model == "" {
		c.Model = DefaultModel
	}
	if c.Speedup == 0 {
		c.Speedup = 1
	}
	if c.KVEvents == "" {
		c.KVEvents = KVAuto
	}
	if c.DataParallelSize == 0 {
		c.DataParallelSize = 1
	}
	if c.Gateways == 0 {
		c.Gateways = 1
	}
	if c.GatewaySync == "" {
		c.GatewaySync = SyncShared
	}
	if c.SyncLoads == "" {
		c.SyncLoads = LoadsOnChange
	}
	return c
}

func (c Config) validate() error {
	switch {
	case c.Replicas < 0 || c.PrefillReplicas < 0 || c.DecodeReplicas < 0:
		return fmt.Errorf("%w: replicas %d, prefill %d, decode %d: none may be negative", ErrConfig, c.Replicas, c.PrefillReplicas, c.DecodeReplicas)
	case (c.PrefillReplicas > 0) != (c.DecodeReplicas > 0):
		return fmt.Errorf("%w: prefill replicas %d and decode replicas %d: a prefill/decode fleet needs both", ErrConfig, c.PrefillReplicas, c.DecodeReplicas)
	case c.servers() < 1:
		return fmt.Errorf("%w: no replica", ErrConfig)
	case !(c.Speedup > 0) || c.Speedup > 1e9:
		return fmt.Errorf("%w: speedup %v out of (0, 1e9]", ErrConfig, c.Speedup)
	case c.Staleness < 0:
		return fmt.Errorf("%w: staleness %v < 0", ErrConfig, c.Staleness)
	case c.ScrapeInterval < 0:
		return fmt.Errorf("%w: scrape interval %v < 0", ErrConfig, c.ScrapeInterval)
	case c.KVBlocks < 1 || c.BlockSize < 1:
		return fmt.Errorf("%w: kv blocks %d and block size %d must be ≥ 1", ErrConfig, c.KVBlocks, c.BlockSize)
	case c.OffloadBlocks < 0 || c.OffloadBlocks >= 1<<31-1:
		return fmt.Errorf("%w: offload blocks %d out of [0, %d)", ErrConfig, c.OffloadBlocks, 1<<31-1)
	case c.KVEvents != KVAuto && c.KVEvents != KVOn && c.KVEvents != KVOff:
		return fmt.Errorf("%w: kv events %q: want auto, on or off", ErrConfig, c.KVEvents)
	case c.servers() > 1<<16 || c.DataParallelSize < 1 || c.servers()*c.DataParallelSize > 1<<16:
		return fmt.Errorf("%w: data parallel size %d out of [1, %d]", ErrConfig, c.DataParallelSize, (1<<16)/max(c.servers(), 1))
	case c.Gateways < 1 || c.Gateways > MaxGateways:
		return fmt.Errorf("%w: gateways %d out of [1, %d]", ErrConfig, c.Gateways, MaxGateways)
	case c.GatewaySync != SyncShared && c.GatewaySync != SyncNone:
		return fmt.Errorf("%w: gateway sync %q: want shared or none", ErrConfig, c.GatewaySync)
	case c.SyncDelay < 0:
		return fmt.Errorf("%w: sync delay %v < 0", ErrConfig, c.SyncDelay)
	case c.SyncLoads != LoadsWithBatches && c.SyncLoads != LoadsOnChange:
		return fmt.Errorf("%w: sync loads %q: want batch or change", ErrConfig, c.SyncLoads)
	}
	if err := c.Profile.Validate(); err != nil {
		return fmt.Errorf("%w: %w", ErrConfig, err)
	}
	for i, p := range c.ReplicaProfiles {
		if i < 0 || i >= c.servers() {
			return fmt.Errorf("%w: replica profile for replica %d of %d", ErrConfig, i, c.servers())
		}
		if err := p.Validate(); err != nil {
			return fmt.Errorf("%w: replica %d: %w", ErrConfig, i, err)
		}
	}
	return nil
}

// scrapeInterval is the scrape period of a run of pol.
func (c Config) scrapeInterval(pol policy.Policy) time.Duration {
	if c.ScrapeInterval > 0 {
		return c.ScrapeInterval
	}
	if d := policy.MetricsRefresh(pol); d > 0 {
		return d
	}
	return DefaultScrapeInterval
}

// servers is the number of replicas of every role. Their slots: the
// aggregated replicas, then the decode replicas, then the prefill
// replicas (the ones that serve answers first, so that a report's replica
// shares are over them).
func (c Config) servers() int { return c.Replicas + c.DecodeReplicas + c.PrefillReplicas }

// engines is the number of engines: each replica's data-parallel ranks.
func (c Config) engines() int { return c.servers() * c.DataParallelSize }

// answering is the number of engines that stream answers: the aggregated
// and decode replicas' ranks.
func (c Config) answering() int { return (c.Replicas + c.DecodeReplicas) * c.DataParallelSize }

// disaggregated reports a prefill/decode fleet.
func (c Config) disaggregated() bool { return c.PrefillReplicas > 0 }

// role is engine i's role.
func (c Config) role(i int) engine.Role {
	switch s := i / c.DataParallelSize; {
	case s < c.Replicas:
		return engine.RoleBoth
	case s < c.Replicas+c.DecodeReplicas:
		return engine.RoleDecode
	}
	return engine.RolePrefill
}

// nonCachedTokens is the router's Config.NonCachedTokens.
func (c Config) nonCachedTokens() int {
	switch {
	case c.NonCachedTokens < 0:
		return 0
	case c.NonCachedTokens == 0:
		return router.DefaultNonCachedTokens
	}
	return c.NonCachedTokens
}

// engineName is engine i's name: replica-R, or replica-R#K for rank K of a
// data-parallel replica (as the gateway names a rank).
func (c Config) engineName(i int) string {
	if c.DataParallelSize == 1 {
		return fmt.Sprintf("replica-%d", i)
	}
	return fmt.Sprintf("replica-%d#%d", i/c.DataParallelSize, i%c.DataParallelSize)
}

// engineConfig is engine i's: its replica's profile, its own seed.
func (c Config) engineConfig(i int, events bool) engine.Config {
	prof := c.Profile
	if p, ok := c.ReplicaProfiles[i/c.DataParallelSize]; ok {
		prof = p
	}
	return engine.Config{
		Profile:         prof,
		NumBlocks:       c.KVBlocks,
		BlockSize:       c.BlockSize,
		MaxBatchTokens:  c.MaxBatchTokens,
		MaxSeqs:         c.MaxSeqs,
		Seed:            c.Seed + uint64(i),
		DisableKVEvents: !events,
		Role:            c.role(i),

		PriorityScheduling: c.EnginePriority,
		HostBlocks:         c.OffloadBlocks,
	}
}

// PolicySpec names one policy run: a registered policy, its parameters and
// the name its run carries in the result.
type PolicySpec struct {
	Name   string         // policy.New name
	Label  string         // run name in the result (default Name)
	Params map[string]any // policy.Options.Params
	// New, when set, builds the policy instead of the registry (a policy of
	// the caller's own, or a wrapped one); it is called once per run and
	// gateway.
	New func(policy.Options) (policy.Policy, error)
}

// RunName is the run's name in the result: Label, or Name.
func (p PolicySpec) RunName() string {
	if p.Label != "" {
		return p.Label
	}
	return p.Name
}

// build makes the run's policy: New when set, else the registry's.
func (p PolicySpec) build(opt policy.Options) (policy.Policy, error) {
	if p.New != nil {
		return p.New(opt)
	}
	return policy.New(p.Name, opt)
}

// Specs turns policy names into specs; "all" (alone) is every registered
// policy. Unknown names are an error listing the known ones.
func Specs(names []string) ([]PolicySpec, error) {
	if len(names) == 1 && names[0] == "all" {
		names = policy.Names()
	}
	known := policy.Names()
	out := make([]PolicySpec, 0, len(names))
	for _, n := range names {
		if !slices.Contains(known, n) {
			return nil, fmt.Errorf("%w: unknown policy %q (known: all, %s)", ErrConfig, n, strings.Join(known, ", "))
		}
		out = append(out, PolicySpec{Name: n})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no policy", ErrConfig)
	}
	return out, nil
}

// Run replays reqs on a fresh fleet routed by one policy and summarises it.
// Requests whose prompt can never fit an engine's cache (engine.ErrTooLong)
// are recorded as errors ("too_long"); so are requests no replica takes.
func Run(ctx context.Context, cfg Config, reqs []workload.Request, spec PolicySpec) (report.Run, error) {
	cfg, pl, err := prepare(cfg, reqs)
	if err != nil {
		return report.Run{}, err
	}
	return runPlan(ctx, cfg, pl, spec)
}

// prepare fills cfg's defaults, validates it and plans reqs.
func prepare(cfg Config, reqs []workload.Request) (Config, *plan, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return cfg, nil, err
	}
	pl, err := newPlan(reqs)
	return cfg, pl, err
}

// prepareBounded is prepare, and the hit-rate bounds of the plan.
func prepareBounded(ctx context.Context, cfg Config, reqs []workload.Request) (Config, *plan, report.Bound, error) {
	cfg, pl, err := prepare(cfg, reqs)
	if err != nil {
		return cfg, nil, report.Bound{}, err
	}
	b, err := boundsPlan(ctx, cfg, pl)
	return cfg, pl, b, err
}

// setVsBound records run's hit rate as a share of the prefix-reuse bound.
func setVsBound(run *report.Run, b report.Bound) {
	if b.PrefixReuse > 0 {
		run.Extra["hit_rate_vs_bound"] = run.HitRate / b.PrefixReuse
	}
}

func runPlan(ctx context.Context, cfg Config, pl *plan, spec PolicySpec) (report.Run, error) {
	vr, err := newVirtualRun(cfg, pl, spec)
	if err != nil {
		return report.Run{}, err
	}
	if err := vr.loop(ctx); err != nil {
		return report.Run{}, err
	}
	return vr.summary(spec.RunName()), nil
}

// epoch is virtual time zero on the router's clock. Any fixed instant would
// do; a recent one keeps Unix-second arithmetic in policies (SGLang's
// eviction stamps) in a realistic range.
var epoch = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

// plan is what every run of one request sequence shares: the requests, their
// dependency graph and the order of independent arrivals.
type plan struct {
	reqs  []workload.Request
	roots []int32 // requests without a predecessor, by (At, index)
	// kids[kidStart[i]:kidStart[i+1]] are the requests waiting for i to
	// finish, by index: one array for all (compressed sparse rows), where
	// a slice per request took 32 bytes each (32 MB for 1M requests).
	kidStart, kids []int32
	// batchSize[b] is the requests of RL batch b (workload.Request.Batch),
	// batchNext[b] those of batch b+1 that wait for all of them to end.
	batchSize []int
	batchNext [][]int32
}

// gated reports whether r waits for the batch before its own (a request
// of batch b > 1 without a predecessor).
func gated(r *workload.Request) bool { return r.Prev < 0 && r.Batch > 1 }

func newPlan(reqs []workload.Request) (*plan, error) {
	if len(reqs) >= 1<<31-1 {
		return nil, fmt.Errorf("%w: %d requests", ErrInput, len(reqs))
	}
	pl := &plan{reqs: reqs, kidStart: make([]int32, len(reqs)+1)}
	for i := range reqs {
		r := &reqs[i]
		switch {
		case r.Batch < 0 || r.Batch > len(reqs):
			return nil, fmt.Errorf("%w: request %d is in batch %d, outside [0, %d]", ErrInput, i, r.Batch, len(reqs))
		case gated(r):
			pl.addBatch(r.Batch - 1)
			pl.batchNext[r.Batch-1] = append(pl.batchNext[r.Batch-1], int32(i))
		case r.Prev < 0:
			pl.roots = append(pl.roots, int32(i))
		case r.Prev >= i:
			// Predecessors come first: this rules out cycles with one check.
			return nil, fmt.Errorf("%w: request %d depends on request %d, which is not before it", ErrInput, i, r.Prev)
		default:
			pl.kidStart[r.Prev+1]++ // counted here, placed by placeKids
		}
		if r.Batch > 0 {
			pl.addBatch(r.Batch)
			pl.batchSize[r.Batch]++
		}
		if r.At < 0 || r.Think < 0 {
			return nil, fmt.Errorf("%w: request %d has a negative arrival or think time", ErrInput, i)
		}
	}
	for b, next := range pl.batchNext {
		if len(next) > 0 && pl.batchSize[b] == 0 {
			return nil, fmt.Errorf("%w: batch %d waits for batch %d, which has no request", ErrInput, b+1, b)
		}
	}
	pl.placeKids()
	slices.SortStableFunc(pl.roots, func(a, b int32) int {
		return cmp.Compare(reqs[a].At, reqs[b].At)
	})
	return pl, nil
}

// placeKids turns kidStart's counts (request i's kids at i+1) into
// offsets and places each request in its predecessor's row, by index.
func (pl *plan) placeKids() {
	for i := 1; i < len(pl.kidStart); i++ {
		pl.kidStart[i] += pl.kidStart[i-1]
	}
	pl.kids = make([]int32, pl.kidStart[len(pl.kidStart)-1])
	next := slices.Clone(pl.kidStart[:len(pl.kidStart)-1])
	for i := range pl.reqs {
		if p := pl.reqs[i].Prev; p >= 0 {
			pl.kids[next[p]] = int32(i)
			next[p]++
		}
	}
}

// kidsOf are the requests waiting for request i to finish.
func (pl *plan) kidsOf(i int) []int32 {
	return pl.kids[pl.kidStart[i]:pl.kidStart[i+1]:pl.kidStart[i+1]]
}

// addBatch sizes the batch tables to hold batch b.
func (pl *plan) addBatch(b int) {
	for len(pl.batchSize) <= b {
		pl.batchSize = append(pl.batchSize, 0)
		pl.batchNext = append(pl.batchNext, nil)
	}
}

// scale divides a trace duration by the speed-up.
func scale(d time.Duration, speedup float64) time.Duration {
	if speedup == 1 {
		return d
	}
	return time.Duration(float64(d) / speedup)
}

// parsed is what the gateway's parser would make of the request's body.
func parsed(r *workload.Request, text, model string) prompt.Parsed {
	if r.Chat {
		// The contents as substrings of text: a generated message's
		// content is made once, in text, not again.
		roles, contents := r.ChatParts(text, nil, nil)
		return prompt.ChatParsed(model, roles, contents, text, r.MaxTokens)
	}
	return prompt.Parsed{Kind: prompt.Completion, Model: model, MaxTokens: r.MaxTokens, Text: text, KeyText: text, Prompts: 1}
}
