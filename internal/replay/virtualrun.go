package replay

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/kvevents/enginekv"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/workload"
)

// Event kinds.
const (
	evArrive    uint8 = iota // arg: request index
	evStepEnd                // arg: engine
	evScrape                 // every engine's metrics are snapshotted
	evMetrics                // the oldest pending snapshot reaches the router
	evKV                     // the oldest pending KV-event batch reaches the routers
	evPublish                // arg: gateway; its sync tick
	evHeartbeat              // arg: gateway; its heartbeat is due
	evSync                   // the oldest batch in transit reaches the other gateways
	evWake                   // arg: engine; its next transfer or hold event is due
	evExpire                 // arg: request index; its wait in the router's queue ends (flow control)
)

// ctxCheckEvery is how many events pass between two looks at ctx.
const ctxCheckEvery = 1 << 12

// liveRequest is the state of one request between its arrival and its end.
type liveRequest struct {
	ticket *router.Ticket
	gw     int // the gateway it reached
	arrive time.Duration
	first  time.Duration
	last   time.Duration // its last output token so far
	stall  time.Duration // its longest gap between two output tokens so far
	cached int
	tokens int
	hashes []uint64 // its engine block hashes (the engine keeps them while live)
	ids    []uint32 // its token ids, in precise mode (likewise)
	// Prefill/decode (pd.go): the prefill step's ticket, engine and cached
	// tokens; the decode step's ticket is ticket. stage is the step on
	// an engine.
	prefill     *router.Ticket
	prefillAt   int32
	prefillHit  int
	transferred int // prompt tokens the decode engine pulled
	stage       uint8
	// waiting is its place in the router's queue while it waits there
	// (nil otherwise); band its priority band (flow control).
	waiting *router.Waiting
	band    int
}

// snapshot is one scrape of one engine on its way to the router.
type snapshot struct {
	replica int
	metrics router.Metrics
	at      time.Duration
	pending []int // each gateway's requests to the replica without a first token at the scrape (staleness only)
}

// kvBatch is one step's KV events of one engine on their way to the router.
type kvBatch struct {
	replica int
	seq     uint64 // the engine's publisher's sequence number
	events  []engine.KVEvent
}

// replica is one simulated replica: its engine and the step it is taking.
type replica struct {
	engine   *engine.Engine
	stepping bool              // a step is in flight
	step     engine.StepResult // that step, consumed at its end
	queued   bool              // in virtualRun.wake
	// wakeAt is the time of the evWake pushed for it (a transfer ending,
	// a hold expiring), -1 when none is pending.
	wakeAt time.Duration
}

// virtualRun is one policy's run on a fresh fleet in virtual time: the
// gateways (a router each), the replicas and the event loop.
type virtualRun struct {
	cfg         Config
	plan        *plan
	gateways    []gatewayState
	replicas    []replica
	precise     bool
	kvSeq       []uint64      // per engine: its next KV batch's sequence number
	scrapeEvery time.Duration // the run's scrape period
	engineRoot  uint64        // engine-namespace root of the hash chain

	events   eventHeap
	now      time.Duration
	nextRoot int // next root arrival to schedule (index into plan.roots)
	arrived  int // requests arrived so far: the next one's turn among the gateways

	wake []int // replicas to step at now, once this instant's events are done
	// requests[i] is request i's state from its arrival to its end, nil
	// before and after: a 1M-request replay holds a pointer per request
	// and a liveRequest per request under way, recycled through spareLive.
	requests        []*liveRequest
	spareLive       []*liveRequest
	records         records         // per request, filled when it ends
	metricsInFlight fifo[snapshot]  // scrapes on their way to the router (staleness)
	kvInFlight      fifo[kvBatch]   // KV events on their way to the router (staleness)
	syncInFlight    fifo[inTransit] // batches on their way to the other gateways
	sync            syncStats       // what the gateways published
	spareHashes     [][]uint64      // recycled engine hash buffers
	kvEventErrors   int             // KV events the precise index rejected
	failures        map[string]int  // failed requests by kind
	ended           int             // requests finished or failed
	released        []released      // requests the router's queue let go, to dispatch
	pd              pdStats         // prefill/decode fleets: what the steps did
	// oracle: the run is the oracle bound's (oracle.go): each engine
	// treats the prefix the router credited as cached.
	oracle bool
	// batchLeft[b]: the requests of RL batch b not ended yet.
	batchLeft []int
}

