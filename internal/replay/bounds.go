package replay

import (
	"cmp"
	"context"
	"encoding/binary"
	"slices"
	"time"
	"unsafe"

	"github.com/cespare/xxhash/v2"

	"github.com/kvgate/kvgate/internal/hashtab"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/workload"
)

// Bounds computes the two hit-rate bounds of a request sequence, over the
// same 16-token blocks the engines cache, with each request's hit counted as
// an engine counts it (the longest run of leading blocks present, at most
// prompt − 1 tokens, whole blocks):
//
//   - prefix_reuse: one cache of unlimited size that has seen every earlier
//     request. No policy on any fleet can hit more.
//   - merged_lru: one LRU cache of Replicas × KVBlocks blocks, the whole
//     fleet's capacity pooled. After each request's look-up its blocks become
//     the most recent, its head most recent of all (an engine frees a
//     request's tail first), then the least recent blocks are evicted down to
//     the capacity. A policy can beat it only by luck of eviction order.
//
// Requests are taken in nominal arrival order: by At, a request never before
// its predecessor (a turn arrives no earlier than its predecessor's nominal
// arrival + Think); the order depends on no policy and no speed-up.
//
// A trace (every request made of Mooncake hash ids) is computed on its hash
// ids instead of its text, which gives the same figures (see traceBounds) in
// a fraction of the time.
func Bounds(ctx context.Context, cfg Config, reqs []workload.Request) (report.Bound, error) {
	_, _, b, err := prepareBounded(ctx, cfg, reqs)
	if err != nil {
		return report.Bound{}, err
	}
	return b, nil
}

func boundsPlan(ctx context.Context, cfg Config, pl *plan) (report.Bound, error) {
	order := nominalOrder(pl.reqs)
	if isTrace(pl.reqs) && workload.BlockTokens%cfg.BlockSize == 0 {
		return traceBounds(ctx, cfg, pl.reqs, order)
	}
	return blockBounds(ctx, cfg, pl.reqs, order)
}

// isTrace reports whether every request's text is synthesised from hash ids.
func isTrace(reqs []workload.Request) bool {
	for i := range reqs {
		r := &reqs[i]
		if r.Chat || r.Prompt != "" || r.HashIDs == nil {
			return false
		}
	}
	return len(reqs) > 0
}

// tally accumulates the bounds' token counts.
type tally struct{ total, reuse, merged int64 }

func (t tally) bound() report.Bound {
	if t.total == 0 {
		return report.Bound{}
	}
	return report.Bound{
		PrefixReuse: float64(t.reuse) / float64(t.total),
		MergedLRU:   float64(t.merged) / float64(t.total),
	}
}

// hitLimit is the most blocks an engine credits a prompt of tokens with:
// it recomputes at least the last prompt token.
func hitLimit(blocks, tokens, blockSize int) int {
	if tokens < 1 {
		return 0
	}
	return min(blocks, (tokens-1)/blockSize)
}

// blockBounds computes the bounds on the blocks' chained hashes.
func blockBounds(ctx context.Context, cfg Config, reqs []workload.Request, order []int32) (report.Bound, error) {
	root := prompt.RootOf("engine", prompt.Key{Model: cfg.Model})
	// hashtab.Set: 8 bytes a slot, where Go's map took 34 for the largest
	// structure of a large replay (17M distinct blocks in a 1M-request
	// multiturn one: 577 MB in a map, 256 MiB in the set).
	seen := hashtab.NewSet()
	lru := newBlockLRU(cfg.engines() * cfg.KVBlocks)
	var t tally
	var hashes []uint64
	var text []byte // each request's text in turn, in one buffer
	for k, i := range order {
		if k%ctxCheckEvery == 0 {
			if err := ctx.Err(); err != nil {
				return report.Bound{}, err
			}
		}
		text = reqs[i].AppendText(text[:0])
		tokens := prompt.Approx{}.Count(bytesString(text))
		hashes = prompt.ApproxBlockHashes(hashes[:0], root, bytesString(text), cfg.BlockSize)
		limit := hitLimit(len(hashes), tokens, cfg.BlockSize)
		t.total += int64(tokens)

		// Unlimited cache. A block's hash chains its whole prefix, so the
		// set is closed under prefixes: past the first miss nothing is
		// present, and the rest is inserted without looking.
		hit := 0
		for hit < len(hashes) && seen.Has(hashes[hit]) {
			hit++
		}
		for _, h := range hashes[hit:] {
			seen.Add(h)
		}
		t.reuse += int64(min(hit, limit) * cfg.BlockSize)

		// Pooled LRU.
		hit = 0
		for hit < limit && lru.has(hashes[hit]) {
			hit++
		}
		t.merged += int64(hit * cfg.BlockSize)
		for j := len(hashes) - 1; j >= 0; j-- {
			lru.touch(hashes[j])
		}
		lru.trim()
	}
	return t.bound(), nil
}

