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

// ErrUnknownBlock reports a host-tier store without token ids (the
// offloading connector's default payload) of a block the replica's GPU
// events never described: kvgate cannot tell which prefix it is.
var ErrUnknownBlock = errors.New("prefixindex: stored block is unknown")

// Tier is where a replica holds blocks: its GPU cache or its host (CPU)
// tier (vLLM's event medium "GPU", "CPU").
type Tier uint8

// Tiers.
const (
	TierGPU Tier = iota
	TierHost
	numTiers
)

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
//
// With a host index (SetHost), the host tier's events (medium CPU) feed it
// as the GPU's feed the main one, and a block stays in the map of engine
// hashes while either tier holds it: the offloading connector's stores
// carry the hashes only, which the GPU's events taught (write-through: a
// block is computed on the GPU before it is offloaded).
type Precise struct {
	ix        [numTiers]*Index // by tier; the host's nil until SetHost
	model     string
	blockSize int

	mu     sync.Mutex
	engine []map[uint64]engineBlock // per replica: engine hash → its index blocks
	inner  []map[uint64][]uint64    // per replica: engine hash → its other index blocks (engine blocks > index blocks)
}

// engineBlock is one engine block: the kvgate hash of its last index
// block, and the tiers holding it (bit per Tier).
type engineBlock struct {
	h     uint64
	tiers uint8
}

// NewPrecise wraps ix. Requests must be hashed with prompt.Key{Model: model,
// Adapter: lora}.Root() and blockSize for their blocks to match.
func NewPrecise(ix *Index, model string, blockSize int) *Precise {
	if blockSize <= 0 {
		blockSize = prompt.DefaultBlockSize
	}
	return &Precise{ix: [numTiers]*Index{ix}, model: model, blockSize: blockSize}
}

// SetHost makes hix the index of the replicas' host tiers, fed by their
// events of medium CPU (else ignored). Call before any event.
func (p *Precise) SetHost(hix *Index) { p.ix[TierHost] = hix }

// Index is the index fed by the GPU's events.
func (p *Precise) Index() *Index { return p.ix[TierGPU] }

// HostIndex is the host tier's index (nil without SetHost).
func (p *Precise) HostIndex() *Index { return p.ix[TierHost] }

func (p *Precise) replicaMap(r int) map[uint64]engineBlock {
	for len(p.engine) <= r {
		p.engine = append(p.engine, make(map[uint64]engineBlock))
		p.inner = append(p.inner, make(map[uint64][]uint64))
	}
	return p.engine[r]
}

// BlockSize is the index's block size.
func (p *Precise) BlockSize() int { return p.blockSize }

// Stored handles BlockStored of the GPU: engineHashes are the new blocks in
// order, parent the engine hash of the block before the first (nil: they
// start a prompt; 0 too, as llm-d writes it, unless 0 is a block the
// replica stored), tokenIDs their tokens (len = blocks × blockSize,
// blockSize a multiple of the index's). model names the partition the
// events are about ("" means the model given to NewPrecise); lora the
// adapter.
func (p *Precise) Stored(r int, model string, engineHashes []uint64, parent *uint64, tokenIDs []uint32, blockSize int, lora string) error {
	return p.StoredTier(r, TierGPU, model, engineHashes, parent, tokenIDs, blockSize, lora)
}

// StoredTier is Stored into tier t's index. A host-tier store without
// token ids (the offloading connector's default payload) names blocks by
// their engine hashes alone: those the GPU's events described are stored,
// the others dropped (ErrUnknownBlock, after storing the known ones). A
// tier without an index ignores the event.
func (p *Precise) StoredTier(r int, t Tier, model string, engineHashes []uint64, parent *uint64, tokenIDs []uint32, blockSize int, lora string) error {
	if t >= numTiers || p.ix[t] == nil {
		return nil
	}
	if t == TierHost && len(tokenIDs) == 0 {
		return p.storedKnown(r, engineHashes)
	}
	if blockSize <= 0 || blockSize%p.blockSize != 0 {
		return fmt.Errorf("%w: replica block size %d is not a multiple of the index's %d", ErrBlockSize, blockSize, p.blockSize)
	}
	if len(tokenIDs) != len(engineHashes)*blockSize {
		return fmt.Errorf("%w: %d token ids for %d blocks of %d", ErrBlockSize, len(tokenIDs), len(engineHashes), blockSize)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if r < 0 || r >= p.ix[t].Replicas() {
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
		h = ph.h
	}
	ours := p.rehash(r, t, h, engineHashes, tokenIDs, blockSize/p.blockSize)
	if err := p.ix[t].Insert(r, ours); err != nil {
		return err
	}
	p.trim(r)
	return nil
}

// storedKnown stores into the host index the blocks of engineHashes the
// replica's map knows, in order.
func (p *Precise) storedKnown(r int, engineHashes []uint64) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r < 0 || r >= p.ix[TierHost].Replicas() {
		return fmt.Errorf("%w: %d", ErrReplica, r)
	}
	m, inner := p.replicaMap(r), p.inner[r]
	ours := make([]uint64, 0, len(engineHashes))
	unknown := 0
	for _, eh := range engineHashes {
		b, ok := m[eh]
		if !ok {
			unknown++
			continue
		}
		ours = append(append(ours, inner[eh]...), b.h)
		b.tiers |= 1 << TierHost
		m[eh] = b
	}
	if err := p.ix[TierHost].Insert(r, ours); err != nil {
		return err
	}
	if unknown > 0 {
		return fmt.Errorf("%w: replica %d, %d of %d host-tier blocks", ErrUnknownBlock, r, unknown, len(engineHashes))
	}
	return nil
}

