package sharedstate

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/router"
)

// Options configures a Syncer.
type Options struct {
	URL       string // redis://[:password@]HOST:PORT[/DB]
	Namespace string // key prefix (default "kvgate"): gateways share state within one
	Gateway   string // this process's name (default host-pid-random); unique per process

	Interval  time.Duration // batch period (default 5ms)
	Heartbeat time.Duration // longest gap between two batches (default 250ms)
	TTL       time.Duration // how long a peer's loads stand without a newer batch (default DefaultTTL)
	// SnapshotEvery is the period of the index snapshot in Redis (default
	// 10s); one gateway writes it per period. Keep it below the stream's
	// retention (StreamMaxLen / batches per second over all gateways: 50,000
	// entries hold about a minute of 4 busy gateways at 200 batches/s each),
	// or a gateway that starts misses the decisions trimmed in between.
	SnapshotEvery time.Duration
	WarmTimeout   time.Duration // bound of the warm load in Start (default 3s)
	Timeout       time.Duration // bound of every Redis command (default 250ms)
	StreamMaxLen  int64         // the stream's approximate length bound (default 50000, about 30 MB)
	// MaxPending bounds the decisions held while Redis is unreachable
	// (default 10000); beyond it the oldest are dropped, and counted.
	MaxPending int
	// ShareDecisions shares routing decisions (the approximate index) as
	// well as loads; false shares loads only (precise mode: every gateway
	// hears the replicas' KV events itself).
	ShareDecisions bool
	// MaxEntryBytes caps a stream entry read (default DefaultMaxEntryBytes;
	// at least minEntryBytes): a larger one is skipped, counted and logged.
	MaxEntryBytes int64
	// MaxSnapshotBytes caps the snapshot read from Redis (default
	// SnapshotBytesFor(0)): a larger one is refused by its length, unread,
	// and a snapshot this gateway writes is cut to fit it.
	MaxSnapshotBytes int64

	Clock      clock.Clock           // default the real clock
	Log        *slog.Logger          // default slog.Default()
	Registerer prometheus.Registerer // metrics (none registered when nil)
}

// Defaults.
const (
	DefaultInterval      = 5 * time.Millisecond
	DefaultHeartbeat     = 250 * time.Millisecond
	DefaultSnapshotEvery = 10 * time.Second
	DefaultWarmTimeout   = 3 * time.Second
	DefaultTimeout       = 250 * time.Millisecond
	DefaultStreamMaxLen  = 50000
	DefaultMaxPending    = 10000
	DefaultNamespace     = "kvgate"
)

const (
	maxBatchDecisions = 256         // per XADD: a backlog goes out in several
	readCount         = 64          // entries per XREAD: with guardConn's budget, what one read may hold
	minEntryBytes     = 64 << 10    // the smallest MaxEntryBytes
	readBlock         = time.Second // XREAD BLOCK: every live gateway heartbeats sooner
	minBackoff        = 10 * time.Millisecond
	maxBackoff        = time.Second // retry period while Redis is down
	closeBudget       = 2           // × Timeout for the last batch at Close
	minQueue          = 64          // the pending ring's first size
	lockHoldFraction  = 9.0 / 10.0  // of SnapshotEvery: the lock expires before the next period
	reachUnknown      = int32(-1)   // no Redis command has completed yet
	reachDown         = int32(0)
	reachUp           = int32(1)
)

