// llm-d's router as users run it: the llm-d Helm chart's default scheduling
// profile (queue-scorer 2, kv-cache-utilization-scorer 2, prefix-cache-scorer
// 3, max-score picker), with the approximate prefix index of llm-d ≥ v0.9
// (llm-d-inference-scheduler, since renamed llm-d-router:
// pkg/epp/framework/plugins/requestcontrol/dataproducer/approximateprefix
// plugin.go, types.go, indexer.go and dataproducer/prefixhash/hashing.go;
// scheduling/scorer/prefix/plugin.go), refreshing the replicas' metrics every
// 50 ms as its scheduler does. The "optimized-baseline" guide
// (llm-d/llm-d guides/optimized-baseline/scheduler/optimized-baseline.values.yaml)
// adds the no-hit-lru-scorer with weight 2
// (scheduling/scorer/nohitlru/no_hit_lru.go): no_hit_lru_weight 2 here.
// The Gateway API inference extension's index of GIE ≤ v1.5 (64-character
// chunks, the first 256, 31,250 per server) stays reachable: index "gie-1.5".

package policy

import (
	"encoding/binary"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/prefixindex"
	"github.com/kvgate/kvgate/internal/prompt"
)

// llm-d's defaults (approximateprefix/types.go, plugin.go, nohitlru).
const (
	llmdMinBlockTokens     = 64     // minBlockSizeTokens: a block size below it is raised to it
	llmdBlockSizeTokens    = 16     // defaultBlockSizeTokens, when auto-tune is off
	llmdMaxPrefixTokens    = 131072 // defaultMaxPrefixTokens
	llmdLRUCapacity        = 31250  // defaultLRUCapacityPerServer (GIE ≤ v1.5 too)
	llmdNoHitLRUSize       = 1024   // no-hit-lru-scorer's defaultLRUSize
	llmdIndexLLMD          = "llm-d"
	llmdIndexGIE15         = "gie-1.5"
	llmdMetricsRefresh     = 50 * time.Millisecond
	gie15BlockSizeChars    = 64
	gie15MaxPrefixBlocks   = 256
	llmdTailHashSeparator  = 0x6c6c6d2d74616c21 // "llm-tal!": keeps tail hashes apart from block hashes
	llmdTokenTailSeparator = 0x746f6b2d7461696c
)

func init() {
	register("llmd", func(o Options) (Policy, error) {
		params := llmdParams{
			scorerWeights:   defaultScorerWeights,
			Index:           llmdIndexLLMD,
			AutoTune:        true,
			BlockSizeTokens: llmdBlockSizeTokens,
			MaxPrefixTokens: llmdMaxPrefixTokens,
			LRUCapacity:     llmdLRUCapacity,
			BlockSizeChars:  gie15BlockSizeChars,
			MaxPrefixBlocks: gie15MaxPrefixBlocks,
			NonCachedTokens: llmdNonCachedTokens,
			CPULRUCapacity:  llmdLRUCapacity,
		}
		params.tiered(o.OffloadBlocks)
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if err := params.scorerWeights.validate(); err != nil {
			return nil, err
		}
		if !(params.NoHitLRUWeight >= 0) {
			return nil, fmt.Errorf("%w: no_hit_lru_weight must be ≥ 0", ErrParam)
		}
		if params.Index != llmdIndexLLMD && params.Index != llmdIndexGIE15 {
			return nil, fmt.Errorf("%w: index must be %q or %q", ErrParam, llmdIndexLLMD, llmdIndexGIE15)
		}
		if params.BlockSizeChars < 1 || params.MaxPrefixBlocks < 1 || params.LRUCapacity < 1 ||
			params.BlockSizeTokens < 1 || params.MaxPrefixTokens < 1 {
			return nil, fmt.Errorf("%w: block_size_chars, max_prefix_blocks, lru_capacity_per_server, "+
				"block_size_tokens and max_prefix_tokens must be at least 1", ErrParam)
		}
		if params.NonCachedTokens < 0 {
			return nil, fmt.Errorf("%w: non_cached_tokens must be ≥ 0", ErrParam)
		}
		if !(params.CPUPrefixWeight >= 0) || params.CPULRUCapacity < 1 {
			return nil, fmt.Errorf("%w: cpu_prefix_weight must be ≥ 0, cpu_lru_capacity_per_server ≥ 1", ErrParam)
		}
		l := &LLMD{params: params, bs: o.BlockSize, g: newRNG(o.Seed)}
		l.blockTokens, l.per, l.maxBlocks = l.params.layout(o.BlockSize)
		cfg := prefixindex.Config{}
		if params.Index == llmdIndexGIE15 {
			cfg.BlocksPerReplica = params.LRUCapacity
		}
		ix, err := prefixindex.New(cfg)
		if err != nil {
			return nil, err
		}
		l.ix = ix
		if params.CPUPrefixWeight > 0 {
			if l.cpu, err = prefixindex.New(prefixindex.Config{BlocksPerReplica: params.CPULRUCapacity}); err != nil {
				return nil, err
			}
		}
		l.scratch.New = func() any { return &llmdScratch{} }
		return l, nil
	})
}