// newVirtualRun builds cfg.Gateways routers, each with its own instance
// of spec's policy, and cfg.Replicas engines for one run of plan.
func newVirtualRun(cfg Config, p *plan, spec PolicySpec) (*virtualRun, error) {
	opt := policy.Options{Seed: cfg.Seed, BlockSize: cfg.BlockSize, Profile: cfg.Profile, MaxBatchTokens: cfg.MaxBatchTokens,
		Params: spec.Params, Pulls: cfg.Pulls, OffloadBlocks: cfg.OffloadBlocks}
	pol, err := spec.build(opt)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	vr := &virtualRun{
		cfg:         cfg,
		plan:        p,
		precise:     cfg.KVEvents.follows(pol),
		scrapeEvery: cfg.scrapeInterval(pol),
		engineRoot:  prompt.RootOf("engine", prompt.Key{Model: cfg.Model}),
		replicas:    make([]replica, cfg.engines()),
		kvSeq:       make([]uint64, cfg.engines()),
		requests:    make([]*liveRequest, len(p.reqs)),
		records:     newRecords(len(p.reqs)),
		failures:    map[string]int{},
		gateways:    make([]gatewayState, cfg.Gateways),
		batchLeft:   slices.Clone(p.batchSize),
	}
	specs := make([]router.Spec, cfg.engines())
	for i := range specs {
		specs[i] = router.Spec{URL: cfg.engineName(i), Role: policyRole(cfg.role(i))}
		vr.replicas[i].wakeAt = -1
		if vr.replicas[i].engine, err = engine.New(cfg.engineConfig(i, vr.precise)); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrConfig, err)
		}
	}
	for g := range vr.gateways {
		if g > 0 || vr.sharing() {
			// Each gateway its own instance, built as the first: gateways
			// deployed from one configuration share its options and seed,
			// but for the seed's mix with the gateway's id when they share
			// state (as the live gateway seeds its policy).
			o := opt
			if vr.sharing() {
				o.Seed = policySeed(cfg.Seed, gatewayName(g))
			}
			if pol, err = spec.build(o); err != nil {
				return nil, fmt.Errorf("%w: %w", ErrConfig, err)
			}
		}
		rc := router.Config{
			Specs:            specs,
			NonCachedTokens:  cfg.nonCachedTokens(),
			Policy:           pol,
			BlockSize:        cfg.BlockSize,
			BlocksPerReplica: cfg.KVBlocks,
			Precise:          vr.precise,
			Model:            cfg.Model,
			OffloadBlocks:    cfg.OffloadBlocks,
			Pulls:            cfg.Pulls,
			Now:              func() time.Time { return epoch.Add(vr.now) },
			Flow:             cfg.Flow,
			Programs:         cfg.Programs,
		}
		if vr.sharing() && !vr.precise {
			// In precise mode every gateway follows every replica's KV
			// events: as the live gateway, it shares only its loads.
			rc.OnLearn = vr.onLearn(g)
		}
		gw := &vr.gateways[g]
		gw.name = gatewayName(g)
		if gw.router, err = router.New(rc); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrConfig, err)
		}
		if ea, ok := pol.(engineAware); ok {
			ea.attach(vr)
			vr.oracle = true
		}
	}
	return vr, nil
}

