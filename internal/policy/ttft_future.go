package policy

import (
	"math"
	"time"
)

// The price of the future (issue #25): the score's TTFT, decode and
// eviction terms price what a choice costs now; two more terms price what
// it costs the requests that come after it.
//
//   - Lost prefixes (future_weight). A request leaves its prompt and its
//     answer in r's cache for the requests that extend them (a chat's next
//     turns) or share them. r's cache is an LRU: a block written now is
//     evicted once r has written NumBlocks more, after T_r = NumBlocks / w_r
//     seconds, w_r being the rate at which r writes new blocks (its
//     characteristic time, as in Che's approximation of an LRU cache). If a
//     prefix stays in use for a time exponentially distributed with mean
//     prefix_life_s = L, the chance that r evicts it while it is still in
//     use is π_r = exp(−T_r / L), and the requests that come back for it
//     compute it again:
//
//     lost(r) = future_weight × π_r × prefill(prompt + output)
//
//     A replica that already turns its cache over quickly (many chats'
//     growing histories on few blocks, a prefix replicated onto a small
//     cache) loses what it is given; a replica with room keeps it. L is a
//     prefix's life, not the gap before its next use: a chat's history is
//     touched again at each turn, but each turn also writes more of it, and
//     the life is what makes a holder that writes fast look as it will
//     once the chats it holds have grown. Learning the gap from next turns
//     instead (the gap before a prompt's next use) was tried: the first
//     turns are placed before any next turn shows it, and by the time it is
//     learnt the chats are pinned to the holders whose caches they outgrow
//     (multiturn on 8 replicas of 1,500–2,000 blocks: p90 1.7–2.0× preble's,
//     as without the term).
//
//   - Wait (wait_weight). The request's prefill lengthens r's steps by s =
//     its uncached tokens' compute; each request that reaches r while it
//     is queued there (q ms of work ahead) or computing waits that much
//     longer (half of it on average for those arriving during it): with
//     λ_r the rate of requests reaching r,
//
//     wait(r) = wait_weight × s × λ_r × (q + s/2)
//
//     the Pollaczek–Khinchine view of a job's cost to the jobs behind it. A
//     prefix's first prefill (a cold miss, 100+ ms) is cheap on an idle
//     replica and costly on a busy one; a cache hit is cheap anywhere.
//
// Both rates are what this policy routed (and, with several gateways, what
// the others shared) in the last window_s seconds, as exponentially decayed
// sums: w_r counts each request's uncached prompt blocks and expected output
// blocks when it is routed, and the blocks the replica computed beyond the
// router's prediction when it ends (usage.cached_tokens below the credited
// prefix: the index believed blocks the engine had evicted).

// ttftFlow is what flowed into one replica recently, as sums decayed with
// time constant window_s: their quotient by window_s is a rate.
type ttftFlow struct {
	at     time.Time // when the sums were last decayed
	blocks float64   // blocks written
	reqs   float64   // requests routed
}

// ttftMaxSlots bounds the replica slots whose correction and flow are kept
// (slots come from the router and stay far below it; past it, a slot
// counts as idle and uncorrected).
const ttftMaxSlots = 1 << 14

// decay is exp(−(now−f.at)/window): how much of the sums is left at now.
// Under traffic a replica's sums were decayed a moment ago: below a
// thousandth of the window the Taylor polynomial is exact to 2e-10 and
// spares Pick an exponential per candidate.
func (t *TTFT) decay(f *ttftFlow, now time.Time) float64 {
	x := now.Sub(f.at).Seconds() / t.params.WindowS
	switch {
	case x <= 0:
		return 1
	case x < 1e-3:
		return 1 - x + x*x/2
	}
	return math.Exp(-x)
}

// addFlow records blocks written and requests routed to replica at at.
// t.mu must be held.
func (t *TTFT) addFlow(replica int, at time.Time, blocks, reqs float64) {
	if !(blocks >= 0) || !(reqs >= 0) || math.IsInf(blocks+reqs, 0) {
		return
	}
	sl := t.grow(replica)
	if sl == nil {
		return
	}
	f := &sl.flow
	if !sl.flowing {
		*f, sl.flowing = ttftFlow{at: at}, true
	}
	if at.After(f.at) {
		d := t.decay(f, at)
		f.blocks, f.reqs, f.at = f.blocks*d, f.reqs*d, at
	}
	f.blocks += blocks
	f.reqs += reqs
}

// rates are replica's blocks written and requests routed per second at now.
// t.mu must be held.
func (t *TTFT) rates(replica int, now time.Time) (blocksPerS, reqsPerS float64) {
	sl := t.slot(replica)
	if sl == nil || !sl.flowing {
		return 0, 0
	}
	f := &sl.flow
	d := t.decay(f, now) / t.params.WindowS
	return f.blocks * d, f.reqs * d
}

// futureCost is the price of the future of sending req to v (lost
// prefixes and the wait, above): own uncached tokens on v after cached
// ones, tokens in the prompt, out expected output tokens, l v's load and
// queueMs the time to run the work queued ahead on it.
func (t *TTFT) futureCost(req *Request, v *ReplicaView, l *ttftLoad, own, cached, tokens int, out, queueMs float64) float64 {
	if t.params.FutureWeight == 0 && t.params.WaitWeight == 0 {
		return 0
	}
	w, lam := t.rates(v.Index, req.Now)
	cost := 0.0
	if t.params.FutureWeight > 0 && w > 0 && v.NumBlocks > 0 {
		// T_r / L; exp(−T_r/L) below e^−30 (a cache that turns over once
		// in 30 lives) is nothing next to any other term: skipped, with
		// its exponential, as on most replicas most of the time.
		if e := float64(count(v.NumBlocks)) / w / t.params.PrefixLifeS; e < 30 {
			n := tokens + int(min(out, float64(viewCeiling)))
			cost += t.params.FutureWeight * math.Exp(-e) * t.prefillMs(n, 0, l)
		}
	}
	if t.params.WaitWeight > 0 && lam > 0 {
		prof := t.o.Profile
		s := prof.C1*float64(own) + prof.C2*float64(own)*float64(cached+own)
		cost += t.params.WaitWeight * s * lam / 1000 * (queueMs + s/2)
	}
	return cost
}

// observeFlow counts a routed request's writes (its uncached prompt and
// expected output) and arrival on its replica, and, when it ends, the
// blocks its replica computed beyond the prefix credited at routing.
// Decisions other gateways shared count as this gateway's own: they fill
// the same caches. t.mu must be held.
func (t *TTFT) observeFlow(ev Event) {
	bs := float64(t.o.BlockSize)
	switch ev.Kind {
	case Routed:
		if pk := &t.picks[ev.Req.ID%ttftPickSlots]; !ev.Remote && pk.id == ev.Req.ID && pk.replica == ev.Decision.Replica {
			t.countPrefix(pk.prefix, ev.At)
			t.countFamily(ev.Req, ev.At)
		}
		_, out := t.means(ev.Req)
		uncached := max(count(ev.Req.Tokens)-count(ev.Decision.Matched)*t.o.BlockSize, 0)
		t.addFlow(ev.Replica, ev.At, (float64(uncached)+out)/bs, 1)
	case Done:
		if ev.Err != nil || ev.CachedTokens < 0 {
			return
		}
		credited := min(count(ev.Decision.Matched)*t.o.BlockSize, count(ev.Req.Tokens))
		if extra := credited - count(ev.CachedTokens); extra > 0 {
			t.addFlow(ev.Replica, ev.At, float64(extra)/bs, 0)
		}
	}
}