// Syncer shares a gateway's routing decisions and loads with the other
// gateways through Redis, and applies theirs to its router. Nothing it does
// is on a request's path: OnLearn only queues, and every Redis command runs
// in the Syncer's own goroutines under a short timeout.
type Syncer struct {
	o   Options
	clk clock.Clock
	log *slog.Logger
	ro  *redis.Options
	m   *metrics

	qmu   sync.Mutex
	queue ring

	rmu, rflush sync.Mutex
	responses   []pendingResponse // stored responses' records queued (responses.go)
	kick        chan struct{}     // wakes the publisher for them

	mu        sync.Mutex // Start and Close
	started   bool
	closed    bool
	rt        *router.Router
	peers     *Peers
	startedAt time.Time
	st        *store
	cancel    context.CancelFunc
	pubDone   chan struct{}
	wg        sync.WaitGroup

	// publisher state (its goroutine, then Close)
	seq       uint64
	lastPub   time.Time
	lastLoads []ReplicaLoad
	buf       []byte

	lastID    atomic.Pointer[string]    // the last stream entry the reader applied
	reach     atomic.Int32              // whether the last Redis command succeeded
	received  atomic.Int64              // s.clk's UnixNano when the reader last moved past an entry; 0: never
	stopped   atomic.Bool               // Close was called
	rclock    atomic.Int64              // Redis's clock less this gateway's (ns), as last measured
	want      atomic.Int32              // resyncs the publisher asks of the reader (wantHealed, wantReset)
	resetSeen atomic.Pointer[[2]string] // the cursor and own entry ID that showed the last reset
	ready     atomic.Bool
	warmed    atomic.Bool
	restored  atomic.Int64
	warmN     atomic.Int64
	live      atomic.Int64          // other gateways live, as last counted
	stp       atomic.Pointer[store] // st, for Stats (which takes no lock)

	decPublished, decApplied, decDropped atomic.Uint64
	batPublished, batReceived            atomic.Uint64
	bytPublished, bytReceived            atomic.Uint64
	snapshots, errs                      atomic.Uint64
	dropped, resyncs, snapshotsRead      atomic.Uint64

	// the reader's own (its goroutine, or warm in Start before it runs)
	future    string    // the ID ahead of Redis's clock last refused
	trimmedAt time.Time // when a trim was last resynced for
	snapRead  time.Time // when the snapshot was last read
	logs      logLimit
}

// New checks opts and fills in the defaults. It does no I/O: Start does.
func New(opts Options) (*Syncer, error) {
	o := opts
	if o.URL == "" {
		return nil, errors.New("sharedstate: no shared-state URL")
	}
	ro, err := ParseURL(o.URL)
	if err != nil {
		return nil, err
	}
	for _, d := range []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{{"interval", &o.Interval, DefaultInterval}, {"heartbeat", &o.Heartbeat, DefaultHeartbeat}, {"TTL", &o.TTL, DefaultTTL},
		{"snapshot period", &o.SnapshotEvery, DefaultSnapshotEvery}, {"warm timeout", &o.WarmTimeout, DefaultWarmTimeout},
		{"timeout", &o.Timeout, DefaultTimeout}} {
		if *d.v < 0 {
			return nil, fmt.Errorf("sharedstate: negative %s %v", d.name, *d.v)
		}
		if *d.v == 0 {
			*d.v = d.def
		}
	}
	if o.Heartbeat < o.Interval {
		return nil, fmt.Errorf("sharedstate: heartbeat %v shorter than the batch interval %v", o.Heartbeat, o.Interval)
	}
	if o.TTL <= o.Heartbeat {
		return nil, fmt.Errorf("sharedstate: TTL %v not longer than the heartbeat %v: live gateways' loads would expire", o.TTL, o.Heartbeat)
	}
	if o.StreamMaxLen < 0 || o.MaxPending < 0 || o.MaxEntryBytes < 0 || o.MaxSnapshotBytes < 0 {
		return nil, errors.New("sharedstate: negative stream length, pending bound or size cap")
	}
	if o.MaxEntryBytes == 0 {
		o.MaxEntryBytes = DefaultMaxEntryBytes
	}
	if o.MaxEntryBytes < minEntryBytes {
		return nil, fmt.Errorf("sharedstate: entry cap %d bytes below %d", o.MaxEntryBytes, minEntryBytes)
	}
	if o.MaxSnapshotBytes == 0 {
		o.MaxSnapshotBytes = SnapshotBytesFor(0)
	}
	if len(o.Gateway) > MaxNameBytes {
		return nil, fmt.Errorf("sharedstate: gateway name of %d bytes, at most %d", len(o.Gateway), MaxNameBytes)
	}
	if o.StreamMaxLen == 0 {
		o.StreamMaxLen = DefaultStreamMaxLen
	}
	if o.MaxPending == 0 {
		o.MaxPending = DefaultMaxPending
	}
	if o.Namespace == "" {
		o.Namespace = DefaultNamespace
	}
	if o.Gateway == "" {
		o.Gateway = defaultGateway()
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	s := &Syncer{o: o, clk: clock.OrReal(o.Clock), ro: ro, queue: ring{max: o.MaxPending}, kick: make(chan struct{}, 1)}
	s.log = o.Log.With("component", "shared-state", "gateway", o.Gateway)
	s.reach.Store(reachUnknown)
	if s.m, err = newMetrics(o.Registerer, s.receiving); err != nil {
		return nil, err
	}
	return s, nil
}

// defaultGateway is host-pid-random: unique per process, and the same
// host's restarts tell apart.
func defaultGateway() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "gateway"
	}
	var b [3]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// Gateway is this gateway's name in the shared state.
