package router

import (
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/prefixindex"
)

// The KV-event follower: one per router, the same for the gateway (batches
// from ZMQ) and the replay (batches from the engine model), so both trust
// the precise index by the same rules.
//
// A replica's precise index holds what its events reported. What they
// reported stored is true at once; what they did not report is certain
// only when kvgate has followed the stream whole: from the publisher's
// first batch (sequence 0, or a replay that reached back to it), without a
// gap since. Until then the replica is "not in sync" and its match is the
// larger of the precise and the approximate index's (Views). It comes back
// in sync when its replay endpoint fills the gap, or once it has stored a
// whole cache's worth of blocks since (everything older is evicted by
// then), or ResyncAfter after it fell out of sync.

// ResyncAfter bounds how long a replica whose event stream was joined late
// (or had a gap) stays out of sync.
const ResyncAfter = 2 * time.Minute

// KVMessage is one batch of a replica's KV events as the follower takes
// it: from a publisher (Seq is its sequence number) or from a replay.
type KVMessage struct {
	Seq uint64
	// Model is the served model the events are about (vLLM's topic
	// kv@HOST:PORT@MODEL; "" when the topic does not say): an alias is
	// mapped to its base model through the replica's /v1/models.
	Model  string
	Events []kvevents.Event
}

// KVFromWire is the follower's view of a batch received from a publisher:
// its sequence number, its events, and the model its topic names.
func KVFromWire(m kvevents.Message) KVMessage {
	return KVMessage{Seq: m.Seq, Model: kvevents.TopicModel(m.Topic), Events: m.Batch.Events}
}

// Resync fetches a replica's buffered batches from sequence number `from`
// on (vLLM's replay endpoint), in order; nil when it has none.
type Resync func(from uint64) ([]KVMessage, error)

// KVDrop is a stored event the precise index could not take.
type KVDrop struct {
	Reason string // unknown_parent, block_size, other
	Err    error
}

// KVReport is what following one batch did.
type KVReport struct {
	Stored, Removed int // blocks of the GPU
	// StoredHost and RemovedHost are the host tier's blocks (medium CPU).
	StoredHost, RemovedHost int
	BlockSize               int      // the block size of the batch's stored events (0: none)
	Drops                   []KVDrop // stored events not taken
	Gap                     bool     // the sequence jumped from Expected to the batch's
	Expected                uint64
	Restart                 bool  // the publisher started over: the replica's index was cleared
	Duplicate               bool  // a batch already applied (live after a replay): ignored
	Replayed                int   // batches applied from the replay endpoint first
	ResyncErr               error // the replay endpoint failed (the fallback rule applies)
	Synced                  bool  // in sync after the batch
	SyncChanged             bool
}

// kvFollow is one replica's follower state.
type kvFollow struct {
	mu          sync.Mutex // serialises the replica's batches (and a resync's fetch)
	seen        bool       // a batch was applied
	last        uint64     // its sequence number
	afterReplay bool       // last came from a replay: a live batch up to it is a duplicate
	storedSince int        // blocks stored since out of sync
	lastHeard   time.Time  // the last batch (or the start of following)
	silent      bool       // reported silent, not heard from since
	// trustAt (unix ns, 0: never) is when an out-of-sync replica is
	// trusted anyway (ResyncAfter): read on the routing path.
	trustAt atomic.Int64
}

// PreciseSynced reports whether the precise index is trusted for the replica.
func (r *Replica) PreciseSynced() bool { return r.preciseOK.Load() }

// preciseTrusted is PreciseSynced, or out of sync for ResyncAfter at now.
func (r *Replica) preciseTrusted(now time.Time) bool {
	if r.preciseOK.Load() {
		return true
	}
	at := r.kv.trustAt.Load()
	return at != 0 && now.UnixNano() >= at
}

// KVStart starts following the replica's KV events at now: out of sync
// until its stream is followed from its start.
func (r *Replica) KVStart(now time.Time) {
	r.kv.mu.Lock()
	r.kv.lastHeard = now
	r.outOfSync(now)
	r.kv.mu.Unlock()
}