// nominalOrder is the arrival order of the requests with no service time:
// by nominal arrival (At, and for a dependent turn at least its
// predecessor's nominal arrival + Think), then by index.
func nominalOrder(reqs []workload.Request) []int32 {
	at := make([]time.Duration, len(reqs))
	order := make([]int32, len(reqs))
	for i := range reqs {
		at[i] = reqs[i].At
		if p := reqs[i].Prev; p >= 0 && p < i {
			at[i] = max(at[i], at[p]+reqs[i].Think)
		}
		order[i] = int32(i)
	}
	slices.SortStableFunc(order, func(a, b int32) int { return cmp.Compare(at[a], at[b]) })
	return order
}

// bytesString views b as a string without copying; b must not change while
// the string is in use.
func bytesString(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }

// blockLRU is an LRU set of block hashes: a hash table to slots
// (hashtab: block hashes need no rehash, and a look-up is one probe run,
// where Go's map spent a third of a large replay's bounds) and an
// intrusive doubly linked list over slot indices (slot 0 is the sentinel),
// with freed slots reused, so that touching a hash allocates nothing in the
// steady state. touch may overflow the capacity; trim evicts down to it.
type blockLRU struct {
	cap        int
	slot       *hashtab.Table[int32]
	hash       []uint64
	prev, next []int32
	free       []int32
}

func newBlockLRU(capacity int) *blockLRU {
	return &blockLRU{
		cap:  max(capacity, 0),
		slot: hashtab.New[int32](),
		hash: []uint64{0},
		prev: []int32{0},
		next: []int32{0},
	}
}

func (l *blockLRU) len() int { return l.slot.Len() }

func (l *blockLRU) has(h uint64) bool { return l.slot.Get(h) != nil }

func (l *blockLRU) unlink(i int32) {
	p, n := l.prev[i], l.next[i]
	l.next[p], l.prev[n] = n, p
}

// pushFront makes slot i the most recent.
func (l *blockLRU) pushFront(i int32) {
	f := l.next[0]
	l.prev[i], l.next[i] = 0, f
	l.prev[f], l.next[0] = i, i
}

// touch makes h the most recent, inserting it if absent.
func (l *blockLRU) touch(h uint64) {
	slot, ok := l.slot.Upsert(h)
	if ok {
		l.unlink(*slot)
		l.pushFront(*slot)
		return
	}
	var i int32
	if n := len(l.free); n > 0 {
		i = l.free[n-1]
		l.free = l.free[:n-1]
	} else {
		i = int32(len(l.hash))
		l.hash, l.prev, l.next = append(l.hash, 0), append(l.prev, 0), append(l.next, 0)
	}
	l.hash[i] = h
	*slot = i
	l.pushFront(i)
}

// trim evicts the least recent hashes down to the capacity.
func (l *blockLRU) trim() {
	for l.slot.Len() > l.cap {
		i := l.prev[0]
		l.unlink(i)
		l.slot.Del(l.hash[i])
		l.free = append(l.free, i)
	}
}

// traceBounds computes the bounds of a trace on its hash ids. The text of a
// trace request is the concatenation of its ids' texts (workload.TraceText),
// each id 512 tokens, i.e. perID = 512/blockSize whole blocks, the last id
// cut short. So block b of a request is determined by its ids up to
// b/perID (its hash chains them) and its position b%perID in that id's
// text, and two requests hold the same block exactly when they share the
// id prefix and both reach that position. A trie node (an id prefix, keyed
// by a chained hash of the ids) therefore stands for perID blocks, of
// which a request holds a prefix [0, nb):
//
//   - prefix_reuse keeps per node the most blocks any request held;
//   - merged_lru keeps per node the blocks the LRU holds, always a prefix
//     [0, have): a request refreshes a prefix [0, nb) of the node, so the
//     node's blocks are ordered by recency exactly as by position, and the
//     LRU evicts its highest block first. The LRU is a list of runs
//     (node, [lo, hi)) of consecutive blocks; a touch removes the node's runs
//     below nb (trimming the one across nb) and pushes [0, nb) in front.
//
// This is blockBounds computed with O(ids) work per request instead of
// O(blocks) hash-map operations; the tests check that both agree.
func traceBounds(ctx context.Context, cfg Config, reqs []workload.Request, order []int32) (report.Bound, error) {
	perID := workload.BlockTokens / cfg.BlockSize
	tr := newTrie(cfg.engines() * cfg.KVBlocks)
	root := prompt.RootOf("engine", prompt.Key{Model: cfg.Model})
	var t tally
	var path []int32
	for k, i := range order {
		if k%ctxCheckEvery == 0 {
			if err := ctx.Err(); err != nil {
				return report.Bound{}, err
			}
		}
		r := &reqs[i]
		tokens := r.InputTokens
		blocks := tokens / cfg.BlockSize
		limit := hitLimit(blocks, tokens, cfg.BlockSize)
		t.total += int64(tokens)

		// The request's nodes, and its hits before it touches anything.
		path = path[:0]
		key := root
		reuse, merged := 0, 0
		reuseOn, mergedOn := true, true
		for j, id := range r.HashIDs {
			nb := min(perID, blocks-j*perID)
			if nb <= 0 {
				break
			}
			key = chainID(key, id)
			n := tr.node(key)
			path = append(path, n)
			nd := &tr.nodes[n]
			if reuseOn {
				reuse += min(int(nd.seen), nb)
				reuseOn = int(nd.seen) >= nb
			}
			if mergedOn {
				merged += min(tr.held(n), nb)
				mergedOn = tr.held(n) >= nb
			}
			nd.seen = max(nd.seen, int32(nb))
		}
		t.reuse += int64(min(reuse, limit) * cfg.BlockSize)
		t.merged += int64(min(merged, limit) * cfg.BlockSize)

		// Touch last node first, so that the head ends most recent.
		for j := len(path) - 1; j >= 0; j-- {
			tr.touch(path[j], min(perID, blocks-j*perID))
		}
		tr.trim()
	}
	return t.bound(), nil
}

