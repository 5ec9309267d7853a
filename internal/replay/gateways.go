package replay

import (
	"fmt"
	"time"

	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sharedstate"
)

// Several gateways in front of one fleet (issue #14). Clients reach them
// through a plain load balancer (a Kubernetes Service): each request goes to
// the next gateway in turn, so the turns of one conversation land on
// different gateways. Each gateway is a router.Router of its own, with its
// own policy instance (built with the same options, as gateways deployed
// from one configuration are), its own counts, index and router queue; every
// gateway scrapes every replica and, in precise mode, follows every
// replica's KV events.
//
// With SyncShared each gateway publishes what the live gateway's syncer
// publishes through Redis, a sharedstate.Batch: the decisions its index
// learnt since its last batch (router.Config.OnLearn; none in precise mode,
// where every gateway follows the replicas' own events, as the gateway
// shares only loads then) and its own counts for every replica. A batch
// goes out at the sync period's next tick while there is something to
// publish (at most one per syncBatchEvery), and at least every
// syncHeartbeatEvery as a heartbeat; it reaches every other gateway
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
	// LoadsWithBatches: loads ride on every batch of decisions, and on a
	// heartbeat when no batch went out for syncHeartbeatEvery (the live
	// syncer's rule).
	LoadsWithBatches SyncLoads = "batch"
	// LoadsOnChange: a batch also goes out (at the sync period's next tick)
	// whenever the gateway's own counts changed: a request routed, its first
	// token, its end.
	LoadsOnChange SyncLoads = "change"
)

// The live syncer's periods.
// TODO(#14): take them from internal/sharedstate once its syncer exports them.
const (
	// syncBatchEvery is the sync period: a gateway publishes at most one
	// batch per period, at its tick.
	syncBatchEvery = 5 * time.Millisecond
	// syncHeartbeatEvery is the longest a gateway stays silent: its loads
	// go out at least this often (sharedstate.DefaultTTL is far longer, so
	// a live gateway's loads never expire).
	syncHeartbeatEvery = 250 * time.Millisecond
)

// MaxGateways bounds Config.Gateways.
const MaxGateways = 64

// gatewayState is one gateway of a run.
type gatewayState struct {
	name   string
	router *router.Router
	peers  *sharedstate.Peers // nil: no sync (one gateway, or SyncNone)
	phase  time.Duration      // its sync ticks are at phase + k·syncBatchEvery

	pending   []sharedstate.Decision // learnt since its last batch
	dirty     bool                   // something to publish at the next tick
	scheduled bool                   // an evPublish is in the heap
	seq       uint64                 // its last batch's number
	last      time.Duration          // when it last published
	heard     []bool                 // per gateway: a batch of it arrived here
	heardN    int                    // gateways heard
}

// inTransit is a published batch on its way to the other gateways.
type inTransit struct {
	from  int
	batch *sharedstate.Batch
}

// syncStats count what the gateways published.
type syncStats struct {
	batches, decisions, blocks, applied int64
	bytes, decisionBytes                int64 // estimated (batchBytes)
	// expired counts deliveries after which a gateway saw fewer live
	// peers than it had heard from: a heartbeat outlived by the TTL (none
	// should be, since every gateway lives to the end).
	expired int64
}

// sharing reports whether the run's gateways share state.
func (vr *virtualRun) sharing() bool {
	return len(vr.gateways) > 1 && vr.cfg.GatewaySync == SyncShared
}

// gatewayName is gateway g's name in its batches.
func gatewayName(g int) string { return fmt.Sprintf("gateway-%d", g) }

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
		gw.phase = time.Duration(g) * syncBatchEvery / time.Duration(n)
		gw.last = -syncHeartbeatEvery
		gw.heard = make([]bool, n)
		vr.events.push(gw.phase, evHeartbeat, int32(g))
	}
}

// onLearn is gateway g's router.Config.OnLearn when it shares decisions.
func (vr *virtualRun) onLearn(g int) func(router.Learned) {
	return func(l router.Learned) {
		gw := &vr.gateways[g]
		gw.pending = append(gw.pending, sharedstate.FromLearned(gw.router, l))
		vr.touch(g)
	}
}

