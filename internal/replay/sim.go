package replay

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/router"
)

// Event kinds.
const (
	evArrive  uint8 = iota // arg: request index
	evStepEnd              // arg: engine
	evScrape               // every engine's metrics are snapshotted
	evMetrics              // the oldest pending snapshot reaches the router
	evKV                   // the oldest pending KV-event batch reaches the router
)

// ctxCheckEvery is how many events pass between two looks at ctx.
const ctxCheckEvery = 1 << 12

// live is the state of one request between its arrival and its end.
type live struct {
	ticket *router.Ticket
	arrive time.Duration
	first  time.Duration
	cached int
	tokens int
	hashes []uint64 // its engine block hashes (the engine keeps them while live)
}

// snapshot is one scrape of one engine on its way to the router.
type snapshot struct {
	replica int
	m       router.Metrics
	at      time.Duration
}

// kvBatch is one step's KV events of one engine on their way to the router.
type kvBatch struct {
	replica int
	events  []engine.KVEvent
}

// sim is one run: a router, its engines and the event loop.
type sim struct {
	cfg     Config
	pl      *plan
	rt      *router.Router
	engines []*engine.Engine
	precise bool
	root    uint64 // engine-namespace root of the hash chain

	h    eventHeap
	now  time.Duration
	next int // next root arrival to schedule (index into pl.roots)

	busy  []bool              // engine has a step in flight
	steps []engine.StepResult // that step, consumed at its end
	wake  []int               // engines to step at now, once this instant's events are done
	woken []bool              // engine is in wake
	reqs  []live              // per request
	recs  []report.Record     // per request, filled when it ends
	mq    fifo[snapshot]      // scrapes in flight (staleness)
	kq    fifo[kvBatch]       // KV events in flight (staleness)
	spare [][]uint64          // recycled engine hash buffers
	kvErr int                 // KV events the precise index rejected
	errs  map[string]int      // failed requests by kind
	ended int                 // requests finished or failed
}

