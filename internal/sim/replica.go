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
	"github.com/kvgate/kvgate/internal/kvevents"
)

// Replica is one simulated vLLM server: one engine per data-parallel rank
// (a core), each with the driver goroutine that steps it in (scaled) wall
// time, an HTTP server, a Prometheus registry and optionally a KV-event
// publisher.
type Replica struct {
	idx    int
	cfg    Config // the fleet's with this replica's override, defaults filled
	faults Faults
	clock  clock.Clock
	start  time.Time // wall time of virtual time 0
	scale  float64

	// mu serialises every engine call of every core and guards the cores'
	// driver state.
	mu     sync.Mutex
	cores  []*core       // one per data-parallel rank, in rank order
	maxLag time.Duration // Config.MaxLag in virtual time

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
	left    int   // choices not finished, driver-owned under Replica.mu
	core    *core // the engine core serving it, set by submit
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

// newReplica builds replica idx on ln with its own configuration (the
// fleet's with its override).
func newReplica(ctx context.Context, cfg Config, idx int, ln net.Listener) (*Replica, error) {
	r := &Replica{
		idx:    idx,
		cfg:    cfg,
		faults: cfg.faultsFor(idx),
		clock:  cfg.Clock,
		scale:  cfg.TimeScale,
		maxLag: time.Duration(float64(cfg.MaxLag) * cfg.TimeScale),
		addr:   ln.Addr().String(),
		ln:     ln,
		reopen: make(chan net.Listener, 1),
		conns:  make(map[net.Conn]struct{}),
		frng:   rand.New(rand.NewPCG(cfg.Seed, 0xfa17_0000+uint64(idx))),
		done:   make(chan struct{}),
	}
	if err := newCores(r); err != nil {
		return nil, err
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

// startKVEvents binds the replica's KV-event publisher. With data
// parallelism every core publishes through it, each batch carrying its
// core's data_parallel_rank. (vLLM binds one publisher per rank, on the
// endpoint's port + rank; the sim keeps one per replica so that replica i
// stays on KVEventsPort+i, and a subscriber tells the ranks apart by the
// batches' rank.)
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

// run starts the drivers (one per core), the server and the fault timers.
func (r *Replica) run() {
	r.start = r.clock.Now()
	r.wg.Add(1 + len(r.cores))
	for _, c := range r.cores {
		go c.drive()
	}
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