// loop runs the simulation to its end.
func (vr *virtualRun) loop(ctx context.Context) error {
	// The first scrape precedes the first arrival: the gateway scrapes as it starts.
	vr.events.push(0, evScrape, 0)
	vr.startSync()
	vr.pushNextRoot()
	for n := 0; ; n++ {
		if n%ctxCheckEvery == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
			if vr.cfg.observe != nil {
				vr.cfg.observe(observation{})
			}
		}
		// Engines woken at this instant step once every event of the instant
		// is handled, so that simultaneous arrivals share the step.
		if len(vr.wake) > 0 && (vr.events.len() == 0 || vr.events.top().at > vr.now) {
			if err := vr.stepWoken(); err != nil {
				return err
			}
			continue
		}
		if vr.events.len() == 0 {
			return nil
		}
		ev := vr.events.pop()
		if vr.afterLast(ev) {
			continue
		}
		vr.now = ev.at
		if err := vr.handle(ev); err != nil {
			return err
		}
		if err := vr.dispatchReleased(); err != nil {
			return err
		}
	}
}

// handle handles one event.
func (vr *virtualRun) handle(ev event) error {
	switch ev.kind {
	case evArrive:
		return vr.arrive(int(ev.arg))
	case evStepEnd:
		return vr.stepEnd(int(ev.arg))
	case evScrape:
		vr.scrape()
	case evMetrics:
		vr.setMetrics(vr.metricsInFlight.pop())
	case evKV:
		b := vr.kvInFlight.pop()
		vr.deliverKV(b)
	case evPublish:
		vr.publishTick(int(ev.arg))
	case evHeartbeat:
		vr.heartbeat(int(ev.arg))
	case evSync:
		vr.deliverSync()
	case evWake:
		vr.woken(int(ev.arg), ev.at)
	case evExpire:
		vr.expire(int(ev.arg))
	}
	return nil
}

func (vr *virtualRun) pushNextRoot() {
	if vr.nextRoot >= len(vr.plan.roots) {
		return
	}
	i := vr.plan.roots[vr.nextRoot]
	vr.nextRoot++
	vr.events.push(scale(vr.plan.reqs[i].At, vr.cfg.Speedup), evArrive, i)
}

// arrive routes request i through the next gateway and hands it to its
// engine, or leaves it waiting in that gateway's router queue (a policy
// that defers: late binding).
func (vr *virtualRun) arrive(i int) error {
	r := &vr.plan.reqs[i]
	if r.Prev < 0 && !gated(r) {
		vr.pushNextRoot()
	}
	text := r.Text()
	p := parsed(r, text, vr.cfg.Model)
	st := vr.begin(i)
	st.gw = vr.gatewayOf(vr.arrived)
	vr.arrived++
	rt := vr.gateways[st.gw].router
	preq := rt.Prepare(&p, r.Session, "")
	st.arrive, st.tokens = vr.now, preq.Tokens
	vr.flowTags(preq, r, st)
	if vr.cfg.disaggregated() {
		// A pair goes through the flow controller's queue as the
		// gateway's does (router.SubmitPD: RoutePD without flow control).
		pd, w, err := rt.SubmitPD(preq)
		if w != nil {
			vr.wait(i, st, w, text, true)
			return nil
		}
		return vr.dispatchPD(i, text, pd, err)
	}
	tk, w, err := rt.Submit(preq)
	if w != nil {
		vr.wait(i, st, w, text, false)
		return nil
	}
	return vr.dispatch(i, text, tk, err)
}

// wait leaves request i waiting in its router's queue (w): routed later,
// inside a ticket event of this loop, and dispatched once that event is
// handled (a pair's two steps when pair); shed at its expiry.
func (vr *virtualRun) wait(i int, st *liveRequest, w *router.Waiting, text string, pair bool) {
	st.waiting = w
	w.OnRouted = func(tk *router.Ticket, err error) {
		st.waiting = nil
		r := released{req: i, text: text, ticket: tk, err: err}
		if pair {
			pd, perr := w.PD()
			r.pd, r.err = &pd, perr
		}
		vr.released = append(vr.released, r)
	}
	if exp := w.Expires(); !exp.IsZero() {
		vr.events.push(exp.Sub(epoch), evExpire, int32(i))
	}
}

