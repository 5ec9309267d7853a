// Package router composes the routing core: it turns a parsed request into
// a routing key (prompt), keeps the gateway's view of every replica (load
// counters, scraped metrics, health) and the prefix index, asks the policy
// for a decision, and feeds outcomes back. The live gateway and the offline
// replay both route through a Router, so they run the same code.
package router

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prefixindex"
	"github.com/kvgate/kvgate/internal/prompt"
)

// Config configures a Router.
type Config struct {
	Replicas []string // replica URLs (or names), in slot order (or Specs)
	// Specs, when set, give each replica's URL, key and KV-event endpoint
	// (and replace Replicas).
	Specs     []Spec
	Policy    policy.Policy
	Tokenizer prompt.Tokenizer // default prompt.Approx{}
	BlockSize int              // default 16
	// BlocksPerReplica bounds each replica's share of the approximate index
	// (default 30,000: the engine's default KV capacity; the gateway sets it
	// from each replica's scraped cache_config_info when known).
	BlocksPerReplica int
	// MaxEntries caps the approximate index, and the precise one (default prefixindex's).
	MaxEntries int
	// Precise enables a second index fed by KV events (see Precise()).
	Precise bool
	// Model names the partition KV events are hashed under in precise mode.
	Model string
	// Now is the clock (default time.Now).
	Now func() time.Time
	// StaleAfter: a replica whose last good scrape is older than this is
	// routed on the gateway's own counts only (0: scrapes never go stale,
	// as in the replay, where staleness is modelled on purpose).
	StaleAfter time.Duration
	// ConfirmOnAccept: the approximate index credits a routed request's
	// blocks to its replica once the caller has sent it (Ticket.Credit),
	// as the peers' routers credit a request they routed, but keeps them
	// only once its ticket is Accepted (the replica took it: first byte or
	// 2xx). A ticket Rejected, or ended (Done) without Accept, forgets the
	// blocks it added; other gateways hear a request (OnLearn) only at
	// Accept. So a burst of identical prompts routed before the first
	// answer sees the first one's replica holding the prompt, and nothing
	// a replica refused stays in the index. Off, the index learns and
	// shares at Route (the replay, whose replicas accept every request).
	ConfirmOnAccept bool
	// Breaker configures every replica's circuit breaker.
	Breaker BreakerConfig
	// OnLearn, when set, hears every request the approximate index learns
	// (at Route, or at Accept with ConfirmOnAccept), for sharing with other
	// gateways. It runs on the request path: it must not block or keep
	// Learned.Blocks.
	OnLearn func(Learned)
	// NonCachedTokens (prefill/decode disaggregation, RoutePD): when the
	// chosen decode replica lacks fewer than this many tokens of the prompt,
	// the prefill step is skipped and the decode replica computes the rest
	// itself. It is llm-d's threshold of the same name (the
	// prefix-based-pd-decider's nonCachedTokens, read by its
	// pd-profile-handler, llm-d-inference-scheduler
	// pkg/plugins/profile/prefix_based_pd_decider.go). Default 16, as
	// llm-d's pd-disaggregation guide sets it (llm-d/llm-d
	// guides/pd-disaggregation, scheduler v0.6.0); negative: never skip
	// (llm-d's 0, the decider's code default: always disaggregate).
	// Policies that pick the pair themselves (policy.PairPicker) see it as
	// Request.SkipPrefillBelow and decide.
	NonCachedTokens int
	// OnDrained, when set, hears (once per removal) that a replica removed
	// by SetReplicas has no request in flight left. It may run on the
	// request path (the last Ticket.Done): it must not block.
	OnDrained func(slot int)
	// OnEject, when set, hears every opening of a replica's breaker by a
	// ticket's failure (Ticket.Done with HealthFailed): the replica left
	// rotation for Ejection.Cooldown. It runs on the request path (the
	// failing ticket's Done): it must not block.
	OnEject func(Ejection)
	// OnPolicyPanic, when set, hears every panic recovered from a policy's
	// Pick or PickPair (guard.go: the request is routed by least load
	// instead), with the stack at most once per PanicReportEvery and
	// policy. It runs on the request path: it must not block.
	OnPolicyPanic func(PolicyPanic)
	// Dynamic: the replicas come from a discovery source (SetReplicas),
	// and the router may start with none (every request ErrNoReplica).
	Dynamic bool
	// ForgetAfter: a replica removed by SetReplicas is forgotten this long
	// after its removal, once drained (membership.go): its slot goes to
	// the next replica added and its state is freed. Listed again before,
	// it is revived with its state. 0: DefaultForgetAfter.
	ForgetAfter time.Duration
	// Pools partition the replicas by the models they serve, each with its
	// own policy (pools.go; Spec.Pool names a replica's). None: one pool of
	// every replica, routed by Policy.
	Pools []Pool
	// Flow configures every pool's flow controller (flow.go; the zero
	// value: off, the queue is late binding's alone).
	Flow FlowConfig
	// Programs configures the program table (programs.go).
	Programs ProgramConfig
	// OffloadBlocks is each replica's host (CPU) tier in blocks, for the
	// approximate index of the host tiers (tiers.go); 0: none assumed (the
	// precise index learns host tiers from events of medium CPU anyway).
	OffloadBlocks int
	// Pulls: the replicas pull a prefix from a peer when told to
	// (Decision.Pull, vLLM's remote_kv_source): a policy that plans pulls
	// (policy.PullPlanner) names them, and for the others the router adds
	// llm-d's p2p-source-producer's pull after their choice. Off: no pull.
	Pulls bool
}

