package sharedstate

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/testutil"
)

var replicaNames = []string{"http://r0", "http://r1", "http://r2"}

// within bounds every wait on real I/O (polled, never slept).
const within = 10 * time.Second

type gateway struct {
	rt *router.Router
	s  *Syncer
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// newGateway builds a Syncer and a router whose OnLearn feeds it, as the
// gateway does; start: Start it too. Both are closed at the test's end.
func newGateway(t *testing.T, url, ns string, start bool, mut func(*Options)) *gateway {
	t.Helper()
	return newGatewayOf(t, replicaNames, url, ns, start, mut)
}

func newGatewayOf(t *testing.T, replicas []string, url, ns string, start bool, mut func(*Options)) *gateway {
	t.Helper()
	o := Options{URL: url, Namespace: ns, ShareDecisions: true, Log: quiet()}
	if mut != nil {
		mut(&o)
	}
	s, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	p, err := policy.New("ttft", policy.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	rt, err := router.New(router.Config{Replicas: replicas, Policy: p, OnLearn: s.OnLearn})
	if err != nil {
		t.Fatal(err)
	}
	g := &gateway{rt: rt, s: s}
	t.Cleanup(func() { _ = s.Close() })
	if start {
		g.start(t)
	}
	return g
}

func (g *gateway) start(t *testing.T) {
	t.Helper()
	if err := g.s.Start(context.Background(), g.rt); err != nil {
		t.Fatal(err)
	}
	if !g.s.Ready() {
		t.Fatal("not ready after Start")
	}
}

func conversation(i int) string {
	return strings.Repeat(fmt.Sprintf("conversation %d: the system prompt and the first question. ", i), 30)
}

// route routes text on g and returns the ticket (left in flight).
func (g *gateway) route(t *testing.T, text string) *router.Ticket {
	t.Helper()
	p := &prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, MaxTokens: 16, Prompts: 1}
	tk, err := g.rt.Route(g.rt.Prepare(p, "", ""))
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// holds reports whether g's index holds the ticket's blocks on the
// ticket's replica (by name).
func (g *gateway) holds(from *gateway, tk *router.Ticket) bool {
	slot, ok := g.rt.Lookup(from.rt.Name(tk.Replica))
	if !ok {
		return false
	}
	match := g.rt.Index().Match(tk.Request().Blocks, nil)
	return match[slot] == len(tk.Request().Blocks)
}

func done(tk *router.Ticket) { tk.Done(time.Now(), router.Outcome{CachedTokens: -1}) }

// A decision learnt on one gateway (one even before its Syncer started)
// reaches the other's index, and the other routes the conversation's next
// turn to the same replica.
func TestDecisionsReachAnotherGateway(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	a := newGateway(t, url, "t", false, nil)
	early := a.route(t, conversation(0)) // queued before Start
	a.start(t)
	b := newGateway(t, url, "t", true, nil)
	var tks []*router.Ticket
	for i := 1; i <= 5; i++ {
		tks = append(tks, a.route(t, conversation(i)))
	}
	testutil.Eventually(t, within, "a's decisions in b's index", func() bool {
		for _, tk := range append(tks, early) {
			if !b.holds(a, tk) {
				return false
			}
		}
		return true
	})
	for i, tk := range tks {
		next := b.route(t, conversation(i+1)+" and the second turn of it.")
		if next.Replica != tk.Replica {
			t.Errorf("conversation %d: turn 2 on b went to %s, turn 1 on a to %s", i+1, b.rt.Name(next.Replica), a.rt.Name(tk.Replica))
		}
		done(next)
		done(tk)
	}
	done(early)
	testutil.Eventually(t, within, "a counting its batches", func() bool { return a.s.Stats().DecisionsPublished == 6 })
	// Up is receiving: each has read an entry (its own heartbeat at least).
	testutil.Eventually(t, within, "a and b receiving", func() bool { return a.s.Stats().Up && b.s.Stats().Up })
	as, bs := a.s.Stats(), b.s.Stats()
	if as.DecisionsPublished != 6 || bs.DecisionsApplied < 6 || !as.Up || !bs.Up || bs.Peers != 1 {
		t.Fatalf("stats a %+v b %+v", as, bs)
	}
}

// A gateway's loads appear in the other's views, follow its counts, and
// are gone as soon as it closes.
func TestLoadsAreShared(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	a := newGateway(t, url, "t", true, nil)
	b := newGateway(t, url, "t", true, nil)
	var tks []*router.Ticket
	for i := range 4 {
		tks = append(tks, a.route(t, conversation(i)))
	}
	remote := func() (n int64) {
		for i := range b.rt.Replicas() {
			n += b.rt.RemoteLoad(i).InFlight
		}
		return n
	}
	testutil.Eventually(t, within, "a's 4 in-flight requests in b's remote load", func() bool { return remote() == 4 })
	r := tks[0].Replica
	slot, _ := b.rt.Lookup(a.rt.Name(r))
	want := a.rt.LocalLoad(r)
	if got := b.rt.RemoteLoad(slot); got != want {
		t.Fatalf("b's remote load on %s = %+v, a's own %+v", a.rt.Name(r), got, want)
	}
	if b.rt.LocalLoad(slot).InFlight != 0 {
		t.Fatal("a's load counted in b's own")
	}
	req := b.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: "hello", KeyText: "hello", Prompts: 1}, "", "")
	if v := b.rt.Views(req)[slot]; v.InFlight != int(want.InFlight) || v.PendingPrefill != int(want.PendingPrefill) {
		t.Fatalf("b's view of %s: in flight %d, pending prefill %d; a's own %+v", a.rt.Name(r), v.InFlight, v.PendingPrefill, want)
	}
	done(tks[0])
	testutil.Eventually(t, within, "a's finished request leaving b's view", func() bool { return remote() == 3 })
	if err := a.s.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, within, "a's loads gone after its Close", func() bool { return remote() == 0 })
	for _, tk := range tks[1:] {
		done(tk)
	}
}

