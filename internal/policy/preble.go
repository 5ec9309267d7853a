package policy

import (
	"fmt"
	"math"
	"sync"
)

func init() {
	register("preble", func(o Options) (Policy, error) {
		params := prebleParams{WindowSecs: 180, RebalanceRatio: 1.5, MaxTracked: 1 << 16, DefaultOutputTokens: 128}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if !(params.WindowSecs >= 1) || params.WindowSecs > 86400 || !(params.RebalanceRatio >= 1) ||
			params.MaxTracked < 1 || params.DefaultOutputTokens < 1 {
			return nil, fmt.Errorf("%w: need 1 ≤ window_secs ≤ 86400, rebalance_ratio ≥ 1, max_tracked ≥ 1, "+
				"default_output_tokens ≥ 1", ErrParam)
		}
		return &Preble{
			params: params, blockSize: o.BlockSize, c1: o.Profile.C1, c3: o.Profile.C3,
			buckets: int(math.Ceil(params.WindowSecs)), g: newRNG(o.Seed),
			replicas: map[int]*prebleReplica{}, inflight: map[uint64]prebleReq{},
			meanOut: float64(params.DefaultOutputTokens),
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
}

// Preble is the E2 global scheduler of Preble (Srivatsa et al., ICLR 2025),
// "exploitation and exploration" over the router's prefix index:
//
//   - exploit when the best replica's cached prefix is longer than the
//     request's new tokens (matched tokens > prompt tokens − matched tokens):
//     among the replicas with that longest match, the least load cost;
//   - else explore: the least load cost over all replicas;
//   - rebalance: if the exploit choice's load cost is over rebalance_ratio ×
//     the least loaded replica's, send it to the least loaded instead, which
//     thereby becomes a second holder of the hot prefix (Preble's prefix
//     replication).
//
// Load cost(r) = prefill work r did in the last window_secs (uncached prompt
// tokens routed to r × c1 ms per token of the latency profile) + decode
// work of its in-flight requests (expected output tokens × (c1 + c3 ×
// context) ms per token). The expected output is max_tokens, else the mean
// observed output; it is counted whole until Done (Preble's estimate does not
// decay it either). The window is kept in one-second buckets per replica, so
// its memory is window_secs floats per replica; in-flight requests are kept
// from Routed to Done, at most max_tracked, and forgotten after a window
// without Done (a lost completion). Preble's eviction-cost term is left out:
// the router's index does not model eviction.
type Preble struct {
	params    prebleParams
	blockSize int
	c1, c3    float64 // ms per token, ms per context token (decode attention)
	buckets   int
	g         *rng

	mu        sync.RWMutex
	replicas  map[int]*prebleReplica // by slot
	inflight  map[uint64]prebleReq   // by request id
	meanOut   float64
	nOut      float64
	lastSweep int64 // second of the last sweep of stale in-flight requests
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
}

type prebleReq struct {
	replica  int
	decodeMs float64
	routedS  int64
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
	now := req.Now.Unix()
	costs := make([]float64, len(rs))
	p.mu.RLock()
	for _, i := range c {
		costs[i] = p.loadMs(rs[i].Index, now)
	}
	p.mu.RUnlock()
	cost := func(i int) float64 { return costs[i] }

	best := 0
	for _, i := range c {
		best = max(best, rs[i].Match)
	}
	least := argBest(c, cost, true, p.g)
	matchTok := best * p.blockSize
	if best == 0 || matchTok <= req.Tokens-matchTok {
		d := decide(rs, least, "explore: least load cost", rs[least].Match, costs[least])
		d.Scores = costs
		return d, nil
	}
	var hbuf [scratchLen]int
	holders := scratch(&hbuf, len(c))[:0]
	for _, i := range c {
		if rs[i].Match == best {
			holders = append(holders, i)
		}
	}
	i := argBest(holders, cost, true, p.g)
	reason := "exploit: least load cost among the longest-prefix holders"
	if costs[i] > p.params.RebalanceRatio*costs[least] {
		i, reason = least, "rebalance: prefix holder overloaded, least load cost replicates it"
	}
	d := decide(rs, i, reason, rs[i].Match, costs[i])
	d.Scores = costs
	return d, nil
}

// Observe adds a routed request's uncached prefill to its replica's window
// and tracks its decode work until Done.
func (p *Preble) Observe(ev Event) {
	if ev.Req == nil || ev.Replica < 0 {
		return
	}
	now := ev.At.Unix()
	p.mu.Lock()
	defer p.mu.Unlock()
	switch ev.Kind {
	case Routed:
		r := p.replica(ev.Replica)
		p.prune(r, now)
		matched := 0
		if ev.Decision.Replica == ev.Replica {
			matched = ev.Decision.Matched
		}
		uncached := max(ev.Req.Tokens-matched*p.blockSize, 0)
		p.add(r, now, float64(uncached)*p.c1)

		out := float64(ev.Req.MaxTokens)
		if out <= 0 {
			out = p.meanOut
		}
		ctx := float64(ev.Req.Tokens) + out/2 // mean context over the decode
		work := out * (p.c1 + p.c3*ctx)
		if old, ok := p.inflight[ev.Req.ID]; ok { // re-routed (retry)
			p.untrack(ev.Req.ID, old)
		}
		if len(p.inflight) < p.params.MaxTracked {
			p.inflight[ev.Req.ID] = prebleReq{replica: ev.Replica, decodeMs: work, routedS: now}
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