// DefaultNonCachedTokens is Config.NonCachedTokens' default.
const DefaultNonCachedTokens = 16

// ErrModelNotServed is returned by Route when no replica serves the
// request's model or adapter.
var ErrModelNotServed = errors.New("router: no replica serves the model")

// Metrics is what a scrape of a replica's /metrics tells.
type Metrics struct {
	Waiting, Running int
	KVUsage          float64
	NumBlocks        int
	BlockSize        int
	// EngineBlockSize is the replica's own block size (vLLM's
	// cache_config_info), before NumBlocks is counted in the router's.
	EngineBlockSize int
}

// Router routes requests.
type Router struct {
	cfg Config
	// pol is the policy and its Observer side (nil: it learns nothing),
	// swapped whole by SetPolicy (a configuration reload).
	pol     atomic.Pointer[policies]
	tok     prompt.Tokenizer
	approx  *prefixindex.Index
	precise *prefixindex.Precise
	// approxHost is the approximate index of the replicas' host tiers
	// (nil without Config.OffloadBlocks); the precise one is precise's.
	approxHost *prefixindex.Index
	// mem is the membership, copy-on-write: routing reads a snapshot
	// without a lock; SetReplicas (a cold path) publishes a new one.
	// A slot number read from any snapshot stays valid (tickets, policies'
	// per-slot state, the index): slots are appended, and reused only once
	// their replica is forgotten (drained, removed for ForgetAfter), its
	// state freed everywhere (membership.go).
	mem    atomic.Pointer[members]
	memMu  sync.Mutex // serialises SetReplicas and Forget
	free   []int      // vacant slots, ascending (memMu)
	nextID atomic.Uint64
	// serials numbers the replicas added (Replica.Serial).
	serials atomic.Uint64
	// flow is Config.Flow with its defaults, which every pool's queue reads.
	flow FlowConfig
	bufs sync.Pool // *viewBuf: the request path's views (getBuf)
	// pools are the configured pools, or the default one (pools.go).
	pools []*pool
	// leastLoad routes a request whose policy panicked (guard.go).
	leastLoad policy.Policy
	panics    panicReports
	// progs is the program table (programs.go) and bursts the recent
	// bursts of identical prompts (bursts.go).
	progs  *programs
	bursts *bursts
	// beforePark, a test's hook, runs in release between a new program's
	// leaving the queue without room and its being held again (parkAgain).
	beforePark func()
}