// ghost publishes a batch as a gateway that then dies: only the TTL
// removes its loads. id "" lets Redis number the entry; a given id is the
// batch's sending time too (readers refuse a batch sent at a time far
// from its entry's).
func ghost(t *testing.T, url, ns, id string, b Batch) {
	t.Helper()
	opt, err := ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	defer c.Close()
	if id == "" {
		id = "*"
	} else if at, ok := idTime(id); ok {
		b.At = at
	}
	if err := c.XAdd(context.Background(), &redis.XAddArgs{Stream: ns + ":batches", ID: id, Values: []any{fieldBatch, AppendBatch(nil, &b)}}).Err(); err != nil {
		t.Fatal(err)
	}
}

func ghostBatch(name string, replica string, inFlight int64, blocks ...uint64) Batch {
	b := Batch{Gateway: name, Seq: 1, At: time.Now(), Loads: []ReplicaLoad{{Replica: replica, Load: router.Load{InFlight: inFlight, PendingCount: inFlight}}}}
	if len(blocks) > 0 {
		b.Decisions = []Decision{{Replica: replica, Model: "m", Tokens: 16 * len(blocks), Blocks: blocks}}
	}
	return b
}

// A gateway that dies without a word leaves its loads for the TTL and no
// longer (on the receiver's clock, here a fake one).
func TestDeadGatewayLoadsExpireAfterTTL(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	clk := clock.NewFake(time.Now())
	const ttl = 2 * time.Second
	b := newGateway(t, url, "t", true, func(o *Options) { o.Clock = clk; o.TTL = ttl })
	ghost(t, url, "t", "", ghostBatch("ghost", "http://r1", 7))
	testutil.Eventually(t, within, "the ghost's load", func() bool { return b.rt.RemoteLoad(1).InFlight == 7 })
	if b.s.Stats().Peers != 1 {
		t.Fatalf("peers %d", b.s.Stats().Peers)
	}
	// The publisher's, the expirer's and the snapshot writer's tickers.
	if !clk.WaitTimers(3, within) {
		t.Fatalf("%d timers armed", clk.Timers())
	}
	clk.Advance(ttl - ttl/4)
	if b.rt.RemoteLoad(1).InFlight != 7 {
		t.Fatal("the load expired before the TTL")
	}
	clk.Advance(ttl / 2)
	testutil.Eventually(t, within, "the ghost's load expiring", func() bool { return b.rt.RemoteLoad(1) == router.Load{} })
	testutil.Eventually(t, within, "the ghost leaving the peers", func() bool { return b.s.Stats().Peers == 0 })
}

