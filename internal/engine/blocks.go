package engine

import "github.com/kvgate/kvgate/internal/hashtab"

// blockPool is the paged KV block manager with automatic prefix caching, after
// vLLM v1's BlockPool:
//
//   - a fixed array of blocks, each with a reference count (the running
//     requests whose block table holds it) and, once its tokens are full and
//     scheduled, the chained hash of its content;
//   - a hash → block map of every block that carries a hash, held or free, so
//     a request can pick up the blocks of its longest cached prefix;
//   - a free queue in LRU order: a block whose reference count drops to zero
//     goes to the back and keeps its hash (it can still be hit); allocation
//     takes the front (the least recently freed block) and evicts its hash.
//
// The free queue is an intrusive doubly linked list over block indices (prev
// and next arrays, index n is the sentinel), so every operation is O(1) and
// nothing is allocated after construction except map growth.
type blockPool struct {
	n      int
	ref    []int32
	hash   []uint64
	hashed []bool
	prev   []int32
	next   []int32
	free   int // blocks in the free queue (reference count zero)

	cache *hashtab.Table[int32] // block hash → the one block carrying it

	// trackRemoved makes alloc record evicted hashes in removed, which the
	// engine turns into Removed events.
	trackRemoved bool
	removed      []uint64
	evicted      int64 // hashed blocks evicted, cumulative
}

func newBlockPool(n int, trackRemoved bool) *blockPool {
	p := &blockPool{
		n:            n,
		ref:          make([]int32, n),
		hash:         make([]uint64, n),
		hashed:       make([]bool, n),
		prev:         make([]int32, n+1),
		next:         make([]int32, n+1),
		cache:        hashtab.New[int32](),
		trackRemoved: trackRemoved,
	}
	s := int32(n)
	p.prev[s], p.next[s] = s, s
	// Every block starts free, in index order, like vLLM's initial queue.
	for b := range int32(n) {
		p.pushBack(b)
	}
	return p
}

func (p *blockPool) pushBack(b int32) {
	s := int32(p.n)
	last := p.prev[s]
	p.prev[b], p.next[b] = last, s
	p.next[last] = b
	p.prev[s] = b
	p.free++
}

func (p *blockPool) unlink(b int32) {
	pv, nx := p.prev[b], p.next[b]
	p.next[pv] = nx
	p.prev[nx] = pv
	p.free--
}

// alloc takes the least recently freed block, evicting the hash it carried.
// The caller has checked that a free block exists.
func (p *blockPool) alloc() int32 {
	b := p.next[p.n]
	p.unlink(b)
	if p.hashed[b] {
		p.cache.Del(p.hash[b])
		p.hashed[b] = false
		p.evicted++
		if p.trackRemoved {
			p.removed = append(p.removed, p.hash[b])
		}
	}
	p.ref[b] = 1
	return b
}

// touch takes one more reference on a cached block found by lookup; a block
// nobody held leaves the free queue so it cannot be evicted while in use.
func (p *blockPool) touch(b int32) {
	if p.ref[b] == 0 {
		p.unlink(b)
	}
	p.ref[b]++
}

// release drops a request's references. Blocks are freed tail first, as vLLM
// does, so that within one request the blocks deepest in the prompt are the
// first to be evicted and a shared head survives longest.
func (p *blockPool) release(blocks []int32) {
	for i := len(blocks) - 1; i >= 0; i-- {
		b := blocks[i]
		p.ref[b]--
		if p.ref[b] == 0 {
			p.pushBack(b)
		}
	}
}

// register gives a freshly computed full block its hash. When another block
// already carries the hash (two requests computed the same block
// concurrently) the new block stays anonymous: one block per hash keeps the
// Stored/Removed event stream a set, which the precise index relies on.
func (p *blockPool) register(b int32, h uint64) bool {
	v, dup := p.cache.Upsert(h)
	if dup {
		return false
	}
	*v = b
	p.hash[b] = h
	p.hashed[b] = true
	return true
}

// matchLen is the number of leading hashes cached now, at most limit.
func (p *blockPool) matchLen(hashes []uint64, limit int) int {
	limit = min(limit, len(hashes))
	for i := range limit {
		if p.cache.Get(hashes[i]) == nil {
			return i
		}
	}
	return limit
}

// used is the number of blocks held by at least one request.
func (p *blockPool) used() int { return p.n - p.free }

// clearHashes drops every hash (vLLM's reset_prefix_cache). Only valid when no
// block is held.
func (p *blockPool) clearHashes() {
	p.cache = hashtab.New[int32]()
	clear(p.hashed)
}
