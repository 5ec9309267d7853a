package policy

import (
	"fmt"
	"math"
	"sync"

	"github.com/kvgate/kvgate/internal/hashtab"
)

func init() {
	register("preble", func(o Options) (Policy, error) {
		params := prebleParams{
			WindowSecs: 180, RebalanceRatio: 1.5, MaxTracked: 1 << 16, DefaultOutputTokens: 128,
			EvictionCost: true, MaxWindowBlocks: 1 << 21,
		}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if !(params.WindowSecs >= 1) || params.WindowSecs > 86400 || !(params.RebalanceRatio >= 1) ||
			params.MaxTracked < 1 || params.DefaultOutputTokens < 1 || params.CapacityBlocks < 0 ||
			params.MaxWindowBlocks < 1 {
			return nil, fmt.Errorf("%w: need 1 ≤ window_secs ≤ 86400, rebalance_ratio ≥ 1, max_tracked ≥ 1, "+
				"default_output_tokens ≥ 1, capacity_blocks ≥ 0, max_window_blocks ≥ 1", ErrParam)
		}
		return &Preble{
			params: params, blockSize: o.BlockSize, c1: o.Profile.C1, c2: o.Profile.C2, c3: o.Profile.C3,
			buckets: int(math.Ceil(params.WindowSecs)), g: newRNG(o.Seed),
			replicas: map[int]*prebleReplica{}, inflight: map[uint64]prebleReq{},
			meanOut: float64(params.DefaultOutputTokens),
			blocks:  hashtab.New[*prebleBlock](), numBlocks: map[int]int{},
		}, nil
	})
}

type prebleParams struct {
	// WindowSecs is the window H of recent prefill work (Preble: 3 minutes).
	WindowSecs float64 `json:"window_secs"`
	// RebalanceRatio: when the exploit choice's load cost exceeds this many
	// times the least loaded replica's, the request goes to the least loaded.
	RebalanceRatio float64 `json:"rebalance_ratio"`
	// MaxTracked bounds the in-flight requests whose decode work is tracked.
	MaxTracked int `json:"max_tracked"`
	// DefaultOutputTokens is the expected output of a request without
	// max_tokens until Done events give a mean.
	DefaultOutputTokens int `json:"default_output_tokens"`
	// EvictionCost adds the eviction cost Preble's server enables
	// (GlobalSchedulerWithTime(enable_eviction=True)).
	EvictionCost bool `json:"eviction_cost"`
	// CapacityBlocks is how many blocks the policy's view of one replica's
	// cache holds (0: the replica's NumBlocks as the router last reported
	// it to Pick, else Preble's max_tokens_gpu, 198,516 tokens).
	CapacityBlocks int `json:"capacity_blocks"`
	// MaxWindowBlocks bounds the block uses remembered for the window's
	// use counts and miss rates (the oldest leave early past it).
	MaxWindowBlocks int `json:"max_window_blocks"`
}

// prebleMaxTokensGPU is Preble's max_tokens_gpu: the tokens its view of a
// GPU's cache holds before it evicts (global_scheduler_with_time.py).
const prebleMaxTokensGPU = 198516