func newSim(cfg Config, pl *plan, spec PolicySpec) (*sim, error) {
	opt := policy.Options{
		Seed:           cfg.Seed,
		BlockSize:      cfg.BlockSize,
		Profile:        cfg.Profile,
		MaxBatchTokens: cfg.MaxBatchTokens,
		Params:         spec.Params,
	}
	var pol policy.Policy
	var err error
	if spec.New != nil {
		pol, err = spec.New(opt)
	} else {
		pol, err = policy.New(spec.Name, opt)
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	s := &sim{
		cfg:     cfg,
		pl:      pl,
		precise: spec.Name == "precise",
		root:    prompt.RootOf("engine", prompt.Key{Model: cfg.Model}),
		busy:    make([]bool, cfg.Replicas),
		steps:   make([]engine.StepResult, cfg.Replicas),
		woken:   make([]bool, cfg.Replicas),
		reqs:    make([]live, len(pl.reqs)),
		recs:    make([]report.Record, len(pl.reqs)),
		errs:    map[string]int{},
	}
	names := make([]string, cfg.Replicas)
	for i := range names {
		names[i] = fmt.Sprintf("replica-%d", i)
		e, err := engine.New(cfg.engineConfig(i, s.precise))
		if err != nil {
			return nil, fmt.Errorf("%w: %w", ErrConfig, err)
		}
		s.engines = append(s.engines, e)
	}
	s.rt, err = router.New(router.Config{
		Replicas:         names,
		Policy:           pol,
		BlockSize:        cfg.BlockSize,
		BlocksPerReplica: cfg.KVBlocks,
		Precise:          s.precise,
		Model:            cfg.Model,
		Now:              func() time.Time { return epoch.Add(s.now) },
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	return s, nil
}

// loop runs the simulation to its end.
func (s *sim) loop(ctx context.Context) error {
	// The first scrape precedes the first arrival: the gateway scrapes as it starts.
	s.h.push(0, evScrape, 0)
	s.pushNextRoot()
	for n := 0; ; n++ {
		if n%ctxCheckEvery == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
			if s.cfg.observe != nil {
				s.cfg.observe(observation{})
			}
		}
		// Engines woken at this instant step once every event of the instant
		// is handled, so that simultaneous arrivals share the step.
		if len(s.wake) > 0 && (s.h.len() == 0 || s.h.top().at > s.now) {
			if err := s.stepWoken(); err != nil {
				return err
			}
			continue
		}
		if s.h.len() == 0 {
			return nil
		}
		ev := s.h.pop()
		s.now = ev.at
		switch ev.kind {
		case evArrive:
			if err := s.arrive(int(ev.arg)); err != nil {
				return err
			}
		case evStepEnd:
			s.stepEnd(int(ev.arg))
		case evScrape:
			s.scrape()
		case evMetrics:
			sn := s.mq.pop()
			s.rt.SetMetrics(sn.replica, sn.m, epoch.Add(sn.at))
		case evKV:
			b := s.kq.pop()
			s.deliverKV(b)
		}
	}
}

func (s *sim) pushNextRoot() {
	if s.next >= len(s.pl.roots) {
		return
	}
	i := s.pl.roots[s.next]
	s.next++
	s.h.push(scale(s.pl.reqs[i].At, s.cfg.Speedup), evArrive, i)
}

// arrive routes request i and hands it to its engine.
func (s *sim) arrive(i int) error {
	r := &s.pl.reqs[i]
	if r.Prev < 0 {
		s.pushNextRoot()
	}
	text := r.Text()
	p := parsed(r, text, s.cfg.Model)
	preq := s.rt.Prepare(&p, r.Session, "")
	st := &s.reqs[i]
	st.arrive, st.tokens = s.now, preq.Tokens
	tk, err := s.rt.Route(preq)
	if err != nil {
		if !errors.Is(err, policy.ErrNoReplica) {
			return fmt.Errorf("replay: request %d: %w", i, err)
		}
		s.fail(i, -1, "no_replica")
		return nil
	}
	st.ticket = tk
	er := engine.Request{
		ID:           uint64(i) + 1,
		PromptTokens: preq.Tokens,
		MaxTokens:    max(r.MaxTokens, 1),
	}
	er.BlockHashes = prompt.ApproxBlockHashes(s.hashBuf(), s.root, text, s.cfg.BlockSize)
	if s.precise {
		// KV events carry token ids; the precise index rehashes them.
		er.TokenIDs = prompt.Approx{}.Encode(make([]uint32, 0, preq.Tokens), text)
	}
	st.hashes = er.BlockHashes
	e := tk.Replica
	if err := s.engines[e].Add(&er, s.now); err != nil {
		if !errors.Is(err, engine.ErrTooLong) {
			return fmt.Errorf("replay: request %d: %w", i, err)
		}
		tk.Done(epoch.Add(s.now), router.Outcome{CachedTokens: -1, Err: err})
		s.fail(i, e, "too_long")
		return nil
	}
	if !s.busy[e] && !s.woken[e] {
		s.woken[e] = true
		s.wake = append(s.wake, e)
	}
	return nil
}

// fail records request i as failed at now and releases its dependants.
func (s *sim) fail(i, replica int, kind string) {
	st := &s.reqs[i]
	s.recs[i] = report.Record{Start: st.arrive, PromptTokens: st.tokens, Replica: replica, Err: true, ErrKind: kind}
	s.errs[kind]++
	s.release(st)
	s.finished(i)
}

func (s *sim) hashBuf() []uint64 {
	if n := len(s.spare); n > 0 {
		b := s.spare[n-1]
		s.spare = s.spare[:n-1]
		return b[:0]
	}
	return nil
}

// release drops a request's references; its hash buffer is recycled unless
// KV events (which point into it) may still be in flight.
func (s *sim) release(st *live) {
	if !s.precise && st.hashes != nil {
		s.spare = append(s.spare, st.hashes)
	}
	st.hashes, st.ticket = nil, nil
}

// finished schedules the requests that waited for request i.
func (s *sim) finished(i int) {
	s.ended++
	for _, k := range s.pl.kids[i] {
		r := &s.pl.reqs[k]
		at := max(scale(r.At, s.cfg.Speedup), s.now+scale(r.Think, s.cfg.Speedup))
		s.h.push(at, evArrive, k)
	}
}

// stepWoken starts a step on every engine woken at now.
func (s *sim) stepWoken() error {
	for _, e := range s.wake {
		s.woken[e] = false
		if s.busy[e] || !s.engines[e].HasWork() {
			continue
		}
		res := s.engines[e].Step(s.now)
		if res.Seqs == 0 {
			return fmt.Errorf("%w: replica %d at %v", ErrStalled, e, s.now)
		}
		s.steps[e] = res
		s.busy[e] = true
		s.h.push(res.End, evStepEnd, int32(e))
	}
	s.wake = s.wake[:0]
	return nil
}

// stepEnd makes engine e's step visible: first tokens, finished requests,
// KV events; the engine is woken again if it has work.
func (s *sim) stepEnd(e int) {
	res := &s.steps[e]
	at := epoch.Add(s.now)
	for _, o := range res.Outputs {
		i := int(o.ReqID - 1)
		st := &s.reqs[i]
		if o.First {
			st.first, st.cached = s.now, o.CachedTokens
			st.ticket.FirstToken(at)
		}
		if o.Finished {
			out := max(s.pl.reqs[i].MaxTokens, 1)
			st.ticket.Done(at, router.Outcome{CachedTokens: st.cached, OutputTokens: out})
			s.recs[i] = report.Record{
				Start: st.arrive, TTFT: st.first - st.arrive, E2E: s.now - st.arrive,
				PromptTokens: st.tokens, CachedTokens: st.cached, OutputTokens: out, Replica: e,
			}
			s.release(st)
			s.finished(i)
		}
	}
	if s.precise && len(res.KV) > 0 {
		b := kvBatch{replica: e, events: res.KV}
		if s.cfg.Staleness == 0 {
			s.deliverKV(b)
		} else {
			s.kq.push(b)
			s.h.push(s.now+s.cfg.Staleness, evKV, 0)
		}
	}
	*res = engine.StepResult{}
	s.busy[e] = false
	if s.engines[e].HasWork() && !s.woken[e] {
		s.woken[e] = true
		s.wake = append(s.wake, e)
	}
}

// scrape snapshots every engine's gauges, as the gateway's scraper reads
// /metrics, and sends them on to the router Staleness later.
func (s *sim) scrape() {
	for e, eng := range s.engines {
		st := eng.Stats()
		sn := snapshot{replica: e, at: s.now, m: router.Metrics{
			Waiting: st.Waiting, Running: st.Running, KVUsage: st.KVUsage,
			NumBlocks: st.NumBlocks, BlockSize: st.BlockSize,
		}}
		if s.cfg.observe != nil {
			s.cfg.observe(observation{scrape: &sn})
		}
		if s.cfg.Staleness == 0 {
			s.rt.SetMetrics(e, sn.m, epoch.Add(sn.at))
			continue
		}
		s.mq.push(sn)
		s.h.push(s.now+s.cfg.Staleness, evMetrics, 0)
	}
	// Keep scraping while requests remain (deliveries in flight do not
	// count: they would keep the scrapes, and so themselves, going forever).
	if s.ended < len(s.pl.reqs) {
		s.h.push(s.now+s.cfg.ScrapeInterval, evScrape, 0)
	}
}

// deliverKV feeds one engine's KV events to the precise index, in order, as
// the gateway's subscriber does.
func (s *sim) deliverKV(b kvBatch) {
	px := s.rt.Precise()
	for _, ev := range b.events {
		var err error
		switch ev.Kind {
		case engine.Stored:
			var parent *uint64
			if ev.HasParent {
				p := ev.ParentHash
				parent = &p
			}
			err = px.Stored(b.replica, s.cfg.Model, ev.BlockHashes, parent, ev.TokenIDs, ev.BlockSize, ev.LoraName)
		case engine.Removed:
			err = px.Removed(b.replica, ev.BlockHashes)
		case engine.Cleared:
			err = px.Cleared(b.replica)
		}
		if err != nil {
			// A stream the index cannot follow: resync from scratch, as the
			// gateway does after a sequence gap; the approximate index
			// answers until the next event.
			s.kvErr++
			_ = px.Cleared(b.replica)
			s.rt.SetPreciseSynced(b.replica, false)
			continue
		}
		s.rt.SetPreciseSynced(b.replica, true)
	}
}

// summary is the run's report entry.
func (s *sim) summary(label string) report.Run {
	run := report.Summarize(label, s.recs, s.cfg.Replicas, 0)
	extra := map[string]float64{}
	var pre, evicted int64
	for _, e := range s.engines {
		st := e.Stats()
		pre += st.Preemptions
		evicted += st.EvictedBlocks
	}
	extra["preemptions"] = float64(pre)
	extra["evicted_blocks"] = float64(evicted)
	extra["virtual_s"] = s.now.Seconds()
	for k, n := range s.errs {
		extra["errors_"+k] = float64(n)
	}
	if s.kvErr > 0 {
		extra["kv_event_errors"] = float64(s.kvErr)
	}
	run.Extra = extra
	return run
}