// outOfSync marks the replica out of sync from now; kv.mu is held.
func (r *Replica) outOfSync(now time.Time) {
	r.kv.storedSince = 0
	r.kv.trustAt.Store(now.Add(ResyncAfter).UnixNano())
	r.preciseOK.Store(false)
}

// inSync marks the replica in sync; kv.mu is held.
func (r *Replica) inSync() {
	r.kv.trustAt.Store(0)
	r.preciseOK.Store(true)
}

// KVSilence reports a change in whether the replica's event stream has been
// silent for at least d at now: silent true the first time it is, false the
// first time it speaks again; changed false otherwise.
func (r *Replica) KVSilence(now time.Time, d time.Duration) (changed, silent bool) {
	r.kv.mu.Lock()
	defer r.kv.mu.Unlock()
	silent = now.Sub(r.kv.lastHeard) >= d
	changed = silent != r.kv.silent
	r.kv.silent = silent
	return changed, silent
}

// FollowKV applies one batch of replica i's KV events at now. A batch
// that shows a late join or a gap first asks resync (when not nil) for the
// missing batches; without them the replica falls out of sync (its index
// is kept: what it holds was reported). A batch numbered below the last
// one is a restarted publisher, whose cache restarted empty.
func (rt *Router) FollowKV(i int, m KVMessage, now time.Time, resync Resync) KVReport {
	r := rt.reps()[i]
	r.kv.mu.Lock()
	defer r.kv.mu.Unlock()
	was := r.preciseOK.Load()
	var rep KVReport
	switch next := r.kv.last + 1; {
	case r.kv.seen && m.Seq == next:
	case r.kv.seen && m.Seq < next && m.Seq > 0 && r.kv.afterReplay:
		// A live batch that raced the replay. (Batch 0 is a restart even
		// then: re-applying a raced batch 0 from an empty index is harmless,
		// ignoring a restart is not.)
		rep.Duplicate = true
	case r.kv.seen && m.Seq < next:
		rep.Restart = true
		_ = rt.precise.Cleared(i)
		r.kv.seen = false
		if m.Seq > 0 {
			rt.resyncLocked(i, 0, m.Seq, now, resync, &rep)
		}
	case r.kv.seen:
		rep.Gap, rep.Expected = true, next
		rt.resyncLocked(i, next, m.Seq, now, resync, &rep)
	case m.Seq > 0:
		rt.resyncLocked(i, 0, m.Seq, now, resync, &rep)
	}
	if !rep.Duplicate {
		rt.applyLocked(i, m, now, false, &rep)
	}
	rep.Synced = r.preciseOK.Load()
	rep.SyncChanged = rep.Synced != was
	return rep
}

// ResyncKV asks replica i's replay endpoint for everything it buffered,
// before any batch arrived (a gateway starting beside running replicas):
// the replica is in sync at once when the buffer reaches back to its start,
// or is empty (vLLM's buffer keeps the latest batches: an empty one means
// none was published).
func (rt *Router) ResyncKV(i int, now time.Time, resync Resync) KVReport {
	r := rt.reps()[i]
	r.kv.mu.Lock()
	defer r.kv.mu.Unlock()
	var rep KVReport
	if r.kv.seen || resync == nil {
		return rep
	}
	was := r.preciseOK.Load()
	msgs, err := resync(0)
	switch {
	case err != nil:
		rep.ResyncErr = err
	case len(msgs) == 0:
		r.inSync() // nothing published yet: the empty index is the whole story
	default:
		rt.resyncLocked(i, 0, ^uint64(0), now, func(uint64) ([]KVMessage, error) { return msgs, nil }, &rep)
	}
	rep.Synced = r.preciseOK.Load()
	rep.SyncChanged = rep.Synced != was
	return rep
}