// Preble is the E2 global scheduler of Preble (Srivatsa et al., ICLR 2025;
// WukLab/preble multi_node/global_scheduler_with_time.py, as its server
// builds it: GlobalSchedulerWithTime(enable_eviction=True)),
// "exploitation and exploration" over the router's prefix index:
//
//   - exploit when the best replica's cached prefix is longer than the
//     request's new tokens (matched tokens > prompt tokens − matched tokens):
//     among the replicas with that longest match, the least cost;
//   - else explore: the least cost over all replicas;
//   - rebalance: if the exploit choice's load cost is over rebalance_ratio ×
//     the least loaded replica's, send it to the least loaded instead, which
//     thereby becomes a second holder of the hot prefix (Preble's prefix
//     replication). Preble itself rebalances otherwise: when the most
//     loaded GPU carries enough more than the least, it moves whole prefix
//     subtrees' allocation from one to the other
//     (handle_important_node_stealing); kvgate does not implement that
//     subtree move, and redirects the one request instead.
//
// Cost(r) = load cost(r) + eviction cost(r).
//
// Load cost(r) = prefill work r did in the last window_secs (uncached prompt
// tokens routed to r × c1 ms per token of the latency profile) + decode
// work of its in-flight requests (expected output tokens × (c1 + c3 ×
// context) ms per token). The expected output is max_tokens, else the mean
// observed output; it is counted whole until Done (Preble's estimate does not
// decay it either). The window is kept in one-second buckets per replica, so
// its memory is window_secs floats per replica; in-flight requests are kept
// from Routed to Done, at most max_tracked, and forgotten after a window
// without Done (a lost completion).
//
// Eviction cost(r) (eviction_cost, default on; Preble's
// virtual_evict_for_routing): assume r's cache is full, as Preble does, and
// evict virtually, least recently used first, as many blocks as the request
// would add to r (its tokens beyond r's match); for each block evicted,
// charge its uses in the window (requests routed anywhere whose prompt held
// it) × its miss rate (1 − cached / prompt tokens over those requests) ×
// the prefill time of its tokens at its position (block size × c1 + c2 ×
// block size × context). It needs the policy's own view of each replica's
// cache: an LRU of the blocks routed there (touched last to first, so a
// prompt's tail goes before its head), capacity_blocks per replica (else the
// replica's NumBlocks as Pick last saw it, else Preble's max_tokens_gpu),
// trimmed when a request is Routed as Preble's handle_eviction does. Blocks
// of requests in flight there and the request's own blocks are not evicted.
// Differences from Preble: it keeps a radix tree of token ids and charges
// only "large" nodes (more than half their context) with per-node counts;
// kvgate charges every block with per-block counts, over its chained block
// hashes, and its miss rate counts the chosen replica's cached tokens where
// Preble counts those already in its global tree. A Pick walks at most the
// request's blocks, the in-flight blocks and the blocks it evicts per
// candidate; the window's uses are bounded by max_window_blocks.
type Preble struct {
	params    prebleParams
	blockSize int
	c1, c2    float64 // ms per token, ms per (prefill token × context token)
	c3        float64 // ms per context token (decode attention)
	buckets   int
	g         *rng

	mu        sync.RWMutex
	replicas  map[int]*prebleReplica // by slot
	inflight  map[uint64]prebleReq   // by request id
	meanOut   float64
	nOut      float64
	lastSweep int64 // second of the last sweep of stale in-flight requests

	// eviction_cost: the blocks in the window's uses or in some replica's
	// LRU, by hash; the uses in routing order, to expire them.
	blocks       *hashtab.Table[*prebleBlock]
	uses         []prebleUse
	usesHead     int
	windowBlocks int // Σ len(blks) over uses[usesHead:]

	numMu     sync.Mutex
	numBlocks map[int]int // slot → NumBlocks last seen by Pick (capacity_blocks 0)
}

// prebleBlock is one block: its uses in the window (the requests holding
// it, their cached and prompt tokens: the miss rate's terms), and how many
// replicas' LRUs hold it. It leaves the table when both are 0.
type prebleBlock struct {
	h            uint64
	n            int32
	held         int32
	hit, prompts float64
}

// prebleUse is one routed request's share of the window.
type prebleUse struct {
	sec         int64
	blks        []*prebleBlock
	hit, prompt float64
}

var _ Policy = (*Preble)(nil)
var _ Observer = (*Preble)(nil)

type prebleReplica struct {
	sec    []int64   // the second each bucket holds
	val    []float64 // prefill ms routed in that second
	sum    float64   // Σ val over live buckets
	oldest int64     // the oldest second with a non-zero bucket (MaxInt64: none)
	decode float64   // Σ decode ms of tracked in-flight requests
	n      int       // tracked in-flight requests
	lru    prebleLRU // eviction_cost: the blocks the policy believes it holds
}