func (s *Syncer) Gateway() string { return s.o.Gateway }

// OnLearn is the router's Config.OnLearn hook: it queues a copy of the
// decision for the next batch and returns. It never blocks on Redis: the
// queue is bounded (Options.MaxPending; the oldest decision is dropped
// beyond it). It may be called before Start.
func (s *Syncer) OnLearn(l router.Learned) {
	if !s.o.ShareDecisions {
		return
	}
	l.Blocks = slices.Clone(l.Blocks)
	s.qmu.Lock()
	dropped := s.queue.push(l)
	s.qmu.Unlock()
	if dropped {
		s.decDropped.Add(1)
		s.m.decDropped.Inc()
	}
}

// Start loads the shared state into rt (the snapshot, then the stream's
// tail after it), bounded by WarmTimeout, and starts the goroutines that
// publish this gateway's batches, apply the others', expire dead peers'
// loads and write the snapshot. When Redis cannot be reached, Start logs
// it once and returns nil all the same: the gateway serves on its own view,
// and the loops catch up when Redis comes back. ctx bounds the warm load
// only; Close stops the rest.
func (s *Syncer) Start(ctx context.Context, rt *router.Router) error {
	if rt == nil {
		return errors.New("sharedstate: Start without a router")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.started || s.closed {
		return errors.New("sharedstate: Syncer started twice, or after Close")
	}
	s.started = true
	s.rt = rt
	s.peers = NewPeers(rt, s.o.Gateway, s.o.TTL)
	s.st = newStore(s.ro, s.o.Namespace, s.o.Timeout, max(s.o.Timeout, s.o.WarmTimeout), s.o.StreamMaxLen,
		limits{entry: s.o.MaxEntryBytes, snapshot: s.o.MaxSnapshotBytes})
	s.stp.Store(s.st)
	s.startedAt = s.clk.Now()
	s.lastPub = s.startedAt

	if err := s.warm(ctx); err != nil {
		s.failed("warm", err)
	}
	s.ready.Store(true)

	loops, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	s.pubDone = make(chan struct{})
	go func() {
		defer close(s.pubDone)
		s.publishLoop(loops)
	}()
	s.wg.Add(3)
	go func() { defer s.wg.Done(); s.readLoop(loops) }()
	go func() { defer s.wg.Done(); s.expireLoop(loops) }()
	go func() { defer s.wg.Done(); s.snapshotLoop(loops) }()
	return nil
}

// Ready reports whether Start's warm load is over (done, or given up).
func (s *Syncer) Ready() bool { return s.ready.Load() }

// Close stops the goroutines and waits for them. While Redis is up it
// first publishes the decisions still queued, with this gateway's loads at
// zero, so that the others drop them at once rather than after the TTL.
// It takes at most a few Timeouts.
func (s *Syncer) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	s.stopped.Store(true)
	if !s.started {
		return nil
	}
	s.cancel()
	<-s.pubDone
	if s.reach.Load() == reachUp {
		ctx, cancel := context.WithTimeout(context.Background(), closeBudget*s.o.Timeout)
		_ = s.flushResponses(ctx)
		_ = s.publish(ctx, s.clk.Now(), true)
		cancel()
	}
	err := s.st.close() // ends the reader's blocking XREAD
	s.wg.Wait()
	s.reach.Store(reachDown)
	if errors.Is(err, redis.ErrClosed) {
		err = nil
	}
	return err
}