// rehash chains tokenIDs from h in index blocks, records each engine block's
// index blocks, and returns them all in order.
func (p *Precise) rehash(r int, t Tier, h uint64, engineHashes []uint64, tokenIDs []uint32, per int) []uint64 {
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
		m[eh] = engineBlock{h: h, tiers: m[eh].tiers | 1<<t}
		if per > 1 {
			inner[eh] = ours[len(ours)-per : len(ours)-1 : len(ours)-1]
		}
	}
	return ours
}

// trim keeps replica r's engine map from outgrowing the indexes, which may
// have evicted entries under their memory caps.
func (p *Precise) trim(r int) {
	m, inner := p.engine[r], p.inner[r]
	held := 0
	for _, ix := range p.ix {
		if ix != nil {
			held += ix.ReplicaLen(r)
		}
	}
	if len(m) <= 2*held+1024 {
		return
	}
	for eh, b := range m {
		if !p.holds(r, b.h) {
			delete(m, eh)
			delete(inner, eh)
		}
	}
}

// holds reports whether an index holds kvgate block h for replica r.
func (p *Precise) holds(r int, h uint64) bool {
	for _, ix := range p.ix {
		if ix != nil && ix.Holds(r, h) {
			return true
		}
	}
	return false
}

// Removed handles BlockRemoved of the GPU. Unknown hashes are ignored
// (already evicted under the memory cap, or stored before kvgate
// subscribed).
func (p *Precise) Removed(r int, engineHashes []uint64) error {
	return p.RemovedTier(r, TierGPU, engineHashes)
}

// RemovedTier is Removed from tier t's index; the engine hash is forgotten
// once no tier holds its block.
func (p *Precise) RemovedTier(r int, t Tier, engineHashes []uint64) error {
	if t >= numTiers || p.ix[t] == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if r < 0 || r >= p.ix[t].Replicas() {
		return fmt.Errorf("%w: %d", ErrReplica, r)
	}
	m := p.replicaMap(r)
	inner := p.inner[r]
	ours := make([]uint64, 0, len(engineHashes))
	for _, eh := range engineHashes {
		b, ok := m[eh]
		if !ok || b.tiers&(1<<t) == 0 {
			continue
		}
		ours = append(append(ours, inner[eh]...), b.h)
		if b.tiers &^= 1 << t; b.tiers == 0 {
			delete(m, eh)
			delete(inner, eh)
		} else {
			m[eh] = b
		}
	}
	return p.ix[t].Remove(r, ours)
}

// Forget empties replica slot r for another replica: its blocks in the
// indexes, and its maps of engine hashes replaced by new ones (a cleared
// map keeps its buckets: a replica that held a million blocks would pin
// them).
func (p *Precise) Forget(r int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r < 0 || r >= p.ix[TierGPU].Replicas() {
		return fmt.Errorf("%w: %d", ErrReplica, r)
	}
	if r < len(p.engine) {
		p.engine[r], p.inner[r] = make(map[uint64]engineBlock), make(map[uint64][]uint64)
	}
	return p.eachIndex(func(ix *Index) error { return ix.Forget(r) })
}

// Cleared handles AllBlocksCleared (every tier), and a resync after lost
// events.
func (p *Precise) Cleared(r int) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if r < 0 || r >= p.ix[TierGPU].Replicas() {
		return fmt.Errorf("%w: %d", ErrReplica, r)
	}
	clear(p.replicaMap(r))
	clear(p.inner[r])
	return p.eachIndex(func(ix *Index) error { return ix.Clear(r) })
}

// eachIndex applies f to every tier's index, returning the first error.
func (p *Precise) eachIndex(f func(*Index) error) error {
	var first error
	for _, ix := range p.ix {
		if ix == nil {
			continue
		}
		if err := f(ix); err != nil && first == nil {
			first = err
		}
	}
	return first
}