type prebleReq struct {
	replica  int
	decodeMs float64
	routedS  int64
	held     []*prebleEntry // eviction_cost: its blocks in the replica's LRU, in use until Done
}

func (*Preble) Name() string { return "preble" }

func (p *Preble) replica(idx int) *prebleReplica {
	r := p.replicas[idx]
	if r == nil {
		r = &prebleReplica{sec: make([]int64, p.buckets), val: make([]float64, p.buckets), oldest: math.MaxInt64}
		for b := range r.sec {
			r.sec[b] = math.MinInt64
		}
		p.replicas[idx] = r
	}
	return r
}

func (p *Preble) bucket(s int64) int {
	b := int(s % int64(p.buckets))
	if b < 0 {
		b += p.buckets
	}
	return b
}

// windowMs is r's prefill work in the window ending at second now, read
// only: buckets older than the window are left out, not cleared.
func (p *Preble) windowMs(r *prebleReplica, now int64) float64 {
	if r == nil {
		return 0
	}
	cut := now - int64(p.buckets) // buckets at or before cut are out
	if r.oldest > cut {
		return r.sum
	}
	sum := 0.0
	for b, s := range r.sec {
		if s > cut && r.val[b] != 0 {
			sum += r.val[b]
		}
	}
	return sum
}

// prune clears buckets that left the window ending at now.
func (p *Preble) prune(r *prebleReplica, now int64) {
	cut := now - int64(p.buckets)
	if r.oldest > cut {
		return
	}
	r.sum, r.oldest = 0, math.MaxInt64
	for b, s := range r.sec {
		if r.val[b] == 0 {
			continue
		}
		if s <= cut {
			r.val[b] = 0
			continue
		}
		r.sum += r.val[b]
		r.oldest = min(r.oldest, s)
	}
}

func (p *Preble) add(r *prebleReplica, s int64, v float64) {
	b := p.bucket(s)
	if r.sec[b] != s {
		if s < r.sec[b] {
			return // older than the window of the newer second in the bucket
		}
		r.sum -= r.val[b]
		r.sec[b], r.val[b] = s, 0
	}
	r.val[b] += v
	r.sum += v
	r.oldest = min(r.oldest, s)
}

// loadMs is the load cost of the replica in slot idx at second now.
func (p *Preble) loadMs(idx int, now int64) float64 {
	r := p.replicas[idx]
	if r == nil {
		return 0
	}
	return p.windowMs(r, now) + r.decode
}

func (p *Preble) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	evict := p.params.EvictionCost
	if evict && p.params.CapacityBlocks == 0 {
		p.noteNumBlocks(rs)
	}
	now := req.Now.Unix()
	loads := make([]float64, len(rs)) // load cost
	costs := loads                    // load + eviction cost
	if evict {
		costs = make([]float64, len(rs))
	}
	p.fillCosts(req, rs, c, now, loads, costs)
	cost := func(i int) float64 { return costs[i] }

	best := 0
	for _, i := range c {
		best = max(best, count(rs[i].Match))
	}
	least := argBest(c, cost, true, p.g)
	matchTok := best * p.blockSize
	if best == 0 || matchTok <= req.Tokens-matchTok {
		d := decide(rs, least, "explore: least cost", count(rs[least].Match), costs[least])
		d.Scores = costs
		return d, nil
	}
	var hbuf [scratchLen]int
	holders := scratch(&hbuf, len(c))[:0]
	for _, i := range c {
		if count(rs[i].Match) == best {
			holders = append(holders, i)
		}
	}
	i := argBest(holders, cost, true, p.g)
	reason := "exploit: least cost among the longest-prefix holders"
	leastLoaded := least // the same replica when costs are the loads
	if evict {
		leastLoaded = argBest(c, func(i int) float64 { return loads[i] }, true, p.g)
	}
	if loads[i] > p.params.RebalanceRatio*loads[leastLoaded] {
		i, reason = leastLoaded, "rebalance: prefix holder overloaded, least load cost replicates it"
	}
	d := decide(rs, i, reason, count(rs[i].Match), costs[i])
	d.Scores = costs
	return d, nil
}