// resyncLocked applies the batches [from, upto) the replay endpoint still
// buffers; a batch missing at the start leaves the gap (or the late join)
// for applyLocked to see. kv.mu is held.
func (rt *Router) resyncLocked(i int, from, upto uint64, now time.Time, resync Resync, rep *KVReport) {
	if resync == nil {
		return
	}
	msgs, err := resync(from)
	if err != nil {
		rep.ResyncErr = err
		return
	}
	for _, m := range msgs {
		if m.Seq < from || m.Seq >= upto {
			continue
		}
		if k := &rt.reps()[i].kv; k.seen && m.Seq <= k.last {
			continue
		}
		rt.applyLocked(i, m, now, true, rep)
		rep.Replayed++
	}
}

// applyLocked applies one batch: the sequence first (in sync from a first
// batch numbered 0, out of sync on a late join or a jump), then the events.
// kv.mu is held.
func (rt *Router) applyLocked(i int, m KVMessage, now time.Time, replayed bool, rep *KVReport) {
	r := rt.reps()[i]
	switch {
	case !r.kv.seen && m.Seq == 0:
		r.inSync()
	case !r.kv.seen || m.Seq != r.kv.last+1:
		r.outOfSync(now)
	}
	r.kv.seen, r.kv.last, r.kv.afterReplay = true, m.Seq, replayed
	r.kv.lastHeard = now
	stored := rt.applyEvents(i, m, rep)
	if r.preciseOK.Load() {
		return
	}
	r.kv.storedSince += stored
	if r.kv.storedSince >= rt.capacityBlocks(i) {
		r.inSync() // a whole cache's worth stored since: older blocks are gone
	}
}

// applyEvents feeds one batch's events to the precise index and returns
// the blocks stored.
func (rt *Router) applyEvents(i int, m KVMessage, rep *KVReport) int {
	p := rt.precise
	base, _ := rt.replicaKey(i, m.Model)
	stored := 0
	for _, ev := range m.Events {
		switch e := ev.(type) {
		case *kvevents.BlockStored:
			tier, ok := tierOf(e.Medium)
			if !ok {
				continue // disk, remote stores: not indexed (tiers.go)
			}
			if err := p.StoredTier(i, tier, base, e.BlockHashes, e.ParentBlockHash, e.TokenIDs, e.BlockSize, e.LoraName); err != nil {
				rep.Drops = append(rep.Drops, KVDrop{Reason: dropReason(err), Err: err})
				continue
			}
			if tier != prefixindex.TierGPU {
				rep.StoredHost += len(e.BlockHashes)
				continue // a sync counts the GPU's stores: what the engine hits first
			}
			stored += len(e.BlockHashes) * e.BlockSize / p.BlockSize()
			rep.BlockSize = e.BlockSize
			rep.Stored += len(e.BlockHashes)
		case *kvevents.BlockRemoved:
			tier, ok := tierOf(e.Medium)
			if !ok {
				continue
			}
			_ = p.RemovedTier(i, tier, e.BlockHashes)
			if tier == prefixindex.TierGPU {
				rep.Removed += len(e.BlockHashes)
			} else {
				rep.RemovedHost += len(e.BlockHashes)
			}
		case *kvevents.AllBlocksCleared:
			_ = p.Cleared(i)
		}
	}
	return stored
}

func dropReason(err error) string {
	switch {
	case errors.Is(err, prefixindex.ErrUnknownParent):
		return "unknown_parent"
	case errors.Is(err, prefixindex.ErrBlockSize):
		return "block_size"
	case errors.Is(err, prefixindex.ErrUnknownBlock):
		return "unknown_block"
	}
	return "other"
}

// capacityBlocks is replica i's KV capacity in index blocks: scraped, or
// the configured assumption.
func (rt *Router) capacityBlocks(i int) int {
	if s := rt.reps()[i].scrape.Load(); s != nil && s.m.NumBlocks > 0 {
		return s.m.NumBlocks
	}
	return rt.cfg.BlocksPerReplica
}