// Stats are the Syncer's counters (tests, debugging).
type Stats struct {
	Gateway string
	Up      bool // receiving (kvgate_shared_state_up): see receiving
	Ready   bool
	Warmed  bool   // a warm load completed (at Start, or once Redis came back)
	LastID  string // the last stream entry applied
	Pending int    // decisions queued for the next batch
	Peers   int    // other gateways with a live heartbeat

	Restored    int // blocks restored from the snapshot by the warm load
	WarmBatches int // batches applied by the warm load

	DecisionsPublished, DecisionsApplied, DecisionsDropped uint64
	BatchesPublished, BatchesReceived                      uint64
	BytesPublished, BytesReceived                          uint64
	Snapshots                                              uint64 // snapshots this gateway wrote
	SnapshotsRead                                          uint64 // snapshots read and checked (warm loads, resyncs)
	Errors                                                 uint64 // failed Redis commands
	Dropped                                                uint64 // entries and snapshots refused (kvgate_shared_state_dropped_total)
	Resyncs                                                uint64 // the stream healed, reset or trimmed under the reader
	Ops                                                    uint64 // Redis commands sent
}

// Stats returns the counters.
func (s *Syncer) Stats() Stats {
	s.qmu.Lock()
	pending := s.queue.n
	s.qmu.Unlock()
	st := Stats{Gateway: s.o.Gateway, Up: s.receiving(), Ready: s.ready.Load(), Warmed: s.warmed.Load(),
		LastID: s.lastApplied(), Pending: pending,
		Restored: int(s.restored.Load()), WarmBatches: int(s.warmN.Load()),
		DecisionsPublished: s.decPublished.Load(), DecisionsApplied: s.decApplied.Load(), DecisionsDropped: s.decDropped.Load(),
		BatchesPublished: s.batPublished.Load(), BatchesReceived: s.batReceived.Load(),
		BytesPublished: s.bytPublished.Load(), BytesReceived: s.bytReceived.Load(),
		Snapshots: s.snapshots.Load(), SnapshotsRead: s.snapshotsRead.Load(), Errors: s.errs.Load(),
		Dropped: s.dropped.Load(), Resyncs: s.resyncs.Load()}
	st.Peers = int(s.live.Load())
	if p := s.stp.Load(); p != nil {
		st.Ops = p.ops.Load()
	}
	return st
}

func (s *Syncer) setLive(n int) {
	s.live.Store(int64(n))
	s.m.peers.Set(float64(n))
}

func (s *Syncer) lastApplied() string {
	if p := s.lastID.Load(); p != nil {
		return *p
	}
	return ""
}

func (s *Syncer) setLastID(id string) { s.lastID.Store(&id) }

// receiving is what kvgate_shared_state_up reports: whether the reader
// has moved past a stream entry (applied it, or dropped it) within the
// last TTL. Every gateway, this one included, publishes a heartbeat every
// Heartbeat (< TTL), so a reader that follows the stream always has; it
// has not while Redis is unreachable, while the reader is stalled on an
// entry ahead of Redis's clock or behind a stream that went backwards, and
// before its first entry. Connected is not enough: a reader stuck on a
// stream it can no longer follow is connected.
func (s *Syncer) receiving() bool {
	t := s.received.Load()
	return t != 0 && !s.stopped.Load() && s.clk.Since(time.Unix(0, t)) <= s.o.TTL
}

// ok and failed track whether Redis answers, and log each transition once.
func (s *Syncer) ok() {
	if s.reach.Swap(reachUp) != reachUp {
		s.log.Info("shared state: Redis reachable", "url", redactURL(s.o.URL))
	}
}