// New builds a Router.
func New(cfg Config) (*Router, error) {
	if len(cfg.Specs) == 0 {
		for _, u := range cfg.Replicas {
			cfg.Specs = append(cfg.Specs, Spec{URL: u})
		}
	}
	if len(cfg.Specs) == 0 && !cfg.Dynamic {
		return nil, errors.New("router: no replicas")
	}
	if cfg.Policy == nil {
		return nil, errors.New("router: no policy")
	}
	if cfg.Tokenizer == nil {
		cfg.Tokenizer = prompt.Approx{}
	}
	if cfg.BlockSize <= 0 {
		cfg.BlockSize = prompt.DefaultBlockSize
	}
	if cfg.BlocksPerReplica <= 0 {
		cfg.BlocksPerReplica = 30000
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.NonCachedTokens == 0 {
		cfg.NonCachedTokens = DefaultNonCachedTokens
	}
	if cfg.ForgetAfter <= 0 {
		cfg.ForgetAfter = DefaultForgetAfter
	}
	ix, err := prefixindex.New(prefixindex.Config{Replicas: len(cfg.Specs), BlocksPerReplica: cfg.BlocksPerReplica, MaxEntries: cfg.MaxEntries})
	if err != nil {
		return nil, err
	}
	ll, err := policy.New("least_load", policy.Options{})
	if err != nil {
		return nil, err
	}
	rt := &Router{cfg: cfg, tok: cfg.Tokenizer, approx: ix, leastLoad: ll, progs: newPrograms(cfg.Programs)}
	if cfg.Flow.Enabled {
		if rt.flow, err = cfg.Flow.withDefaults(); err != nil {
			return nil, err
		}
	}
	rt.bursts = newBursts(rt.progs.cfg)
	rt.SetPolicy(cfg.Policy)
	if err := rt.newPools(cfg.Pools); err != nil {
		return nil, err
	}
	rt.progs.onIdle = rt.programIdled
	if cfg.Precise {
		pix, err := prefixindex.New(prefixindex.Config{Replicas: len(cfg.Specs), MaxEntries: cfg.MaxEntries})
		if err != nil {
			return nil, err
		}
		rt.precise = prefixindex.NewPrecise(pix, cfg.Model, cfg.BlockSize)
	}
	if err := rt.newHostIndexes(); err != nil {
		return nil, err
	}
	m := &members{byName: map[string]int{}}
	for _, sp := range cfg.Specs {
		if _, dup := m.byName[sp.Name()]; dup {
			return nil, fmt.Errorf("router: replica %s listed twice", sp.Name())
		}
		if err := rt.checkPool(sp); err != nil {
			return nil, err
		}
		m.add(rt.newReplica(len(m.replicas), sp))
	}
	rt.mem.Store(m)
	return rt, nil
}

// Policy is the router's policy.
func (rt *Router) Policy() policy.Policy { return rt.pol.Load().pol }

// policies is a policy and its Observer side.
type policies struct {
	pol policy.Policy
	obs policy.Observer
}

// SetPolicy makes p the router's policy from the next decision on (a
// configuration reload with new parameters: the policy's own learnt state
// starts over, the index and the replicas' state are kept). Requests
// routed before report their outcomes to the policy that routed them.
func (rt *Router) SetPolicy(p policy.Policy) {
	ps := &policies{pol: p}
	ps.obs, _ = p.(policy.Observer)
	rt.pol.Store(ps)
}

// Replicas is the number of replica slots.
func (rt *Router) Replicas() int { return len(rt.reps()) }

// URL is replica slot i's URL.
func (rt *Router) URL(i int) string { return rt.reps()[i].URL() }

// Name is replica slot i's name: its URL, or URL#k for rank k of a
// data-parallel server.
func (rt *Router) Name(i int) string { return rt.reps()[i].name }

// Replica is replica slot i's home.
func (rt *Router) Replica(i int) *Replica { return rt.reps()[i] }

// Now is the router's clock.
func (rt *Router) Now() time.Time { return rt.cfg.Now() }

// Index is the approximate index.
func (rt *Router) Index() *prefixindex.Index { return rt.approx }

// Precise is the KV-event index (nil unless Config.Precise).
func (rt *Router) Precise() *prefixindex.Precise { return rt.precise }

// SetHealthy marks replica i in or out of rotation; back in, it takes
// the requests waiting in the router's queue at once.
func (rt *Router) SetHealthy(i int, ok bool) { rt.reps()[i].setHealthy(ok) }

// Healthy reports replica i's health.
func (rt *Router) Healthy(i int) bool { return rt.reps()[i].healthy.Load() }

// SetMetrics records a scrape of replica i taken at `at`, arriving now:
// this gateway's requests to it without a first token now are those the
// scrape may show waiting (WaitingUnseen).
func (rt *Router) SetMetrics(i int, m Metrics, at time.Time) Metrics {
	return rt.SetMetricsSeen(i, m, at, int(rt.LocalLoad(i).PendingCount))
}

// SetMetricsSeen is SetMetrics for a scrape that arrives late: pending is
// LocalLoad(i).PendingCount when it was taken.
func (rt *Router) SetMetricsSeen(i int, m Metrics, at time.Time, pending int) Metrics {
	// The replica's KV capacity in the router's blocks: vLLM's block size
	// (its cache_config_info) need not be the index's.
	m.EngineBlockSize = m.BlockSize
	if m.BlockSize > 0 && m.BlockSize != rt.cfg.BlockSize && m.NumBlocks > 0 {
		m.NumBlocks = int(int64(m.NumBlocks) * int64(m.BlockSize) / int64(rt.cfg.BlockSize))
		m.BlockSize = rt.cfg.BlockSize
	}
	rt.reps()[i].scrape.Store(&scrape{m: m, at: at, pending: max(pending, 0)})
	rt.releaseIfQueued()
	return m
}

// ReplicaMetrics is replica i's last scrape and when it was taken.
func (rt *Router) ReplicaMetrics(i int) (Metrics, time.Time, bool) {
	if s := rt.reps()[i].scrape.Load(); s != nil {
		return s.m, s.at, true
	}
	return Metrics{}, time.Time{}, false
}

// Pending is the prompt tokens routed to replica i that have not produced
// a first token.
func (rt *Router) Pending(i int) int { return int(rt.reps()[i].pendingPrefill.Load()) }

// InFlight is the number of requests in flight to replica i.
func (rt *Router) InFlight(i int) int { return int(rt.reps()[i].inFlight.Load()) }

// Prepare makes the routing key of a parsed request (its model resolved
// now: PrepareIn takes a resolution made before). session is the program
// id the transport found (a session header, or the program of a Responses
// call's previous_response_id; "" for none): the request's program is its
// body's prompt_cache_key, else session, else it has none and its Session
// is the body's user (see ProgramOf).
func (rt *Router) Prepare(p *prompt.Parsed, session, adapter string) *policy.Request {
	return rt.prepare(rt.resolve(p.Model), p, session, adapter)
}

// PrepareIn makes the routing key of a parsed request whose model m
// resolved (Resolve of p.Model): the request carries the resolution, so
// that routing it looks nothing up again.
func (rt *Router) PrepareIn(m Resolved, p *prompt.Parsed, session string) *policy.Request {
	return rt.prepare(m, p, session, "")
}

func (rt *Router) prepare(m Resolved, p *prompt.Parsed, session, adapter string) *policy.Request {
	req := &policy.Request{
		ID:        rt.nextID.Add(1),
		Now:       rt.cfg.Now(),
		Model:     p.Model,
		Adapter:   adapter,
		Salt:      p.CacheSalt,
		Text:      p.Text,
		KeyText:   p.KeyText,
		System:    p.System,
		MaxTokens: p.MaxTokens,
		Pool:      m.ref,
	}
	model := p.Model
	if adapter == "" {
		model, adapter = m.base, m.adapter
	}
	if id := ProgramOf(p, session); id != "" {
		SetProgram(req, id)
	} else {
		req.Session = p.User
	}
	root := prompt.Key{Model: model, Adapter: adapter, Salt: p.CacheSalt}.Root()
	req.Tokens, req.Blocks = p.Blocks(nil, rt.tok, root, rt.cfg.BlockSize)
	return req
}

// Views returns the router's view of every replica for req, with each
// replica's match from the index.
func (rt *Router) Views(req *policy.Request) []policy.ReplicaView {
	views, _ := rt.views(req, new(viewBuf))
	return views
}

// viewBuf is the memory of one decision's views: the request path takes
// one from Router.bufs and gives it back once decided, so that a decision
// allocates nothing per replica (at 256 replicas the views alone were
// 40 KiB a request, a third of what a decision cost beside the hash).
type viewBuf struct {
	views []policy.ReplicaView
	ints  []int // the approximate and precise matches and lengths
}

// getBuf is a viewBuf from the pool; putBuf gives it back. Nothing of it
// may be kept past putBuf (policies do not keep their views: policy.Policy).
func (rt *Router) getBuf() *viewBuf {
	if b, ok := rt.bufs.Get().(*viewBuf); ok {
		return b
	}
	return new(viewBuf)
}

func (rt *Router) putBuf(b *viewBuf) { rt.bufs.Put(b) }

// views is Views, in vb's memory, and the approximate index's match per
// replica.
func (rt *Router) views(req *policy.Request, vb *viewBuf) ([]policy.ReplicaView, []int) {
	reps := rt.reps()
	n := len(reps)
	rt.lookupProgram(req)
	if cap(vb.views) < n {
		vb.views, vb.ints = make([]policy.ReplicaView, n), make([]int, 4*n)
	}
	views, buf := vb.views[:n], vb.ints[:4*n]
	var precise, preciseLen []int
	approx, approxLen := rt.approx.MatchLens(req.Blocks, buf[:n:n], buf[n:2*n:2*n])
	if rt.precise != nil {
		precise, preciseLen = rt.precise.Index().MatchLens(req.Blocks, buf[2*n:3*n:3*n], buf[3*n:])
	}
	host := rt.hostMatches(req.Blocks)
	for i, r := range reps {
		v := &views[i]
		// A removed replica (draining, or gone) is never a candidate.
		*v = policy.ReplicaView{Index: i, URL: r.name, Healthy: r.healthy.Load() && !r.removed.Load(), Role: r.sp().Role}
		r.loadView(v)
		if s := r.scrape.Load(); s != nil {
			v.MetricsAge = req.Now.Sub(s.at)
			// Stale metrics are not used: the gateway's own counts decide.
			if rt.cfg.StaleAfter <= 0 || v.MetricsAge <= rt.cfg.StaleAfter {
				v.HaveMetrics = true
				v.Waiting, v.Running, v.KVUsage = s.m.Waiting, s.m.Running, s.m.KVUsage
				v.WaitingUnseen = max(s.m.Waiting-s.pending-r.remotePending(), 0)
			}
			v.NumBlocks = s.m.NumBlocks
		}
		if v.NumBlocks == 0 {
			v.NumBlocks = rt.cfg.BlocksPerReplica // the configured assumption until a scrape says
		}
		v.Match, v.Cached = approx[i], approxLen[i]
		switch {
		case precise == nil:
		case r.preciseTrusted(req.Now):
			v.Match, v.Cached = precise[i], preciseLen[i]
		case precise[i] > v.Match:
			// Not in sync (a late join, a gap): what the events did report
			// is true at once; only absence is uncertain, so the larger
			// match of the two indexes stands.
			v.Match, v.Cached = precise[i], max(v.Cached, preciseLen[i])
		}
		v.MatchHost = host.of(i, precise != nil && r.preciseTrusted(req.Now))
	}
	rt.progs.fill(views, req.Now, rt.serialOf)
	return views, approx
}

// loadView sets v's loads: this gateway's counts of the replica, plus the
// other gateways' (shared state).
func (r *Replica) loadView(v *policy.ReplicaView) {
	v.InFlight = int(r.inFlight.Load())
	v.InFlightTokens = int(r.inFlightTokens.Load())
	v.InFlightKV = int(r.inFlightKV.Load())
	v.PendingPrefill = int(r.pendingPrefill.Load())
	v.PendingCount = int(r.pendingCount.Load())
	v.PendingTransfer = int(r.pendingTransfer.Load())
	v.BurstPending = int(r.burstPending.Load())
	if l := r.remote.Load(); l != nil {
		v.InFlight += int(l.InFlight)
		v.InFlightKV += remoteKV(l.InFlightTokens, v.InFlightTokens, v.InFlightKV)
		v.InFlightTokens += int(l.InFlightTokens)
		v.PendingPrefill += int(l.PendingPrefill)
		v.PendingCount += int(l.PendingCount)
	}
}

// remotePending is the other gateways' requests to the replica without a
// first token, as their last shared loads say (shared state).
func (r *Replica) remotePending() int {
	if l := r.remote.Load(); l != nil {
		return max(int(l.PendingCount), 0)
	}
	return 0
}

// remoteKV is the KV of the other gateways' requests in flight to a
// replica, which share only their contexts' sum (remoteTokens): scaled by
// this gateway's own ratio of KV to contexts on it (all of it when this
// gateway has nothing there).
func remoteKV(remoteTokens int64, localTokens, localKV int) int {
	if localTokens <= 0 {
		return int(remoteTokens)
	}
	return int(float64(remoteTokens) * float64(localKV) / float64(localTokens))
}

// DryRun is the decision for req without sending anything or learning,
// explained (req.Explain): the policy scores every replica.
func (rt *Router) DryRun(req *policy.Request) (policy.Decision, []policy.ReplicaView, error) {
	req.Explain = true
	views := rt.Views(req)
	pl, err := rt.candidates(req, views, nil)
	if err != nil {
		return policy.Decision{}, views, err
	}
	pol := pl.pol.Load().pol
	d, burst, err := rt.decide(pl, pol, req, views, policy.PlacesPrograms(pol))
	if err == nil && !burst {
		rt.pullFor(pol, req, views, &d)
	}
	return d, views, err
}

// decide is pol's decision for req, of pool pl, among views; for a policy
// that places programs (placer), a burst's follower goes with its burst
// (burst true) and a new program only where it has room (admit: errNoRoom
// when none has).
func (rt *Router) decide(pl *pool, pol policy.Policy, req *policy.Request, views []policy.ReplicaView, placer bool) (policy.Decision, bool, error) {
	if placer {
		if d, ok := rt.burstPick(req, views); ok {
			return d, true, nil
		}
		if err := rt.admit(pl, req, views); err != nil {
			return policy.Decision{}, false, err
		}
	}
	d, err := rt.pick(pol, req, views)
	return d, false, err
}

// candidates takes out of views (Healthy false) the replicas excluded and
// those that do not serve req's model: the replicas listed as serving it,
// or, while none of those can take it, also those not listed yet (they judge
// for themselves); ErrModelNotServed when no replica serves it at all. A
// request without a model (a multipart upload whose model part came late, a
// lookup by id) may go to any replica of the first pool. Only the replicas
// of the pool routing req's model are candidates; that pool is returned.
func (rt *Router) candidates(req *policy.Request, views []policy.ReplicaView, exclude []int) (*pool, error) {
	excludeViews(views, exclude)
	pl := rt.poolOfRequest(req)
	if pl == nil {
		return nil, ErrModelNotServed
	}
	reps := rt.reps()[:len(views)]
	if req.Model == "" {
		restrict(pl, reps, views)
		return pl, nil
	}
	known, unlisted, available, active := 0, 0, 0, 0
	for i, r := range reps {
		if !pl.has(r) {
			views[i].Healthy = false
			continue
		}
		if !r.removed.Load() {
			active++
		}
		switch s := r.served.Load(); {
		case r.removed.Load():
			views[i].Healthy = false
		case s == nil:
			unlisted++
		case s.Has(req.Model):
			known++
			if views[i].Healthy {
				available++
			}
		default:
			views[i].Healthy = false
		}
	}
	switch {
	case active == 0:
		return nil, policy.ErrNoReplica // none discovered yet, or all removed
	case known+unlisted == 0:
		return nil, ErrModelNotServed
	}
	if available > 0 && unlisted > 0 {
		for i, r := range reps {
			if r.served.Load() == nil {
				views[i].Healthy = false
			}
		}
	}
	return pl, nil
}

// excludeViews takes the replicas of exclude (the ones a request already
// tried) out of views.
func excludeViews(views []policy.ReplicaView, exclude []int) {
	for _, x := range exclude {
		if x >= 0 && x < len(views) {
			views[x].Healthy = false
		}
	}
}

// Ticket tracks one routed request until it ends.
type Ticket struct {
	rt       *Router
	r        *Replica        // the slot's replica (its counters)
	obs      policy.Observer // the policy that routed it hears its outcome
	req      *policy.Request
	Decision policy.Decision
	Replica  int
	start    time.Time
	phase    policy.Phase
	uncached int64
	transfer int64 // prompt tokens a decode step pulls (PhaseDecode)
	kv       int64 // the KV it adds beyond its credited prefix (ReplicaView.InFlightKV)
	tokens   int64
	match    int // the approximate index's match on the replica at routing
	// predicted is the prompt tokens the precise index, trusted, said the
	// replica holds (-1: not in precise mode, or not trusted).
	predicted int
	// Held is the prompt's blocks the chosen replica held at routing, and
	// BestHeld the most any candidate of the step held (the chosen one
	// included), by the index the router trusts: the gateway tells a
	// decision that followed the prefix from one that spilled it for load.
	Held, BestHeld int
	mu             sync.Mutex
	first          bool
	done           bool
	learned        bool // the approximate index holds this request's blocks for Replica
	accepted       bool // taken: Accept before the ticket ended (or learnt at Route, without ConfirmOnAccept)
	rejected       bool // the replica did not take it: never learnt
	burst          bool // a burst follower, counted in burstPending until its first token
	// policy is the name of the policy that decided (the pool's, or the
	// one RouteWith was given).
	policy string
	// pass is the breaker's admission (Allow), reported by Done; asked:
	// Allow was called, allowed: it admitted the request.
	pass           Pass
	asked, allowed bool
	// fq is the queue whose flow controller charged the ticket's work to
	// ten (expOut: the output it expected), settled by Done; nil: none.
	fq     *queue
	ten    *tenant
	expOut float64
}

// Route decides and commits: the replica's counters go up (before the
// upstream call) and observers hear Routed. Candidates are the healthy
// replicas that serve the request's model, less exclude (a retry's failed
// ones); ErrModelNotServed when no replica serves it at all. The
// approximate index learns the request at Route (with ConfirmOnAccept:
// credits it at Credit, keeps it when the ticket is Accepted).
func (rt *Router) Route(req *policy.Request, exclude ...int) (*Ticket, error) {
	return rt.RouteWith(nil, req, exclude...)
}

// RouteWith is Route deciding with pol instead of the policy of the
// request's pool (nil: that policy): the gateway routes requests without a
// prompt by load, and pins a stateful request to the replica holding its
// state. The candidates are still the pool's, and its policy's observer
// still hears the request, whose load counts like any other.
func (rt *Router) RouteWith(pol policy.Policy, req *policy.Request, exclude ...int) (*Ticket, error) {
	return rt.routeWith(pol, req, exclude, nil, false)
}

// routeWith is RouteWith, through the flow controller of q when q has one
// (q's mutex held): a saturated pool defers the request, a decision whose
// estimated first token comes after the request's deadline sheds it, and
// the ticket's work is charged to its tenant. anyway: a new program that
// waited AdmissionWait for room, placed without it and not deferred by its
// policy (NoDefer, for this decision only), once the gate lets it go.
func (rt *Router) routeWith(pol policy.Policy, req *policy.Request, exclude []int, q *queue, anyway bool) (*Ticket, error) {
	vb := rt.getBuf()
	defer rt.putBuf(vb)
	views, approx := rt.views(req, vb)
	pl, err := rt.candidates(req, views, exclude)
	if err != nil {
		return nil, err
	}
	var fl *flow
	if q != nil {
		fl = q.fl
	}
	if pol == nil {
		pol = pl.pol.Load().pol
	}
	if fl != nil && !req.NoDefer {
		if err := rt.gate(pl, fl, pol, req, views); err != nil {
			return nil, err
		}
	}
	if anyway && !req.NoDefer {
		req.NoDefer = true
		defer func() { req.NoDefer = false }()
	}
	placer := policy.PlacesPrograms(pol)
	d, _, err := rt.decide(pl, pol, req, views, placer)
	if err != nil {
		return nil, err
	}
	if d.Replica < 0 || d.Replica >= len(views) || !views[d.Replica].Healthy {
		return nil, fmt.Errorf("router: policy %s chose replica %d of %d, not a candidate", pol.Name(), d.Replica, len(views))
	}
	rt.pullFor(pol, req, views, &d)
	if fl != nil {
		if err := fl.feasible(req, d); err != nil {
			return nil, err
		}
	}
	t := rt.commitView(pol, req, d, views, approx, policy.PhaseNone)
	if placer {
		rt.burstRouted(req, t)
	}
	if fl != nil {
		t.fq = q
		fl.charge(t, fl.tenant(req.Tenant), t.uncached)
	}
	return t, nil
}

// commitView commits d, which pol decided, for one step (phase) of req,
// with the match views and the approximate index (approx) give its replica. A decode step's
// precise prediction is not checked (Underpredicted): the cached tokens
// its replica reports count the pulled ones.
func (rt *Router) commitView(pol policy.Policy, req *policy.Request, d policy.Decision, views []policy.ReplicaView, approx []int, phase policy.Phase) *Ticket {
	t := rt.commit(req, d, &views[d.Replica], approx[d.Replica], phase)
	t.policy = pol.Name()
	t.Held, t.BestHeld = views[d.Replica].Match, bestHeld(views, phase)
	t.predicted = -1
	if rt.precise != nil && phase != policy.PhaseDecode && rt.reps()[d.Replica].preciseTrusted(req.Now) {
		t.predicted = views[d.Replica].Match * rt.cfg.BlockSize
	}
	return t
}

// bestHeld is the longest match among the candidates (Healthy) that can
// take a step of phase: a prefill step's side prefills, a decode step's
// decodes.
func bestHeld(views []policy.ReplicaView, phase policy.Phase) int {
	best := 0
	for _, v := range views {
		switch {
		case !v.Healthy:
		case phase == policy.PhasePrefill && !v.Role.Prefills():
		case phase == policy.PhaseDecode && !v.Role.Decodes():
		default:
			best = max(best, v.Match)
		}
	}
	return best
}

// Serves reports whether some replica of the pool routing model serves
// it (or has not been listed), or the pool is empty (discovery found none
// yet: no replica to ask, which Route answers with policy.ErrNoReplica).
// No pool routing model: false.
func (rt *Router) Serves(model string) bool { return rt.servesIn(rt.poolFor(model), model) }

// servesIn is Serves with model's pool pl (nil: none) resolved.
func (rt *Router) servesIn(pl *pool, model string) bool {
	if pl == nil {
		return false
	}
	active := false
	for _, r := range rt.reps() {
		if r.removed.Load() || !pl.has(r) {
			continue
		}
		active = true
		if r.Serves(model) {
			return true
		}
	}
	return !active
}

// ModelInfo is what the replicas list for model (the first listing found).
func (rt *Router) ModelInfo(model string) (Model, bool) {
	for _, r := range rt.reps() {
		if s := r.served.Load(); s != nil && !r.removed.Load() {
			if m, ok := s.Model(model); ok {
				return m, true
			}
		}
	}
	return Model{}, false
}

// commit counts req in d's replica and tells the observers. A decode step
// (PhaseDecode) pulls what its replica lacks of the prompt and computes
// only the last token, as vLLM's NixlConnector does: its pending prefill is
// that token, and what it pulls is pending transfer until its first token.
func (rt *Router) commit(req *policy.Request, d policy.Decision, v *policy.ReplicaView, approxMatch int, phase policy.Phase) *Ticket {
	r := rt.reps()[d.Replica]
	local := *v
	if phase == policy.PhaseDecode {
		local.MatchHost = 0 // a decode step pulls what its GPU lacks from the prefill replica
	}
	cached, pulled := cachedAt(&local, d.Pull, req.Tokens, rt.cfg.BlockSize)
	t := &Ticket{rt: rt, r: r, req: req, Decision: d, Replica: d.Replica, start: req.Now, phase: phase,
		uncached: int64(req.Tokens - cached), tokens: int64(req.Tokens + req.MaxTokens), transfer: int64(pulled)}
	if phase == policy.PhaseDecode {
		t.transfer, t.uncached = t.uncached+t.transfer, min(t.uncached, 1)
	}
	t.match = approxMatch
	t.kv = t.uncached + t.transfer + int64(max(req.MaxTokens, 0))
	r.inFlight.Add(1)
	r.inFlightTokens.Add(t.tokens)
	r.inFlightKV.Add(t.kv)
	r.pendingPrefill.Add(t.uncached)
	r.pendingCount.Add(1)
	r.pendingTransfer.Add(t.transfer)
	r.countWork(t.uncached, int64(req.Tokens), int64(max(req.MaxTokens, 0))) // saturation.go
	if !rt.cfg.ConfirmOnAccept {
		t.learn(true)
	}
	rt.programRouted(t)
	t.obs = rt.observer(d.Replica)
	t.observe(policy.Event{Kind: policy.Routed, At: req.Now, Req: req, Decision: d, Replica: d.Replica, Phase: phase})
	return t
}

// Accept records that the replica took the request (its first response
// byte, or a 2xx): the approximate index keeps its blocks, and other
// gateways hear it (idempotent; ignored once the ticket was Rejected or
// ended).
func (t *Ticket) Accept() { t.learn(true) }

// Credit records that the request is on its way to its replica: with
// ConfirmOnAccept the approximate index credits its blocks there now,
// without telling other gateways, until Accept keeps them or the ticket
// ends without it (idempotent; ignored once the ticket was Rejected or
// ended). The caller calls it once the request is sent (the gateway: once
// written to the replica's connection), off the decision's path: at 256
// replicas a 128k-token prompt's blocks take several times the decision
// to insert into a full index.
func (t *Ticket) Credit() { t.learn(false) }

// learn inserts the request's blocks into the approximate index for its
// replica (once); with accept, it marks the ticket taken and tells OnLearn
// (once). t.mu is held throughout: a Reject or Done cannot run between.
func (t *Ticket) learn(accept bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done || t.rejected {
		return
	}
	first := accept && !t.accepted // OnLearn hears it once
	t.accepted = t.accepted || accept
	if !t.learned {
		t.learned = true
		_ = t.rt.approx.Insert(t.Replica, t.req.Blocks)
		if h := t.rt.approxHost; h != nil {
			_ = h.Insert(t.Replica, t.req.Blocks) // write-through, as the connector offloads
		}
	}
	if f := t.rt.cfg.OnLearn; first && f != nil {
		f(Learned{Replica: t.Replica, Model: t.req.Model, Held: min(t.match, len(t.req.Blocks)), Blocks: t.req.Blocks, Tokens: t.req.Tokens,
			Program: t.req.Program.ID})
	}
}

// Reject records that the replica refused the request as the client's
// fault (a 4xx): if the index already learnt it, the blocks this request
// added are forgotten (those beyond the match the replica had at routing).
func (t *Ticket) Reject() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.rejected = true
	t.forget()
}