// scorerWeights are the weights of llm-d's scheduling profiles.
type scorerWeights struct {
	Queue  float64 `json:"queue_weight"`
	KV     float64 `json:"kv_cache_weight"`
	Prefix float64 `json:"prefix_weight"`
}

// defaultScorerWeights is the llm-d Helm chart's default profile.
var defaultScorerWeights = scorerWeights{Queue: 2, KV: 2, Prefix: 3}

func (w scorerWeights) validate() error {
	if !(w.Queue >= 0 && w.KV >= 0 && w.Prefix >= 0) {
		return fmt.Errorf("%w: scorer weights must be ≥ 0", ErrParam)
	}
	return nil
}

// fill sets out[i] for the candidate positions c to llm-d's weighted score
//
//	queue_weight × (max waiting − waiting)/(max waiting − min waiting)   (1 when all equal)
//	+ kv_cache_weight × (1 − KV usage)
//	+ prefix_weight × prefix[i]
//
// waiting and KV usage are the scraped vllm:num_requests_waiting and
// vllm:kv_cache_usage_perc, 0 before the first scrape (queue-scorer,
// kv-cache-utilization-scorer), clamped (a NaN usage is 0).
func (w scorerWeights) fill(rs []ReplicaView, c []int, prefix, out []float64) {
	waiting := func(v *ReplicaView) float64 {
		if !v.HaveMetrics {
			return 0
		}
		return float64(count(v.Waiting))
	}
	kvUsage := func(v *ReplicaView) float64 {
		if !v.HaveMetrics {
			return 0
		}
		return fraction(v.KVUsage)
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
}

type llmdParams struct {
	scorerWeights
	// NoHitLRUWeight is the no-hit-lru-scorer's weight: 0 in the Helm
	// chart's default profile, 2 in the optimized-baseline guide.
	NoHitLRUWeight float64 `json:"no_hit_lru_weight"`
	// Index is "llm-d" (llm-d ≥ v0.9's token blocks) or "gie-1.5" (the
	// inference extension's 64-character chunks).
	Index string `json:"index"`

	// llm-d index (approx-prefix-cache-producer: autoTune,
	// blockSizeTokens, maxPrefixTokensToMatch, lruCapacityPerServer).
	// AutoTune takes the block size and each LRU's capacity from the
	// server; else BlockSizeTokens and LRUCapacity.
	AutoTune        bool `json:"auto_tune"`
	BlockSizeTokens int  `json:"block_size_tokens"`
	MaxPrefixTokens int  `json:"max_prefix_tokens"`
	// LRUCapacity is each server's LRU in blocks (both indexes; for llm-d's
	// only when auto-tune is off or the server's block count is unknown).
	LRUCapacity int `json:"lru_capacity_per_server"`

	// GIE ≤ v1.5 index: chunks of BlockSizeChars characters of the routing
	// text, at most MaxPrefixBlocks of them.
	BlockSizeChars  int `json:"block_size_chars"`
	MaxPrefixBlocks int `json:"max_prefix_blocks"`

	// NonCachedTokens is the prefix-based-pd-decider's nonCachedTokens
	// (P/D, see PickPair): the prefill step runs when the decode server
	// lacks at least this many tokens of the prompt; 0: always.
	NonCachedTokens int `json:"non_cached_tokens"`

	// CPUPrefixWeight is the weight of a second prefix scorer over a
	// second approximate producer for the host tier, as llm-d's
	// tiered-prefix-cache guide runs them (llm-d/llm-d
	// guides/tiered-prefix-cache/cpu: gpu-prefix-cache-producer and
	// cpu-prefix-cache-producer, scorers weighted queue 2, kv-cache 2, gpu
	// prefix 1, cpu prefix 1); 0 (the chart's default): no such producer.
	// The CPU producer indexes every routed request too (the connector
	// offloads every block: write-through), in an LRU of
	// CPULRUCapacity blocks per server, set by hand (autoTune false) since
	// vLLM exports no CPU block count; the GPU producer keeps its
	// auto-tuned, GPU-sized LRU (llm-d-router #1650).
	CPUPrefixWeight float64 `json:"cpu_prefix_weight"`
	CPULRUCapacity  int     `json:"cpu_lru_capacity_per_server"`
}

// llmdTieredWeights are the scorer weights of llm-d's tiered-prefix-cache
// guide (guides/tiered-prefix-cache/cpu, the inference pool's
// EndpointPickerConfig): queue 2, kv-cache 2, gpu prefix 1 and, below, cpu
// prefix 1.
var llmdTieredWeights = scorerWeights{Queue: 2, KV: 2, Prefix: 1}

// tiered makes the defaults those of the tiered-prefix-cache guide when the
// replicas have a host tier of hostBlocks blocks (Options.OffloadBlocks):
// the CPU producer on, its LRU set by hand to the tier's block count, as
// the guide sets lruCapacityPerServer from the host memory in the server's
// 16-token blocks; llm-d's producer counts its own (64-token) blocks
// against it, the unit mix-up of llm-d-router #1650 kept as upstream has
// it. Parameters given by name still override each.
func (p *llmdParams) tiered(hostBlocks int) {
	if hostBlocks <= 0 {
		return
	}
	p.scorerWeights = llmdTieredWeights
	p.CPUPrefixWeight, p.CPULRUCapacity = 1, hostBlocks
}

// llmdNonCachedTokens is non_cached_tokens' default: llm-d's
// pd-disaggregation guide's (llm-d/llm-d guides/pd-disaggregation, with
// llm-d-inference-scheduler v0.6.0: prefix-based-pd-decider
// nonCachedTokens 16). The decider's code default is 0 (always
// disaggregate), as is the always-disagg-pd-decider of later guides.
const llmdNonCachedTokens = 16

// layout is llm-d's block for router blocks of bs tokens: its size in
// tokens (the server's block size under auto-tune, else block_size_tokens,
// raised to 64 as upstream's GetBlockSize does, then up to a multiple of bs
// so that it is made of whole router blocks), router blocks per llm-d block,
// and the blocks hashed at most (max_prefix_tokens / block size).
func (p llmdParams) layout(bs int) (blockTokens, per, maxBlocks int) {
	blockTokens = p.BlockSizeTokens
	if p.AutoTune {
		blockTokens = bs // the server's block size: kvgate's blocks are the engine's
	}
	blockTokens = max(blockTokens, llmdMinBlockTokens)
	per = (blockTokens + bs - 1) / bs
	blockTokens = per * bs
	return blockTokens, per, max(p.MaxPrefixTokens/blockTokens, 1)
}

// LLMD is llm-d's scheduler: queue, kv-cache-utilization and prefix-cache
// scorers (and optionally no-hit-lru), weighted and summed, the highest
// score wins, ties at random.
//
// Prefix index (index "llm-d", the default). llm-d hashes the tokenized
// prompt in blocks of the server's block size but at least 64 tokens
// (vLLM's 16 → 64), chained from the model and cache salt, the last block
// partial, at most max_prefix_tokens (131,072) tokens' worth; each server
// has an LRU of such blocks, created at its first insert with the server's
// block count (vllm:cache_config_info num_gpu_blocks) as capacity — a count
// of the server's blocks used as a count of llm-d's 4× larger blocks, kept
// as upstream has it — or lru_capacity_per_server when that is unknown or
// auto_tune is off; the chosen server's LRU gets the request's blocks.
// Prefix score = leading blocks the server holds / blocks of the prompt.
//
// kvgate builds llm-d's blocks from Request.Blocks, the chained hashes of
// the prompt's full router blocks (bs tokens): every such hash already
// identifies its whole prefix, so llm-d block k (per = 64/bs router blocks)
// is Blocks[(k+1)·per − 1] — the same equalities as upstream's hashes, no
// text rehashed. The partial last block (which upstream hashes and a repeat
// of the same prompt matches) identifies the whole prompt; kvgate hashes
// the routing text (Request.Text) under the last full block for it, or, for
// a token-id prompt without text, the last router block and the token
// count — an approximation: such prompts ending alike beyond their last
// full router block would share it. Approximations besides: the server's
// block size is taken to be kvgate's (Options.BlockSize), and
// ReplicaView.NumBlocks, in kvgate's blocks, is then the server's own count;
// llm-d's block is rounded up to whole router blocks when 64 is not a
// multiple of bs; kvgate's index touches a prompt's blocks last to first
// (the LRU evicts leaves before their prefixes) where upstream's LRU adds
// them first to last.
//
// No-hit-lru (no_hit_lru_weight > 0): a request is cold when no candidate
// holds any of its blocks. For a cold request, servers never chosen for a
// cold request score 1 − i/(n−1) (i their order among the n candidates),
// the others 1 − (never-used count + their position in the LRU of servers
// chosen for cold requests, oldest first)/(n−1), at least 0; a request
// with a hit scores 0.5 everywhere. A cold request moves its server to the
// LRU's most recent end (1,024 servers kept). kvgate decides coldness again
// when the request is Routed, over every replica the index knows.
type LLMD struct {
	params      llmdParams
	bs          int // tokens per Request block
	blockTokens int // tokens per llm-d block
	per         int // Request blocks per llm-d block
	maxBlocks   int // llm-d blocks hashed at most
	g           *rng
	ix          *prefixindex.Index
	cpu         *prefixindex.Index // the CPU producer's (cpu_prefix_weight > 0), else nil
	scratch     sync.Pool          // *llmdScratch

	mu        sync.Mutex
	numBlocks []int  // per slot: the server's block count last seen by Pick (auto-tune)
	sized     []bool // per slot: its LRU exists (capacity fixed at the first insert, as upstream)
	noHit     []int  // no-hit-lru: slots chosen for cold requests, least recent first
}

type llmdScratch struct {
	hashes []uint64
	match  []int
	prefix []float64
	nohit  []float64
	tail   []byte
}

var _ Policy = (*LLMD)(nil)
var _ Observer = (*LLMD)(nil)
var _ MetricsRefresher = (*LLMD)(nil)

func (*LLMD) Name() string { return "llmd" }

// MetricsRefresh is llm-d's scheduler's metrics period.
func (*LLMD) MetricsRefresh() time.Duration { return llmdMetricsRefresh }

// hashes appends the request's prefix hashes under the configured index.
func (l *LLMD) hashes(sc *llmdScratch, req *Request) []uint64 {
	if l.params.Index == llmdIndexGIE15 {
		return l.chunkHashes(sc.hashes[:0], req)
	}
	return l.tokenBlockHashes(sc, req)
}

// chunkHashes appends the chained hashes of the text's full chunks of
// block_size_chars characters, at most max_prefix_blocks of them (GIE ≤
// v1.5). The text is hashed in place.
func (l *LLMD) chunkHashes(dst []uint64, req *Request) []uint64 {
	h := prompt.RootOf("llmd", prompt.Key{Model: req.Model, Adapter: req.Adapter, Salt: req.Salt})
	bs, text := l.params.BlockSizeChars, req.Text
	for off := 0; off+bs <= len(text) && len(dst) < l.params.MaxPrefixBlocks; off += bs {
		h = prompt.Chain(h, strBytes(text[off:off+bs]))
		dst = append(dst, h)
	}
	return dst
}

// tokenBlockHashes returns llm-d's block hashes of the request (see LLMD).
func (l *LLMD) tokenBlockHashes(sc *llmdScratch, req *Request) []uint64 {
	dst := sc.hashes[:0]
	full := len(req.Blocks) / l.per
	for k := 0; k < full && len(dst) < l.maxBlocks; k++ {
		dst = append(dst, req.Blocks[(k+1)*l.per-1])
	}
	if len(dst) == l.maxBlocks || req.Tokens <= full*l.blockTokens {
		return dst
	}
	// The partial last block stands for the whole prompt.
	parent := prompt.RootOf("llmd", prompt.Key{Model: req.Model, Adapter: req.Adapter, Salt: req.Salt})
	if full > 0 {
		parent = dst[full-1]
	}
	var tail []byte
	if req.Text != "" {
		parent ^= llmdTailHashSeparator
		tail = strBytes(req.Text)
	} else {
		parent ^= llmdTokenTailSeparator
		tail = sc.tail[:0]
		if n := len(req.Blocks); n > full*l.per {
			tail = binary.LittleEndian.AppendUint64(tail, req.Blocks[n-1])
		}
		tail = binary.LittleEndian.AppendUint64(tail, uint64(req.Tokens))
		sc.tail = tail
	}
	return append(dst, prompt.Chain(parent, tail))
}

func (l *LLMD) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	if l.params.Index == llmdIndexLLMD && l.params.AutoTune {
		l.noteNumBlocks(rs)
	}
	sc := l.scratch.Get().(*llmdScratch)
	defer l.scratch.Put(sc)
	sc.hashes = l.hashes(sc, req)
	sc.match = l.ix.Match(sc.hashes, sc.match)
	match := func(i int) int {
		if idx := rs[i].Index; idx >= 0 && idx < len(sc.match) {
			return sc.match[idx]
		}
		return 0
	}
	sc.prefix = grow(sc.prefix, len(rs))
	prefix := sc.prefix
	cold := true
	for _, i := range c {
		if m := match(i); m > 0 && len(sc.hashes) > 0 {
			prefix[i] = float64(m) / float64(len(sc.hashes))
			cold = false
		}
	}
	scores := make([]float64, len(rs))
	l.params.fill(rs, c, prefix, scores)
	if l.cpu != nil && l.cpuScores(rs, c, sc, scores) {
		cold = false
	}
	reason := "max weighted queue + kv-cache + prefix score"
	if w := l.params.NoHitLRUWeight; w > 0 {
		sc.nohit = grow(sc.nohit, len(rs))
		l.noHitScores(rs, c, cold, sc.nohit)
		for _, i := range c {
			scores[i] += w * sc.nohit[i]
		}
		reason = "max weighted queue + kv-cache + prefix + no-hit-lru score"
	}
	i := argBest(c, func(i int) float64 { return scores[i] }, false, l.g)
	d := decide(rs, i, reason, l.matchedBlocks(req, match(i)), float64(rs[i].InFlight))
	d.Scores = scores
	return d, nil
}