// The warm load applies the stream's decisions, old or new, but only the
// loads younger than the TTL (by Redis's clock: an entry's ID).
func TestWarmLoadSkipsExpiredLoads(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	ghost(t, url, "t", "1000-0", ghostBatch("old", "http://r0", 5, 11, 12)) // sent in 1970
	ghost(t, url, "t", "", ghostBatch("new", "http://r2", 3, 21, 22))
	c := newGateway(t, url, "t", true, nil)
	if got := c.rt.RemoteLoad(0); got != (router.Load{}) {
		t.Errorf("an expired heartbeat counts: %+v", got)
	}
	if got := c.rt.RemoteLoad(2).InFlight; got != 3 {
		t.Errorf("a live heartbeat's load %d, want 3", got)
	}
	if !c.rt.Index().Holds(0, 12) || !c.rt.Index().Holds(2, 22) {
		t.Error("the tail's decisions are not in the index")
	}
	if st := c.s.Stats(); st.WarmBatches != 2 || st.Peers != 1 || !st.Warmed {
		t.Errorf("stats %+v", st)
	}
}

// A gateway that starts after the others published routes like them from
// its first request: before Ready it holds the stream's tail, and with a
// snapshot the snapshot and the tail after it.
func TestWarmStart(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	a := newGateway(t, url, "t", true, nil)
	t1 := a.route(t, conversation(1))
	testutil.Eventually(t, within, "a's decision published", func() bool { return a.s.Stats().DecisionsPublished == 1 })

	// From the stream's tail alone.
	c := newGateway(t, url, "t", true, nil)
	if !c.holds(a, t1) {
		t.Fatal("c started without a's decision")
	}
	if st := c.s.Stats(); st.Restored != 0 || st.WarmBatches == 0 {
		t.Fatalf("c's warm load %+v", st)
	}

	// From the snapshot: the stream is then emptied, as trimming would.
	testutil.Eventually(t, within, "a reading its own batch", func() bool { return a.s.Stats().LastID != "0-0" })
	if err := a.s.WriteSnapshot(context.Background()); err != nil {
		t.Fatal(err)
	}
	if a.s.Stats().Snapshots != 1 {
		t.Fatal("a did not write the snapshot")
	}
	// Another gateway in the same period finds the lock taken.
	if err := c.s.WriteSnapshot(context.Background()); err != nil || c.s.Stats().Snapshots != 0 {
		t.Fatalf("c wrote a snapshot in a's period (err %v)", err)
	}
	opt, _ := ParseURL(url)
	rc := redis.NewClient(opt)
	defer rc.Close()
	if err := rc.Del(context.Background(), "t:batches").Err(); err != nil {
		t.Fatal(err)
	}
	t2 := a.route(t, conversation(2))
	testutil.Eventually(t, within, "a's second decision published", func() bool { return a.s.Stats().DecisionsPublished == 2 })
	d := newGateway(t, url, "t", true, nil)
	if !d.holds(a, t1) || !d.holds(a, t2) {
		t.Fatalf("d holds turn 1: %v, turn 2: %v", d.holds(a, t1), d.holds(a, t2))
	}
	if st := d.s.Stats(); st.Restored < len(t1.Request().Blocks) {
		t.Fatalf("d restored %d blocks from the snapshot", st.Restored)
	}
	for _, tk := range []*router.Ticket{t1, t2} {
		done(tk)
	}
}

