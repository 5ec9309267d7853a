package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
)

// Replica is one simulated vLLM server: one engine per data-parallel rank
// (a core), each with the driver goroutine that steps it in (scaled) wall
// time, an HTTP server, a Prometheus registry and optionally KV-event
// publishers (one per rank).
type Replica struct {
	idx    int
	cfg    Config // the fleet's with this replica's override, defaults filled
	faults Faults
	clock  clock.Clock
	start  time.Time // wall time at which it started serving
	scale  float64
	tl     *Timeline // the fleet's model time

	// mu serialises every engine call of every core and guards the cores'
	// driver state.
	mu     sync.Mutex
	cores  []*core       // one per data-parallel rank, in rank order
	maxLag time.Duration // Config.MaxLag in virtual time

	metrics *metrics
	// pubs are the KV-event publishers, one per data-parallel rank in rank
	// order (nil without KV events); kvAddrs and replayAddrs their bound
	// endpoints (nil in connect mode, and without replay sockets).
	pubs        []rankPublisher
	kvAddrs     []string
	replayAddrs []string
	topic       string

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

	// KV transfers: the client of prefill replicas' side channels, the
	// queue of release notifications, and the context that ends both's
	// calls when the replica stops.
	side       *http.Client
	releases   releaser
	sideCtx    context.Context
	sideCancel context.CancelFunc
	log        *slog.Logger

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
	held     []int32 // a remote decode's blocks held for the decode side, set when finished
	// Engine times (virtual) of its first and latest token, and the
	// longest gap between two of its tokens: the call's Timing.
	firstAt, lastAt, maxGap time.Duration

	// remote is the prefill side a remote-prefill choice pulls from, until
	// told to release; guarded by Replica.mu.
	remote *kvRemote
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

// KVEndpoint is the bound ZMQ endpoint of its rank 0's KV-event publisher
// (tcp://HOST:PORT); rank k's is kvevents.OffsetPort of it by k. "" without
// KV events and in connect mode (Config.KVEventsConnect), where nothing is
// bound.
func (r *Replica) KVEndpoint() string { return first(r.kvAddrs) }

// KVEndpoints are the bound endpoints of its KV-event publishers, one per
// data-parallel rank in rank order, on consecutive ports; nil without KV
// events and in connect mode.
func (r *Replica) KVEndpoints() []string { return slices.Clone(r.kvAddrs) }

// KVReplayEndpoint is the endpoint of its rank 0's replay socket
// (Config.KVEventsReplay; vLLM's replay_endpoint), "" without one.
func (r *Replica) KVReplayEndpoint() string { return first(r.replayAddrs) }

// KVReplayEndpoints are the endpoints of its replay sockets, one per
// data-parallel rank in rank order, on consecutive ports; nil without.
func (r *Replica) KVReplayEndpoints() []string { return slices.Clone(r.replayAddrs) }

// KVTopic is the topic its KV events are published under,
// kv@HOST:PORT@MODEL ("" without KV events).
func (r *Replica) KVTopic() string { return r.topic }

func first(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}

// Registry is the replica's Prometheus registry, served at /metrics.
func (r *Replica) Registry() *prometheus.Registry { return r.metrics.reg }

// Handler is the replica's HTTP API, usable without its listener.
func (r *Replica) Handler() http.Handler { return r.handler }

// Config is the replica's configuration: the fleet's with its PerReplica
// override applied.
func (r *Replica) Config() Config { return r.cfg }

// newReplica builds replica idx on ln with its own configuration (the
// fleet's with its override).
func newReplica(ctx context.Context, cfg Config, idx int, ln net.Listener, tl *Timeline) (*Replica, error) {
	maxLag := time.Duration(float64(cfg.MaxLag) * cfg.TimeScale)
	if cfg.Elastic > 0 {
		maxLag = cfg.Elastic // model time never passes a core by more
	}
	r := &Replica{
		idx:    idx,
		cfg:    cfg,
		faults: cfg.faultsFor(idx),
		clock:  cfg.Clock,
		scale:  cfg.TimeScale,
		tl:     tl,
		maxLag: maxLag,
		addr:   ln.Addr().String(),
		ln:     ln,
		reopen: make(chan net.Listener, 1),
		conns:  make(map[net.Conn]struct{}),
		frng:   rand.New(rand.NewPCG(cfg.Seed, 0xfa17_0000+uint64(idx))),
		done:   make(chan struct{}),
		side:   &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}},
		log:    cfg.Logger,
	}
	r.releases.queue = make(chan releaseJob, releaseQueue)
	r.sideCtx, r.sideCancel = context.WithCancel(context.Background())
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