// loadsChanged tells gateway g's syncer that its counts changed.
func (vr *virtualRun) loadsChanged(g int) {
	if vr.sharing() && vr.cfg.SyncLoads == LoadsOnChange {
		vr.touch(g)
	}
}

// touch marks gateway g as having something to publish at its next tick.
func (vr *virtualRun) touch(g int) {
	gw := &vr.gateways[g]
	gw.dirty = true
	if gw.scheduled {
		return
	}
	gw.scheduled = true
	vr.events.push(nextTick(vr.now, gw.phase, syncBatchEvery), evPublish, int32(g))
}

// nextTick is the first instant phase + k·period (k ≥ 0) at or after now.
func nextTick(now, phase, period time.Duration) time.Duration {
	if now <= phase {
		return phase
	}
	k := (now - phase + period - 1) / period
	return phase + k*period
}

// publishTick is gateway g's sync tick: a batch if it has something new.
func (vr *virtualRun) publishTick(g int) {
	gw := &vr.gateways[g]
	gw.scheduled = false
	if gw.dirty {
		vr.publish(g)
	}
}

// heartbeat publishes gateway g's loads when it has been silent for
// syncHeartbeatEvery, and schedules its next look while requests remain.
func (vr *virtualRun) heartbeat(g int) {
	gw := &vr.gateways[g]
	if vr.now-gw.last >= syncHeartbeatEvery {
		vr.publish(g)
	}
	if vr.ended < len(vr.plan.reqs) {
		vr.events.push(gw.last+syncHeartbeatEvery, evHeartbeat, int32(g))
	}
}

// publish sends gateway g's batch: its pending decisions and its own
// counts, to reach the others SyncDelay later.
func (vr *virtualRun) publish(g int) {
	gw := &vr.gateways[g]
	gw.seq++
	b := &sharedstate.Batch{
		Gateway: gw.name, Seq: gw.seq, At: epoch.Add(vr.now),
		Decisions: gw.pending, Loads: sharedstate.Loads(gw.router),
	}
	gw.pending, gw.dirty, gw.last = nil, false, vr.now
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
		vr.sync.applied += int64(gw.peers.Apply(t.batch, at))
		if !gw.heard[t.from] {
			gw.heard[t.from] = true
			gw.heardN++
		}
		if gw.peers.Live() < gw.heardN {
			vr.sync.expired++
		}
	}
}

// countBatch adds b to the run's sync statistics.
func (vr *virtualRun) countBatch(b *sharedstate.Batch) {
	vr.sync.batches++
	vr.sync.decisions += int64(len(b.Decisions))
	for i := range b.Decisions {
		vr.sync.blocks += int64(len(b.Decisions[i].Blocks))
		vr.sync.decisionBytes += int64(decisionBytes(&b.Decisions[i]))
	}
	vr.sync.bytes += int64(batchBytes(b))
}

// batchBytes is what b would cost on the wire.
//
// TODO(#14): replace by len(sharedstate.AppendBatch(nil, b)) once the
// codec lands. Until then an estimate of a compact binary form: 8 bytes per
// block hash; per decision the replica's name, the model's and about 8
// bytes of varints (offset, tokens, counts); per replica load the name and
// about 12 bytes of varints; about 24 bytes of header (gateway, sequence
// number, time).
func batchBytes(b *sharedstate.Batch) int {
	n := 24 + len(b.Gateway)
	for i := range b.Decisions {
		n += decisionBytes(&b.Decisions[i])
	}
	for i := range b.Loads {
		n += len(b.Loads[i].Replica) + 12
	}
	return n
}

// decisionBytes is one decision's share of batchBytes.
func decisionBytes(d *sharedstate.Decision) int {
	return 8*len(d.Blocks) + len(d.Replica) + len(d.Model) + 8
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
	extra["sync_bytes_est"] = float64(s.bytes)
	if s.decisions > 0 {
		extra["sync_bytes_per_decision_est"] = float64(s.decisionBytes) / float64(s.decisions)
	}
	if s.expired > 0 {
		extra["sync_peers_expired"] = float64(s.expired)
	}
	if vr.now > 0 {
		extra["sync_batches_per_s"] = float64(s.batches) / vr.now.Seconds()
	}
}
