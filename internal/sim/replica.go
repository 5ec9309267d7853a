package sim

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/kvevents"
)

// Replica is one simulated vLLM server: an engine, the driver goroutine that
// steps it in (scaled) wall time, an HTTP server, a Prometheus registry and
// optionally a KV-event publisher.
type Replica struct {
	idx    int
	cfg    Config // the fleet's with this replica's override, defaults filled
	faults Faults
	clock  clock.Clock
	start  time.Time // wall time of virtual time 0
	scale  float64

	// mu serialises every engine call and guards live and nextID.
	mu     sync.Mutex
	eng    *engine.Engine
	live   map[uint64]*choice // engine request id → its choice, until finished or aborted
	nextID uint64

	wake    chan struct{} // cap 1: work was added or freed
	idle    bool          // the driver found no work and waits (guarded by mu)
	wokeAt  time.Duration // while idle: arrival of the first request since (guarded by mu)
	planEnd time.Duration // end of the last planned step (guarded by mu)
	maxLag  time.Duration // Config.MaxLag in virtual time

	metrics *metrics
	pub     kvevents.Publisher // nil without KV events
	kvAddr  string             // tcp://host:port of pub
	topic   string

	url     string
	addr    string // host:port
	srv     *http.Server
	handler http.Handler
	reopen  chan net.Listener // the listener after an outage, for serve

	// lnMu guards ln and the changes of down: an outage (a refuse window
	// or a crash) closes ln, and the listener it opens again replaces it.
	lnMu sync.Mutex
	ln   net.Listener
	down atomic.Bool // off the network: new connections are cut at once

	connMu sync.Mutex
	conns  map[net.Conn]struct{}

	frng   *rand.Rand // fault draws, guarded by frngMu
	frngMu sync.Mutex
	served atomic.Int64 // inference requests received (for FailAfter)
	failed atomic.Bool
	calls  atomic.Uint64 // response id counter

	gate gate
	done chan struct{} // closed when the replica stops
	wg   sync.WaitGroup
}

// choice is one output sequence of a call: one engine request.
type choice struct {
	call    *call
	index   int
	id      uint64
	arrival time.Duration // virtual time of Add
	length  int           // tokens to generate
	reason  string        // finish_reason when it has generated length tokens
	gen     outputGen

	// Guarded by call.mu; written by the driver, read by the handler.
	pending  int // tokens delivered and not yet taken by the handler
	total    int // tokens delivered
	cached   int // prefix-cache hit, set with the first token
	finished bool
}

// call is one HTTP inference request and its choices. The driver never
// blocks on it: it adds delivered tokens to each choice's pending count
// (coalescing when the handler is slow) and pokes notify, whose capacity of
// one means a wake-up is never lost and never queued twice.
type call struct {
	mu      sync.Mutex
	notify  chan struct{}
	stream  bool
	choices []*choice
	left    int // choices not finished, driver-owned under Replica.mu
}

// URL is the replica's base URL, e.g. http://127.0.0.1:8000.
func (r *Replica) URL() string { return r.url }

// Index is the replica's position in its fleet.
func (r *Replica) Index() int { return r.idx }

// KVEndpoint is the ZMQ endpoint of its KV-event publisher ("" without).
func (r *Replica) KVEndpoint() string { return r.kvAddr }

// KVTopic is the topic its KV events are published under ("" without).
func (r *Replica) KVTopic() string { return r.topic }

// Registry is the replica's Prometheus registry, served at /metrics.
func (r *Replica) Registry() *prometheus.Registry { return r.metrics.reg }

// Handler is the replica's HTTP API, usable without its listener.
func (r *Replica) Handler() http.Handler { return r.handler }

// Config is the replica's configuration: the fleet's with its PerReplica
// override applied.
func (r *Replica) Config() Config { return r.cfg }

// Stats is a snapshot of the replica's engine.
func (r *Replica) Stats() engine.Stats { return r.stats() }