// A gateway restarted under the same name gets back what it learnt itself
// before (its own entries in the stream), but not its old loads.
func TestRestartUnderTheSameName(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	name := func(o *Options) { o.Gateway = "gw-a" }
	a := newGateway(t, url, "t", true, name)
	tk := a.route(t, conversation(1))
	testutil.Eventually(t, within, "a's decision published", func() bool { return a.s.Stats().DecisionsPublished == 1 })
	if err := a.s.Close(); err != nil {
		t.Fatal(err)
	}
	a2 := newGateway(t, url, "t", true, name)
	if !a2.holds(a, tk) {
		t.Fatal("the restarted gateway lost its own decisions")
	}
	for i := range a2.rt.Replicas() {
		if a2.rt.RemoteLoad(i) != (router.Load{}) {
			t.Fatalf("its old self's load counts on %d", i)
		}
	}
	done(tk)
}

// logCounter counts log records by message prefix.
type logCounter struct {
	mu   sync.Mutex
	msgs []string
}

func (l *logCounter) Enabled(context.Context, slog.Level) bool { return true }
func (l *logCounter) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, r.Message)
	return nil
}
func (l *logCounter) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logCounter) WithGroup(string) slog.Handler      { return l }
func (l *logCounter) count(prefix string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, m := range l.msgs {
		if strings.HasPrefix(m, prefix) {
			n++
		}
	}
	return n
}

const (
	logDown = "shared state: Redis unreachable"
	logUp   = "shared state: Redis reachable"
)

// Redis stopped mid-run: routing goes on without waiting, up drops to 0
// (logged once), and once Redis is back the decisions made meanwhile reach
// the other gateway.
func TestRedisOutageAndCatchUp(t *testing.T) {
	t.Parallel()
	srv := testutil.NewRedis(t)
	logs := &logCounter{}
	reg := prometheus.NewRegistry()
	a := newGateway(t, srv.URL(), "t", true, func(o *Options) { o.Log = slog.New(logs); o.Registerer = reg })
	b := newGateway(t, srv.URL(), "t", true, nil)
	before := a.route(t, conversation(0))
	testutil.Eventually(t, within, "the first decision at b", func() bool { return b.holds(a, before) })

	srv.Stop()
	testutil.Eventually(t, within, "a noticing the outage", func() bool { return !a.s.Stats().Up })
	if v := value(a.s.m.up); v != 0 {
		t.Fatalf("kvgate_shared_state_up %v during the outage", v)
	}
	start := time.Now()
	var during []*router.Ticket
	for i := 1; i <= 20; i++ {
		during = append(during, a.route(t, conversation(i)))
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("20 routes took %v with Redis down", d)
	}
	if st := a.s.Stats(); st.Pending != 20 {
		t.Fatalf("%d decisions pending, want 20", st.Pending)
	}

	testutil.Eventually(t, within, "a failing to publish them", func() bool {
		return value(a.s.m.errors.WithLabelValues("publish")) > 0
	})

	srv.Start()
	testutil.Eventually(t, within, "the outage's decisions at b", func() bool {
		for _, tk := range during {
			if !b.holds(a, tk) {
				return false
			}
		}
		return true
	})
	testutil.Eventually(t, within, "a up again", func() bool { return a.s.Stats().Up })
	if v := value(a.s.m.up); v != 1 {
		t.Fatalf("kvgate_shared_state_up %v after the outage", v)
	}
	if n := logs.count(logDown); n != 1 {
		t.Errorf("the outage logged %d times", n)
	}
	if n := logs.count(logUp); n != 2 { // at Start, and back
		t.Errorf("Redis reachable logged %d times, want 2", n)
	}
	testutil.Eventually(t, within, "a's queue emptied", func() bool { return a.s.Stats().Pending == 0 })
	if st := a.s.Stats(); st.DecisionsDropped != 0 || st.Errors == 0 {
		t.Errorf("a's stats after the outage %+v", st)
	}
	for _, tk := range append(during, before) {
		done(tk)
	}
}