// flowTags gives a request its tenant, band and deadline (flow control),
// as the gateway gives them: the band is the request's priority clamped
// to its tenant's range.
func (vr *virtualRun) flowTags(preq *policy.Request, r *workload.Request, st *liveRequest) {
	if !vr.cfg.Flow.Enabled {
		return
	}
	preq.Tenant = r.Tenant
	preq.Priority = vr.cfg.Flow.BandOf(r.Tenant, r.Priority, true)
	if r.Deadline > 0 {
		preq.Deadline = preq.Now.Add(r.Deadline)
	}
	st.band = preq.Priority
}

// expire ends request i's wait in its router's queue at its expiry, if it
// still waits there: it is shed.
func (vr *virtualRun) expire(i int) {
	st := vr.requests[i]
	if st == nil || st.waiting == nil { // routed since, or ended
		return
	}
	w := st.waiting
	st.waiting = nil
	if err := vr.gateways[st.gw].router.Expire(w); err != nil {
		vr.shed(i, err)
	}
}

// shed records request i as refused by flow control (a *router.ShedError).
func (vr *virtualRun) shed(i int, err error) {
	var se *router.ShedError
	if !errors.As(err, &se) {
		se = &router.ShedError{Reason: "unknown"}
	}
	vr.fail(i, -1, "shed_"+se.Reason)
}

// released is a request the router's queue let go.
type released struct {
	req    int
	text   string
	ticket *router.Ticket
	pd     *router.PD // a prefill/decode pair's (nil: one ticket)
	err    error
}

