package replay

import (
	"fmt"
	"hash/fnv"
	"slices"
	"time"

	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sharedstate"
)

// Several gateways in front of one fleet (issue #14). Clients reach them
// through a plain load balancer (a Kubernetes Service): each request goes to
// the next gateway in turn, so the turns of one conversation land on
// different gateways. Each gateway is a router.Router of its own, with its
// own policy instance (built with the same options, as gateways deployed
// from one configuration are; with SyncShared its seed mixed with the
// gateway's id, as the live gateway's), its own counts, index and router
// queue; every
// gateway scrapes every replica and, in precise mode, follows every
// replica's KV events.
//
// With SyncShared each gateway publishes what the live gateway's
// sharedstate.Syncer publishes through Redis, a sharedstate.Batch: the
// decisions its index learnt since its last batch (router.Config.OnLearn;
// none in precise mode, where every gateway follows the replicas' own
// events and the gateway shares loads only) and its own counts for the
// replicas. As the Syncer, it looks every sharedstate.DefaultInterval (its
// ticks; a tick with nothing new costs nothing here, so only ticks that
// may publish are events) and publishes when decisions are queued, when its
// counts changed since its last batch, or when sharedstate.DefaultHeartbeat
// has passed since it (sharedstate.DefaultTTL is far longer, so a live
// gateway's loads never expire). A batch reaches every other gateway
// SyncDelay later, where sharedstate.Peers.Apply, the live gateway's code,
// applies it.

// GatewaySync is how several gateways share their state.
type GatewaySync string

// Gateway sync modes.
const (
	// SyncShared: each gateway's decisions and loads reach the others
	// SyncDelay after it publishes them.
	SyncShared GatewaySync = "shared"
	// SyncNone: the gateways know nothing of each other.
	SyncNone GatewaySync = "none"
)

// SyncLoads is when a gateway publishes its load counts.
type SyncLoads string

// Load publishing modes.
const (
	// LoadsOnChange: at the next tick after they change (the Syncer's
	// rule), and with every batch.
	LoadsOnChange SyncLoads = "change"
	// LoadsWithBatches: only with batches of decisions and on the
	// heartbeat: what loads cost to keep fresh (an experiment; the Syncer
	// publishes on change).
	LoadsWithBatches SyncLoads = "batch"
)

// MaxGateways bounds Config.Gateways.
const MaxGateways = 64

// gatewayState is one gateway of a run.
type gatewayState struct {
	name   string
	router *router.Router
	peers  *sharedstate.Peers // nil: no sync (one gateway, or SyncNone)
	phase  time.Duration      // its ticks are at phase + k·sharedstate.DefaultInterval

	pending   []sharedstate.Decision    // learnt since its last batch
	scheduled bool                      // an evPublish (its next tick) is in the heap
	seq       uint64                    // its last batch's number
	last      time.Duration             // when it last published
	loads     []sharedstate.ReplicaLoad // its loads in its last batch
	heard     []bool                    // per gateway: a batch of it arrived here
	heardN    int                       // gateways heard
}

// inTransit is a published batch on its way to the other gateways.
type inTransit struct {
	from  int
	batch *sharedstate.Batch
}

// syncStats count what the gateways published.
type syncStats struct {
	batches, decisions, blocks, applied int64
	bytes, decisionBytes                int64 // encoded (sharedstate.AppendBatch)
	// expired counts deliveries after which a gateway saw fewer live
	// peers than it had heard from: a heartbeat outlived by the TTL (none
	// should be, since every gateway lives to the end).
	expired int64
	buf     []byte
}

// sharing reports whether the run's gateways share state.
func (vr *virtualRun) sharing() bool {
	return len(vr.gateways) > 1 && vr.cfg.GatewaySync == SyncShared
}

// gatewayName is gateway g's name in its batches.
func gatewayName(g int) string { return fmt.Sprintf("gateway-%d", g) }

