package policy

import (
	"hash/fnv"
	"strconv"
)

// PullPlanner is implemented by a policy that decides peer pulls itself
// (ttft prices them in its choice): the router then adds none.
type PullPlanner interface {
	PlansPulls() bool
}

// PlansPulls reports whether p decides pulls itself.
func PlansPulls(p Policy) bool {
	pp, ok := p.(PullPlanner)
	return ok && pp.PlansPulls()
}

// PlansPulls: ttft plans the pulls it is allowed (Options.Pulls).
func (t *TTFT) PlansPulls() bool { return t.o.Pulls }

// P2PMinCachedTokenDelta is the p2p-source-producer's minCachedTokenDelta
// default.
const P2PMinCachedTokenDelta = 1

// P2PSource is llm-d's p2p-source-producer (llm-d-router v0.10,
// pkg/epp/framework/plugins/requestcontrol/dataproducer/p2psource): after
// the scheduling decision, a peer to pull the prompt's cached prefix from,
// or nil. It runs after the choice and changes nothing of it: the header it
// sets only tells the chosen pod where to pull from. Its rule:
//
//   - the candidates are the healthy replicas holding any of the prompt,
//     and among them those within one block of the most held
//     (max − cached < one block);
//   - one is sampled with probability ∝ 1/(1 + waiting queue) (the scraped
//     vllm:num_requests_waiting; 0 without metrics), the sampling
//     coordinate an FNV-1a hash of the request id, mapped onto [0, 1);
//   - the pull is set when that peer holds at least minDelta more prompt
//     tokens than the chosen replica, and it is not the chosen one.
//
// Held blocks are counted in any tier (ReplicaView.Local): kvgate's engine
// serves a pull from its GPU or its host tier. Upstream counts the source's
// CPU tier when its producer reports tiers (llm-d-router #2321, after
// #1952 showed pulls nominating sources that could not serve them), all
// tiers of the computing pod.
func P2PSource(req *Request, rs []ReplicaView, chosen, minDelta, blockSize int) *Pull {
	c := posOf(rs, chosen)
	if c < 0 || minDelta < 1 || blockSize < 1 {
		return nil
	}
	limit := len(req.Blocks)
	held := func(i int) int { return min(rs[i].Local(), limit) * blockSize }
	most := 0
	for i := range rs {
		if rs[i].Healthy {
			most = max(most, held(i))
		}
	}
	if most == 0 {
		return nil
	}
	var cands []int
	var weights []float64
	total := 0.0
	for i := range rs {
		if h := held(i); rs[i].Healthy && h > 0 && h+blockSize >= most {
			waiting := 0
			if rs[i].HaveMetrics {
				waiting = count(rs[i].Waiting)
			}
			w := 1 / (1 + float64(waiting))
			cands, weights, total = append(cands, i), append(weights, w), total+w
		}
	}
	target := requestSpread(req.ID) * total
	pick := cands[len(cands)-1]
	for k, w := range weights {
		if target < w {
			pick = cands[k]
			break
		}
		target -= w
	}
	if pick == c || held(pick)-held(c) < minDelta {
		return nil
	}
	return &Pull{Replica: rs[pick].Index, URL: rs[pick].URL, Blocks: min(rs[pick].Local(), limit)}
}

// requestSpread maps a request id onto [0, 1) as the producer does (FNV-1a
// of the id; kvgate's ids are numbers, hashed as their decimal text).
func requestSpread(id uint64) float64 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(strconv.FormatUint(id, 10)))
	return float64(h.Sum32()) / float64(1<<32)
}