func (s *Syncer) failed(op string, err error) {
	s.errs.Add(1)
	s.m.errors.WithLabelValues(op).Inc()
	if s.reach.Swap(reachDown) != reachDown {
		s.log.Warn("shared state: Redis unreachable; routing on this gateway's own view until it returns",
			"url", redactURL(s.o.URL), "op", op, "err", err)
	}
}

func redactURL(raw string) string {
	if ro, err := ParseURL(raw); err == nil {
		return ro.Addr
	}
	return "?"
}

// ---- loops ----

// backoff is a capped exponential retry delay.
type backoff struct{ d time.Duration }

func (b *backoff) next() time.Duration {
	b.d = min(max(2*b.d, minBackoff), maxBackoff)
	return b.d
}

func (b *backoff) reset() { b.d = 0 }

// publishLoop publishes a batch every Interval when there are decisions
// queued or loads changed, and at least every Heartbeat; while Redis fails
// it retries with a capped backoff, the decisions waiting in the queue.
func (s *Syncer) publishLoop(ctx context.Context) {
	t := s.clk.NewTicker(s.o.Interval)
	defer t.Stop()
	var bo backoff
	var retry time.Time
	for {
		kicked := false
		select {
		case <-ctx.Done():
			return
		case <-t.C():
		case <-s.kick: // a stored response's record queued: write it now
			kicked = true
		}
		now := s.clk.Now()
		if now.Before(retry) {
			continue
		}
		err := s.flushResponses(ctx)
		if err == nil && !kicked { // the decisions and loads keep their interval: batched
			err = s.publish(ctx, now, false)
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			retry = now.Add(bo.next())
			continue
		}
		bo.reset()
	}
}

// publish sends the queued decisions (several batches for a backlog) with
// this gateway's loads; with nothing queued, a heartbeat when the loads
// changed or Heartbeat has passed (and at once at first, so that the
// others know of this gateway). final: the last batch, loads at zero.
func (s *Syncer) publish(ctx context.Context, now time.Time, final bool) error {
	for {
		s.qmu.Lock()
		queued, end := s.queue.peek(maxBatchDecisions)
		s.qmu.Unlock()
		loads := s.ownLoads(final)
		if len(queued) == 0 && !final && s.seq > 0 && slices.Equal(loads, s.lastLoads) && now.Sub(s.lastPub) < s.o.Heartbeat {
			return nil
		}
		b, taken := s.batchOf(now, loads, queued)
		end -= uint64(len(queued) - taken)
		s.buf = AppendBatch(s.buf[:0], &b)
		before := s.lastApplied()
		id, err := s.st.add(ctx, s.buf)
		if err != nil {
			if ctx.Err() == nil {
				s.failed("publish", err)
			}
			return err
		}
		s.ok()
		if !final {
			if err := s.checkOwn(ctx, before, id); err != nil {
				return err // the batch goes again, after a backoff
			}
		}
		s.seq++
		s.lastPub, s.lastLoads = now, loads
		s.qmu.Lock()
		s.queue.discard(end)
		s.qmu.Unlock()
		s.decPublished.Add(uint64(len(b.Decisions)))
		s.batPublished.Add(1)
		s.bytPublished.Add(uint64(len(s.buf)))
		s.m.decPublished.Add(float64(len(b.Decisions)))
		s.m.batPublished.Inc()
		s.m.bytPublished.Add(float64(len(s.buf)))
		if taken == len(queued) && len(queued) < maxBatchDecisions {
			return nil
		}
		final = false
	}
}

// ownLoads are this gateway's loads as it publishes them: within the
// bounds every reader checks (clampLoad), idle replicas left out (Peers
// reads a missing replica as zero), none in the last batch (zero for all).
func (s *Syncer) ownLoads(final bool) []ReplicaLoad {
	if final {
		return nil
	}
	loads := Loads(s.rt)
	for i := range loads {
		loads[i].Load = clampLoad(loads[i].Load)
	}
	return slices.DeleteFunc(loads, func(l ReplicaLoad) bool { return l.Load == router.Load{} })
}