// policySeed is the seed of gateway's policy when the gateways share
// state: the configured seed mixed with the gateway's id, so that gateways
// deployed from one configuration do not break every tie alike.
// TODO(#14): the gateway's own rule (internal/gateway policySeed), written
// twice until it moves to internal/sharedstate.
func policySeed(seed uint64, gateway string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(gateway))
	return seed ^ h.Sum64()
}

// gatewayOf is the gateway request number n (in arrival order) reaches.
func (vr *virtualRun) gatewayOf(n int) int { return n % len(vr.gateways) }

// startSync sets up the shared state of a run with several gateways: each
// gateway's Peers, its decisions hook (not in precise mode), its ticks'
// phase and its first heartbeat.
func (vr *virtualRun) startSync() {
	if !vr.sharing() {
		return
	}
	n := len(vr.gateways)
	for g := range vr.gateways {
		gw := &vr.gateways[g]
		gw.peers = sharedstate.NewPeers(gw.router, gw.name, 0)
		// The gateways' tickers are not in step: spread over the period.
		gw.phase = time.Duration(g) * sharedstate.DefaultInterval / time.Duration(n)
		gw.heard = make([]bool, n)
		// Its first tick publishes at once, so that the others know of it.
		vr.events.push(gw.phase, evHeartbeat, int32(g))
	}
}

// onLearn is gateway g's router.Config.OnLearn when it shares decisions.
func (vr *virtualRun) onLearn(g int) func(router.Learned) {
	return func(l router.Learned) {
		gw := &vr.gateways[g]
		gw.pending = append(gw.pending, sharedstate.FromLearned(gw.router, l))
		vr.wakeSync(g)
	}
}

// loadsChanged tells gateway g's syncer that its counts may have changed.
func (vr *virtualRun) loadsChanged(g int) {
	if vr.sharing() && vr.cfg.SyncLoads == LoadsOnChange {
		vr.wakeSync(g)
	}
}

// wakeSync has gateway g look at its next tick (at or after now).
func (vr *virtualRun) wakeSync(g int) {
	gw := &vr.gateways[g]
	if !gw.scheduled {
		gw.scheduled = true
		vr.events.push(nextTick(vr.now, gw.phase, sharedstate.DefaultInterval), evPublish, int32(g))
	}
}

// nextTick is the first instant phase + k·period (k ≥ 0) at or after now.
func nextTick(now, phase, period time.Duration) time.Duration {
	if now <= phase {
		return phase
	}
	k := (now - phase + period - 1) / period
	return phase + k*period
}

// publishTick is a tick of gateway g that may publish: a batch when
// decisions are queued or (LoadsOnChange) its loads changed since its last
// batch.
func (vr *virtualRun) publishTick(g int) {
	gw := &vr.gateways[g]
	gw.scheduled = false
	loads := vr.loadsOf(g)
	if len(gw.pending) > 0 || (vr.cfg.SyncLoads == LoadsOnChange && !slices.Equal(loads, gw.loads)) {
		vr.publish(g, loads)
	}
}

// heartbeat is the tick of gateway g at which DefaultHeartbeat has passed
// since its last batch: it publishes, if nothing did since; its next
// heartbeat is scheduled while requests remain.
func (vr *virtualRun) heartbeat(g int) {
	gw := &vr.gateways[g]
	if gw.seq == 0 || vr.now-gw.last >= sharedstate.DefaultHeartbeat {
		vr.publish(g, vr.loadsOf(g))
	}
	if vr.ended < len(vr.plan.reqs) {
		vr.events.push(nextTick(gw.last+sharedstate.DefaultHeartbeat, gw.phase, sharedstate.DefaultInterval), evHeartbeat, int32(g))
	}
}

// loadsOf is gateway g's counts as its Syncer publishes them: the
// replicas it has requests on (Peers reads a missing one as zero).
func (vr *virtualRun) loadsOf(g int) []sharedstate.ReplicaLoad {
	return slices.DeleteFunc(sharedstate.Loads(vr.gateways[g].router), func(l sharedstate.ReplicaLoad) bool {
		return l.Load == router.Load{}
	})
}

