package sim

import (
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/kvevents/enginekv"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
)

// core is one engine core of a replica. vLLM started with
// --data-parallel-size N runs N of them behind one API server, each with its
// own KV cache, scheduler and busy loop; a replica here has
// Config.DataParallelSize cores, rank 0 to N−1, each stepped by its own
// driver goroutine. They share the replica's lock (Replica.mu), clock and
// registry; each publishes its KV events through its own publisher, as
// vLLM's ranks do.
type core struct {
	r    *Replica
	rank int
	slot int // its place in the fleet's Timeline

	// Guarded by r.mu.
	eng     *engine.Engine
	live    map[uint64]*choice // engine request id → its choice, until finished or aborted
	nextID  uint64
	idle    bool          // the driver found nothing to compute and waits
	wokeAt  time.Duration // while idle: when to resume (see goIdleLocked)
	planEnd time.Duration // end of the last planned step

	// engineID names the core to prefill/decode peers (vLLM's
	// kv_transfer_config.engine_id, with _dp<rank> under data parallelism).
	engineID string

	wake    chan struct{} // cap 1: work was added or freed
	metrics *coreMetrics
	// dpRank is the data_parallel_rank of its KV-event batches: nil
	// without data parallelism, as the sim sent before it had any.
	dpRank *int
	// pub is the rank's KV-event publisher, nil without KV events. Set
	// before the driver starts; closed after it ends.
	pub kvzmq.Publisher
	// sourceMisses counts the peer pulls whose source held none of the
	// prompt or did not answer (noteSource): never given to the engine.
	sourceMisses atomic.Int64
}

// newEngine is the engine model of replica idx's core of the given rank.
// Rank 0 keeps the seed a replica had before data parallelism.
func newEngine(cfg Config, idx, rank int) (*engine.Engine, error) {
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
		Seed:            cfg.Seed + uint64(idx) + uint64(rank)*0x9e37_79b9_7f4a_7c15,
		Jitter:          cfg.Jitter,
		DisableKVEvents: !cfg.KVEvents,
		Role:            cfg.Role,
		KVHoldTimeout:   cfg.KVHoldTimeout,

		PriorityScheduling: cfg.SchedulingPolicy == SchedulingPriority,
		HostBlocks:         cfg.OffloadBlocks,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return eng, nil
}

// newCores builds the replica's engine cores.
func newCores(r *Replica) error {
	n := r.cfg.DataParallelSize
	for rank := range n {
		eng, err := newEngine(r.cfg, r.idx, rank)
		if err != nil {
			return err
		}
		c := &core{r: r, rank: rank, slot: r.tl.join(), eng: eng, live: make(map[uint64]*choice), idle: true,
			wokeAt: never, wake: make(chan struct{}, 1), engineID: engineIDOf(r.addr, rank, n)}
		if n > 1 {
			c.dpRank = &c.rank
		}
		r.cores = append(r.cores, c)
	}
	return nil
}

// presentLocked is the engine's present: the virtual time of the wall
// clock, except while the driver is busy and behind it by less than MaxLag,
// when it is the end of the planned step (the driver is catching up, and
// whatever arrives now is in the engine's present at that step's end). r.mu
// is held.
func (c *core) presentLocked() time.Duration {
	vw := c.r.virtualNow()
	if c.idle || vw <= c.planEnd {
		return vw
	}
	return max(c.planEnd, vw-c.r.maxLag)
}

func (c *core) poke() {
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// drive is the core's engine loop, vLLM's busy loop in virtual time:
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
func (c *core) drive() {
	r := c.r
	defer r.wg.Done()
	t := r.clock.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		res, ev, hasEv := c.plan()
		if res == nil {
			// Nothing to compute: wait for a request or a freed block,
			// or for the engine's next event (a transfer ending, a hold
			// expiring).
			if !c.waitWake(t, ev, hasEv) {
				return
			}
			continue
		}
		if !r.tl.Until(t, res.End, r.done) {
			return
		}
		// res.Outputs is only overwritten by the next Step, which this
		// goroutine alone calls.
		c.deliver(res.Outputs, res.End)
		c.publish(res.KV)
	}
}

