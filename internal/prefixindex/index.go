// Package prefixindex knows which replica holds which prompt prefix.
//
// It maps a chained block hash to the replicas believed to hold that block.
// Each replica's blocks sit in an LRU list with a capacity; a hard cap on
// (block, replica) entries over all replicas bounds memory whatever the
// traffic. Two ways to feed it:
//
//   - approximate: the router inserts a request's blocks for the replica it
//     chose (SGLang's, llm-d's and Dynamo's approximate trees do the same);
//   - precise: the replicas' own KV events say which blocks are stored and
//     removed (see Precise).
//
// Blocks are touched last-to-first, so a prompt's head is always more recent
// than its tail and the LRU evicts leaves before their ancestors, like a radix
// tree's leaf eviction. Each replica's set of blocks is therefore closed under
// prefixes, which lets Match find every replica's match length by binary
// search over the prompt's blocks instead of a walk: O(distinct match lengths
// × log blocks) map look-ups rather than O(blocks).
package prefixindex

import (
	"errors"
	"fmt"
	"sync"
)

// ErrReplica reports a replica slot out of range.
var ErrReplica = errors.New("prefixindex: replica slot out of range")

// shardWidth is the number of replicas whose membership fits one bit mask.
const shardWidth = 32

// Config bounds the index.
type Config struct {
	// Replicas is the number of replica slots.
	Replicas int
	// BlocksPerReplica is each replica's LRU capacity in blocks
	// (0: no per-replica bound, only MaxEntries).
	BlocksPerReplica int
	// MaxEntries is the hard cap on (block, replica) entries over all
	// replicas (0: 4M, about 160 MiB). Inserting past it evicts from the
	// replica holding the most entries.
	MaxEntries int
}

// DefaultMaxEntries is MaxEntries when not set.
const DefaultMaxEntries = 4 << 20

// Index is the approximate prefix index. It is safe for concurrent use.
type Index struct {
	mu     sync.RWMutex
	cfg    Config
	shards []*shard
	total  int
}

// New returns an empty index.
func New(cfg Config) (*Index, error) {
	if cfg.Replicas < 0 || cfg.BlocksPerReplica < 0 || cfg.MaxEntries < 0 {
		return nil, fmt.Errorf("prefixindex: negative size in %+v", cfg)
	}
	if cfg.MaxEntries == 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	ix := &Index{cfg: cfg}
	ix.grow(cfg.Replicas)
	return ix, nil
}

func (ix *Index) grow(replicas int) {
	for len(ix.shards)*shardWidth < replicas {
		ix.shards = append(ix.shards, newShard())
	}
	ix.cfg.Replicas = max(ix.cfg.Replicas, replicas)
}

// SetReplicas grows the number of replica slots (it never shrinks: a
// replica removed for good is emptied with Forget and its slot reused).
func (ix *Index) SetReplicas(n int) {
	ix.mu.Lock()
	ix.grow(n)
	ix.mu.Unlock()
}

// Replicas is the number of replica slots.
func (ix *Index) Replicas() int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.cfg.Replicas
}

func (ix *Index) slot(r int) (*shard, int, error) {
	if r < 0 || r >= ix.cfg.Replicas {
		return nil, 0, fmt.Errorf("%w: %d of %d", ErrReplica, r, ix.cfg.Replicas)
	}
	return ix.shards[r/shardWidth], r % shardWidth, nil
}

// Match sets out[r] to the number of leading blocks of hashes that replica r
// holds, for every replica slot, and returns out (grown to Replicas()).
func (ix *Index) Match(hashes []uint64, out []int) []int {
	out, _ = ix.MatchLens(hashes, out, nil)
	return out
}

// MatchLens is Match, and also sets lens[r] to the number of blocks replica
// r holds (lens grown to Replicas()), under one lock. A nil lens is left nil.
func (ix *Index) MatchLens(hashes []uint64, out, lens []int) ([]int, []int) {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	n := ix.cfg.Replicas
	if cap(out) < n {
		out = make([]int, n)
	}
	out = out[:n]
	clear(out)
	for s, sh := range ix.shards {
		base := s * shardWidth
		sh.match(hashes, out[base:min(base+shardWidth, n)])
	}
	if lens != nil {
		if cap(lens) < n {
			lens = make([]int, n)
		}
		lens = lens[:n]
		for r := range lens {
			lens[r] = ix.shards[r/shardWidth].lists[r%shardWidth].n
		}
	}
	return out, lens
}