// forget removes from the approximate index the blocks the request added
// (those beyond the match its replica had at routing), if it holds them.
// t.mu held.
func (t *Ticket) forget() {
	learned := t.learned
	t.learned = false
	if learned && t.match < len(t.req.Blocks) {
		_ = t.rt.approx.Remove(t.Replica, t.req.Blocks[t.match:])
		if h := t.rt.approxHost; h != nil {
			_ = h.Remove(t.Replica, t.req.Blocks[t.match:])
		}
	}
}

// Underpredicted checks the precise index against what the replica
// reported it hit (usage.prompt_tokens_details.cached_tokens): true when
// the engine's cache held more of the prompt than the trusted precise
// index predicted by over two blocks, the mark of events that never match
// (another tokenizer, block size or model name). The replica's tallies
// (UnderpredictedShare) count every check.
func (t *Ticket) Underpredicted(cached int) bool {
	if t.predicted < 0 || cached < 0 {
		return false
	}
	r := t.r
	r.preciseChecks.Add(1)
	if cached <= t.predicted+2*t.rt.cfg.BlockSize {
		return false
	}
	r.preciseUnder.Add(1)
	return true
}

// Request is the ticket's request.
func (t *Ticket) Request() *policy.Request { return t.req }

// Policy is the name of the policy that decided: the request's pool's (the
// top-level one without pools), or the one RouteWith was given. (A policy
// that panicked is named; least load routed the request instead, and
// Config.OnPolicyPanic heard it.)
func (t *Ticket) Policy() string { return t.policy }

