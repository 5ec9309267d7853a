package router

import (
	"math"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/policy"
)

// Saturation is a pool's scaling signal: the work it is routed as a
// fraction of what its replicas can do within the TTFT objective, by the
// cost model (the step time c0 + c1·tokens + c2·Σ chunk×context + c3·Σ
// decode context of internal/costmodel, which the engine and the ttft
// policy share).
//
//	saturation = load / (N · ρ*)
//
// load is the engine time per second the pool's requests take, in
// replicas' worth: each routed request costs its uncached prompt tokens
// (as the decision counted them, raised at its end to what the replica
// reported computing) at c1 + c2·context, and its output tokens
// at c1 + c3·context + c0/b — a decode token pays its share of the step
// it rides in, b the largest batch a replica runs (max_num_seqs, at most
// the token budget): at saturation the batch is full. The rates are
// exponentially weighted over Window; the output counted is max_tokens at
// routing, and what the usage reports beyond it at the end. N is the
// pool's replicas in rotation. ρ* is the utilisation at which the TTFT's
// 90th percentile meets the objective O, by the M/M/1 queue each replica
// is to its prefills: a request's time to first token is exponential with
// mean s/(1−ρ), s its own prefill alone (a step: c0 plus its uncached
// tokens), so its p90 is ln(10)·s/(1−ρ), and ρ* = 1 − ln(10)·s/O.
//
// Why load over capacity rather than the predicted p90 over the
// objective: the predicted TTFT reads the queues, and a queue builds only
// once the load is already too high, so it moves with the measured p90,
// not before it; the load moves as soon as the arrivals do. A rate is
// smooth, where a queue snapshot jumps with every burst. And it is
// proportional to replicas: at saturation 1.5 on 4 replicas, 6 replicas
// bring it to 1 — what an autoscaler's proportional rule (HPA, KEDA:
// desired = ceil(current × metric / target)) computes. 1 is the
// objective's edge: scale out above it.
type Saturation struct {
	rt  *Router
	cfg SaturationConfig
	mu  sync.Mutex
	// rates is each pool's estimate, by the pool's index in rt.pools.
	rates []poolRate
}

// SaturationConfig configures a Saturation.
type SaturationConfig struct {
	Profile     costmodel.Profile
	BatchTokens int           // the replicas' token budget per step (max_num_batched_tokens)
	MaxSeqs     int           // the replicas' batch cap (max_num_seqs; 0: vLLM's 256)
	Objective   time.Duration // the TTFT objective (p90)
	Window      time.Duration // the rates' time constant
}

// defaultMaxSeqs is vLLM's default max_num_seqs, and the engine model's.
const defaultMaxSeqs = 256

// maxSaturation bounds the gauge: a pool with load and no replica in
// rotation, or whose objective no utilisation meets.
const maxSaturation = 100

// minRho bounds ρ* from below: an objective shorter than ln(10) lone
// prefills is met at no load; the gauge is then load over 5% of capacity.
const minRho = 0.05

// poolRate is one pool's rates.
type poolRate struct {
	at     time.Time
	last   workCount  // the counters at the last sample
	queued [4]float64 // the work waiting in the router's queue then
	// arrived are the rates of work arriving (routed, and the queue's
	// growth); routed the rates of work routed alone, whose means
	// (tokens per request) price the load.
	arrived, routed [4]float64
	started         bool
}

// workCount is what the replicas were sent: uncached prompt tokens,
// prompt tokens, output tokens, requests.
type workCount [4]int64

// PoolSaturation is one pool's gauge and what it is made of.
type PoolSaturation struct {
	Pool       string  // "" for the default pool
	Saturation float64 // load over capacity at the objective
	Load       float64 // engine time per second routed: replicas' worth of work
	Capacity   float64 // replicas' worth the pool can take within the objective: N·ρ*
	Replicas   int     // in rotation
}

// NewSaturation is the saturation of rt's pools.
func NewSaturation(rt *Router, cfg SaturationConfig) *Saturation {
	if cfg.MaxSeqs <= 0 {
		cfg.MaxSeqs = defaultMaxSeqs
	}
	return &Saturation{rt: rt, cfg: cfg, rates: make([]poolRate, len(rt.pools))}
}

// Sample updates every pool's rates at the router's now and returns the
// pools' gauges. It is cheap (a pass over the replicas); a scrape of the
// gauge, or the replay at each of its scrapes, calls it.
func (s *Saturation) Sample() []PoolSaturation {
	now := s.rt.cfg.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]PoolSaturation, len(s.rt.pools))
	for i, pl := range s.rt.pools {
		var c workCount
		n := 0
		for _, r := range s.rt.reps() {
			if !pl.has(r) {
				continue
			}
			c[0], c[1], c[2], c[3] = c[0]+r.prefilled.Load(), c[1]+r.prompted.Load(), c[2]+r.decoded.Load(), c[3]+r.routed.Load()
			if r.healthy.Load() && !r.removed.Load() {
				n++
			}
		}
		pr := &s.rates[i]
		pr.update(now, c, pr.queuedWork(pl), s.cfg.Window)
		out[i] = s.gauge(pl.name, pr, n)
	}
	return out
}