// Redis down at Start: Start returns at once, ready, and the gateway
// serves; when Redis comes up the Syncer warm-loads and shares.
func TestStartWithRedisDown(t *testing.T) {
	t.Parallel()
	srv := testutil.NewRedis(t)
	srv.Stop()
	a := newGateway(t, srv.URL(), "t", false, nil)
	t0 := time.Now()
	a.start(t)
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("Start took %v with Redis down", d)
	}
	if st := a.s.Stats(); st.Up || st.Warmed {
		t.Fatalf("stats with Redis down %+v", st)
	}
	tk := a.route(t, conversation(1))
	srv.Start()
	testutil.Eventually(t, within, "the warm load once Redis is up", func() bool { return a.s.Stats().Warmed })
	b := newGateway(t, srv.URL(), "t", true, nil)
	testutil.Eventually(t, within, "the decision made while Redis was down at b", func() bool { return b.holds(a, tk) })
	done(tk)
}

// Close is bounded even with Redis gone, and leaves no goroutine (goleak
// checks the package).
func TestCloseWithRedisDown(t *testing.T) {
	t.Parallel()
	srv := testutil.NewRedis(t)
	a := newGateway(t, srv.URL(), "t", true, nil)
	srv.Stop()
	testutil.Eventually(t, within, "a noticing the outage", func() bool { return !a.s.Stats().Up })
	t0 := time.Now()
	if err := a.s.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(t0); d > time.Second {
		t.Fatalf("Close took %v", d)
	}
}

// The snapshot loop writes on its period.
func TestSnapshotLoop(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	a := newGateway(t, url, "t", true, func(o *Options) { o.SnapshotEvery = 20 * time.Millisecond })
	tk := a.route(t, conversation(1))
	testutil.Eventually(t, within, "a snapshot", func() bool { return a.s.Stats().Snapshots > 0 })
	opt, _ := ParseURL(url)
	rc := redis.NewClient(opt)
	defer rc.Close()
	data, err := rc.Get(context.Background(), "t:snapshot").Bytes()
	if err != nil {
		t.Fatal(err)
	}
	snap, err := DecodeSnapshot(data)
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Replicas) != 3 || snap.Len() < len(tk.Request().Blocks) {
		t.Fatalf("snapshot of %d replicas, %d blocks", len(snap.Replicas), snap.Len())
	}
	done(tk)
}

// Loads-only (precise mode): decisions are neither queued nor applied,
// loads are shared.
func TestLoadsOnly(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	loadsOnly := func(o *Options) { o.ShareDecisions = false }
	a := newGateway(t, url, "t", true, loadsOnly)
	b := newGateway(t, url, "t", true, loadsOnly)
	tk := a.route(t, conversation(1))
	slot, _ := b.rt.Lookup(a.rt.Name(tk.Replica))
	testutil.Eventually(t, within, "a's load at b", func() bool { return b.rt.RemoteLoad(slot).InFlight == 1 })
	if a.s.Stats().Pending != 0 || a.s.Stats().DecisionsPublished != 0 || b.holds(a, tk) {
		t.Fatal("a decision was shared in loads-only mode")
	}
	done(tk)
}

// The metrics are registered on the given registry under their names.
func TestMetrics(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	reg := prometheus.NewRegistry()
	a := newGateway(t, url, "t", true, func(o *Options) { o.Registerer = reg })
	b := newGateway(t, url, "t", true, nil)
	tk := a.route(t, conversation(1))
	testutil.Eventually(t, within, "the decision at b", func() bool { return b.holds(a, tk) })
	testutil.Eventually(t, within, "a hearing b", func() bool { return a.s.Stats().Peers == 1 })
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series := map[string]int{}
	for _, f := range fams {
		series[f.GetName()] = len(f.GetMetric())
	}
	for name, n := range map[string]int{"kvgate_shared_state_up": 1, "kvgate_shared_state_lag_seconds": 1, "kvgate_shared_state_peers": 1,
		"kvgate_shared_state_decisions_total": 3, "kvgate_shared_state_batches_total": 2, "kvgate_shared_state_bytes_total": 2} {
		if series[name] != n {
			t.Errorf("%s: %d series, want %d", name, series[name], n)
		}
	}
	// a counts a batch once Redis took it and its own read-back checked it,
	// which can be after b already applied it.
	testutil.Eventually(t, within, "a counting its publication", func() bool { return value(a.s.m.decPublished) == 1 })
	if v := value(a.s.m.peers); v != 1 {
		t.Errorf("peers %v", v)
	}
	// Two Syncers on one registry: the second is refused, clearly.
	if _, err := New(Options{URL: url, Registerer: reg}); err == nil {
		t.Error("metrics registered twice")
	}
	done(tk)
}