// dispatchReleased hands the requests the router's queue let go to their
// engines, in the order they left it.
func (vr *virtualRun) dispatchReleased() error {
	for len(vr.released) > 0 {
		r := vr.released[0]
		vr.released = vr.released[1:]
		var err error
		if r.pd != nil {
			err = vr.dispatchPD(r.req, r.text, *r.pd, r.err)
		} else {
			err = vr.dispatch(r.req, r.text, r.ticket, r.err)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// dispatch hands routed request i to its engine (or records why it could
// not be routed).
func (vr *virtualRun) dispatch(i int, text string, tk *router.Ticket, err error) error {
	if err != nil {
		return vr.unrouted(i, err)
	}
	st := vr.requests[i]
	st.ticket = tk
	vr.loadsChanged(st.gw)
	er := vr.engineRequest(i, text)
	if vr.oracle {
		er.AssumedCached = tk.Decision.Matched * vr.cfg.BlockSize
	}
	if p := tk.Decision.Pull; p != nil && p.Replica >= 0 && p.Replica < len(vr.replicas) {
		// The engine asks its peer what it holds as the request comes, as
		// the sim's side channel does; a peer that evicted it since makes
		// the request compute (tiers.go in the engine).
		er.PullBlocks = vr.replicas[p.Replica].engine.Servable(er.BlockHashes)
	}
	return vr.submit(i, tk.Replica, &er)
}

// unrouted records why request i could not be routed.
func (vr *virtualRun) unrouted(i int, err error) error {
	if errors.Is(err, router.ErrShed) {
		vr.shed(i, err)
		return nil
	}
	if !errors.Is(err, policy.ErrNoReplica) {
		return fmt.Errorf("replay: request %d: %w", i, err)
	}
	vr.fail(i, -1, "no_replica")
	return nil
}

// engineRequest is request i as its engine gets it: its prompt's block
// hashes in the engine's namespace (kept in st.hashes).
func (vr *virtualRun) engineRequest(i int, text string) engine.Request {
	st := vr.requests[i]
	er := engine.Request{
		ID:           uint64(i) + 1,
		PromptTokens: st.tokens,
		MaxTokens:    max(vr.plan.reqs[i].MaxTokens, 1),
		Priority:     st.band,
	}
	er.BlockHashes = prompt.ApproxBlockHashes(vr.hashBuf(), vr.engineRoot, text, vr.cfg.BlockSize)
	if vr.precise {
		// KV events carry token ids; the precise index rehashes them.
		er.TokenIDs = prompt.Approx{}.Encode(make([]uint32, 0, st.tokens), text)
	}
	st.hashes, st.ids = er.BlockHashes, er.TokenIDs
	return er
}

// submit adds request i's step er to engine e. A prompt that can never fit
// the engine fails the request: its tickets end with the error.
func (vr *virtualRun) submit(i, e int, er *engine.Request) error {
	st := vr.requests[i]
	if err := vr.replicas[e].engine.Add(er, vr.now); err != nil {
		if !errors.Is(err, engine.ErrTooLong) {
			return fmt.Errorf("replay: request %d: %w", i, err)
		}
		at := epoch.Add(vr.now)
		if st.prefill != nil {
			st.prefill.Done(at, router.Outcome{CachedTokens: -1, Err: err})
			st.ticket.Reject()
		}
		st.ticket.Done(at, router.Outcome{CachedTokens: -1, Err: err})
		vr.loadsChanged(st.gw)
		vr.fail(i, e, "too_long")
		return nil
	}
	if !vr.replicas[e].stepping {
		vr.queueStep(e)
	}
	return nil
}

// fail records request i as failed at now and releases its dependants.
func (vr *virtualRun) fail(i, replica int, kind string) {
	st := vr.requests[i]
	vr.records.set(i, &report.Record{Start: st.arrive, PromptTokens: st.tokens, Replica: replica, Err: true, ErrKind: kind,
		Priority: st.band})
	vr.failures[kind]++
	vr.release(i)
	vr.finished(i)
}

func (vr *virtualRun) hashBuf() []uint64 {
	if n := len(vr.spareHashes); n > 0 {
		b := vr.spareHashes[n-1]
		vr.spareHashes = vr.spareHashes[:n-1]
		return b[:0]
	}
	return nil
}

// begin is request i's state as it arrives: a recycled one, or new.
func (vr *virtualRun) begin(i int) *liveRequest {
	var st *liveRequest
	if n := len(vr.spareLive); n > 0 {
		st = vr.spareLive[n-1]
		vr.spareLive = vr.spareLive[:n-1]
	} else {
		st = new(liveRequest)
	}
	vr.requests[i] = st
	return st
}

// release ends request i's state, for reuse; its hash buffer is recycled
// unless KV events (which point into it) may still be in flight.
func (vr *virtualRun) release(i int) {
	st := vr.requests[i]
	if !vr.precise && st.hashes != nil {
		vr.spareHashes = append(vr.spareHashes, st.hashes)
	}
	*st = liveRequest{}
	vr.requests[i] = nil
	vr.spareLive = append(vr.spareLive, st)
}

// finished schedules the requests that waited for request i: its
// dependants, and, when it was the last of its batch to end, the next
// batch.
func (vr *virtualRun) finished(i int) {
	vr.ended++
	next := vr.plan.kidsOf(i)
	if b := vr.plan.reqs[i].Batch; b > 0 {
		if vr.batchLeft[b]--; vr.batchLeft[b] == 0 && b < len(vr.plan.batchNext) {
			next = append(slices.Clip(next), vr.plan.batchNext[b]...)
		}
	}
	for _, k := range next {
		r := &vr.plan.reqs[k]
		at := max(scale(r.At, vr.cfg.Speedup), vr.now+scale(r.Think, vr.cfg.Speedup))
		vr.events.push(at, evArrive, k)
	}
}

// queueStep has replica e step at now, once this instant's events are done.
func (vr *virtualRun) queueStep(e int) {
	if rep := &vr.replicas[e]; !rep.queued {
		rep.queued = true
		vr.wake = append(vr.wake, e)
	}
}

// stepWoken starts a step on every engine woken at now. A step that
// computes nothing (a prefill/decode engine whose transfers are under
// way) ends at once: its transfers and KV events are handled, and the
// engine is woken again at its next event.
func (vr *virtualRun) stepWoken() error {
	var pulls []engine.Pull
	for _, e := range vr.wake {
		rep := &vr.replicas[e]
		rep.queued = false
		if rep.stepping || !vr.due(e) {
			continue
		}
		res := rep.engine.Step(vr.now)
		pulls = append(pulls, res.Pulls...)
		vr.pd.expired += len(res.Expired)
		if res.Seqs > 0 {
			rep.step, rep.stepping = res, true
			vr.events.push(res.End, evStepEnd, int32(e))
			continue
		}
		vr.publishKV(e, res.KV)
		if _, ok := rep.engine.NextEvent(); !ok && rep.engine.HasWork() {
			return fmt.Errorf("%w: replica %d at %v", ErrStalled, e, vr.now)
		}
		vr.wakeLater(e)
	}
	vr.wake = vr.wake[:0]
	// After the loop: a pull releases its prefill engine's blocks, which
	// may wake that engine (into vr.wake).
	vr.pulled(pulls)
	return nil
}

// due reports whether engine e has something to do at now: work, or a
// transfer or hold event.
func (vr *virtualRun) due(e int) bool {
	eng := vr.replicas[e].engine
	if eng.HasWork() {
		return true
	}
	at, ok := eng.NextEvent()
	return ok && at <= vr.now
}

// wakeLater has idle engine e woken at its next event, if it has one.
func (vr *virtualRun) wakeLater(e int) {
	rep := &vr.replicas[e]
	at, ok := rep.engine.NextEvent()
	if !ok || (rep.wakeAt >= 0 && rep.wakeAt <= at) {
		return
	}
	rep.wakeAt = max(at, vr.now)
	vr.events.push(rep.wakeAt, evWake, int32(e))
}

// woken handles engine e's evWake of time at.
func (vr *virtualRun) woken(e int, at time.Duration) {
	rep := &vr.replicas[e]
	if rep.wakeAt == at {
		rep.wakeAt = -1
	}
	if !rep.stepping {
		vr.queueStep(e)
	}
}

// stepEnd makes engine e's step visible: first tokens, finished requests,
// KV events; the engine is woken again if it has work, or at its next
// event.
func (vr *virtualRun) stepEnd(e int) error {
	rep := &vr.replicas[e]
	res := &rep.step
	at := epoch.Add(vr.now)
	for _, o := range res.Outputs {
		i := int(o.ReqID - 1)
		if vr.requests[i].stage == stagePrefill {
			if err := vr.prefillOutput(i, o, at); err != nil {
				return fmt.Errorf("replay: request %d: %w", i, err)
			}
			continue
		}
		vr.output(i, e, o, at)
	}
	vr.publishKV(e, res.KV)
	*res = engine.StepResult{}
	rep.stepping = false
	if rep.engine.HasWork() {
		vr.queueStep(e)
	} else {
		vr.wakeLater(e)
	}
	return nil
}

// output is one engine output of request i's (only or decode) step.
func (vr *virtualRun) output(i, e int, o engine.Output, at time.Time) {
	st := vr.requests[i]
	if o.First {
		st.first, st.cached = vr.now, o.CachedTokens
		st.ticket.FirstToken(at)
		vr.loadsChanged(st.gw)
	} else {
		st.stall = max(st.stall, vr.now-st.last)
	}
	st.last = vr.now
	if !o.Finished {
		return
	}
	out := max(vr.plan.reqs[i].MaxTokens, 1)
	st.ticket.Done(at, router.Outcome{CachedTokens: st.cached, OutputTokens: out})
	vr.loadsChanged(st.gw)
	vr.records.set(i, &report.Record{
		Start: st.arrive, TTFT: st.first - st.arrive, E2E: vr.now - st.arrive,
		PromptTokens: st.tokens, CachedTokens: vr.computedHit(st), OutputTokens: out, Replica: e, MaxITL: st.stall,
		Priority: st.band,
	})
	vr.release(i)
	vr.finished(i)
}

// publishKV sends engine e's KV events on to the routers (in precise mode).
func (vr *virtualRun) publishKV(e int, kv []engine.KVEvent) {
	if !vr.precise || len(kv) == 0 {
		return
	}
	b := kvBatch{replica: e, seq: vr.kvSeq[e], events: kv}
	vr.kvSeq[e]++
	if vr.cfg.Staleness == 0 {
		vr.deliverKV(b)
		return
	}
	vr.kvInFlight.push(b)
	vr.events.push(vr.now+vr.cfg.Staleness, evKV, 0)
}

// scrape snapshots every engine's gauges, as the gateway's scraper reads
// /metrics, and sends them on to the router Staleness later.
func (vr *virtualRun) scrape() {
	for e := range vr.replicas {
		st := vr.replicas[e].engine.Stats()
		sn := snapshot{replica: e, at: vr.now, metrics: router.Metrics{
			Waiting: st.Waiting, Running: st.Running, KVUsage: st.KVUsage,
			NumBlocks: st.NumBlocks, BlockSize: st.BlockSize,
		}}
		if vr.cfg.observe != nil {
			vr.cfg.observe(observation{scrape: &sn})
		}
		if vr.cfg.Staleness == 0 {
			vr.setMetrics(sn)
			continue
		}
		sn.pending = make([]int, len(vr.gateways))
		for g := range vr.gateways {
			sn.pending[g] = int(vr.gateways[g].router.LocalLoad(e).PendingCount)
		}
		vr.metricsInFlight.push(sn)
		vr.events.push(vr.now+vr.cfg.Staleness, evMetrics, 0)
	}
	// Keep scraping while requests remain (deliveries in flight do not
	// count: they would keep the scrapes, and so themselves, going forever).
	if vr.ended < len(vr.plan.reqs) {
		vr.events.push(vr.now+vr.scrapeEvery, evScrape, 0)
	}
}

// setMetrics hands one scrape to every gateway: each scrapes every replica.
func (vr *virtualRun) setMetrics(sn snapshot) {
	for g := range vr.gateways {
		rt := vr.gateways[g].router
		if sn.pending == nil {
			rt.SetMetrics(sn.replica, sn.metrics, epoch.Add(sn.at))
			continue
		}
		rt.SetMetricsSeen(sn.replica, sn.metrics, epoch.Add(sn.at), sn.pending[g])
	}
}

// deliverKV hands one engine's KV-event batch to every gateway's
// follower, numbered as its publisher would number it: the gateway's
// rules, the gateway's code. Every gateway subscribes to every replica.
func (vr *virtualRun) deliverKV(b kvBatch) {
	if vr.cfg.observe != nil {
		drop := false
		if vr.cfg.observe(observation{kv: &b, at: vr.now, drop: &drop}); drop {
			return
		}
	}
	for g := range vr.gateways {
		m := router.KVMessage{Seq: b.seq, Model: vr.cfg.Model, Events: enginekv.Events(b.events)}
		rep := vr.gateways[g].router.FollowKV(b.replica, m, epoch.Add(vr.now), nil)
		vr.kvEventErrors += len(rep.Drops)
	}
}

// summary is the run's report entry.
func (vr *virtualRun) summary(label string) report.Run {
	run := report.Summarize(label, vr.reportRecords(), vr.cfg.answering(), 0)
	extra := map[string]float64{}
	var pre, evicted int64
	for _, rep := range vr.replicas {
		st := rep.engine.Stats()
		pre += st.Preemptions
		evicted += st.EvictedBlocks
	}
	extra["preemptions"] = float64(pre)
	extra["evicted_blocks"] = float64(evicted)
	vr.tierSummary(extra)
	extra["virtual_s"] = vr.now.Seconds()
	for k, n := range vr.failures {
		extra["errors_"+k] = float64(n)
	}
	if vr.kvEventErrors > 0 {
		extra["kv_event_errors"] = float64(vr.kvEventErrors)
	}
	vr.syncSummary(extra)
	vr.pdSummary(extra)
	run.Extra = extra
	return run
}
