package prefixindex

import (
	"errors"
	"fmt"
	"sync"

	"github.com/kvgate/kvgate/internal/prompt"
)

// ErrUnknownParent reports a BlockStored whose parent block was never seen:
// the event stream lost something, and the replica's view must be resynced.
var ErrUnknownParent = errors.New("prefixindex: stored block's parent is unknown")

// ErrBlockSize reports a stored event whose token ids do not fill its
// blocks, or whose block size is not a multiple of the index's.
var ErrBlockSize = errors.New("prefixindex: stored blocks do not fit the index's block size")

// Precise feeds an Index from replicas' KV events. An engine's block hashes
// are its own (vLLM: sha256 or its builtin hash, seeded per process); kvgate
// never reproduces them. It rehashes the token ids each BlockStored event
// carries with its own chained hash, from the same root a request's blocks
// use, and keeps a per-replica map engine hash → kvgate hash so that
// BlockRemoved can be resolved.
//
// A replica's blocks may be larger than the index's (vLLM's --block-size 32
// or 64 under an index of 16): each engine block of m index blocks becomes m
// index blocks, the engine hash standing for the last of them (the parent of
// the next) and the others kept aside for its removal.
type Precise struct {
	ix        *Index
	model     string
	blockSize int

	mu     sync.Mutex
	engine []map[uint64]uint64   // per replica: engine hash → kvgate hash of its last index block
	inner  []map[uint64][]uint64 // per replica: engine hash → its other index blocks (engine blocks > index blocks)
}

// NewPrecise wraps ix. Requests must be hashed with prompt.Key{Model: model,
// Adapter: lora}.Root() and blockSize for their blocks to match.
func NewPrecise(ix *Index, model string, blockSize int) *Precise {
	if blockSize <= 0 {
		blockSize = prompt.DefaultBlockSize
	}
	return &Precise{ix: ix, model: model, blockSize: blockSize}
}

// Index is the index fed.
func (p *Precise) Index() *Index { return p.ix }

func (p *Precise) replicaMap(r int) map[uint64]uint64 {
	for len(p.engine) <= r {
		p.engine = append(p.engine, make(map[uint64]uint64))
		p.inner = append(p.inner, make(map[uint64][]uint64))
	}
	return p.engine[r]
}

// BlockSize is the index's block size.
func (p *Precise) BlockSize() int { return p.blockSize }

// Stored handles BlockStored: engineHashes are the new blocks in order,
// parent the engine hash of the block before the first (nil: they start a
// prompt; 0 too, as llm-d writes it, unless 0 is a block the replica
// stored), tokenIDs their tokens (len = blocks × blockSize, blockSize a
// multiple of the index's). model names the partition the events are
// about ("" means the model given to NewPrecise); lora the adapter.
func (p *Precise) Stored(r int, model string, engineHashes []uint64, parent *uint64, tokenIDs []uint32, blockSize int, lora string) error {
	if blockSize <= 0 || blockSize%p.blockSize != 0 {
		return fmt.Errorf("%w: replica block size %d is not a multiple of the index's %d", ErrBlockSize, blockSize, p.blockSize)
	}
	if len(tokenIDs) != len(engineHashes)*blockSize {
		return fmt.Errorf("%w: %d token ids for %d blocks of %d", ErrBlockSize, len(tokenIDs), len(engineHashes), blockSize)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if r < 0 || r >= p.ix.Replicas() {
		return fmt.Errorf("%w: %d", ErrReplica, r)
	}
	m := p.replicaMap(r)
	if model == "" {
		model = p.model
	}
	h := prompt.Key{Model: model, Adapter: lora}.Root()
	if parent != nil && *parent == 0 {
		// llm-d's positional events (and its vLLM simulator) write 0 for
		// "no parent"; an engine hash of 0 is read as one only when known.
		if _, known := m[0]; !known {
			parent = nil
		}
	}
	if parent != nil {
		ph, ok := m[*parent]
		if !ok {
			return fmt.Errorf("%w: replica %d, parent %#x", ErrUnknownParent, r, *parent)
		}
		h = ph
	}
	ours := p.rehash(r, h, engineHashes, tokenIDs, blockSize/p.blockSize)
	if err := p.ix.Insert(r, ours); err != nil {
		return err
	}
	p.trim(r)
	return nil
}

// rehash chains tokenIDs from h in index blocks, records each engine block's
// index blocks, and returns them all in order.
func (p *Precise) rehash(r int, h uint64, engineHashes []uint64, tokenIDs []uint32, per int) []uint64 {
	m, inner := p.engine[r], p.inner[r]
	ours := make([]uint64, 0, len(engineHashes)*per)
	buf := prompt.TokenBytes(make([]byte, 0, len(tokenIDs)*prompt.TokenBytesPer), tokenIDs)
	step := p.blockSize * prompt.TokenBytesPer
	for i, eh := range engineHashes {
		for j := range per {
			k := i*per + j
			h = prompt.Chain(h, buf[k*step:(k+1)*step])
			ours = append(ours, h)
		}
		m[eh] = h
		if per > 1 {
			inner[eh] = ours[len(ours)-per : len(ours)-1 : len(ours)-1]
		}
	}
	return ours
}

// trim keeps replica r's engine map from outgrowing the index, which may
// have evicted entries under its memory cap.
func (p *Precise) trim(r int) {
	m, inner := p.engine[r], p.inner[r]
	if len(m) <= 2*p.ix.ReplicaLen(r)+1024 {
		return
	}
	for eh, h := range m {
		if !p.ix.Holds(r, h) {
			delete(m, eh)
			delete(inner, eh)
		}
	}
}

// Removed handles BlockRemoved. Unknown hashes are ignored (already evicted
// under the memory cap, or stored before kvgate subscribed).
func (p *Precise) Removed(r int, engineHashes []uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r < 0 || r >= p.ix.Replicas() {
		return fmt.Errorf("%w: %d", ErrReplica, r)
	}
	m := p.replicaMap(r)
	inner := p.inner[r]
	ours := make([]uint64, 0, len(engineHashes))
	for _, eh := range engineHashes {
		if h, ok := m[eh]; ok {
			ours = append(ours, inner[eh]...)
			ours = append(ours, h)
			delete(m, eh)
			delete(inner, eh)
		}
	}
	return p.ix.Remove(r, ours)
}

// Forget empties replica slot r for another replica: its blocks in the
// index, and its maps of engine hashes replaced by new ones (a cleared map
// keeps its buckets: a replica that held a million blocks would pin them).
func (p *Precise) Forget(r int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r < 0 || r >= p.ix.Replicas() {
		return fmt.Errorf("%w: %d", ErrReplica, r)
	}
	if r < len(p.engine) {
		p.engine[r], p.inner[r] = make(map[uint64]uint64), make(map[uint64][]uint64)
	}
	return p.ix.Forget(r)
}

// Cleared handles AllBlocksCleared, and a resync after lost events.
func (p *Precise) Cleared(r int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r < 0 || r >= p.ix.Replicas() {
		return fmt.Errorf("%w: %d", ErrReplica, r)
	}
	clear(p.replicaMap(r))
	clear(p.inner[r])
	return p.ix.Clear(r)
}
