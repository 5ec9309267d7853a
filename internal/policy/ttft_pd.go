package policy

import (
	"fmt"
	"math"
)

var _ PairPicker = (*TTFT)(nil)

// ttftSide is what PickPair estimates of one replica for one request.
type ttftSide struct {
	ok bool // a candidate of its side
	// As the prefill replica of a pair (a request of 1 output token): the
	// estimated time to its answer (ms, uncorrected), the cost of the
	// choice, the blocks credited and the replica's correction.
	preMs, preCost, corr float64
	// As the decode replica of a pair: its queue ahead (ms), the wire time
	// of the pulls ahead on its KV link, this request's pull, the step
	// computing the last prompt token with KV admission, and the cost of
	// the choice.
	admitMs, linkMs, pullMs, lastMs, decCost float64
	matched                                  int
	// Served whole on this replica (aggregated on a replica of role both,
	// or a decode replica lacking fewer than SkipPrefillBelow tokens):
	// allowed, estimated TTFT (corrected) and the cost of the choice.
	whole, aggregated  bool
	wholeMs, wholeCost float64
	uncached           int // prompt tokens the replica lacks
}

// PickPair is ttft on a prefill/decode fleet: the option with the lowest
// estimated time to first token of the whole path plus the costs of the
// choice, among
//
//   - every pair of a prefill replica P and another decode replica D:
//     TTFT = corr(P) × (max(prefill(P), queue(D), link(D)) + pull(D) + last(D)),
//     where prefill(P) is P's TTFT estimate for the request with one output
//     token (its queue ahead and the uncached prompt), queue(D) the prompt
//     work queued ahead on D (the decode request is admitted first come
//     first served: its transfer starts once it reaches the head of D's
//     queue), link(D) the wire time of the pulls D has pending (one KV link
//     per decode engine, first come first served), pull(D) the transfer of
//     what D lacks of the prompt (the profile's latency + bytes over
//     bandwidth, costmodel.Profile.TransferMs), and last(D) the step in
//     which D computes the last prompt token beside its decodes, plus KV
//     admission when D's cache is full; costs: P's eviction cost as Pick
//     counts it, D's decode cost (the request's output slowed by D's batch)
//     and D's evictions priced as transfers;
//   - every decode replica D served whole, as Pick estimates it: on a
//     replica of role both (aggregated), or on one lacking fewer than
//     Request.SkipPrefillBelow tokens of the prompt (the prefill step
//     skipped: it computes the rest itself).
//
// As Pick does, among the options within the margin of the best the one
// whose replicas hold the most of the prompt wins (a pair counts P's match
// and D's, a whole option its replica's twice), then the lowest score,
// then one at random. O(P·D) per request.
//
// The whole path's estimate is corrected and learnt as one: the decision
// carries it as Decode.EstTTFT, and Observe learns it, for P's correction,
// against the first token the decode step streams.
func (t *TTFT) PickPair(req *Request, prefill, decode []ReplicaView) (PairDecision, error) {
	var pbuf, dbuf [scratchLen]ttftSide
	pre, dec := scratch(&pbuf, len(prefill)), scratch(&dbuf, len(decode))
	t.mu.Lock()
	defer t.mu.Unlock()
	// The saturation floor from the deepest healthy match on either side.
	if p, d := t.firstEstimated(req, prefill), t.firstEstimated(req, decode); p >= 0 && (d < 0 || count(prefill[p].Match) > count(decode[d].Match)) {
		t.setFloor(req, p, prefill)
	} else {
		t.setFloor(req, d, decode)
	}
	t.pairSides(req, prefill, decode, pre, dec)
	// The best score of an option through each replica (returned).
	preScores, decScores := infs(len(prefill)), infs(len(decode))
	best := math.Inf(1)
	eachOption(prefill, decode, pre, dec, func(i, j int, score, _ float64, _ int) {
		best = min(best, score)
		if i >= 0 {
			preScores[i] = min(preScores[i], score)
		}
		decScores[j] = min(decScores[j], score)
	})
	if math.IsInf(best, 1) {
		return PairDecision{}, ErrNoReplica
	}
	i, j, est, score := t.choosePair(prefill, decode, pre, dec, best)
	reason := "lowest score (estimated TTFT of the path + decode and eviction costs)"
	if score > best {
		reason = "deepest match within the margin of the lowest score"
	}
	pd := t.pairDecision(req, prefill, decode, pre, dec, i, j, est, reason)
	pd.Prefill.Scores, pd.Decode.Scores = finite(preScores), finite(decScores)
	return pd, nil
}