// grow returns s[:n] zeroed, reallocated when too short.
func grow(s []float64, n int) []float64 {
	if cap(s) < n {
		return make([]float64, n)
	}
	s = s[:n]
	clear(s)
	return s
}

// matchedBlocks converts a match in the index's blocks to Request blocks.
func (l *LLMD) matchedBlocks(req *Request, m int) int {
	if l.params.Index == llmdIndexGIE15 {
		return m * l.params.BlockSizeChars / (4 * l.bs) // 4 characters per token
	}
	return min(m*l.per, len(req.Blocks))
}

// noteNumBlocks remembers each slot's block count for the capacity of its
// LRU, which upstream reads from the chosen server's metrics when it first
// inserts. It changes nothing Pick computes.
func (l *LLMD) noteNumBlocks(rs []ReplicaView) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i := range rs {
		idx := rs[i].Index
		if idx < 0 || rs[i].NumBlocks <= 0 {
			continue
		}
		if idx >= len(l.numBlocks) {
			l.numBlocks = append(l.numBlocks, make([]int, idx+1-len(l.numBlocks))...)
		}
		l.numBlocks[idx] = rs[i].NumBlocks
	}
}

// noHitScores fills out for the candidates with the no-hit-lru score.
func (l *LLMD) noHitScores(rs []ReplicaView, c []int, cold bool, out []float64) {
	if !cold {
		for _, i := range c {
			out[i] = 0.5
		}
		return
	}
	n := len(c)
	if n == 1 {
		out[c[0]] = 1
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	never := 0
	for _, i := range c {
		if !slices.Contains(l.noHit, rs[i].Index) {
			out[i] = 1 - float64(never)/float64(n-1)
			never++
		}
	}
	for _, i := range c {
		if pos := slices.Index(l.noHit, rs[i].Index); pos >= 0 {
			out[i] = max(0, 1-float64(never+pos)/float64(n-1))
		}
	}
}

// Observe records a routed request's blocks in its replica's LRU and, for
// a cold request, the replica in the no-hit LRU.
func (l *LLMD) Observe(ev Event) {
	if ev.Kind != Routed || ev.Req == nil || ev.Replica < 0 {
		return
	}
	if ev.Replica >= l.ix.Replicas() {
		l.ix.SetReplicas(ev.Replica + 1)
	}
	sc := l.scratch.Get().(*llmdScratch)
	defer l.scratch.Put(sc)
	if ev.Remote {
		sc.hashes = l.remoteHashes(sc.hashes[:0], ev.Req)
	} else {
		sc.hashes = l.hashes(sc, ev.Req)
	}
	if l.params.NoHitLRUWeight > 0 && ev.Req.BlockOffset == 0 {
		sc.match = l.ix.Match(sc.hashes, sc.match)
		if !slices.ContainsFunc(sc.match, func(m int) bool { return m > 0 }) {
			l.touchNoHit(ev.Replica)
		}
	}
	if l.params.Index == llmdIndexLLMD {
		l.sizeLRU(ev.Replica)
	}
	_ = l.ix.Insert(ev.Replica, sc.hashes) // the slot exists: grown above
	if l.cpu != nil {
		if ev.Replica >= l.cpu.Replicas() {
			l.cpu.SetReplicas(ev.Replica + 1)
		}
		_ = l.cpu.Insert(ev.Replica, sc.hashes)
	}
}

// cpuScores adds the CPU prefix scorer (cpu_prefix_weight × leading blocks
// the CPU producer's LRU holds / prompt blocks) to the candidates' scores,
// and reports whether it holds any block of the request.
func (l *LLMD) cpuScores(rs []ReplicaView, c []int, sc *llmdScratch, scores []float64) bool {
	if len(sc.hashes) == 0 {
		return false
	}
	sc.match = l.cpu.Match(sc.hashes, sc.match)
	hit := false
	for _, i := range c {
		if idx := rs[i].Index; idx >= 0 && idx < len(sc.match) && sc.match[idx] > 0 {
			scores[i] += l.params.CPUPrefixWeight * float64(sc.match[idx]) / float64(len(sc.hashes))
			hit = true
		}
	}
	return hit
}

// remoteHashes are llm-d's full blocks among a remote decision's blocks
// (those from req.BlockOffset on). Its text is not shared, so the GIE ≤ v1.5
// character chunks and the partial last block are not: the next request's
// own tail is the only block a remote decision leaves unknown.
func (l *LLMD) remoteHashes(dst []uint64, req *Request) []uint64 {
	if l.params.Index == llmdIndexGIE15 {
		return dst
	}
	off, end := req.BlockOffset, req.BlockOffset+len(req.Blocks)
	for k := off / l.per; (k+1)*l.per <= end && k < l.maxBlocks; k++ {
		if p := (k+1)*l.per - 1; p >= off {
			dst = append(dst, req.Blocks[p-off])
		}
	}
	return dst
}

// touchNoHit makes slot the most recent in the no-hit LRU.
func (l *LLMD) touchNoHit(slot int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if i := slices.Index(l.noHit, slot); i >= 0 {
		l.noHit = slices.Delete(l.noHit, i, i+1)
	}
	l.noHit = append(l.noHit, slot)
	if len(l.noHit) > llmdNoHitLRUSize {
		l.noHit = slices.Delete(l.noHit, 0, 1)
	}
}

// sizeLRU fixes slot's LRU capacity at its first insert: the server's block
// count under auto-tune when known, else lru_capacity_per_server.
func (l *LLMD) sizeLRU(slot int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if slot < len(l.sized) && l.sized[slot] {
		return
	}
	if slot >= len(l.sized) {
		l.sized = append(l.sized, make([]bool, slot+1-len(l.sized))...)
	}
	l.sized[slot] = true
	capacity := l.params.LRUCapacity
	if l.params.AutoTune && slot < len(l.numBlocks) && l.numBlocks[slot] > 0 {
		capacity = l.numBlocks[slot]
	}
	_ = l.ix.SetCapacity(slot, capacity) // the slot exists
}

var _ PairPicker = (*LLMD)(nil)

// PickPair is llm-d's pd-profile-handler with the prefix-based-pd-decider
// (llm-d-inference-scheduler pkg/plugins/profile/pd_profile_handler.go,
// prefix_based_pd_decider.go): the decode profile runs first and picks the
// decode server; the decider then reads that server's match in llm-d's own
// prefix index, and when the prompt's non-cached part (its tokens less the
// matched blocks' tokens) is below non_cached_tokens the request goes to
// the decode server alone; else the prefill profile picks the prefill
// server. Both profiles are this policy's scorers (llm-d's P/D guides give
// each profile its own plugin list; kvgate keeps the configured one).
func (l *LLMD) PickPair(req *Request, prefill, decode []ReplicaView) (PairDecision, error) {
	d, err := l.Pick(req, decode)
	if err != nil {
		return PairDecision{}, err
	}
	if n := req.Tokens - d.Matched*l.bs; l.params.NonCachedTokens > 0 && n < l.params.NonCachedTokens {
		return SkipPair(d, fmt.Sprintf("decode only: non-cached suffix %d < %d tokens (prefix-based-pd-decider)",
			n, l.params.NonCachedTokens)), nil
	}
	p, err := l.Pick(req, prefill)
	if err != nil {
		return PairDecision{}, err
	}
	return Pair(p, d, "pd-profile-handler: decode profile, decider, prefill profile"), nil
}