// update folds the counters at now into the rates: an exponentially
// weighted mean over window of the rates between samples (the weight of
// a gap dt is 1 − e^(−dt/window), so irregular samples weigh by time).
// The work arriving is the work routed plus what the router's queue
// gained: a policy that defers (late binding) holds the load back from
// the replicas, not from the pool.
func (pr *poolRate) update(now time.Time, c workCount, queued [4]float64, window time.Duration) {
	back := false
	for k := range c {
		back = back || c[k] < pr.last[k]
	}
	if !pr.started || back {
		// The first sample, or counters that went back (a replica forgotten
		// and its slot reused): start from here.
		pr.at, pr.last, pr.queued, pr.started = now, c, queued, true
		return
	}
	dt := now.Sub(pr.at).Seconds()
	if dt <= 0 {
		return
	}
	a := 1 - math.Exp(-dt/window.Seconds())
	for k := range c {
		routed := float64(c[k] - pr.last[k])
		pr.routed[k] += a * (routed/dt - pr.routed[k])
		pr.arrived[k] += a * ((routed+queued[k]-pr.queued[k])/dt - pr.arrived[k])
	}
	pr.at, pr.last, pr.queued = now, c, queued
}

// queuedWork is the work waiting in pl's queue: its requests' prompts,
// uncached in the proportion the routed ones were, and their max_tokens.
func (pr *poolRate) queuedWork(pl *pool) [4]float64 {
	pl.q.mu.Lock()
	defer pl.q.mu.Unlock()
	var out [4]float64
	pl.q.eachLocked(func(w *Waiting) {
		out[1] += float64(w.req.Tokens)
		out[2] += float64(max(w.req.MaxTokens, 0))
		out[3]++
	})
	ratio := 1.0 // before anything was routed: all of it
	if pr.routed[1] > 0 {
		ratio = pr.routed[0] / pr.routed[1]
	}
	out[0] = out[1] * ratio
	return out
}

// gauge is a pool's saturation from its rates and its n replicas in rotation.
func (s *Saturation) gauge(name string, pr *poolRate, n int) PoolSaturation {
	r := pr.routed
	if r[3] <= 0 {
		r = pr.arrived // nothing routed of late (all held in the queue): the arrivals' own means
	}
	var meanUncached, meanPrompt, meanOutput float64
	if r[3] > 0 {
		meanUncached, meanPrompt, meanOutput = r[0]/r[3], r[1]/r[3], r[2]/r[3]
	}
	p := s.cfg.Profile
	prefillCost := p.C1 + p.C2*max(meanPrompt-meanUncached/2, 0) // ms per uncached token
	batch := float64(min(s.cfg.MaxSeqs, max(s.cfg.BatchTokens, 1)))
	decodeCost := p.C1 + p.C3*(meanPrompt+meanOutput/2) + p.C0/batch // ms per output token
	alone := (p.C0 + meanUncached*prefillCost) / 1000                // seconds: a request's prefill on an idle replica
	rho := max(1-math.Ln10*alone/s.cfg.Objective.Seconds(), minRho)
	out := PoolSaturation{Pool: name, Replicas: n, Capacity: float64(n) * rho,
		Load: max(pr.arrived[0]*prefillCost+pr.arrived[2]*decodeCost, 0) / 1000}
	switch {
	case out.Load <= 0:
	case out.Capacity <= 0:
		out.Saturation = maxSaturation
	default:
		out.Saturation = min(out.Load/out.Capacity, maxSaturation)
	}
	return out
}

// countWork counts a routed request's work: its uncached and whole
// prompt, the output it asked for, the request.
func (r *Replica) countWork(uncached, prompt, maxTokens int64) {
	r.prefilled.Add(uncached)
	r.prompted.Add(prompt)
	r.decoded.Add(maxTokens)
	r.routed.Add(1)
}

// correctWork adds, at a request's end, what the replica reported beyond
// what was counted at routing: the prompt tokens it computed beyond the
// decision's estimate (its cache had evicted what the index still
// credited), and the output beyond max_tokens (all of it without). The
// counters only grow: work counted and not done (a shorter answer, a
// better hit) stays counted, the work the replica reserved for it.
func (r *Replica) correctWork(t *Ticket, o Outcome) {
	if o.CachedTokens >= 0 && t.phase != policy.PhaseDecode {
		if extra := int64(t.req.Tokens-o.CachedTokens) - t.uncached; extra > 0 {
			r.prefilled.Add(extra)
		}
	}
	if extra := o.OutputTokens - max(t.req.MaxTokens, 0); extra > 0 {
		r.decoded.Add(int64(extra))
	}
}
