package prefixindex

import "github.com/kvgate/kvgate/internal/hashtab"

// A shard indexes up to 32 replicas: one bit each in a block's mask.
//
// Memory per (block, replica) entry: one 24-byte node in a chunked slab (no
// doubling slack), plus the block's 16-byte map slot (8-byte key, 8-byte
// value) with the map's overhead, shared by the replicas holding it.
type shard struct {
	table  *hashtab.Table[entry]
	chunks [][]node // the node slab, in chunks of chunkSize
	used   int32    // nodes ever allocated
	free   int32    // head of the free-node list (linked through next), -1 if none
	lists  [shardWidth]list
}

const (
	chunkShift = 12
	chunkSize  = 1 << chunkShift
)

type entry struct {
	mask  uint32 // bit b: replica b of the shard holds the block
	first int32  // first node of the block (one per holding replica), linked by sibling
}

type node struct {
	hash       uint64
	prev, next int32 // the replica's LRU list, most recent at head
	sibling    int32 // next node of the same block (another replica)
	bit        uint8
}

type list struct {
	head, tail int32
	n          int
	capacity   int // blocks; 0: the index's BlocksPerReplica
}

func newShard() *shard {
	s := &shard{table: hashtab.New[entry](), free: -1}
	for i := range s.lists {
		s.lists[i] = list{head: -1, tail: -1}
	}
	return s
}

// match fills out[b] for each replica bit with the length of the longest
// prefix of hashes it holds. Prefix-closed sets make "replica b holds block
// i" monotone in i, so a divide-and-conquer binary search finds every
// replica's length with one look-up per split.
func (s *shard) match(hashes []uint64, out []int) {
	if len(hashes) == 0 || s.table.Len() == 0 {
		return
	}
	m0 := s.mask(hashes[0])
	if m0 == 0 {
		return
	}
	s.split(hashes, 0, len(hashes), m0, 0, out)
}

// split resolves the replicas in mLo&^mHi, whose lengths lie in (lo, hi]:
// mLo is the mask at block lo, mHi the mask at block hi (0 past the end).
func (s *shard) split(hashes []uint64, lo, hi int, mLo, mHi uint64, out []int) {
	for {
		diff := mLo &^ mHi
		if diff == 0 {
			return
		}
		if hi-lo == 1 {
			for b := range out {
				if diff&(1<<b) != 0 {
					out[b] = hi
				}
			}
			return
		}
		mid := int(uint(lo+hi) >> 1)
		// Intersect with mLo: a replica missing an ancestor holds no descendant.
		mMid := s.mask(hashes[mid])&mLo | mHi
		s.split(hashes, lo, mid, mLo, mMid, out)
		lo, mLo = mid, mMid
	}
}

// touch makes block h the most recent of replica bit b, adding it if absent;
// it reports whether an entry was added.
func (s *shard) touch(h uint64, b int) bool {
	e, ok := s.table.Upsert(h)
	if ok && e.mask&(1<<b) != 0 {
		for i := e.first; i >= 0; i = s.node(i).sibling {
			if int(s.node(i).bit) == b {
				s.moveFront(b, i)
				return false
			}
		}
	}
	i := s.alloc()
	*s.node(i) = node{hash: h, prev: -1, next: -1, sibling: -1, bit: uint8(b)}
	if ok {
		s.node(i).sibling = e.first
	}
	e.first = i
	e.mask |= 1 << b
	s.pushFront(b, i)
	return true
}

// mask is the bit mask of the replicas holding block h.
func (s *shard) mask(h uint64) uint64 {
	if e := s.table.Get(h); e != nil {
		return uint64(e.mask)
	}
	return 0
}

func (s *shard) alloc() int32 {
	if s.free >= 0 {
		i := s.free
		s.free = s.node(i).next
		return i
	}
	i := s.used
	if int(i)>>chunkShift == len(s.chunks) {
		s.chunks = append(s.chunks, make([]node, chunkSize))
	}
	s.used++
	return i
}

func (s *shard) node(i int32) *node { return &s.chunks[i>>chunkShift][i&(chunkSize-1)] }

func (s *shard) pushFront(b int, i int32) {
	l := &s.lists[b]
	s.node(i).prev, s.node(i).next = -1, l.head
	if l.head >= 0 {
		s.node(l.head).prev = i
	}
	l.head = i
	if l.tail < 0 {
		l.tail = i
	}
	l.n++
}

func (s *shard) unlink(b int, i int32) {
	l := &s.lists[b]
	n := s.node(i)
	if n.prev >= 0 {
		s.node(n.prev).next = n.next
	} else {
		l.head = n.next
	}
	if n.next >= 0 {
		s.node(n.next).prev = n.prev
	} else {
		l.tail = n.prev
	}
	l.n--
}

func (s *shard) moveFront(b int, i int32) {
	if s.lists[b].head == i {
		return
	}
	s.unlink(b, i)
	s.pushFront(b, i)
}

func (s *shard) evictTail(b int) {
	if i := s.lists[b].tail; i >= 0 {
		s.drop(b, i)
	}
}

// remove drops block h from replica bit b; it reports whether it was held.
func (s *shard) remove(h uint64, b int) bool {
	e := s.table.Get(h)
	if e == nil || e.mask&(1<<b) == 0 {
		return false
	}
	for i := e.first; i >= 0; i = s.node(i).sibling {
		if int(s.node(i).bit) == b {
			s.drop(b, i)
			return true
		}
	}
	return false
}

// drop unlinks node i from its replica's list and its block's siblings and
// frees it.
func (s *shard) drop(b int, i int32) {
	s.unlink(b, i)
	h := s.node(i).hash
	e := s.table.Get(h)
	if e.first == i {
		e.first = s.node(i).sibling
	} else {
		for j := e.first; j >= 0; j = s.node(j).sibling {
			if s.node(j).sibling == i {
				s.node(j).sibling = s.node(i).sibling
				break
			}
		}
	}
	e.mask &^= 1 << b
	if e.mask == 0 {
		s.table.Del(h)
	}
	*s.node(i) = node{next: s.free}
	s.free = i
}