// kvBindAttempts bounds the tries at finding consecutive ephemeral ports
// for a replica's ranks.
const kvBindAttempts = 20

// kvReplayBuffer is how many batches a replay socket keeps: vLLM's
// buffer_steps default.
const kvReplayBuffer = 10_000

// rankPublisher is one data-parallel rank's KV-event publisher, as
// kvzmq.NewPublisher makes it.
type rankPublisher interface {
	kvzmq.Publisher
	Addr() net.Addr       // nil in connect mode
	ReplayAddr() net.Addr // nil without a replay socket
}

// startKVEvents starts the replica's KV-event publishers, one per
// data-parallel rank as vLLM runs them: rank k binds (or, in connect mode,
// dials) the endpoint's port + k and its replay socket likewise, counts its
// own sequence numbers, and publishes its core's batches.
func (r *Replica) startKVEvents(ctx context.Context) error {
	cfg, n := r.cfg, len(r.cores)
	// vLLM's topic convention as llm-d uses it: kv@<pod address>@<model>.
	r.topic = "kv@" + r.addr + "@" + cfg.Model
	pubPort, replayPort := -1, -1
	if cfg.KVEventsConnect == "" {
		pubPort = 0
		if cfg.KVEventsPort > 0 {
			pubPort = cfg.KVEventsPort + r.idx*n
		}
	}
	if cfg.KVEventsReplay {
		replayPort = 0
		if cfg.KVEventsReplayPort > 0 {
			replayPort = cfg.KVEventsReplayPort + r.idx*n
		}
	}
	pubs, err := openRanks(n, pubPort, replayPort, rankOpener(ctx, cfg, r.topic))
	if err != nil {
		return fmt.Errorf("sim: replica %d: kv events: %w", r.idx, err)
	}
	r.pubs = pubs
	for k, p := range pubs {
		r.cores[k].pub = p
		if a := p.Addr(); a != nil {
			r.kvAddrs = append(r.kvAddrs, "tcp://"+a.String())
		}
		if a := p.ReplayAddr(); a != nil {
			r.replayAddrs = append(r.replayAddrs, "tcp://"+a.String())
		}
	}
	return nil
}

// closeKVEvents closes the publishers; the first error.
func (r *Replica) closeKVEvents() error {
	var err error
	for _, p := range r.pubs {
		if perr := p.Close(); perr != nil && err == nil {
			err = perr
		}
	}
	return err
}

// openRankFunc starts rank k's publisher: its PUB socket bound on pubPort
// (0: an ephemeral port), or connected when pubPort is −1, and its replay
// socket on replayPort (0: ephemeral; −1: none).
type openRankFunc func(k, pubPort, replayPort int) (rankPublisher, error)