// batchOf is the next batch: the loads, and the queued decisions (the
// whole prompt: see router.Learned; within the bounds, see shareable) up
// to maxBatchBytes encoded, at least one. taken is how many of queued it
// covers: the rest go in the next batch, so that no entry a live gateway
// writes comes near a reader's cap.
func (s *Syncer) batchOf(now time.Time, loads []ReplicaLoad, queued []router.Learned) (Batch, int) {
	b := Batch{Gateway: s.o.Gateway, Seq: s.seq + 1, At: now, Loads: loads, Decisions: make([]Decision, 0, len(queued))}
	size := len(b.Gateway) + 4*binaryMaxVarint
	for _, l := range loads {
		size += len(l.Replica) + 5*binaryMaxVarint
	}
	for i, l := range queued {
		if l.Replica < 0 || l.Replica >= s.rt.Replicas() {
			continue
		}
		d := shareable(Decision{Replica: s.rt.Name(l.Replica), Model: l.Model, Tokens: l.Tokens, Blocks: l.Blocks, Program: l.Program})
		if size += decisionBytes(&d); size > maxBatchBytes && len(b.Decisions) > 0 {
			return b, i
		}
		b.Decisions = append(b.Decisions, d)
	}
	return b, len(queued)
}

// expireLoop drops the loads of gateways silent for longer than the TTL.
func (s *Syncer) expireLoop(ctx context.Context) {
	t := s.clk.NewTicker(max(s.o.TTL/4, time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
			s.setLive(s.peers.Expire(s.clk.Now()))
		}
	}
}

// snapshotLoop writes the index snapshot every SnapshotEvery, when this
// gateway wins the period's lock. Its position is the last entry applied,
// read before the index is copied: every entry up to it is in the copy
// (and some after it may be too; applying those again is harmless).
func (s *Syncer) snapshotLoop(ctx context.Context) {
	if !s.o.ShareDecisions {
		return
	}
	t := s.clk.NewTicker(s.o.SnapshotEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
		}
		if err := s.WriteSnapshot(ctx); err != nil && ctx.Err() == nil {
			s.failed("snapshot", err)
		}
	}
}

// WriteSnapshot writes the index snapshot to Redis now, unless another
// gateway holds this period's lock (then nothing). The snapshot loop calls
// it every SnapshotEvery; a gateway may call it at shutdown.
func (s *Syncer) WriteSnapshot(ctx context.Context) error {
	if !s.o.ShareDecisions || !s.warmed.Load() {
		return nil
	}
	hold := time.Duration(float64(s.o.SnapshotEvery) * lockHoldFraction)
	won, err := s.st.tryLock(ctx, s.o.Gateway, max(hold, time.Millisecond))
	if err != nil || !won {
		return err
	}
	pos := s.lastApplied()
	snap := TakeSnapshot(s.rt, pos, s.clk.Now())
	snap.fit(s.o.MaxSnapshotBytes)
	data := AppendSnapshot(make([]byte, 0, 64+9*snap.Len()), &snap)
	if err := s.st.putSnapshot(ctx, data); err != nil {
		return err
	}
	s.ok()
	s.snapshots.Add(1)
	return nil
}

// ---- the pending queue ----

// ring is the queue of decisions waiting for a batch: a ring buffer that
// grows up to max and then overwrites its oldest. Every decision pushed
// has a sequence number, so that a batch taken by peek is discarded by
// number even if pushes overwrote some of it in between.
type ring struct {
	buf   []router.Learned
	head  int    // the oldest
	n     int    // queued
	first uint64 // the oldest's number
	max   int
}

// push queues l; it reports whether the oldest decision was dropped.
func (r *ring) push(l router.Learned) bool {
	if r.n == len(r.buf) && len(r.buf) < r.max {
		r.grow()
	}
	if r.n == len(r.buf) {
		r.buf[r.head] = l
		r.head = (r.head + 1) % len(r.buf)
		r.first++
		return true
	}
	r.buf[(r.head+r.n)%len(r.buf)] = l
	r.n++
	return false
}

