package sim

import (
	"net/http"
	"strconv"
	"strings"

	"github.com/kvgate/kvgate/internal/engine"
)

// HeaderDataParallelRank is the request header that pins a request to one
// engine core of a data-parallel replica, as vLLM's OpenAI server reads it
// (it spells it X-data-parallel-rank; HTTP header names are
// case-insensitive). The sim also sets it on its answers to name the rank
// that served them: an aid for tests that vLLM does not give.
const HeaderDataParallelRank = "X-Data-Parallel-Rank"

// MaxDataParallelSize bounds Config.DataParallelSize: each core holds its
// own KV cache and goroutine.
const MaxDataParallelSize = 1024

// requestedRank is the rank the request's X-Data-Parallel-Rank header asks
// for, or −1 without one. As in vLLM, a value that is not an integer is
// ignored (the request is balanced as if it had none), and an integer out
// of [0, DataParallelSize) is refused with a 400.
func (r *Replica) requestedRank(req *http.Request) (int, error) {
	v := req.Header.Get(HeaderDataParallelRank)
	if v == "" {
		return -1, nil
	}
	k, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil {
		return -1, nil
	}
	if n := len(r.cores); k < 0 || k >= n {
		return 0, badRequest(HeaderDataParallelRank, "%s %d is out of range [0, %d).",
			HeaderDataParallelRank, k, n)
	}
	return k, nil
}

// leastLoadedLocked is the core vLLM's internal data-parallel load balancer
// would pick for a request without a rank: the fewest requests running and
// waiting, the lowest rank on ties. r.mu is held.
func (r *Replica) leastLoadedLocked() *core {
	best, bestLoad := r.cores[0], -1
	for _, c := range r.cores {
		s := c.eng.Stats()
		if load := s.Running + s.Waiting; bestLoad < 0 || load < bestLoad {
			best, bestLoad = c, load
		}
	}
	return best
}

// DataParallelSize is the number of engine cores (data-parallel ranks) of
// the replica.
func (r *Replica) DataParallelSize() int { return len(r.cores) }

// EngineStats is a snapshot of the engine of one data-parallel rank, in
// [0, DataParallelSize).
func (r *Replica) EngineStats(rank int) engine.Stats { return r.cores[rank].stats() }

// Stats is a snapshot of the replica's engines: with one core, its engine's;
// with data parallelism the sum over the cores of every count, NumBlocks
// included, and KVUsage their mean (each core has the same number of
// blocks, so the fraction of all blocks held).
func (r *Replica) Stats() engine.Stats {
	r.mu.Lock()
	defer r.mu.Unlock()
	sum := r.cores[0].eng.Stats()
	for _, c := range r.cores[1:] {
		s := c.eng.Stats()
		sum.Running += s.Running
		sum.Waiting += s.Waiting
		sum.KVUsage += s.KVUsage
		sum.CachedBlocks += s.CachedBlocks
		sum.PrefixQueries += s.PrefixQueries
		sum.PrefixHits += s.PrefixHits
		sum.PromptTokens += s.PromptTokens
		sum.GenerationTokens += s.GenerationTokens
		sum.RequestsFinished += s.RequestsFinished
		sum.RequestsAborted += s.RequestsAborted
		sum.Preemptions += s.Preemptions
		sum.EvictedBlocks += s.EvictedBlocks
		sum.NumBlocks += s.NumBlocks
	}
	sum.KVUsage /= float64(len(r.cores))
	return sum
}
