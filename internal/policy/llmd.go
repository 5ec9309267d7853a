package policy

import (
	"fmt"
	"sync"

	"github.com/kvgate/kvgate/internal/prefixindex"
	"github.com/kvgate/kvgate/internal/prompt"
)

func init() {
	register("llmd", func(o Options) (Policy, error) {
		params := llmdParams{
			scorerWeights:   defaultScorerWeights,
			BlockSizeChars:  64,
			MaxPrefixBlocks: 256,
			LRUCapacity:     31250,
		}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if err := params.scorerWeights.validate(); err != nil {
			return nil, err
		}
		if params.BlockSizeChars < 1 || params.MaxPrefixBlocks < 1 || params.LRUCapacity < 1 {
			return nil, fmt.Errorf("%w: block_size_chars, max_prefix_blocks and lru_capacity_per_server must be at least 1", ErrParam)
		}
		ix, err := prefixindex.New(prefixindex.Config{BlocksPerReplica: params.LRUCapacity})
		if err != nil {
			return nil, err
		}
		l := &LLMD{params: params, blockChars: 4 * o.BlockSize, g: newRNG(o.Seed), ix: ix}
		l.scratch.New = func() any {
			return &llmdScratch{hashes: make([]uint64, 0, params.MaxPrefixBlocks)}
		}
		return l, nil
	})
}

// scorerWeights are the weights of the inference extension's default
// scheduling profile.
type scorerWeights struct {
	Queue  float64 `json:"queue_weight"`
	KV     float64 `json:"kv_cache_weight"`
	Prefix float64 `json:"prefix_weight"`
}

var defaultScorerWeights = scorerWeights{Queue: 2, KV: 2, Prefix: 3}

func (w scorerWeights) validate() error {
	if !(w.Queue >= 0 && w.KV >= 0 && w.Prefix >= 0) {
		return fmt.Errorf("%w: scorer weights must be ≥ 0", ErrParam)
	}
	return nil
}

// weightedScores fills out[i] for the candidate positions c with the llm-d
// (Gateway API inference extension) score
//
//	queue_weight × (max waiting − waiting)/(max waiting − min waiting)   (1 when all equal)
//	+ kv_cache_weight × (1 − KV usage)
//	+ prefix_weight × prefix[i]
//
// waiting and KV usage are the scraped vllm:num_requests_waiting and
// vllm:kv_cache_usage_perc, 0 before the first scrape. It returns the best
// position, ties at random.
func (w scorerWeights) weightedScores(rs []ReplicaView, c []int, prefix, out []float64, g *rng) int {
	waiting := func(v *ReplicaView) float64 {
		if !v.HaveMetrics {
			return 0
		}
		return float64(v.Waiting)
	}
	kvUsage := func(v *ReplicaView) float64 {
		if !v.HaveMetrics {
			return 0
		}
		return min(max(v.KVUsage, 0), 1)
	}
	lo, hi := waiting(&rs[c[0]]), waiting(&rs[c[0]])
	for _, i := range c[1:] {
		lo, hi = min(lo, waiting(&rs[i])), max(hi, waiting(&rs[i]))
	}
	for _, i := range c {
		queue := 1.0
		if hi > lo {
			queue = (hi - waiting(&rs[i])) / (hi - lo)
		}
		out[i] = w.Queue*queue + w.KV*(1-kvUsage(&rs[i])) + w.Prefix*prefix[i]
	}
	return argBest(c, func(i int) float64 { return out[i] }, false, g)
}

type llmdParams struct {
	scorerWeights
	// BlockSizeChars is the characters per hashed chunk of the prompt.
	BlockSizeChars int `json:"block_size_chars"`
	// MaxPrefixBlocks caps the chunks hashed per request (the prompt's head).
	MaxPrefixBlocks int `json:"max_prefix_blocks"`
	// LRUCapacity is each replica's LRU of chunks.
	LRUCapacity int `json:"lru_capacity_per_server"`
}

// LLMD is llm-d's default scheduling profile (the Gateway API inference
// extension's queue, kv-cache-utilization and prefix-cache scorers, weights
// 2:2:3, max wins). Its prefix scorer keeps its own approximate index, as
// the extension's prefix plugin does: the routing text in chunks of
// block_size_chars characters, chained xxhash64 rooted in the cache
// partition, at most max_prefix_blocks chunks, an LRU of
// lru_capacity_per_server chunks per replica; the chosen replica's LRU gets
// the request's chunks when the request is Routed. Prefix score = leading
// chunks the replica holds / chunks of the prompt.
type LLMD struct {
	params     llmdParams
	blockChars int // characters per Request block (approximate tokenizer)
	g          *rng
	ix         *prefixindex.Index
	scratch    sync.Pool // *llmdScratch
}

type llmdScratch struct {
	hashes []uint64
	match  []int
	prefix []float64
}

var _ Policy = (*LLMD)(nil)
var _ Observer = (*LLMD)(nil)

func (*LLMD) Name() string { return "llmd" }

// chunkHashes appends the chained hashes of the text's full chunks, at most
// max_prefix_blocks of them. The text is hashed in place.
func (l *LLMD) chunkHashes(dst []uint64, req *Request) []uint64 {
	h := prompt.RootOf("llmd", prompt.Key{Model: req.Model, Adapter: req.Adapter, Salt: req.Salt})
	bs, text := l.params.BlockSizeChars, req.Text
	for off := 0; off+bs <= len(text) && len(dst) < l.params.MaxPrefixBlocks; off += bs {
		h = prompt.Chain(h, strBytes(text[off:off+bs]))
		dst = append(dst, h)
	}
	return dst
}

func (l *LLMD) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	sc := l.scratch.Get().(*llmdScratch)
	defer l.scratch.Put(sc)
	sc.hashes = l.chunkHashes(sc.hashes[:0], req)
	sc.match = l.ix.Match(sc.hashes, sc.match)
	if cap(sc.prefix) < len(rs) {
		sc.prefix = make([]float64, len(rs))
	}
	prefix := sc.prefix[:len(rs)]
	clear(prefix)
	for _, i := range c {
		if idx := rs[i].Index; idx >= 0 && idx < len(sc.match) && len(sc.hashes) > 0 {
			prefix[i] = float64(sc.match[idx]) / float64(len(sc.hashes))
		}
	}
	scores := make([]float64, len(rs))
	i := l.params.weightedScores(rs, c, prefix, scores, l.g)
	matched := 0
	if idx := rs[i].Index; idx >= 0 && idx < len(sc.match) {
		// Chunks to Request blocks (4 characters per token).
		matched = sc.match[idx] * l.params.BlockSizeChars / l.blockChars
	}
	d := decide(rs, i, "max weighted queue + kv-cache + prefix score", matched, float64(rs[i].InFlight))
	d.Scores = scores
	return d, nil
}

// Observe records a routed request's chunks in its replica's LRU.
func (l *LLMD) Observe(ev Event) {
	if ev.Kind != Routed || ev.Req == nil || ev.Replica < 0 {
		return
	}
	if ev.Replica >= l.ix.Replicas() {
		l.ix.SetReplicas(ev.Replica + 1)
	}
	sc := l.scratch.Get().(*llmdScratch)
	defer l.scratch.Put(sc)
	sc.hashes = l.chunkHashes(sc.hashes[:0], ev.Req)
	_ = l.ix.Insert(ev.Replica, sc.hashes) // the slot exists: grown above
}