// rankOpener opens the ranks' publishers of a replica publishing under topic.
func rankOpener(ctx context.Context, cfg Config, topic string) openRankFunc {
	endpoint := func(port int) string { return "tcp://" + net.JoinHostPort(cfg.Host, strconv.Itoa(port)) }
	return func(k, pubPort, replayPort int) (rankPublisher, error) {
		o := kvzmq.PublisherOptions{Topic: topic, Form: cfg.KVEventsForm, FirstSeq: cfg.KVEventsFirstSeq}
		ep := kvevents.OffsetPort(cfg.KVEventsConnect, k)
		if pubPort >= 0 {
			ep = endpoint(pubPort)
		} else {
			o.Connect = true
			// vLLM dials from its pod's address: a listener that checks a
			// publisher's source address (kv_events_trust) sees the host
			// the replica serves on, not the system's choice.
			if ip := net.ParseIP(cfg.Host); ip != nil && !ip.IsUnspecified() {
				o.LocalAddr = &net.TCPAddr{IP: ip}
			}
		}
		if replayPort >= 0 {
			o.ReplayEndpoint, o.Buffer = endpoint(replayPort), kvReplayBuffer
		}
		pub, err := kvzmq.NewPublisher(ctx, ep, o)
		if err != nil {
			return nil, err
		}
		rp, ok := pub.(rankPublisher)
		if !ok {
			_ = pub.Close()
			return nil, fmt.Errorf("publisher %T has no addresses", pub)
		}
		return rp, nil
	}
}

// errRankPort: a rank above 0 could not have rank 0's port + k.
var errRankPort = errors.New("port + rank unavailable")

// openRanks opens n ranks' publishers, rank k on pubPort + k and replayPort
// + k (−1: none; see openRankFunc). A port of 0 makes rank 0 take an
// ephemeral port p and rank k then p + k, as a subscriber finds rank k at
// kvevents.OffsetPort of rank 0's endpoint; when one of those is taken, all
// are closed and the ranks start over on new ephemeral ports, up to
// kvBindAttempts times.
func openRanks(n, pubPort, replayPort int, open openRankFunc) ([]rankPublisher, error) {
	retry := n > 1 && (pubPort == 0 || replayPort == 0)
	var err error
	for range kvBindAttempts {
		var pubs []rankPublisher
		pubs, err = openRanksOnce(n, pubPort, replayPort, open)
		if err == nil {
			return pubs, nil
		}
		if !retry || !errors.Is(err, errRankPort) {
			return nil, err
		}
	}
	return nil, fmt.Errorf("no %d consecutive free ports in %d attempts: %w", n, kvBindAttempts, err)
}

// openRanksOnce is one attempt of openRanks; on an error every publisher
// it opened is closed.
func openRanksOnce(n, pubPort, replayPort int, open openRankFunc) ([]rankPublisher, error) {
	p0, err := open(0, pubPort, replayPort)
	if err != nil {
		return nil, fmt.Errorf("rank 0: %w", err)
	}
	pubs := []rankPublisher{p0}
	if pubPort == 0 {
		pubPort = p0.Addr().(*net.TCPAddr).Port
	}
	if replayPort == 0 {
		replayPort = p0.ReplayAddr().(*net.TCPAddr).Port
	}
	offset := func(port, k int) int {
		if port < 0 {
			return port
		}
		return port + k
	}
	for k := 1; k < n; k++ {
		pk, rk := offset(pubPort, k), offset(replayPort, k)
		if pk > 65535 || rk > 65535 {
			err = fmt.Errorf("%w: rank %d: port %d beyond 65535", errRankPort, k, max(pk, rk))
		} else {
			var p rankPublisher
			if p, err = open(k, pk, rk); err == nil {
				pubs = append(pubs, p)
				continue
			}
			err = fmt.Errorf("%w: rank %d: %w", errRankPort, k, err)
		}
		for _, p := range pubs {
			_ = p.Close()
		}
		return nil, err
	}
	return pubs, nil
}

// run starts the drivers (one per core), the server and the fault timers.
func (r *Replica) run() {
	r.start = r.clock.Now()
	r.wg.Add(2 + len(r.cores))
	for _, c := range r.cores {
		go c.drive()
	}
	go r.sendReleases()
	go r.serve(r.ln)
	if r.faults.RefuseAfter > 0 && r.faults.RefuseFor > 0 {
		r.wg.Add(1)
		go r.refuseWindow()
	}
}

// virtualNow is the engine time of the wall clock now: the fleet's model
// time.
func (r *Replica) virtualNow() time.Duration { return r.tl.Now() }

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