// never is the wokeAt of an idle driver nothing has woken yet.
const never = time.Duration(math.MaxInt64)

// plan runs the next step at the engine's present. It returns nil when
// there is nothing to compute, or the step computed nothing (a transfer
// started, say): then ev, if hasEv, is the engine time of its next event.
func (c *core) plan() (res *engine.StepResult, ev time.Duration, hasEv bool) {
	r := c.r
	r.mu.Lock()
	now := c.presentLocked()
	if c.idle && c.wokeAt != never {
		// Start when the driver was woken (an arrival, a freed block, an
		// event): the wake-up's scheduling delay is not the engine's time.
		now = max(c.wokeAt, now-r.maxLag)
	}
	ev, hasEv = c.eng.NextEvent()
	if !c.eng.HasWork() && !(hasEv && ev <= now) {
		c.goIdleLocked(ev, hasEv)
		r.mu.Unlock()
		return nil, ev, hasEv
	}
	step := c.eng.Step(now)
	c.idle = false
	c.planEnd = step.End
	c.transfersLocked(step.Pulls)
	if step.Seqs > 0 {
		r.tl.setEnd(c.slot, step.End)
		r.mu.Unlock()
		return &step, 0, false
	}
	ev, hasEv = c.eng.NextEvent()
	c.goIdleLocked(ev, hasEv)
	r.mu.Unlock()
	c.publish(step.KV)
	return nil, ev, hasEv
}

// goIdleLocked marks the driver idle: it resumes at the first of an
// arrival, a poke or the engine's next event ev, if hasEv (see
// wakeLocked). An elastic timeline does not pass that event by more than
// its slack before the driver has handled it. r.mu is held.
func (c *core) goIdleLocked(ev time.Duration, hasEv bool) {
	c.idle = true
	c.wokeAt = never
	if !hasEv {
		ev = never
	}
	c.r.tl.setEnd(c.slot, ev)
}

// wakeLocked records that the idle driver has cause to resume at engine
// time now; the timeline waits for it there. r.mu is held.
func (c *core) wakeLocked(now time.Duration) {
	if c.idle {
		c.wokeAt = min(c.wokeAt, now)
		c.r.tl.setEnd(c.slot, c.wokeAt)
	}
}

// waitWake waits for a poke or, if hasEv, until model time ev; false when
// the replica stops first.
func (c *core) waitWake(t clock.Timer, ev time.Duration, hasEv bool) bool {
	for {
		var fire <-chan time.Time
		var moved <-chan struct{}
		if hasEv {
			reached, d, mv := c.r.tl.Wait(ev)
			if reached {
				c.r.mu.Lock()
				c.wakeLocked(ev)
				c.r.mu.Unlock()
				return true
			}
			if moved = mv; d > 0 {
				t.Reset(d)
				fire = t.C()
			}
		}
		select {
		case <-c.wake:
			if fire != nil {
				t.Stop()
			}
			return true
		case <-fire: // model time may have been held back meanwhile: ask again
		case <-moved:
			if fire != nil {
				t.Stop()
			}
		case <-c.r.done:
			if fire != nil {
				t.Stop()
			}
			return false
		}
	}
}

// publish sends a step's KV events.
func (c *core) publish(kv []engine.KVEvent) {
	if c.pub != nil && len(kv) > 0 {
		_ = c.pub.Publish(c.batch(kv))
	}
}

// transfersLocked handles the transfers a step saw end: their time and
// bytes in vLLM's NIXL metrics, and the notification that frees the
// prefill side's hold. r.mu is held.
func (c *core) transfersLocked(pulls []engine.Pull) {
	for _, p := range pulls {
		c.metrics.xferTime.Observe((p.End - p.Start).Seconds())
		c.metrics.xferBytes.Observe(p.Bytes)
		if ch := c.live[p.ReqID]; ch != nil && ch.remote != nil {
			c.r.release(c, ch.remote)
			ch.remote = nil
		}
	}
}