// FirstToken reports the first token at `at` (idempotent).
func (t *Ticket) FirstToken(at time.Time) {
	if !t.prefillDone() {
		return
	}
	t.observe(policy.Event{Kind: policy.FirstToken, At: at, Req: t.req, Decision: t.Decision,
		Replica: t.Replica, Phase: t.phase, TTFT: at.Sub(t.start)})
}

// PrefillDone ends the request's prefill in the replica's counters without
// a first-token observation: for a non-streamed response, whose first token
// the gateway never sees, once the prefill has surely run (idempotent).
func (t *Ticket) PrefillDone() { t.prefillDone() }

// UncachedTokens is the prompt the replica is expected to compute (a
// decode step: the last token).
func (t *Ticket) UncachedTokens() int { return int(t.uncached) }

// TransferTokens is the prompt a decode step is expected to pull from its
// prefill replica (0 for other tickets).
func (t *Ticket) TransferTokens() int { return int(t.transfer) }

// Phase is the step of the request the ticket is for (PhaseNone: the
// whole request).
func (t *Ticket) Phase() policy.Phase { return t.phase }

func (t *Ticket) prefillDone() bool {
	t.mu.Lock()
	if t.first || t.done {
		t.mu.Unlock()
		return false
	}
	t.first = true
	burst := t.burst
	t.mu.Unlock()
	r := t.r
	r.pendingPrefill.Add(-t.uncached)
	r.pendingCount.Add(-1)
	r.pendingTransfer.Add(-t.transfer)
	if burst {
		r.burstPending.Add(-1)
	}
	t.rt.releaseIfQueued()
	return true
}