// pairSides fills pre and dec with the estimates of each candidate.
// t.mu must be held.
func (t *TTFT) pairSides(req *Request, prefill, decode []ReplicaView, pre, dec []ttftSide) {
	meanPrompt, out := t.means(req)
	for i := range prefill {
		if v := &prefill[i]; v.Healthy {
			var e ttftEstimate
			plan := t.hostPlan(req, v)
			t.estimate(&e, req, v, meanPrompt, 1, &plan)
			pre[i] = ttftSide{ok: true, preMs: e.ms, preCost: e.cost, corr: t.corr(v.Index), matched: e.matched}
		}
	}
	prof := t.o.Profile
	for j := range decode {
		v, s := &decode[j], &dec[j]
		if !v.Healthy {
			continue
		}
		*s = ttftSide{ok: true, corr: t.corr(v.Index), matched: min(count(v.Match), len(req.Blocks))}
		s.uncached = uncachedOn(req, v, t.o.BlockSize)
		var l ttftLoad
		t.load(&l, v, meanPrompt)
		s.admitMs, s.linkMs, s.pullMs = t.queueMs(&l), prof.TransferWireMs(count(v.PendingTransfer)), prof.TransferMs(s.uncached)
		tokens := count(req.Tokens)
		s.lastMs = l.stepMs + prof.C1 + prof.C2*float64(tokens) + t.kvWaitMs(v, &l, tokens, out)
		s.decCost = t.params.DecodeWeight*out*(prof.C1+prof.C3*l.meanCtx)*float64(l.decodes) +
			t.params.InterferenceWeight*float64(l.decodes)*prof.C1 +
			t.params.EvictionWeight*t.evictShare(v, s.uncached)*s.pullMs
		s.aggregated = v.Role.Prefills()
		if s.whole = s.aggregated || s.uncached < req.SkipPrefillBelow; s.whole {
			var e ttftEstimate
			plan := t.hostPlan(req, v)
			t.estimate(&e, req, v, meanPrompt, out, &plan)
			s.wholeMs, s.wholeCost = e.ms*s.corr, e.cost
		}
	}
}

// means is the mean uncached prompt of a request the gateway did not send
// and the expected output of req. t.mu must be held.
func (t *TTFT) means(req *Request) (meanPrompt, out float64) {
	meanPrompt = t.meanPrompt
	if meanPrompt == 0 {
		meanPrompt = float64(count(req.Tokens))
	}
	out = float64(req.MaxTokens)
	if out <= 0 {
		out = t.meanOutput
		if out == 0 {
			out = ttftDefaultOutput
		}
	}
	return meanPrompt, out
}

// eachOption calls f for every option with its score, its corrected
// estimated TTFT and its key (blocks held): i the prefill position (-1:
// served whole on j), j the decode position.
func eachOption(prefill, decode []ReplicaView, pre, dec []ttftSide, f func(i, j int, score, est float64, key int)) {
	for j := range dec {
		d := &dec[j]
		if !d.ok {
			continue
		}
		if d.whole {
			f(-1, j, d.wholeMs+d.wholeCost, d.wholeMs, 2*d.matched)
		}
		for i := range pre {
			p := &pre[i]
			if !p.ok || prefill[i].Index == decode[j].Index {
				continue
			}
			est := p.corr * (max(p.preMs, d.admitMs, d.linkMs) + d.pullMs + d.lastMs)
			f(i, j, est+p.preCost+d.decCost, est, p.matched+d.matched)
		}
	}
}

// choosePair returns the option to take among those within the margin of
// best: the deepest key, then the lowest score, then one at random; with
// its corrected estimated TTFT and its score.
func (t *TTFT) choosePair(prefill, decode []ReplicaView, pre, dec []ttftSide, best float64) (ci, cj int, cest, cscore float64) {
	limit := t.limit(best)
	ci, cj = -2, -1
	ckey, seen := -1, 0
	eachOption(prefill, decode, pre, dec, func(i, j int, score, est float64, key int) {
		switch {
		case score > limit:
			return
		case cj < 0 || key > ckey, key == ckey && score < cscore:
			seen = 1
		case key == ckey && score == cscore:
			if seen++; t.g.IntN(seen) != 0 {
				return
			}
		default:
			return
		}
		ci, cj, cest, ckey, cscore = i, j, est, key, score
	})
	return ci, cj, cest, cscore
}

// pairDecision builds the decision of option (i, j), whose corrected
// estimated TTFT is est, and records the pick for Observe. t.mu must be held.
func (t *TTFT) pairDecision(req *Request, prefill, decode []ReplicaView, pre, dec []ttftSide,
	i, j int, est float64, reason string) PairDecision {
	d := decide(decode, j, reason, dec[j].matched, float64(count(decode[j].PendingPrefill)))
	d.EstTTFT = msDuration(est)
	if i < 0 {
		t.picks[req.ID%ttftPickSlots] = ttftPick{id: req.ID, replica: d.Replica, est: d.EstTTFT, corr: dec[j].corr, learnt: d.Replica}
		why := "aggregated"
		if !dec[j].aggregated {
			why = fmt.Sprintf("prefill skipped: the decode replica lacks %d prompt tokens, fewer than %d; %s",
				dec[j].uncached, req.SkipPrefillBelow, reason)
		}
		return SkipPair(d, why)
	}
	p := decide(prefill, i, reason, pre[i].matched, float64(count(prefill[i].PendingPrefill)))
	p.EstTTFT = msDuration(pre[i].corr * pre[i].preMs)
	t.picks[req.ID%ttftPickSlots] = ttftPick{id: req.ID, replica: d.Replica, est: d.EstTTFT, corr: pre[i].corr, learnt: p.Replica}
	return PairDecision{Prefill: p, Decode: d, Reason: reason}
}

// infs is n times +Inf.
func infs(n int) []float64 {
	out := make([]float64, n)
	for i := range out {
		out[i] = math.Inf(1)
	}
	return out
}

// finite replaces +Inf (not a candidate) by -1: JSON has no infinity.
func finite(scores []float64) []float64 {
	for i := range scores {
		if math.IsInf(scores[i], 1) {
			scores[i] = -1
		}
	}
	return scores
}
