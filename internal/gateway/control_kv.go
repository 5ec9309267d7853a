package gateway

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
	"github.com/kvgate/kvgate/internal/router"
)

// replayTimeout bounds one exchange with a replica's replay endpoint.
const replayTimeout = 2 * time.Second

// kvState is the control plane's own KV-event state beside the router's
// follower: the rate limits of the logs and of the replay dials, what the
// listening socket checks publishers against (control_kvlisten.go), and
// what each replica's topic named.
type kvState struct {
	logs    sync.Map // key (replica name and cause) → *logGate
	replays sync.Map // replica name → *replayGate
	logged  sync.Map // replica name + cause already logged (logOnce)
	// models is, per target (slot → string), the model its KV-event topic
	// last named.
	models        sync.Map
	unknownTopics atomic.Int64 // batches with an unknown topic (logging bound)
	// topics maps kv_events_listen topics to targets; rebuilt when the
	// membership changes.
	topics atomic.Pointer[kvTopics]
	// book knows the replicas' addresses (kv_events_listen; nil before).
	book atomic.Pointer[kvzmq.AddrBook]
	// conns counts the listening socket's connections refused or closed,
	// by reason (registered when it listens).
	conns atomic.Pointer[prometheus.CounterVec]
}

// forget drops what is kept of a forgotten replica: its logged-once
// causes and the model its topic named.
func (s *kvState) forget(f router.Forgotten) {
	s.logged.Range(func(k, _ any) bool {
		if strings.HasPrefix(k.(string), f.Name+"\x00") {
			s.logged.Delete(k)
		}
		return true
	})
	s.models.Delete(f.Slot)
}

// kvLogEvery: at most one line per replica and cause this often. The
// lines between are counted in the next one ("suppressed"), and the
// metrics count every event: a stream out of order, or a forger, cannot
// flood the log.
const kvLogEvery = time.Minute

// logGate rate-limits one kind of line.
type logGate struct {
	mu         sync.Mutex
	last       time.Time
	logged     bool
	suppressed int
}

// pass reports whether a line may be written at now, and how many were
// suppressed since the last one.
func (l *logGate) pass(now time.Time) (ok bool, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.logged && now.Sub(l.last) < kvLogEvery {
		l.suppressed++
		return false, 0
	}
	suppressed, l.suppressed = l.suppressed, 0
	l.last, l.logged = now, true
	return true, suppressed
}

// logEvery logs msg at most once per kvLogEvery per key (a bounded set:
// replica names and causes, or the listening socket's reasons).
func (c *control) logEvery(key string, level slog.Level, msg string, args ...any) {
	v, _ := c.kv.logs.LoadOrStore(key, &logGate{})
	ok, n := v.(*logGate).pass(c.clock.Now())
	if !ok {
		return
	}
	if n > 0 {
		args = append(args, "suppressed", n)
	}
	c.log.Log(context.Background(), level, msg+" (logged at most once a minute; the metrics count every one)", args...)
}

// logKV logs msg about replica name at most once per kvLogEvery per cause.
func (c *control) logKV(name, cause string, level slog.Level, msg string, args ...any) {
	c.logEvery(name+"\x00"+cause, level, msg, append([]any{"replica", name}, args...)...)
}

// Replay dials per replica: at most one in flight, and kvReplayBurst at
// most, refilled one per kvReplayEvery (a token bucket). Each dial makes
// the replica send its buffer from the gap on (up to 10,000 batches from a
// restart), so a stream out of order must not make it do that per batch;
// the burst lets a few real gaps in a row (a subscriber's HWM drops come
// in bursts) still be filled.
const (
	kvReplayEvery = time.Second
	kvReplayBurst = 3
)

// errReplayThrottled: a replay asked for while one was in flight or past
// the rate; the batch is applied without it (the replica falls out of
// sync, as after a failed replay, until a later one fills it).
var errReplayThrottled = errors.New("replay skipped: asked too often (at most one in flight, one a second)")

// replayGate is one replica's replay rate limit.
type replayGate struct {
	mu     sync.Mutex
	busy   bool
	tokens float64
	at     time.Time // when tokens was counted
	used   bool      // a dial was made (tokens start full)
}

// begin reports whether a dial may start at now, and marks it in flight.
func (r *replayGate) begin(now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.used {
		r.tokens, r.at, r.used = kvReplayBurst, now, true
	}
	r.tokens = min(kvReplayBurst, r.tokens+now.Sub(r.at).Seconds()/kvReplayEvery.Seconds())
	r.at = now
	if r.busy || r.tokens < 1 {
		return false
	}
	r.tokens--
	r.busy = true
	return true
}

func (r *replayGate) end() {
	r.mu.Lock()
	r.busy = false
	r.mu.Unlock()
}