// fillCosts sets, for the candidates c, loads to their load cost at second
// now and, when costs is not loads (eviction_cost), costs to the load plus
// the eviction cost.
func (p *Preble) fillCosts(req *Request, rs []ReplicaView, c []int, now int64, loads, costs []float64) {
	p.mu.RLock()
	defer p.mu.RUnlock() // deferred: a panic in a Pick must leave no lock held (the router recovers it)
	for _, i := range c {
		loads[i] = p.loadMs(rs[i].Index, now)
		if p.params.EvictionCost {
			costs[i] = loads[i] + p.evictionMs(p.replicas[rs[i].Index], req, req.Tokens-count(rs[i].Match)*p.blockSize)
		}
	}
}

// evictionMs is Preble's eviction cost of sending req to r (read only):
// evict virtually, oldest first, as many blocks as newTokens fill, skipping
// blocks held by tracked in-flight requests and req's own blocks, and
// charge each evicted block its window uses × miss rate × prefill time.
func (p *Preble) evictionMs(r *prebleReplica, req *Request, newTokens int) float64 {
	if r == nil || newTokens <= 0 || r.lru.n == 0 {
		return 0
	}
	need := (newTokens + p.blockSize - 1) / p.blockSize
	cost := 0.0
	for e := r.lru.root.prev; e != &r.lru.root && need > 0; e = e.prev {
		if e.ref > 0 {
			continue // in use: not evictable
		}
		b := e.blk
		if d := int(e.depth); d < len(req.Blocks) && req.Blocks[d] == b.h {
			continue // the request's own prefix: about to be used
		}
		need--
		if b.n <= 0 || b.prompts <= 0 {
			continue
		}
		miss := max(1-b.hit/b.prompts, 0)
		cost += float64(b.n) * miss * p.blockMs(int(e.depth))
	}
	return cost
}

// blockMs is the prefill time of the block at position depth of a prompt:
// its tokens' linear cost and their attention to the context up to it.
func (p *Preble) blockMs(depth int) float64 {
	bs := float64(p.blockSize)
	return bs*p.c1 + p.c2*bs*float64(depth+1)*bs
}

// noteNumBlocks remembers each slot's NumBlocks, the capacity of the
// policy's view of its cache (trimmed when a request is Routed). It changes
// nothing Pick computes.
func (p *Preble) noteNumBlocks(rs []ReplicaView) {
	p.numMu.Lock()
	defer p.numMu.Unlock()
	for i := range rs {
		if n := rs[i].NumBlocks; n > 0 && p.numBlocks[rs[i].Index] != n {
			p.numBlocks[rs[i].Index] = n
		}
	}
}

// capacity is the blocks the policy's view of slot idx's cache holds.
func (p *Preble) capacity(idx int) int {
	if p.params.CapacityBlocks > 0 {
		return p.params.CapacityBlocks
	}
	p.numMu.Lock()
	n := p.numBlocks[idx]
	p.numMu.Unlock()
	if n > 0 {
		return n
	}
	return (prebleMaxTokensGPU + p.blockSize - 1) / p.blockSize
}