// chainID extends a trie key by one hash id.
func chainID(parent uint64, id int) uint64 {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], parent)
	binary.LittleEndian.PutUint64(b[8:], uint64(id))
	return xxhash.Sum64(b[:])
}

// trie is traceBounds' state: the id-prefix nodes and the LRU of runs.
type trie struct {
	cap   int
	total int // blocks held by the LRU
	index map[uint64]int32
	nodes []trieNode
	runs  []run // runs[0] is the list's sentinel
	free  []int32
}

type trieNode struct {
	seen int32   // most blocks any request held (prefix_reuse)
	runs []int32 // the node's runs in the LRU, by position (lo) ascending
}

// run is blocks [lo, hi) of a node, consecutive in the LRU's order.
type run struct {
	node       int32
	lo, hi     int32
	prev, next int32
}

func newTrie(capacity int) *trie {
	return &trie{cap: max(capacity, 0), index: make(map[uint64]int32, 1<<12), runs: make([]run, 1)}
}

func (t *trie) node(key uint64) int32 {
	if n, ok := t.index[key]; ok {
		return n
	}
	n := int32(len(t.nodes))
	t.nodes = append(t.nodes, trieNode{})
	t.index[key] = n
	return n
}

// held is the number of the node's blocks the LRU holds: its runs cover
// [0, held) without gaps.
func (t *trie) held(n int32) int {
	rs := t.nodes[n].runs
	if len(rs) == 0 {
		return 0
	}
	return int(t.runs[rs[len(rs)-1]].hi)
}

func (t *trie) unlink(i int32) {
	p, n := t.runs[i].prev, t.runs[i].next
	t.runs[p].next, t.runs[n].prev = n, p
}

// touch makes blocks [0, nb) of node n the most recent.
func (t *trie) touch(n int32, nb int) {
	nd := &t.nodes[n]
	k := 0
	for ; k < len(nd.runs); k++ {
		r := &t.runs[nd.runs[k]]
		if int(r.hi) > nb {
			if int(r.lo) < nb {
				t.total -= nb - int(r.lo)
				r.lo = int32(nb)
			}
			break
		}
		t.total -= int(r.hi - r.lo)
		t.unlink(nd.runs[k])
		t.free = append(t.free, nd.runs[k])
	}
	var i int32
	if m := len(t.free); m > 0 {
		i = t.free[m-1]
		t.free = t.free[:m-1]
	} else {
		i = int32(len(t.runs))
		t.runs = append(t.runs, run{})
	}
	f := t.runs[0].next
	t.runs[i] = run{node: n, lo: 0, hi: int32(nb), prev: 0, next: f}
	t.runs[f].prev, t.runs[0].next = i, i
	// Replace the removed runs by the new one, which has the lowest blocks.
	rest := nd.runs[k:]
	nd.runs = append(append(nd.runs[:0:0], i), rest...)
	t.total += nb
}

// trim evicts the least recent blocks down to the capacity: the last run's
// highest blocks first.
func (t *trie) trim() {
	for t.total > t.cap {
		i := t.runs[0].prev
		r := &t.runs[i]
		k := min(t.total-t.cap, int(r.hi-r.lo))
		r.hi -= int32(k)
		t.total -= k
		if r.hi > r.lo {
			continue
		}
		// The run is the node's highest (its least recent): drop it.
		nd := &t.nodes[r.node]
		nd.runs = nd.runs[:len(nd.runs)-1]
		t.unlink(i)
		t.free = append(t.free, i)
	}
}
