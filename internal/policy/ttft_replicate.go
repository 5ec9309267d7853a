package policy

import (
	"math"
	"time"
)

// A second holder for a hot prefix (issue #25, the cache-pressure sweep).
// The estimate prices a request's own TTFT: on a holder of its prefix the
// queue there and a short prefill, elsewhere the whole prefill. So a prefix
// many requests share stays with its holders until their queues outweigh
// the prefill it saves, and gets a second holder only then, late and under
// load, where a p90 objective is better served by a few early misses:
// shared_prefix on 8 replicas at 72 requests/s kept each of its six groups
// on one holder and two replicas nearly idle (p90 TTFT 30.0 ms) where
// Dynamo's rule spread every group within 0.3 s at the price of 16 misses,
// 3 % of the requests (26.4 ms); multiturn chats on 8 replicas of 3,000
// blocks at 16/s piled onto the four holders of their system prompts until
// their histories no longer fitted there (41.5 ms against preble's 32.1).
//
// The miss a new holder costs is paid once, by the request that makes it;
// what it buys comes after: the prefix's later requests are shared by one
// more holder. So every holder of the request's deepest match carries
//
//	replicate = λ_p × replicate_s / (k + 1) × max(q_h − q̄_n, 0)
//
// λ_p is the rate of the requests routed with that prefix as their deepest
// match (its last block, counted in a fixed table decayed over window_s;
// until the prefix has been seen for window_s, its requests over the time
// since its first, that time taken as at least replicate_s), k its holders,
// q_h the shortest queue among them and q̄_n the mean queue of the replicas
// that could take a copy (ms, corrected as the estimate is): the wait each
// request sent to the new holder saves, over the horizon replicate_s. A
// copy counts only where the cache, with it and the requests in flight,
// stays within replicate_room of its blocks: under cache pressure a copy
// evicts contexts that come back (at 0.5 the sweep's shared-prefix point on
// 4 replicas of 1,000 blocks at 48/s thrashed, p90 3× llm-d's). A chat's
// turn is the only one of its deepest match (the next turn's is longer):
// its λ_p is 0 and it stays with its context; so does any request whose
// holders are idle.
//
// Only this gateway's requests are counted: a decision another gateway
// shared carries the blocks past its match, not the match's last one.

// ttftPrefixSlots is the size of the table of prefix rates (40 bytes a
// slot): a prefix whose slot another takes is forgotten, and its rate
// counts from 0 again.
const ttftPrefixSlots = 1 << 12

// ttftPrefixRate is one slot of the table: a prefix's last block and its
// count of routed requests, decayed and not.
type ttftPrefixRate struct {
	key   uint64
	since time.Time // its first request in the slot
	at    time.Time // when n was last decayed
	n     float64   // decayed with time constant window_s
	seen  float64   // not decayed: its requests since since
}

// prefixRate is key's requests routed per second at now. t.mu held.
func (t *TTFT) prefixRate(key uint64, now time.Time) float64 {
	s := &t.prefixes[key%ttftPrefixSlots]
	if s.key != key || s.seen == 0 {
		return 0
	}
	if age := now.Sub(s.since).Seconds(); age < t.params.WindowS {
		// Young: a decayed sum would read as a rate over a window the
		// prefix has not lived yet. The requests after its first, over
		// the time since, no shorter than the horizon (two requests a
		// millisecond apart are not a rate).
		return max(s.seen-1, 0) / max(age, t.params.ReplicateS)
	}
	return s.n * t.decay(&ttftFlow{at: s.at}, now) / t.params.WindowS
}

// countPrefix counts a request routed at at whose deepest match ended at
// block key. t.mu held.
func (t *TTFT) countPrefix(key uint64, at time.Time) {
	if key == 0 || t.params.ReplicateS == 0 {
		return
	}
	s := &t.prefixes[key%ttftPrefixSlots]
	if s.key != key {
		*s = ttftPrefixRate{key: key, since: at, at: at}
	}
	if at.After(s.at) {
		s.n *= t.decay(&ttftFlow{at: s.at}, at)
		s.at = at
	}
	s.n++
	s.seen++
}