// publish sends gateway g's batch: its queued decisions and its loads, to
// reach the others SyncDelay later.
func (vr *virtualRun) publish(g int, loads []sharedstate.ReplicaLoad) {
	gw := &vr.gateways[g]
	gw.seq++
	b := &sharedstate.Batch{
		Gateway: gw.name, Seq: gw.seq, At: epoch.Add(vr.now),
		Decisions: gw.pending, Loads: loads,
	}
	gw.pending, gw.last, gw.loads = nil, vr.now, loads
	vr.countBatch(b)
	vr.syncInFlight.push(inTransit{from: g, batch: b})
	vr.events.push(vr.now+vr.cfg.SyncDelay, evSync, 0)
}

// deliverSync hands the oldest batch in transit to every other gateway's
// Peers, as the live gateway applies what Redis brings.
func (vr *virtualRun) deliverSync() {
	t := vr.syncInFlight.pop()
	at := epoch.Add(vr.now)
	for g := range vr.gateways {
		if g == t.from {
			continue
		}
		gw := &vr.gateways[g]
		applied, _ := gw.peers.Apply(t.batch, at) // a gateway's own records pass
		vr.sync.applied += int64(applied)
		if !gw.heard[t.from] {
			gw.heard[t.from] = true
			gw.heardN++
		}
		if gw.peers.Live() < gw.heardN {
			vr.sync.expired++
		}
	}
}

// afterLast reports (and drops) a sync event once every request has
// ended: nothing will be routed again, and a long delay would otherwise
// lengthen the run.
func (vr *virtualRun) afterLast(ev event) bool {
	if vr.ended < len(vr.plan.reqs) {
		return false
	}
	switch ev.kind {
	case evSync:
		vr.syncInFlight.pop()
		return true
	case evPublish, evHeartbeat, evWake, evExpire:
		return true
	}
	return false
}

// countBatch adds b to the run's sync statistics: its size encoded as
// the Syncer sends it, and the share of its decisions.
func (vr *virtualRun) countBatch(b *sharedstate.Batch) {
	st := &vr.sync
	st.batches++
	st.decisions += int64(len(b.Decisions))
	for i := range b.Decisions {
		st.blocks += int64(len(b.Decisions[i].Blocks))
	}
	st.buf = sharedstate.AppendBatch(st.buf[:0], b)
	n := len(st.buf)
	st.bytes += int64(n)
	if len(b.Decisions) > 0 {
		loadsOnly := *b
		loadsOnly.Decisions = nil
		st.buf = sharedstate.AppendBatch(st.buf[:0], &loadsOnly)
		st.decisionBytes += int64(n - len(st.buf))
	}
}

// syncSummary adds the gateways' figures to a run's extra.
func (vr *virtualRun) syncSummary(extra map[string]float64) {
	if len(vr.gateways) == 1 {
		return
	}
	extra["gateways"] = float64(len(vr.gateways))
	if !vr.sharing() {
		return
	}
	s := vr.sync
	extra["sync_delay_ms"] = float64(vr.cfg.SyncDelay) / float64(time.Millisecond)
	extra["sync_batches"] = float64(s.batches)
	extra["sync_decisions"] = float64(s.decisions)
	extra["sync_decisions_applied"] = float64(s.applied)
	extra["sync_blocks"] = float64(s.blocks)
	extra["sync_bytes"] = float64(s.bytes)
	if s.decisions > 0 {
		extra["sync_bytes_per_decision"] = float64(s.decisionBytes) / float64(s.decisions)
	}
	if s.expired > 0 {
		extra["sync_peers_expired"] = float64(s.expired)
	}
	if vr.now > 0 {
		extra["sync_batches_per_s"] = float64(s.batches) / vr.now.Seconds()
	}
}