// Insert records that replica r holds hashes (a prompt's blocks, first to
// last) and makes them its most recent, head most recent of all.
func (ix *Index) Insert(r int, hashes []uint64) error {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	sh, bit, err := ix.slot(r)
	if err != nil {
		return err
	}
	for i := len(hashes) - 1; i >= 0; i-- {
		if sh.touch(hashes[i], bit) {
			ix.total++
		}
	}
	c := sh.lists[bit].capacity
	if c == 0 {
		c = ix.cfg.BlocksPerReplica
	}
	if c > 0 {
		for sh.lists[bit].n > c {
			sh.evictTail(bit)
			ix.total--
		}
	}
	for ix.total > ix.cfg.MaxEntries {
		ix.evictLargest()
	}
	return nil
}

// evictLargest drops the least recent block of the replica holding most.
func (ix *Index) evictLargest() {
	var best *shard
	bestBit, bestN := -1, -1
	for _, sh := range ix.shards {
		for b := range shardWidth {
			if n := sh.lists[b].n; n > bestN {
				best, bestBit, bestN = sh, b, n
			}
		}
	}
	if bestN <= 0 {
		return
	}
	best.evictTail(bestBit)
	ix.total--
}

// SetCapacity sets replica r's LRU capacity in blocks (0: the index's
// BlocksPerReplica), e.g. from the replica's own num_gpu_blocks, so that the
// index forgets roughly when the replica does. A smaller capacity applies at
// the replica's next insert.
func (ix *Index) SetCapacity(r, blocks int) error {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	sh, bit, err := ix.slot(r)
	if err != nil {
		return err
	}
	sh.lists[bit].capacity = max(blocks, 0)
	return nil
}

// Remove forgets that replica r holds hashes (precise mode: the replica
// evicted them; or a correction: the replica reported fewer cached tokens).
func (ix *Index) Remove(r int, hashes []uint64) error {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	sh, bit, err := ix.slot(r)
	if err != nil {
		return err
	}
	for _, h := range hashes {
		if sh.remove(h, bit) {
			ix.total--
		}
	}
	return nil
}

// Clear forgets everything replica r holds (it restarted, or was removed).
func (ix *Index) Clear(r int) error {
	ix.mu.Lock()
	defer ix.mu.Unlock()
	sh, bit, err := ix.slot(r)
	if err != nil {
		return err
	}
	for sh.lists[bit].n > 0 {
		sh.evictTail(bit)
		ix.total--
	}
	return nil
}

// Forget empties replica slot r for another replica (the router forgot a
// removed one): its blocks and its capacity (back to BlocksPerReplica).
// Its entries' memory goes back to the index, for any replica's use.
func (ix *Index) Forget(r int) error {
	if err := ix.Clear(r); err != nil {
		return err
	}
	return ix.SetCapacity(r, 0)
}

// Holds reports whether replica r holds block h.
func (ix *Index) Holds(r int, h uint64) bool {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	sh, bit, err := ix.slot(r)
	if err != nil {
		return false
	}
	return sh.mask(h)&(1<<bit) != 0
}

// Len is the number of (block, replica) entries.
func (ix *Index) Len() int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	return ix.total
}

// ReplicaLen is the number of blocks replica r holds.
func (ix *Index) ReplicaLen(r int) int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	sh, bit, err := ix.slot(r)
	if err != nil {
		return 0
	}
	return sh.lists[bit].n
}

// Blocks returns the distinct blocks indexed.
func (ix *Index) Blocks() int {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	n := 0
	for _, sh := range ix.shards {
		n += sh.table.Len()
	}
	return n
}

// Snapshot returns the blocks replica r holds, most recent first (tests,
// debugging).
func (ix *Index) Snapshot(r int) []uint64 {
	ix.mu.RLock()
	defer ix.mu.RUnlock()
	sh, bit, err := ix.slot(r)
	if err != nil {
		return nil
	}
	out := make([]uint64, 0, sh.lists[bit].n)
	for i := sh.lists[bit].head; i >= 0; i = sh.node(i).next {
		out = append(out, sh.node(i).hash)
	}
	return out
}