// runKVEvents follows every replica's KV events until ctx ends: it dials
// the endpoints configured per replica (each rank of a data-parallel one on
// its own port) and, with kv_events_listen, binds the socket replicas
// connect to. Every batch goes through the router's one follower.
func (c *control) runKVEvents(ctx context.Context) {
	now := c.clock.Now()
	for i := range c.rt.Replicas() {
		if r := c.rt.Replica(i); r.KVEvents() != "" || c.cfg.KVEventsListen != "" {
			r.KVStart(now)
		}
	}
	var closers []func() error
	if c.cfg.KVEventsListen != "" {
		closers = append(closers, c.listenKV(ctx)...)
	}
	var wg sync.WaitGroup
	for i := range c.rt.Replicas() {
		r := c.rt.Replica(i)
		switch {
		case r.KVEvents() != "":
			if sub := c.subscribeKV(ctx, i); sub != nil {
				closers = append(closers, sub.Close)
			}
		case r.KVReplay() != "": // listen mode: what it buffered, without waiting for its first batch
			wg.Add(1)
			go func() { defer wg.Done(); c.resyncAtStart(ctx, i) }()
		}
	}
	c.watchKVSilence(ctx)
	wg.Wait()
	for _, c := range closers {
		_ = c()
	}
}

// resyncAtStart asks replica i's replay endpoint for everything it holds,
// once the replica is listed (a replay names no model: its events are
// hashed under the replica's listed base model).
func (c *control) resyncAtStart(ctx context.Context, i int) {
	if c.rt.Replica(i).KVReplay() == "" || !c.waitListed(ctx, i) {
		return
	}
	c.reportKV(i, c.rt.ResyncKV(i, c.clock.Now(), c.resyncFor(ctx, i)))
}

// listedPoll is how often a replica's first listing is looked for.
const listedPoll = 20 * time.Millisecond

// waitListed waits until replica i's models are listed (its first passing
// health check), or ctx ends (false), unless a topic named its model.
func (c *control) waitListed(ctx context.Context, i int) bool {
	for c.rt.Replica(i).Served() == nil && c.kvModel(i) == "" {
		if !clock.Sleep(c.clock, listedPoll, ctx.Done()) {
			return false
		}
	}
	return true
}

// subscribeKV dials replica i's publisher; on each connection it first asks
// the replay endpoint (if any) for what was published before.
func (c *control) subscribeKV(ctx context.Context, i int) *kvzmq.Subscriber {
	r := c.rt.Replica(i)
	sub, err := kvzmq.SubscribeWithOptions(ctx, r.KVEvents(), "",
		func(m kvevents.Message) { c.onKVMessage(ctx, i, m) }, nil,
		kvzmq.SubscribeOptions{
			MaxFrameBytes: c.cfg.KVEventsMaxFrameBytes,
			OnConnect:     func() { c.resyncAtStart(ctx, i) },
			OnError: func(err error) {
				c.log.Debug("kv events", "replica", r.Name(), "endpoint", r.KVEvents(), "err", err)
			}})
	if err != nil {
		c.log.Error("kv events: cannot subscribe; the replica stays on the approximate index",
			"replica", r.Name(), "endpoint", r.KVEvents(), "err", err)
		return nil
	}
	return sub
}

// onKVMessage follows one batch of replica i. A batch whose topic names no
// model (vLLM's default topic is "") waits for the replica's first listing,
// which names it.
func (c *control) onKVMessage(ctx context.Context, i int, m kvevents.Message) {
	km := router.KVFromWire(m)
	if km.Model != "" {
		c.kv.models.Store(i, km.Model)
	} else if !c.waitListed(ctx, i) {
		return
	}
	c.reportKV(i, c.rt.FollowKV(i, km, c.clock.Now(), c.resyncFor(ctx, i)))
	c.met.kvBatches.WithLabelValues(c.rt.Name(i)).Inc()
}

// resyncFor is replica i's replay endpoint as the follower asks it (nil
// without one), within the replica's replay rate (replayGate).
func (c *control) resyncFor(ctx context.Context, i int) router.Resync {
	ep := c.rt.Replica(i).KVReplay()
	if ep == "" {
		return nil
	}
	return func(from uint64) ([]router.KVMessage, error) {
		v, _ := c.kv.replays.LoadOrStore(c.rt.Name(i), &replayGate{})
		gate := v.(*replayGate)
		if !gate.begin(c.clock.Now()) {
			return nil, errReplayThrottled
		}
		defer gate.end()
		ctx, cancel := context.WithTimeout(ctx, replayTimeout)
		defer cancel()
		var out []router.KVMessage
		model := "" // a replay's batches name no model (vLLM's 3-frame form): the live topic's
		if m := c.kvModel(i); m != "" {
			model = m
		}
		_, err := kvzmq.ReplayWithOptions(ctx, ep, from, func(m kvevents.Message) {
			km := router.KVFromWire(m)
			if km.Model == "" {
				km.Model = model
			}
			out = append(out, km)
		}, kvzmq.ReplayOptions{MaxFrameBytes: c.cfg.KVEventsMaxFrameBytes})
		return out, err
	}
}

// kvModel is the model replica i's KV-event topic last named ("": none).
func (c *control) kvModel(i int) string {
	if m, ok := c.kv.models.Load(i); ok {
		return m.(string)
	}
	return ""
}