// releaseIfQueued moves the queue, and the new programs waiting for room,
// when requests wait (cheap when none do).
func (rt *Router) releaseIfQueued() {
	for _, pl := range rt.pools {
		if pl.q.len() > 0 {
			rt.release(pl)
		}
	}
	if rt.progs.park.len() > 0 {
		rt.releaseParked()
	}
}

// Outcome is how a request ended.
type Outcome struct {
	// CachedTokens is the replica's usage.prompt_tokens_details.cached_tokens
	// (-1: not reported).
	CachedTokens int
	OutputTokens int
	Err          error
	// Health is what the request says of its replica's health, reported
	// to the breaker when Allow admitted it (HealthNeutral, the zero
	// value: nothing).
	Health Health
}

// Done ends the ticket (idempotent): the breaker hears the outcome's
// health (once: Done ends the ticket once), counters go down, observers
// hear Done.
func (t *Ticket) Done(at time.Time, o Outcome) {
	t.mu.Lock()
	if t.done {
		t.mu.Unlock()
		return
	}
	t.done = true
	if t.rt.cfg.ConfirmOnAccept && !t.accepted {
		t.forget() // credited once sent (Credit), never taken
	}
	first, burst := t.first, t.burst
	t.mu.Unlock()
	t.report(at, o.Health)
	r := t.r
	if !first {
		r.pendingPrefill.Add(-t.uncached)
		r.pendingCount.Add(-1)
		r.pendingTransfer.Add(-t.transfer)
		if burst {
			r.burstPending.Add(-1)
		}
	}
	r.inFlightTokens.Add(-t.tokens)
	r.inFlightKV.Add(-t.kv)
	r.correctWork(t, o) // saturation.go
	if r.inFlight.Add(-1) == 0 && r.removed.Load() {
		t.rt.drained(r)
	}
	if t.fq != nil {
		t.fq.mu.Lock()
		t.fq.fl.settle(t, o.OutputTokens)
		t.fq.mu.Unlock()
	}
	t.rt.programEnded(t, at)
	defer t.rt.releaseIfQueued()
	t.observe(policy.Event{Kind: policy.Done, At: at, Req: t.req, Decision: t.Decision,
		Replica: t.Replica, Phase: t.phase, CachedTokens: o.CachedTokens, OutputTokens: o.OutputTokens, Err: o.Err})
}