// newEngine is replica idx's engine model.
func newEngine(cfg Config, idx int) (*engine.Engine, error) {
	prof, err := costmodel.Lookup(cfg.Profile)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	eng, err := engine.New(engine.Config{
		Profile:         prof,
		NumBlocks:       cfg.KVBlocks,
		BlockSize:       cfg.BlockSize,
		MaxBatchTokens:  cfg.MaxBatchTokens,
		MaxSeqs:         cfg.MaxSeqs,
		Seed:            cfg.Seed + uint64(idx),
		Jitter:          cfg.Jitter,
		DisableKVEvents: !cfg.KVEvents,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return eng, nil
}

// newReplica builds replica idx on ln with its own configuration (the
// fleet's with its override).
func newReplica(ctx context.Context, cfg Config, idx int, ln net.Listener) (*Replica, error) {
	eng, err := newEngine(cfg, idx)
	if err != nil {
		return nil, err
	}
	r := &Replica{
		idx:    idx,
		cfg:    cfg,
		faults: cfg.faultsFor(idx),
		clock:  cfg.Clock,
		scale:  cfg.TimeScale,
		maxLag: time.Duration(float64(cfg.MaxLag) * cfg.TimeScale),
		idle:   true,
		eng:    eng,
		live:   make(map[uint64]*choice),
		wake:   make(chan struct{}, 1),
		addr:   ln.Addr().String(),
		ln:     ln,
		reopen: make(chan net.Listener, 1),
		conns:  make(map[net.Conn]struct{}),
		frng:   rand.New(rand.NewPCG(cfg.Seed, 0xfa17_0000+uint64(idx))),
		done:   make(chan struct{}),
	}
	r.gate.init()
	r.url = "http://" + r.addr
	r.metrics = newMetrics(r)
	if cfg.KVEvents {
		if err := r.startKVEvents(ctx); err != nil {
			return nil, err
		}
	}
	r.handler = r.routes()
	r.srv = &http.Server{
		Handler:           r.handler,
		ReadHeaderTimeout: 10 * time.Second,
		ConnState:         r.trackConn,
	}
	return r, nil
}

// startKVEvents binds the replica's KV-event publisher.
func (r *Replica) startKVEvents(ctx context.Context) error {
	port := 0
	if r.cfg.KVEventsPort > 0 {
		port = r.cfg.KVEventsPort + r.idx
	}
	ep := "tcp://" + net.JoinHostPort(r.cfg.Host, strconv.Itoa(port))
	// vLLM's topic convention as llm-d uses it: kv@<pod address>@<model>.
	r.topic = "kv@" + r.addr + "@" + r.cfg.servedName()
	pub, err := kvevents.NewZMQPublisher(ctx, ep, r.topic, r.cfg.KVEventsForm)
	if err != nil {
		return fmt.Errorf("sim: replica %d: kv events: %w", r.idx, err)
	}
	r.pub = pub
	r.kvAddr = ep
	if a, ok := pub.(interface{ Addr() net.Addr }); ok {
		r.kvAddr = "tcp://" + a.Addr().String()
	}
	return nil
}

// run starts the driver, the server and the fault timers.
func (r *Replica) run() {
	r.start = r.clock.Now()
	r.wg.Add(2)
	go r.drive()
	go r.serve(r.ln)
	if r.faults.RefuseAfter > 0 && r.faults.RefuseFor > 0 {
		r.wg.Add(1)
		go r.refuseWindow()
	}
}

// virtualNow is the engine time of the wall clock now.
func (r *Replica) virtualNow() time.Duration {
	return time.Duration(float64(r.clock.Now().Sub(r.start)) * r.scale)
}

// wallOf is the wall time of engine time v.
func (r *Replica) wallOf(v time.Duration) time.Time {
	return r.start.Add(time.Duration(float64(v) / r.scale))
}

// presentLocked is the engine's present: the virtual time of the wall
// clock, except while the driver is busy and behind it by less than MaxLag,
// when it is the end of the planned step (the driver is catching up, and
// whatever arrives now is in the engine's present at that step's end). r.mu
// is held.
func (r *Replica) presentLocked() time.Duration {
	vw := r.virtualNow()
	if r.idle || vw <= r.planEnd {
		return vw
	}
	return max(r.planEnd, vw-r.maxLag)
}

func (r *Replica) poke() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// drive is the replica's engine loop, vLLM's busy loop in virtual time:
// while there is work, plan a step at the engine's present, wait until the
// wall time of its end, then deliver its outputs and publish its KV events.
// With no work it sleeps until a request arrives, and the next step starts
// at the wall clock's virtual time.
//
// Pacing is catch-up pacing, as in discrete-event simulators run against a
// wall clock: a step starts where the previous one ended as long as that is
// less than MaxLag (wall) behind the wall clock, so a timer that wakes late
// (Go's timers have about a millisecond of granularity here) delays the
// following deliveries a little but never stretches virtual time; the steps
// after it run back to back until the chain has caught up. Virtual time
// never goes backwards, never lags the wall clock by more than MaxLag (it
// jumps forward when the driver falls further behind, e.g. CPU-starved), and
// outputs are never delivered before the wall time of their step's end.
// Without the slack, at --time-scale 1000 every 10 ms step would cost a
// timer's millisecond of wall time, a second of virtual time.
func (r *Replica) drive() {
	defer r.wg.Done()
	t := r.clock.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		r.mu.Lock()
		if !r.eng.HasWork() {
			r.idle = true
			r.mu.Unlock()
			select {
			case <-r.wake:
				continue
			case <-r.done:
				return
			}
		}
		now := r.presentLocked()
		if r.idle {
			// Start at the arrival that woke the driver: the wake-up's
			// scheduling delay is not the engine's time.
			now = max(r.wokeAt, now-r.maxLag)
		}
		res := r.eng.Step(now)
		r.idle = false
		r.planEnd = res.End
		r.mu.Unlock()
		if res.Seqs == 0 {
			// Nothing could be scheduled; only a new request or an abort changes that.
			select {
			case <-r.wake:
				continue
			case <-r.done:
				return
			}
		}
		if !r.sleepUntil(t, r.wallOf(res.End)) {
			return
		}
		// res.Outputs is only overwritten by the next Step, which this
		// goroutine alone calls.
		r.deliver(res.Outputs, res.End)
		if r.pub != nil && len(res.KV) > 0 {
			_ = r.pub.Publish(r.batch(res.KV))
		}
	}
}

// sleepUntil waits on t until the wall clock reaches at; false when the
// replica stops first.
func (r *Replica) sleepUntil(t clock.Timer, at time.Time) bool {
	d := at.Sub(r.clock.Now())
	if d <= 0 {
		return true
	}
	t.Reset(d)
	select {
	case <-t.C():
		return true
	case <-r.done:
		return false
	}
}

// deliver hands one step's outputs, visible at end, to their calls.
func (r *Replica) deliver(outs []engine.Output, end time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, o := range outs {
		c := r.live[o.ReqID]
		if c == nil {
			continue // aborted
		}
		cl := c.call
		if o.First {
			r.metrics.ttft.Observe((end - c.arrival).Seconds())
		}
		if o.Finished {
			delete(r.live, o.ReqID)
			r.metrics.e2e.Observe((end - c.arrival).Seconds())
			r.metrics.success[c.reason].Inc()
			cl.left--
		}
		cl.mu.Lock()
		c.pending += o.NewTokens
		c.total += o.NewTokens
		if o.First {
			c.cached = o.CachedTokens
		}
		c.finished = o.Finished
		cl.mu.Unlock()
		// A non-streamed call only needs waking when it is complete.
		if cl.stream || cl.left == 0 {
			select {
			case cl.notify <- struct{}{}:
			default:
			}
		}
	}
}

// submit adds a call's engine requests; reqs[i] belongs to cl.choices[i].
func (r *Replica) submit(cl *call, reqs []engine.Request) error {
	r.mu.Lock()
	now := r.presentLocked()
	if r.idle && !r.eng.HasWork() {
		r.wokeAt = now
	}
	for i := range reqs {
		r.nextID++
		reqs[i].ID = r.nextID
		if err := r.eng.Add(&reqs[i], now); err != nil {
			for _, c := range cl.choices[:i] {
				r.eng.Abort(c.id)
				delete(r.live, c.id)
			}
			r.mu.Unlock()
			return err
		}
		c := cl.choices[i]
		c.id, c.arrival = reqs[i].ID, now
		r.live[c.id] = c
	}
	cl.left = len(reqs)
	r.mu.Unlock()
	r.poke()
	return nil
}

// abort drops the call's unfinished choices (the client went away). A
// choice the engine already finished in the step being waited on stays in
// live: the driver delivers and counts it.
func (r *Replica) abort(cl *call) {
	r.mu.Lock()
	n := 0
	for _, c := range cl.choices {
		if r.live[c.id] != c {
			continue
		}
		if r.eng.Abort(c.id) {
			delete(r.live, c.id)
			r.metrics.success[finishAbort].Inc()
			n++
		}
	}
	r.mu.Unlock()
	if n > 0 {
		r.poke() // freed blocks may let a waiting request in
	}
}

// batch converts one step's engine events to a vLLM event batch.
func (r *Replica) batch(evs []engine.KVEvent) kvevents.Batch {
	out := make([]kvevents.Event, 0, len(evs))
	for _, ev := range evs {
		switch ev.Kind {
		case engine.Stored:
			s := &kvevents.BlockStored{
				BlockHashes: ev.BlockHashes,
				TokenIDs:    ev.TokenIDs,
				BlockSize:   ev.BlockSize,
				Medium:      "GPU",
				LoraName:    ev.LoraName,
			}
			if ev.HasParent {
				p := ev.ParentHash
				s.ParentBlockHash = &p
			}
			out = append(out, s)
		case engine.Removed:
			out = append(out, &kvevents.BlockRemoved{BlockHashes: ev.BlockHashes, Medium: "GPU"})
		case engine.Cleared:
			out = append(out, &kvevents.AllBlocksCleared{})
		}
	}
	now := r.clock.Now()
	return kvevents.Batch{Timestamp: float64(now.UnixNano()) / 1e9, Events: out}
}

// gate counts running handlers so that shutdown can wait for them; unlike
// a WaitGroup it refuses entries once closed, so a handler that starts
// while the server is being closed cannot race the wait.
type gate struct {
	mu     sync.Mutex
	n      int
	closed bool
	zero   chan struct{}
}

func (g *gate) init() { g.zero = make(chan struct{}) }

func (g *gate) enter() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return false
	}
	g.n++
	return true
}

func (g *gate) leave() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.n--
	if g.closed && g.n == 0 {
		close(g.zero)
	}
}

// close refuses new entries and returns a channel closed when none is left.
func (g *gate) close() <-chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.closed {
		g.closed = true
		if g.n == 0 {
			close(g.zero)
		}
	}
	return g.zero
}
