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
// blocks, ending at block key) carries in this pick; 0 when the prefix is
// not shared at a rate, or no replica with room is less busy than its
// holders. t.mu held.
func (t *TTFT) replicateMs(req *Request, rs []ReplicaView, key uint64, depth int, meanPrompt float64) float64 {
	if t.params.ReplicateS == 0 || depth == 0 {
		return 0
	}
	lam := t.prefixRate(key, req.Now)
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