func TestNewValidates(t *testing.T) {
	t.Parallel()
	for _, o := range []Options{
		{},
		{URL: "http://127.0.0.1:6379"},
		{URL: "unix:///tmp/redis.sock"},
		{URL: "redis://"},
		{URL: "redis://127.0.0.1:6379/x"},
		{URL: "redis://127.0.0.1:6379", Interval: -1},
		{URL: "redis://127.0.0.1:6379", Heartbeat: time.Second, TTL: time.Second},
		{URL: "redis://127.0.0.1:6379", Interval: time.Second, Heartbeat: time.Millisecond},
		{URL: "redis://127.0.0.1:6379", MaxPending: -1},
	} {
		if _, err := New(o); err == nil {
			t.Errorf("New(%+v) accepted", o)
		} else {
			t.Logf("%q: %v", o.URL, err)
		}
	}
	s, err := New(Options{URL: "redis://:secret@127.0.0.1:6379/2"})
	if err != nil {
		t.Fatal(err)
	}
	if s.o.Namespace != "kvgate" || s.o.Interval != DefaultInterval || s.o.Heartbeat != DefaultHeartbeat || s.o.TTL != DefaultTTL ||
		s.o.Timeout != DefaultTimeout || s.o.MaxPending != DefaultMaxPending || s.o.StreamMaxLen != DefaultStreamMaxLen || s.o.Gateway == "" {
		t.Fatalf("defaults %+v", s.o)
	}
	if s.ro.DB != 2 || s.ro.Password != "secret" {
		t.Fatalf("parsed %+v", s.ro)
	}
	if err := s.Close(); err != nil { // never started
		t.Fatal(err)
	}
}

// OnLearn before Start queues a bounded number of decisions; beyond it the
// oldest are dropped and counted, and the newest are published.
func TestPendingIsBounded(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	a := newGateway(t, url, "t", false, func(o *Options) { o.MaxPending = 3 })
	var tks []*router.Ticket
	for i := range 5 {
		tks = append(tks, a.route(t, conversation(i)))
	}
	if st := a.s.Stats(); st.Pending != 3 || st.DecisionsDropped != 2 {
		t.Fatalf("pending %d dropped %d", st.Pending, st.DecisionsDropped)
	}
	a.start(t)
	b := newGateway(t, url, "t", true, nil)
	testutil.Eventually(t, within, "the 3 newest decisions at b", func() bool {
		return b.holds(a, tks[2]) && b.holds(a, tks[3]) && b.holds(a, tks[4])
	})
	if b.holds(a, tks[0]) || b.holds(a, tks[1]) {
		t.Error("a dropped decision arrived")
	}
	for _, tk := range tks {
		done(tk)
	}
}

func TestRing(t *testing.T) {
	t.Parallel()
	r := ring{max: 4}
	l := func(i int) router.Learned { return router.Learned{Tokens: i} }
	for i := range 3 {
		if r.push(l(i)) {
			t.Fatal("dropped below the bound")
		}
	}
	got, end := r.peek(2)
	if len(got) != 2 || got[0].Tokens != 0 || got[1].Tokens != 1 || end != 2 {
		t.Fatalf("peek %v %d", got, end)
	}
	// Pushes overwrite the oldest while the batch is out.
	for i := 3; i < 7; i++ {
		r.push(l(i))
	}
	if r.n != 4 || r.first != 3 {
		t.Fatalf("n %d first %d", r.n, r.first)
	}
	r.discard(end) // already overwritten: nothing more goes
	if r.n != 4 {
		t.Fatalf("discard dropped newer decisions: n %d", r.n)
	}
	got, end = r.peek(10)
	if len(got) != 4 || got[0].Tokens != 3 || got[3].Tokens != 6 || end != 7 {
		t.Fatalf("peek %v %d", got, end)
	}
	r.discard(end)
	if r.n != 0 {
		t.Fatalf("n %d", r.n)
	}
}