// replicateMs is the term each holder of req's deepest match (depth
// blocks, requested lam times a second) carries in this pick; 0 when the
// prefix is not shared at a rate, or no replica with room is less busy
// than its holders. t.mu held.
func (t *TTFT) replicateMs(req *Request, rs []ReplicaView, lam float64, depth int, meanPrompt float64) float64 {
	if t.params.ReplicateS == 0 || depth == 0 {
		return 0
	}
	if lam*t.params.ReplicateS < 1 { // less than one request to share over the horizon
		return 0
	}
	var l ttftLoad
	holders, held := 0, math.Inf(1)
	others, sum := 0, 0.0
	for i := range rs {
		v := &rs[i]
		if !v.Healthy {
			continue
		}
		isHolder := min(count(v.Match), len(req.Blocks)) >= depth
		if !isHolder && !t.roomFor(v, depth) {
			continue
		}
		t.load(&l, v, meanPrompt)
		q := t.queueMs(&l) * t.corr(v.Index)
		if isHolder {
			holders++
			held = min(held, q)
		} else {
			others++
			sum += q
		}
	}
	if holders == 0 || others == 0 {
		return 0
	}
	gain := held - sum/float64(others)
	if !(gain > 0) {
		return 0
	}
	return min(lam*t.params.ReplicateS/float64(holders+1)*gain, float64(viewCeiling))
}

// roomFor reports whether a copy of depth blocks fits v's cache beside
// what it holds and what its requests in flight add, within replicate_room
// of its blocks (a cache of unknown size has none).
func (t *TTFT) roomFor(v *ReplicaView, depth int) bool {
	if v.NumBlocks <= 0 {
		return false
	}
	used := float64(count(v.Cached)) + float64(depth) + float64(count(v.InFlightKV))/float64(t.o.BlockSize)
	return used <= t.params.ReplicateRoom*float64(count(v.NumBlocks))
}

// The recent work of the replicas a hot prefix may go to (balance_s). The
// replicate term weighs the queues a prefix's holders have now; a hot
// prefix's requests keep coming, and they find the queues the work routed
// recently builds. So every replica carries, for a request whose deepest
// match is a hot prefix (λ_p × replicate_s ≥ 1, as above),
//
//	balance(r) = balance_s × max(W_r − W̄, 0)
//
// W_r being the compute (ms per second) of the work routed to r in the
// last window_s (its blocks written, the flows of ttft_future.go, at the
// profile's cost per token) and W̄ the mean over the healthy replicas: the
// backlog r gathers over balance_s beyond an average replica if its share
// of the work stays as it is. Over a holder, it is a holder busy for a
// while, not only at this instant, that gets a copy of the prefix made
// elsewhere; among holders, the one that has had the least. A chat's turn
// is the only one of its deepest match (λ_p 0) and never carries it: it
// stays with its context. See balanceMs for the figures.

// workRate is replica's W_r at now, ms per second. t.mu held.
func (t *TTFT) workRate(replica int, now time.Time) float64 {
	w, _ := t.rates(replica, now)
	return w * float64(t.o.BlockSize) * t.o.Profile.C1
}

// workMean is W̄ for req, whose deepest match is requested lam times a
// second; -1 when the term is off or the prefix not hot. t.mu held.
func (t *TTFT) workMean(req *Request, rs []ReplicaView, lam float64) float64 {
	if t.params.BalanceS == 0 || lam*t.params.ReplicateS < 1 {
		return -1
	}
	sum, n := 0.0, 0
	for i := range rs {
		if rs[i].Healthy {
			sum += t.workRate(rs[i].Index, req.Now)
			n++
		}
	}
	if n == 0 {
		return -1
	}
	return sum / float64(n)
}

// balanceMs is balance(r) for replica at now, the mean W̄ being mean.
//
// Off by default (balance_s 0). At 3, over the pressure sweep on seeds 1
// and 2 and at 3× its length (ttft's p90 TTFT over the best peer's):
// points above 1.05× 21 → 19, 24 → 18, 14 → 11; geometric mean of the
// ratios 1.0238 → 1.0188, 1.0227 → 1.0162, 1.0234 → 1.0132; worst 1.49 →
// 1.39, 1.42 → 1.39, 1.69 → 1.36 (balance_s 2: 19, 18, 10; 4: 22, 20, 9;
// 5: 20, 18, 9; 8: 18, 20, 7 but shared prefix at the point fell
// from 93.4 to 93.0 % hit); the two points unchanged. But capacity
// at p90 ≤ 2 s on 8 replicas fell a little: conversation trace 3.964× →
// 3.961× (seed 2 3.976× → 3.962×), agents 2.090× → 2.071× (seeds 2 and 3:
// 2.466× → 2.546×, 2.254× → 2.221×; balance_s 2: 2.026×), synthetic
// 3.454× both. Priced for every request, not only a hot prefix's, it
// gained more on the sweep (at 10 s, beyond 1.2× the least loaded
// replica: 11, 10, 8) but spread the multiturn chats' first turns
// off the replicas that held their system prompts (hit 86.6 → 84.7 %, p90
// 35.8 → 39.4 ms; llm-d's rule 86.6 %, 35.8 ms).
func (t *TTFT) balanceMs(replica int, now time.Time, mean float64) float64 {
	return min(t.params.BalanceS*max(t.workRate(replica, now)-mean, 0), float64(viewCeiling))
}
