package policy

import (
	"math"
	"slices"
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
	others, sum, healthy := 0, 0.0, 0
	for i := range rs {
		v := &rs[i]
		if !v.Healthy {
			continue
		}
		healthy++
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
	if holders == 0 || others == 0 || t.familyHeld(req, holders, healthy) {
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
// match is a hot prefix (λ_p × replicate_s ≥ 1, as above) and that does
// not continue a program,
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
// stays with its context; nor does any request that continues a program
// (its home's move price weighs a move), where its first request, which
// picks the home for the turns to come, does. See balanceMs for the
// figures.

// workRate is replica's W_r at now, ms per second. t.mu held.
func (t *TTFT) workRate(replica int, now time.Time) float64 {
	w, _ := t.rates(replica, now)
	return w * float64(t.o.BlockSize) * t.o.Profile.C1
}

// workMean is W̄ for req, whose deepest match is requested lam times a
// second; -1 when the term is off or the prefix not hot. t.mu held.
func (t *TTFT) workMean(req *Request, rs []ReplicaView, lam float64) float64 {
	if t.params.BalanceS == 0 || req.Program.Continues || lam*t.params.ReplicateS < 1 {
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
// For a request that does not continue a program (a program's first
// request, or a request of none); balance_s 5. Chats at low load on
// caches with room (multiturn, 8 replicas of 3,000 blocks, 16/s): their
// first turns went to the holders of their system prompts, whose queues
// were short, and stayed there with their later turns; three replicas
// served 17–24 requests of 640, the others up to 143, and the idle ones
// took late moves of chats whose homes had filled (seed 1: p90 TTFT 37.3
// ms against preble's 32.1; seeds 1–30: 34.1 ms against 31.9). Priced,
// 32.8 and 32.2 ms. The pressure sweep's points above 1.05× the best
// peer on ten seeds' means 3 → 2 (on seeds 1, 2, 3: 7, 6, 8 → 5, 6, 7);
// agents' capacity on 8 replicas, seeds 1–8, mean 2.296× → 2.334×
// (seed 1 2.09× → 2.03×, preble 2.00×; its program makespan p90 193.8 →
// 191.8 s, preble 193.7); the conversation trace 4.00× both, synthetic
// 3.46× both; the two points and RL batches unchanged.
//
// Before, for every request of a hot prefix and off by default: at 3,
// over the pressure sweep on seeds 1
// and 2 and at 3× its length (ttft's p90 TTFT over the best peer's):
// points above 1.05× 21 → 19, 24 → 18, 14 → 11; geometric mean of the
// ratios 1.0238 → 1.0188, 1.0227 → 1.0162, 1.0234 → 1.0132; worst 1.49 →
// 1.39, 1.42 → 1.39, 1.69 → 1.36 (balance_s 2: 19, 18, 10; 4: 22, 20, 9;
// 5: 20, 18, 9; 8: 18, 20, 7 but shared prefix at the point fell
// from 93.4 to 93.0 % hit); the two points unchanged. But capacity
// at p90 ≤ 2 s on 8 replicas fell a little: conversation trace 3.964× →
// 3.961× (seed 2 3.976× → 3.962×), agents 2.090× → 2.071× (seeds 2 and 3:
// 2.466× → 2.546×, 2.254× → 2.221×; balance_s 2: 2.026×), synthetic
// 3.454× both; and live, a shared prefix's requests (a session's
// questions, continuing it) made copies that cost hit rate. Priced for
// every request, not only a hot prefix's, it
// gained more on the sweep (at 10 s, beyond 1.2× the least loaded
// replica: 11, 10, 8) but spread the multiturn chats' first turns
// off the replicas that held their system prompts (hit 86.6 → 84.7 %, p90
// 35.8 → 39.4 ms; llm-d's rule 86.6 %, 35.8 ms).
func (t *TTFT) balanceMs(replica int, now time.Time, mean float64) float64 {
	return min(t.params.BalanceS*max(t.workRate(replica, now)-mean, 0), float64(viewCeiling))
}

// The replicate term at startup (issue #25, the multiturn point). In a
// fleet's first requests a holder's queue is one chat's prefill under way,
// or a short queue beside a moment's decodes, and a prefix's rate is two
// or three requests over a second: the term read them as lasting and made
// a second holder of a system prompt within the first 25 requests (4
// system prompts on 4 replicas of 1,500 blocks at 16/s, seeds 1–20: p90
// TTFT above 1.05× llm-d's rule on seeds 2, 3, 5 and 12, 40.8–49.1 ms
// against 33.6–34.2). The copy took a replica another system prompt then
// needed, and that replica served two groups for the rest of the run. So
// while the fleet has routed fewer than replicate_warmup requests
// (decayed over window_s, as the rates are), a prefix gets another holder
// from this term only if its family's share of those requests asks for
// more holders than it has:
//
//	holders < share × healthy replicas,  share = n_f / (n + prior)
//
// n_f being the requests of the request's family (those whose first block
// is its first block: a chat's later turns count with its system prompt,
// whose deepest match they no longer are), n the fleet's and prior
// (ttftFamilyPrior) shrinking a share read from few requests toward 0.
// Four system prompts on 8 replicas ask for two holders each and get them
// early; four on 4 ask for one. A workload whose prompts share their first
// block is one family: its share asks for every replica, as before.
//
// replicate_warmup 25, prior 4: seed 12 no longer behind (41.2 → 33.6 ms),
// seeds 2 and 3 closer (49.1 → 36.7, 43.1 → 38.0 ms; mean p90 over the 20
// seeds 36.5 → 35.1 ms, llm-d 39.0; no seed worse by 1 %); the pressure
// sweep's points above 1.05× the best peer unchanged (seeds 1 and 2 and
// the long sweep: 21, 24, 14; geometric means 1.0238 → 1.0235, 1.0227 →
// 1.0225, 1.0234 both). Prior 16 also keeps seeds 3 and 5 (mean 34.5 ms)
// but one sweep point rises past 1.05× (multiturn on 4 replicas of 1,500
// blocks at 24/s, seed 1: 75.8 → 77.2 ms; 22, 24, 12 points); warm-up 20
// or 30 did worse. Past the warm-up the term is as above: a share counts
// requests, not the queues that decide whether a copy pays under load (the
// gate kept for the whole run, prior 16, cost the sweep's shared-prefix
// points on 4 and 8 replicas: 21 → 19, 24 → 30, 14 → 16). Seed 2 stays
// behind: its fourth request finds the holder computing the first three
// (29 ms into a 77 ms prefill) and the estimate, which does not count
// the prefill already done, sends it to an idle replica on its own score.

// Programs hold their family. A program's turns go where its first went,
// so a copy of its family's opening made for one of them moves that
// program, and the families sharing the copy's replica, for the rest of
// the run. Past the warm-up the term weighs the holders' queues of the
// moment, and in a fleet's first seconds, when most requests start a
// program, a queue and a prefix's rate read from a few requests make
// copies that last: 4 system prompts on 4 replicas of 1,500 blocks at
// 32/s (128 chats), mean p90 TTFT over seeds 1–100 241.6 ms where
// SGLang's rule, which never moves a chat, has 200.7 (the term off while
// the fleet's decayed count of routed requests is below 100: 201.6 ms;
// off only past it: no gain). So for a program's request the family
// gate holds for the whole run, on the family's count less one standard
// deviation (a Poisson count's √n_f): equal families on a fleet that
// divides them evenly ask for an integer number of holders exactly, and
// the share read from its count exceeds it on half the draws. Four system prompts
// on 8 replicas still get two holders each; one family (an agent fleet's
// system prompt) every replica; six groups of questions on 8 replicas
// (each group a session, so a program) 1.33 holders each, a second for
// each group once its count is read from a few dozen requests. A request
// of no program keeps the warm-up's gate alone.
//
// Measured: that point 241.6 → 206.1 ms (a count less two deviations:
// 201.6, but shared prefix on 8 replicas of 6,000 blocks at 72/s, seeds
// 1–30, 26.8 → 27.3 ms; one: 26.9; rounding the share instead, a holder
// more only from half a holder up: 27.3). The pressure sweep's points
// above 1.05× the best peer on ten seeds' means 3 → 1 (that point 226.7
// → 207.6 ms, 1.14× → 1.04×; 3,000 blocks at 32/s 1.05× → 1.01×), on
// seeds 1, 2 and 3 9, 10, 14 → 10, 7, 10. The multiturn point
// (64 chats at 16/s on 1,500 blocks), seeds 1–20: mean p90 36.0 → 34.4
// ms, hit 86.4 → 86.8 % (llm-d's rule 39.0 ms, 85.6 %). Agents' capacity
// on 8 replicas, seeds 1–8, identical. With it, replicate_s 2 gains 8
// replicas at 16/s on 3,000 blocks (seeds 1–60: 34.2 → 32.3 ms, preble
// 31.9) but costs agents' capacity (2.315× → 2.293× over seeds 1–8).

// ttftFamilySlots is the size of the table of families' counts (32 bytes
// a slot), in sets of ttftFamilyWays: a family not in its set takes the
// way whose count is lowest now, so two active families whose keys share
// a set both keep counting (with one way a set, a rare family's requests
// reset a hot one's count at each, and with it the copies its share asks
// for), and a family pushed out is the least of ttftFamilyWays.
const (
	ttftFamilySlots = 1 << 10
	ttftFamilyWays  = 4
)

// ttftFamilyPrior is the share's prior, in requests. See replicate_warmup.
const ttftFamilyPrior = 4

// ttftCount is a count of routed requests decayed over window_s: a
// family's (key its first block) or the fleet's (key unused).
type ttftCount struct {
	key uint64
	at  time.Time // when n was last decayed
	n   float64
}

// add counts one request at at. t.mu held.
func (t *TTFT) add(c *ttftCount, at time.Time) {
	if at.After(c.at) {
		c.n *= t.decay(&ttftFlow{at: c.at}, at)
		c.at = at
	}
	c.n++
}

// value is c's count at now. t.mu held.
func (t *TTFT) value(c *ttftCount, now time.Time) float64 {
	return c.n * t.decay(&ttftFlow{at: c.at}, now)
}

// countFamily counts a request routed at at in its family and the fleet's
// total, the whole run (the counts decay over window_s): the replicate
// term's gate reads both in the warm-up, copy_inflight the fleet's. t.mu
// held.
func (t *TTFT) countFamily(req *Request, at time.Time) {
	if len(req.Blocks) == 0 || t.params.ReplicateWarmup == 0 {
		return
	}
	t.add(&t.routed, at)
	key := req.Blocks[0]
	c := t.family(key)
	if c == nil { // the way counted least now
		set := t.familySet(key)
		c = &set[0]
		least := t.value(c, at)
		for i := 1; i < len(set); i++ {
			if v := t.value(&set[i], at); v < least {
				c, least = &set[i], v
			}
		}
		*c = ttftCount{key: key, at: at}
	}
	t.add(c, at)
}

// familySet is the set of ways where key's family is counted.
func (t *TTFT) familySet(key uint64) []ttftCount {
	i := int(key%(ttftFamilySlots/ttftFamilyWays)) * ttftFamilyWays
	return t.families[i : i+ttftFamilyWays]
}

// family is key's count, nil if its family is not counted. t.mu held.
func (t *TTFT) family(key uint64) *ttftCount {
	set := t.familySet(key)
	for i := range set {
		if set[i].key == key && set[i].n > 0 {
			return &set[i]
		}
	}
	return nil
}

// familyHeld reports whether req's family has as many holders as its
// share asks for (holders of the healthy replicas), where the gate holds:
// in the warm-up, and for a program's request the whole run, on its
// share less its noise (programs hold their family, below). t.mu held.
func (t *TTFT) familyHeld(req *Request, holders, healthy int) bool {
	if t.params.ReplicateWarmup == 0 || len(req.Blocks) == 0 {
		return false
	}
	n := t.value(&t.routed, req.Now)
	program := req.Program.ID != 0
	if n >= t.params.ReplicateWarmup && !program {
		return false
	}
	nf := 0.0
	if c := t.family(req.Blocks[0]); c != nil {
		nf = t.value(c, req.Now)
	}
	if program {
		nf = max(nf-math.Sqrt(nf), 0)
	}
	return float64(holders) >= nf/(n+ttftFamilyPrior)*float64(healthy)
}

// What copy_inflight may copy (copyInflight, ttft.go). The index credits
// a replica with a request's blocks when the request is routed there, not
// when they are computed; and a queue as long as the blocks a replica
// holds beyond another's does not tell whose blocks they are. A chat's
// next turn on the replica holding its history, busy with other chats'
// prefills, read as waiting for its own history (computed a turn ago),
// moved off its context, and its later turns followed it (agents on 8
// replicas, capacity at p90 ≤ 2 s, seed 1, before the price of a moved
// program's opening: 2.09× → 1.99× with the warm-up's family share, 2.11×
// with this). So a copy is made only of blocks that are
//
//   - still being computed there: a request this gateway sent that has
//     no first token yet writes them (its blocks from its credited match
//     on cover them); each replica keeps those requests until their first
//     token or their end; or
//   - a prefix shared at a rate: the deepest match ends at a prefix whose
//     requests come λ_p × replicate_s ≥ 1 per horizon (the replicate
//     term's hot prefix); a program's own context is the deepest match of
//     its next turn only (λ_p 0).
//
// Without the first, the shared-prefix points the copies win stay where
// they were (the sweep's points above 1.05× on seeds 1 and 2 and at 3×
// its length: 20, 22, 12 against 11, 12, 12): there a group's first
// requests find its prefix still being computed on its first holder.
// Without the second: 13, 16, 12.

// ttftMaxWrites bounds the writes kept per replica: past it the oldest is
// forgotten (a copy it would have allowed is not made).
const ttftMaxWrites = 256

// ttftWrite is one request's prefill in flight on a replica: its blocks
// from its credited match on.
type ttftWrite struct {
	id     uint64
	from   int      // the blocks credited at routing: those before are not its own
	blocks []uint64 // the request's block hashes (Request.Blocks, never written to)
	at     time.Time
	tokens int // its uncached prompt tokens (the prefill it was routed with)
}

// observeWrite keeps the writes in flight on each replica: a local request
// routed whole or as its prefill step, until its first token or its end.
// Only while copy_inflight is on. t.mu held.
func (t *TTFT) observeWrite(ev Event) {
	if !t.params.CopyInflight || ev.Remote || ev.Phase == PhaseDecode {
		return
	}
	sl := t.grow(ev.Replica)
	if sl == nil {
		return
	}
	if ev.Kind == Routed {
		from := count(ev.Decision.Matched)
		if from >= len(ev.Req.Blocks) {
			return // nothing written beyond the credited match
		}
		if len(sl.writes) == ttftMaxWrites {
			sl.writes = slices.Delete(sl.writes, 0, 1)
		}
		sl.writes = append(sl.writes, ttftWrite{id: ev.Req.ID, from: from, blocks: ev.Req.Blocks, at: ev.At,
			tokens: max(count(ev.Req.Tokens)-from*t.o.BlockSize, 0)})
		return
	}
	for i := range sl.writes {
		if sl.writes[i].id == ev.Req.ID {
			sl.writes = slices.Delete(sl.writes, i, i+1) // zeroes the freed slot: its blocks are not kept
			return
		}
	}
}

// copyable reports whether req's blocks a to m (a < m ≤ len(req.Blocks))
// on replica may be copied elsewhere: a request in flight there without a
// first token writes them, or they end at a hot prefix. t.mu held.
func (t *TTFT) copyable(req *Request, replica, a, m int) bool {
	if m <= a || m > len(req.Blocks) {
		return false
	}
	last := req.Blocks[m-1]
	if sl := t.slot(replica); sl != nil {
		for i := range sl.writes {
			w := &sl.writes[i]
			if w.from <= a && len(w.blocks) >= m && w.blocks[m-1] == last {
				return true
			}
		}
	}
	return t.prefixRate(last, req.Now)*t.params.ReplicateS >= 1
}

// startsInWarmup reports whether req starts a program while the fleet has
// routed fewer than replicate_warmup requests: copy_inflight leaves it on
// its deepest match. t.mu held.
func (t *TTFT) startsInWarmup(req *Request) bool {
	return req.Program.ID != 0 && !req.Program.Continues && t.params.ReplicateWarmup > 0 &&
		t.value(&t.routed, req.Now) < t.params.ReplicateWarmup
}

// The prefill under way, in the warm-up. A replica's queue counts the
// uncached prompts of the requests routed to it that have no first token
// yet, whole: the router does not know how far the engine has gone. In a
// fleet's first requests that reads a holder still computing a system
// prompt's first prefill as busy for all of it, and a program's first
// turn arriving near its end went to an idle replica as a miss, making a
// second holder of that prompt where another family's first chat then
// went: multiturn on 4 replicas of 1,500 blocks at 32/s, seed 9, one
// replica took 190 of 640 requests, p90 432 ms against 161 for
// SGLang's rule, which never moves a chat. So, for a request that starts
// a program in the warm-up (startsInWarmup, the same requests
// copy_inflight leaves on their deepest match), the oldest prefill this
// gateway sent to a replica counts only its part not computed yet, as if
// it began when it was routed (the warm-up's replicas are idle) at the
// profile's idle rate. Only there: the other requests of the warm-up
// make the early copies the shared-prefix points on 8 replicas need
// (counted for every request of the warm-up, 96/s on 6,000–8,000 blocks
// went to 1.08–1.09× the best peer; counted always, the sweep's points
// above 1.05× on ten seeds' means went from 4 to 15).
//
// Measured (scripts/pressure-sweep.sh, SEEDS 1–10): that point's mean
// p90 255.3 → 226.7 ms (seed 9 432 → 149; SGLang's rule 198.7), the
// sweep's points above 1.05× on the means 4 → 3, on seeds 1, 2 and 3
// 9, 10, 17 → 9, 10, 14. Capacity at p90 ≤ 2 s on 8 replicas: the
// Mooncake conversation trace 4.00×, synthetic 3.51×, unchanged; agents
// over seeds 1–8 a mean of 2.299× → 2.315× (seed 1 2.11× → 2.06×, seed 3
// 2.16× → 2.24×, seed 5 2.16× → 2.25×), their program makespan p90 at 1×
// over seeds 1–12 200.3 → 200.3 s (seed 1 193.4 → 195.7 s). Live, 4
// simulated replicas of 1,500 blocks, 64 chats at 16/s (#25): hit rate
// 86.6 % in 6 runs of 6, engine TTFT 28.8–28.9 ms (llm-d's rule 86.1–86.6
// %, 28.8–30.1 ms).

// warmupElapsed is the prompt tokens of the oldest write in flight on
// replica computed by req.Now, while estimateAll estimates a request that
// starts a program in the warm-up (t.warm; 0 otherwise, and without
// copy_inflight, which keeps the writes). Its prefill is timed on an idle
// replica, and prune reads the same, so that its bound stays below the
// estimate. t.mu held.
func (t *TTFT) warmupElapsed(req *Request, replica int) float64 {
	if !t.warm {
		return 0
	}
	sl := t.slot(replica)
	if sl == nil || len(sl.writes) == 0 {
		return 0
	}
	w := &sl.writes[0]
	el := float64(req.Now.Sub(w.at)) / float64(time.Millisecond)
	if !(el > 0) || w.tokens <= 0 {
		return 0
	}
	idle := t.idleLoad()
	full := t.prefillMs(w.tokens, w.from*t.o.BlockSize, &idle)
	if !(full > 0) {
		return 0
	}
	return float64(w.tokens) * min(el/full, 1)
}

// holdersOf counts the healthy replicas holding req's first m blocks.
func holdersOf(req *Request, rs []ReplicaView, m int) int {
	n := 0
	for i := range rs {
		if rs[i].Healthy && min(count(rs[i].Match), len(req.Blocks)) >= m {
			n++
		}
	}
	return n
}