// Observe adds a routed request's uncached prefill to its replica's window
// and tracks its decode work until Done; with eviction_cost, it counts its
// blocks in the window, touches them in its replica's LRU (held until Done)
// and trims that LRU to its capacity.
func (p *Preble) Observe(ev Event) {
	if ev.Req == nil || ev.Replica < 0 {
		return
	}
	now := ev.At.Unix()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.params.EvictionCost {
		p.expireUses(now)
	}
	switch ev.Kind {
	case Routed:
		r := p.replica(ev.Replica)
		p.prune(r, now)
		matched := 0
		if ev.Decision.Replica == ev.Replica {
			matched = ev.Decision.Matched
		}
		uncached := max(ev.Req.Tokens-matched*p.blockSize, 0)
		if ev.Phase == PhaseDecode {
			// A decode step pulls the prompt from its prefill replica and
			// computes the last token only (kvgate's reading of Preble's
			// prefill window on a P/D fleet, which Preble does not route).
			uncached = min(uncached, 1)
		}
		p.add(r, now, float64(uncached)*p.c1)

		out := float64(ev.Req.MaxTokens)
		if out <= 0 {
			out = p.meanOut
		}
		ctx := float64(ev.Req.Tokens) + out/2 // mean context over the decode
		work := out * (p.c1 + p.c3*ctx)
		if old, ok := p.inflight[ev.Req.ID]; ok && !ev.Remote { // re-routed (retry)
			p.untrack(ev.Req.ID, old)
		}
		var held []*prebleEntry
		// A remote decision (another gateway's: only the blocks new to the
		// replica) counts in the windows, but is not tracked to its end: no
		// Done follows; its decode load arrives as the other gateways' counts.
		tracked := !ev.Remote && len(p.inflight) < p.params.MaxTracked
		if p.params.EvictionCost && len(ev.Req.Blocks) > 0 {
			blks := p.addUse(now, ev.Req.Blocks, float64(min(matched*p.blockSize, ev.Req.Tokens)), float64(ev.Req.Tokens))
			held = p.touch(r, blks, tracked)
			p.trim(r, p.capacity(ev.Replica))
			p.expireUses(now) // after touch: blks stay in the table
		}
		if tracked {
			p.inflight[ev.Req.ID] = prebleReq{replica: ev.Replica, decodeMs: work, routedS: now, held: held}
			r.decode += work
			r.n++
		}
	case Done:
		if old, ok := p.inflight[ev.Req.ID]; ok {
			p.untrack(ev.Req.ID, old)
		}
		if ev.Err == nil && ev.OutputTokens > 0 {
			// Running mean of observed outputs, weight of the past capped
			// at 1000 requests so that it follows a changing workload.
			p.nOut = min(p.nOut+1, 1000)
			p.meanOut += (float64(ev.OutputTokens) - p.meanOut) / p.nOut
		}
	}
	p.sweep(now)
}

func (p *Preble) untrack(id uint64, q prebleReq) {
	delete(p.inflight, id)
	if r := p.replicas[q.replica]; r != nil {
		for _, e := range q.held {
			e.ref--
		}
		r.n--
		r.decode = max(r.decode-q.decodeMs, 0)
		if r.n == 0 {
			r.decode = 0 // drop rounding residue
		}
	}
}

// sweep, at most once per second of event time, prunes every window and
// forgets in-flight requests routed more than a window ago.
func (p *Preble) sweep(now int64) {
	if now == p.lastSweep {
		return
	}
	p.lastSweep = now
	for _, r := range p.replicas {
		p.prune(r, now)
	}
	cut := now - int64(p.buckets)
	for id, q := range p.inflight {
		if q.routedS <= cut {
			p.untrack(id, q)
		}
	}
}

// addUse counts a routed request's blocks in the window (each block's uses
// and the request's cached and prompt tokens) and returns them; the caller
// expires the window afterwards.
func (p *Preble) addUse(now int64, hashes []uint64, hit, prompt float64) []*prebleBlock {
	blks := make([]*prebleBlock, len(hashes))
	for k, h := range hashes {
		slot, ok := p.blocks.Upsert(h)
		if !ok {
			*slot = &prebleBlock{h: h}
		}
		b := *slot
		b.n++
		b.hit += hit
		b.prompts += prompt
		blks[k] = b
	}
	p.uses = append(p.uses, prebleUse{sec: now, blks: blks, hit: hit, prompt: prompt})
	p.windowBlocks += len(blks)
	return blks
}