func (r *ring) grow() {
	nb := make([]router.Learned, min(max(2*len(r.buf), minQueue), r.max))
	for i := range r.n {
		nb[i] = r.buf[(r.head+i)%len(r.buf)]
	}
	r.buf, r.head = nb, 0
}

// peek copies up to k of the oldest decisions, and the number after the
// last one copied.
func (r *ring) peek(k int) ([]router.Learned, uint64) {
	k = min(k, r.n)
	out := make([]router.Learned, k)
	for i := range out {
		out[i] = r.buf[(r.head+i)%len(r.buf)]
	}
	return out, r.first + uint64(k)
}

// discard forgets the decisions numbered below end.
func (r *ring) discard(end uint64) {
	for r.n > 0 && r.first < end {
		r.buf[r.head] = router.Learned{}
		r.head = (r.head + 1) % len(r.buf)
		r.n--
		r.first++
	}
}

// ---- metrics ----

type metrics struct {
	up                                   prometheus.GaugeFunc
	lag, peers                           prometheus.Gauge
	decPublished, decApplied, decDropped prometheus.Counter
	batPublished, batReceived            prometheus.Counter
	bytPublished, bytReceived            prometheus.Counter
	errors, dropped, resyncs             *prometheus.CounterVec
}

// newMetrics makes (and registers on reg, when not nil) the Syncer's
// metrics; up is read from receiving when scraped.
func newMetrics(reg prometheus.Registerer, receiving func() bool) (*metrics, error) {
	up := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvgate_shared_state_up",
		Help: "1 while this gateway receives the shared state: its reader moved past a stream entry within the TTL (every gateway heartbeats more often), else 0."},
		func() float64 {
			if receiving() {
				return 1
			}
			return 0
		})
	lag := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvgate_shared_state_lag_seconds",
		Help: "Receive time less the sender's time of the last batch applied from another gateway."})
	peers := prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvgate_shared_state_peers",
		Help: "Other gateways with a live heartbeat."})
	dec := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_shared_state_decisions_total",
		Help: "Routing decisions published, applied from other gateways, or dropped while Redis was unreachable."}, []string{"dir"})
	bat := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_shared_state_batches_total",
		Help: "Batches published and received."}, []string{"dir"})
	byt := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_shared_state_bytes_total",
		Help: "Encoded batch bytes published and received."}, []string{"dir"})
	errs := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_shared_state_errors_total",
		Help: "Failed shared-state Redis commands by operation."}, []string{"op"})
	dropped := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_shared_state_dropped_total",
		Help: "Stream entries and snapshots refused, by reason: entry_size, snapshot_size, decode, load, decision, program, name, time, snapshot, future_id, peers (program: one per program record of an applied entry the router refused); response: a stored response's record read back refused; response_queue: a record this gateway could not queue while Redis was unreachable."}, []string{"reason"})
	resyncs := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_shared_state_resyncs_total",
		Help: "Times the reader started over (healed: the stream's IDs ran ahead of Redis's clock and it was deleted; reset: the stream went back behind the reader; trimmed: entries were trimmed before the reader read them)."}, []string{"reason"})
	if reg != nil {
		for _, c := range []prometheus.Collector{up, lag, peers, dec, bat, byt, errs, dropped, resyncs} {
			if err := reg.Register(c); err != nil {
				return nil, fmt.Errorf("sharedstate: metrics: %w", err)
			}
		}
	}
	return &metrics{up: up, lag: lag, peers: peers,
		decPublished: dec.WithLabelValues("published"), decApplied: dec.WithLabelValues("applied"), decDropped: dec.WithLabelValues("dropped"),
		batPublished: bat.WithLabelValues("published"), batReceived: bat.WithLabelValues("received"),
		bytPublished: byt.WithLabelValues("published"), bytReceived: byt.WithLabelValues("received"),
		errors: errs, dropped: dropped, resyncs: resyncs}, nil
}