// reportKV turns what following a batch did into metrics and logs (each
// kind of line at most once a minute per replica: logKV).
func (c *control) reportKV(i int, rep router.KVReport) {
	name := c.rt.Name(i)
	if rep.Replayed > 0 {
		c.met.kvReplayed.WithLabelValues(name).Add(float64(rep.Replayed))
	}
	switch {
	case errors.Is(rep.ResyncErr, errReplayThrottled):
		c.logKV(name, "replay_throttled", slog.LevelInfo, "kv events: a replay skipped, the replica's replay endpoint "+
			"was asked too often; the replica follows the fallback rule until resynchronised", "err", rep.ResyncErr)
	case rep.ResyncErr != nil:
		c.logKV(name, "replay_error", slog.LevelWarn, "kv events: the replay endpoint failed; the replica follows the fallback rule "+
			"(its reported blocks count, their absence does not) until resynchronised", "err", rep.ResyncErr)
	}
	switch {
	case rep.Gap:
		c.met.kvGaps.WithLabelValues(name).Inc()
		c.logKV(name, "gap", slog.LevelWarn, "kv events: sequence gap", "expected", rep.Expected,
			"filled_from_replay", rep.Replayed, "in_sync", rep.Synced)
	case rep.Restart:
		c.logKV(name, "restart", slog.LevelInfo, "kv events: the replica's publisher restarted; its precise index starts over",
			"in_sync", rep.Synced)
	case rep.SyncChanged:
		c.logKV(name, "sync", slog.LevelInfo, "kv events: sync changed", "in_sync", rep.Synced, "replayed", rep.Replayed)
	}
	for _, d := range rep.Drops {
		c.met.kvDropped.WithLabelValues(name, d.Reason).Inc()
		level := slog.LevelWarn
		if d.Reason == "unknown_parent" {
			level = slog.LevelInfo // expected after a late join: the parent was stored before we listened
		}
		c.logKV(name, d.Reason, level, "kv events: stored blocks dropped from the precise index", "reason", d.Reason, "err", d.Err)
	}
	c.checkBlockSize(i, rep.BlockSize)
}

// checkBlockSize counts (and logs once) events whose block size is not the
// one the replica's cache_config_info reports: the events are used, but a
// replica and its publisher disagreeing is a misconfiguration to look at.
func (c *control) checkBlockSize(i, events int) {
	m, _, ok := c.rt.ReplicaMetrics(i)
	if events == 0 || !ok || m.EngineBlockSize == 0 || m.EngineBlockSize == events {
		return
	}
	c.met.kvBlockSizeMismatch.WithLabelValues(c.rt.Name(i)).Inc()
	c.LogOnce(i, "block_size_mismatch", slog.LevelWarn, "kv events: the events' block size differs from the replica's "+
		"vllm:cache_config_info", "events_block_size", events, "metrics_block_size", m.EngineBlockSize)
}

func (c *control) LogOnce(i int, cause string, level slog.Level, msg string, args ...any) {
	if _, logged := c.kv.logged.LoadOrStore(c.rt.Name(i)+"\x00"+cause, true); logged {
		return
	}
	c.log.Log(context.Background(), level, msg, append([]any{"replica", c.rt.Name(i)}, args...)...)
}

// kvSilence is how long a replica configured for KV events may send none
// before kvgate warns: vLLM publishes a batch for every step that stores or
// evicts a block, so a minute of silence under traffic is a misconfigured
// publisher (endpoint, topic, --kv-events-config), not a quiet engine.
const kvSilence = time.Minute

// watchKVSilence warns once when a replica's KV events stop for kvSilence,
// and notes once when they come back, until ctx ends.
func (c *control) watchKVSilence(ctx context.Context) {
	tick := c.clock.NewTicker(kvSilence / 4)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
		}
		for i := range c.rt.Replicas() {
			r := c.rt.Replica(i)
			if (r.KVEvents() == "" && c.cfg.KVEventsListen == "") || r.Removed() {
				continue
			}
			changed, silent := r.KVSilence(c.clock.Now(), kvSilence)
			switch {
			case changed && silent:
				c.log.Warn("kv events: none received for a minute; the replica is routed on the approximate index. "+
					"Check the replica's KV-event publisher (vLLM --kv-events-config) and this endpoint",
					"replica", r.Name(), "endpoint", kvEndpointOf(r, c.cfg.KVEventsListen))
			case changed:
				c.log.Info("kv events: arriving again", "replica", r.Name())
			}
		}
	}
}

// kvEndpointOf is where replica r's events should come from.
func kvEndpointOf(r *router.Replica, listen string) string {
	if r.KVEvents() != "" {
		return r.KVEvents()
	}
	return listen + " (listening)"
}

// hostPort is a replica URL's host:port (the scheme's default port when
// it names none), lowercased.
func hostPort(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return ""
	}
	port := p.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[p.Scheme]
	}
	return strings.ToLower(net.JoinHostPort(p.Hostname(), port))
}