// The cost of sharing, measured (KVGATE_BENCH=1; the README quotes it):
// 4 gateways in front of 8 replicas routing 1,000 requests/s between them,
// each request 60 blocks new to its replica, for 2 s. Redis's own command counts (INFO
// commandstats) give the operations per second.
func TestSharingCostLive(t *testing.T) {
	if os.Getenv("KVGATE_BENCH") == "" {
		t.Skip("a 2 s measurement: KVGATE_BENCH=1")
	}
	const gateways, rate, seconds = 4, 1000, 2
	srv := testutil.NewRedis(t)
	var replicas []string
	for i := range 8 {
		replicas = append(replicas, fmt.Sprintf("http://10.0.0.%d:8000", i+1))
	}
	var gws []*gateway
	for range gateways {
		gws = append(gws, newGatewayOf(t, replicas, srv.URL(), "t", true, nil))
	}
	opt, _ := ParseURL(srv.URL())
	rc := redis.NewClient(opt)
	defer rc.Close()
	ctx := context.Background()
	if err := rc.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	// 60 blocks of 16 tokens of about 4 characters: 3,840 characters.
	text := func(g, i int) string {
		return fmt.Sprintf("gateway %d request %d ", g, i) + strings.Repeat(fmt.Sprintf("unique text %d-%d ", g, i), 240)[:3840]
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	routed := 0
	for gi, g := range gws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tick := time.NewTicker(time.Second * gateways / rate)
			defer tick.Stop()
			for i := range rate / gateways * seconds {
				<-tick.C
				p := &prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text(gi, i), KeyText: text(gi, i), MaxTokens: 16, Prompts: 1}
				tk, err := g.rt.Route(g.rt.Prepare(p, "", ""))
				if err != nil {
					t.Error(err)
					return
				}
				done(tk)
				mu.Lock()
				routed++
				mu.Unlock()
			}
		}()
	}
	start := time.Now()
	wg.Wait()
	testutil.Eventually(t, within, "every decision published", func() bool {
		for _, g := range gws {
			if g.s.Stats().Pending != 0 {
				return false
			}
		}
		return true
	})
	elapsed := time.Since(start).Seconds()
	info, err := rc.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]int{}
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
		if !ok {
			continue
		}
		n, _ := strconv.Atoi(strings.SplitN(rest, ",", 2)[0])
		calls[strings.TrimPrefix(name, "cmdstat_")] = n
	}
	var st Stats
	for _, g := range gws {
		s := g.s.Stats()
		st.DecisionsPublished += s.DecisionsPublished
		st.BatchesPublished += s.BatchesPublished
		st.BytesPublished += s.BytesPublished
		st.BytesReceived += s.BytesReceived
	}
	t.Logf("%d gateways, %d requests in %.2f s (%.0f req/s)", gateways, routed, elapsed, float64(routed)/elapsed)
	t.Logf("published: %d decisions in %d batches (%.2f decisions/batch), %.0f bytes/decision with the heartbeats",
		st.DecisionsPublished, st.BatchesPublished, float64(st.DecisionsPublished)/float64(st.BatchesPublished), float64(st.BytesPublished)/float64(st.DecisionsPublished))
	t.Logf("Redis: XADD %.0f/s, XREAD %.0f/s, all commands %.0f/s; into Redis %.0f KB/s, out of it %.0f KB/s",
		float64(calls["xadd"])/elapsed, float64(calls["xread"])/elapsed, float64(sum(calls))/elapsed,
		float64(st.BytesPublished)/elapsed/1000, float64(st.BytesReceived)/elapsed/1000)
	t.Logf("commands: %v", calls)
}