// deliver hands one step's outputs, visible at end, to their calls.
func (c *core) deliver(outs []engine.Output, end time.Duration) {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	for _, o := range outs {
		ch := c.live[o.ReqID]
		if ch == nil {
			continue // aborted
		}
		cl := ch.call
		if o.First {
			c.metrics.ttft.Observe((end - ch.arrival).Seconds())
		} else if o.NewTokens > 0 {
			c.metrics.itl.Observe((end - ch.lastAt).Seconds())
		}
		if o.Finished {
			delete(c.live, o.ReqID)
			c.metrics.e2e.Observe((end - ch.arrival).Seconds())
			c.metrics.success[ch.reason].Inc()
			cl.left--
		}
		cl.mu.Lock()
		ch.pending += o.NewTokens
		ch.total += o.NewTokens
		if o.First {
			ch.cached, ch.firstAt = o.CachedTokens, end
		} else if o.NewTokens > 0 {
			ch.maxGap = max(ch.maxGap, end-ch.lastAt)
		}
		if o.NewTokens > 0 {
			ch.lastAt = end
		}
		ch.finished = o.Finished
		if o.Held {
			ch.held, _ = c.eng.HeldBlocks(o.ReqID)
		}
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

// submit adds a call's engine requests (reqs[i] belongs to cl.choices[i])
// to the core of the given rank, or with rank < 0 to the least loaded one,
// chosen under the same lock as the requests are added so that a burst of
// requests spreads over the cores. It sets cl.core.
func (r *Replica) submit(cl *call, reqs []engine.Request, rank int) error {
	r.mu.Lock()
	c := r.leastLoadedLocked()
	if rank >= 0 {
		c = r.cores[rank]
	}
	cl.core = c
	err := c.addLocked(cl, reqs)
	r.mu.Unlock()
	if err == nil {
		c.poke()
	}
	return err
}

// addLocked adds the call's engine requests, all or none. r.mu is held.
func (c *core) addLocked(cl *call, reqs []engine.Request) error {
	now := c.presentLocked()
	c.wakeLocked(now)
	for i := range reqs {
		c.nextID++
		reqs[i].ID = c.nextID
		if err := c.eng.Add(&reqs[i], now); err != nil {
			for _, ch := range cl.choices[:i] {
				c.eng.Abort(ch.id)
				delete(c.live, ch.id)
			}
			return err
		}
		ch := cl.choices[i]
		ch.id, ch.arrival = reqs[i].ID, now
		c.live[ch.id] = ch
	}
	cl.left = len(reqs)
	return nil
}

// abort drops the call's unfinished choices (the client went away). A
// choice the engine already finished in the step being waited on stays in
// live: the driver delivers and counts it.
func (c *core) abort(cl *call) {
	c.r.mu.Lock()
	n := 0
	for _, ch := range cl.choices {
		if c.live[ch.id] != ch {
			continue
		}
		if c.eng.Abort(ch.id) {
			delete(c.live, ch.id)
			c.metrics.success[finishAbort].Inc()
			n++
		}
		if ch.remote != nil {
			// vLLM's decode side frees the prefill side's blocks of a
			// request aborted before its transfer ended.
			c.r.release(c, ch.remote)
			ch.remote = nil
		}
	}
	if n > 0 {
		c.wakeLocked(c.presentLocked())
	}
	c.r.mu.Unlock()
	if n > 0 {
		c.poke() // freed blocks may let a waiting request in
	}
}

// batch converts one step's engine events to a vLLM event batch.
func (c *core) batch(evs []engine.KVEvent) kvevents.Batch {
	now := c.r.clock.Now()
	return kvevents.Batch{Timestamp: float64(now.UnixNano()) / 1e9, Events: enginekv.Events(evs), DataParallelRank: c.dpRank}
}

// stats is a snapshot of the core's engine.
func (c *core) stats() engine.Stats {
	c.r.mu.Lock()
	defer c.r.mu.Unlock()
	return c.eng.Stats()
}