// expireUses takes out of the window the uses routed window_secs or more
// before now (as the load window does), and the oldest past
// max_window_blocks, as Preble's histogram drops old entries on each
// update.
func (p *Preble) expireUses(now int64) {
	cut := now - int64(p.buckets)
	for p.usesHead < len(p.uses) {
		u := p.uses[p.usesHead]
		if u.sec > cut && p.windowBlocks <= p.params.MaxWindowBlocks {
			break
		}
		for _, b := range u.blks {
			if b.n--; b.n <= 0 {
				b.n, b.hit, b.prompts = 0, 0, 0
				p.forget(b)
			} else {
				b.hit -= u.hit
				b.prompts -= u.prompt
			}
		}
		p.windowBlocks -= len(u.blks)
		p.uses[p.usesHead] = prebleUse{}
		p.usesHead++
	}
	if p.usesHead == len(p.uses) {
		p.uses, p.usesHead = p.uses[:0], 0
	} else if p.usesHead > 1024 && p.usesHead > len(p.uses)/2 {
		n := copy(p.uses, p.uses[p.usesHead:])
		clear(p.uses[n:])
		p.uses, p.usesHead = p.uses[:n], 0
	}
}

// forget drops b from the table once neither the window nor an LRU has it.
// Every block a use or an LRU entry points to is the table's own for its
// hash (touch runs before the window expires), so its hash is its key.
func (p *Preble) forget(b *prebleBlock) {
	if b.n == 0 && b.held == 0 {
		p.blocks.Del(b.h)
	}
}

// prebleLRU is the policy's view of one replica's cache: its blocks by last
// use, in a table and a circular list through root (root.next the most
// recent, root.prev the least).
type prebleLRU struct {
	m    *hashtab.Table[*prebleEntry]
	n    int
	root prebleEntry
}

type prebleEntry struct {
	blk        *prebleBlock
	depth      int32 // the block's position in its prompts (its chained hash fixes it)
	ref        int32 // tracked in-flight requests holding it
	prev, next *prebleEntry
}

func (l *prebleLRU) unlink(e *prebleEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
}

func (l *prebleLRU) pushFront(e *prebleEntry) {
	e.prev, e.next = &l.root, l.root.next
	l.root.next.prev = e
	l.root.next = e
}

// touch makes blks the most recently used on r, last to first, so that a
// prompt's head is more recent than its tail (evicted before it, as a
// radix cache evicts leaves first); ref: a tracked request holds them,
// whose entries it returns.
func (p *Preble) touch(r *prebleReplica, blks []*prebleBlock, ref bool) []*prebleEntry {
	l := &r.lru
	if l.m == nil {
		l.m = hashtab.New[*prebleEntry]()
		l.root.next, l.root.prev = &l.root, &l.root
	}
	var held []*prebleEntry
	if ref {
		held = make([]*prebleEntry, len(blks))
	}
	for k := len(blks) - 1; k >= 0; k-- {
		b := blks[k]
		slot, ok := l.m.Upsert(b.h)
		e := *slot
		if ok {
			l.unlink(e)
		} else {
			e = &prebleEntry{blk: b, depth: int32(min(k, math.MaxInt32))}
			*slot = e
			l.n++
			b.held++
		}
		l.pushFront(e)
		if ref {
			e.ref++
			held[k] = e
		}
	}
	return held
}

// trim evicts r's least recently used blocks until at most capacity
// remain, as Preble's handle_eviction does; blocks in use stay where they
// are (a replica over capacity with everything in use stays over it).
func (p *Preble) trim(r *prebleReplica, capacity int) {
	l := &r.lru
	for e := l.root.prev; l.n > capacity && e != &l.root; {
		older := e
		e = e.prev
		if older.ref == 0 {
			l.unlink(older)
			l.m.Del(older.blk.h)
			l.n--
			older.blk.held--
			p.forget(older.blk)
		}
	}
}