func sum(m map[string]int) (n int) {
	for _, v := range m {
		n += v
	}
	return n
}

// value reads a gauge or counter.
func value(c prometheus.Metric) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	if m.Gauge != nil {
		return m.Gauge.GetValue()
	}
	return m.Counter.GetValue()
}

// Redis hung (frozen: connections open, no answer): every command gives up
// after its timeout, routing never waits, up drops to 0, Close is bounded,
// and the other gateway recovers when Redis thaws.
func TestRedisHung(t *testing.T) {
	t.Parallel()
	srv := testutil.NewRedis(t)
	a := newGateway(t, srv.URL(), "t", true, nil)
	b := newGateway(t, srv.URL(), "t", true, nil)
	testutil.Eventually(t, within, "a and b hearing each other", func() bool {
		return a.s.Stats().Peers == 1 && b.s.Stats().Peers == 1
	})
	srv.Pause()
	defer srv.Resume()
	start := time.Now()
	var tks []*router.Ticket
	for i := range 20 {
		tks = append(tks, a.route(t, conversation(i)))
	}
	if d := time.Since(start); d > time.Second {
		t.Fatalf("20 routes took %v with Redis hung", d)
	}
	testutil.Eventually(t, within, "a noticing", func() bool { return !a.s.Stats().Up })
	t0 := time.Now()
	if err := a.s.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(t0); d > 2*time.Second {
		t.Fatalf("Close took %v with Redis hung", d)
	}
	srv.Resume()
	b2 := b.route(t, conversation(100))
	testutil.Eventually(t, within, "b publishing again", func() bool { return b.s.Stats().Up && b.s.Stats().DecisionsPublished == 1 })
	for _, tk := range append(tks, b2) {
		done(tk)
	}
}

// A backlog read late (after a partition): each entry's age is taken from
// the newest entry read, so a dead gateway's old heartbeat is expired on
// arrival while a live one's stands.
func TestBacklogAges(t *testing.T) {
	t.Parallel()
	s, err := New(Options{URL: "redis://127.0.0.1:1", ShareDecisions: true, Log: quiet(), Clock: clock.NewFake(time.Time{})})
	if err != nil {
		t.Fatal(err)
	}
	s.rt = testRouter(t, replicaNames...)
	s.peers = NewPeers(s.rt, s.o.Gateway, s.o.TTL)
	entry := func(id string, b Batch) redis.XMessage {
		b.At, _ = idTime(id)
		return redis.XMessage{ID: id, Values: map[string]any{fieldBatch: string(AppendBatch(nil, &b))}}
	}
	base := int64(1_767_225_600_000)
	msgs := []redis.XMessage{
		entry(fmt.Sprintf("%d-0", base), ghostBatch("dead", "http://r0", 4, 1, 2)),
		entry(fmt.Sprintf("%d-0", base+DefaultTTL.Milliseconds()+500), ghostBatch("live", "http://r1", 2)),
		{ID: fmt.Sprintf("%d-1", base+DefaultTTL.Milliseconds()+500), Values: map[string]any{"x": "y"}}, // not a batch
	}
	s.apply(msgs, time.Time{}, false)
	if got := s.rt.RemoteLoad(0); got != (router.Load{}) {
		t.Errorf("the dead gateway's old heartbeat counts: %+v", got)
	}
	if got := s.rt.RemoteLoad(1).InFlight; got != 2 {
		t.Errorf("the live gateway's load %d", got)
	}
	if !s.rt.Index().Holds(0, 2) {
		t.Error("the old decision was not applied")
	}
	if st := s.Stats(); st.Peers != 1 || st.LastID != msgs[2].ID || st.Dropped != 1 || st.Errors != 0 || st.DecisionsApplied != 1 {
		t.Errorf("stats %+v", st)
	}
}