// keyOf is the partition a request for model is hashed under, the one its
// replicas' KV events name: an alias (vLLM --served-model-name) is its base
// model's root, as /v1/models lists it, so both names share the engine's
// cache; a LoRA adapter is its base model's partition with the adapter.
func (rt *Router) keyOf(model string) (base, adapter string) {
	m, ok := rt.ModelInfo(model)
	return rt.keyFrom(model, m, ok)
}

// keyFrom is keyOf given model's listing m (ok false: not listed).
func (rt *Router) keyFrom(model string, m Model, ok bool) (base, adapter string) {
	switch {
	case !ok:
		return model, ""
	case m.Parent != "":
		if pm, ok := rt.ModelInfo(m.Parent); ok && pm.Parent == "" && pm.Root != "" {
			return pm.Root, m.ID
		}
		return m.Parent, m.ID
	case m.Root != "":
		return m.Root, ""
	}
	return model, ""
}

// replicaKey is the partition replica i's KV events about model are
// hashed under: model as keyOf maps it, or, when the topic names none,
// the replica's base model.
func (rt *Router) replicaKey(i int, model string) (base, adapter string) {
	s := rt.reps()[i].served.Load()
	if model == "" && s != nil {
		for _, m := range s.Models {
			if m.Parent == "" {
				model = m.ID
				break
			}
		}
	}
	if model == "" {
		return rt.cfg.Model, ""
	}
	if s != nil {
		if m, ok := s.Model(model); ok && m.Parent == "" && m.Root != "" {
			return m.Root, ""
		}
	}
	return rt.keyOf(model)
}
