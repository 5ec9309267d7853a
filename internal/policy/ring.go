package policy

import (
	"cmp"
	"slices"
	"strconv"
	"sync/atomic"
	"unicode/utf8"

	"github.com/cespare/xxhash/v2"
)

// defaultVNodes is the number of points per replica on a consistent-hash
// ring: KubeAI's CHWBL replication (256), used by session and prefix_key too.
const defaultVNodes = 256

// hashRing is a consistent-hash ring (Karger et al., 1997) with virtual
// nodes: each replica owns vnodes points, xxhash64 of "key#v", and a request
// key goes to the owner of the first point clockwise from its own hash. Adding
// or removing a replica moves only the keys of its own arcs. A ring is
// immutable once built.
type hashRing struct {
	members []ringMember // the replicas it was built over, in Pick's order
	points  []ringPoint  // sorted by comparePoints: hash, then position
}

type ringMember struct {
	url   string
	index int
}

type ringPoint struct {
	hash uint64
	pos  int32 // position in members (and in the replicas passed to Pick)
}

// ringKey is what a replica's points are hashed from: the URL as configured
// (so that every gateway with the same replica list builds the same ring),
// or the slot when no URL is set.
func ringKey(url string, index int) string {
	if url != "" {
		return url
	}
	return "replica-" + strconv.Itoa(index)
}

func buildRing(rs []ReplicaView, vnodes int) *hashRing {
	r := &hashRing{
		members: make([]ringMember, len(rs)),
		points:  make([]ringPoint, 0, len(rs)*vnodes),
	}
	var d xxhash.Digest
	var num [20]byte
	for i := range rs {
		r.members[i] = ringMember{url: rs[i].URL, index: rs[i].Index}
		key := ringKey(rs[i].URL, rs[i].Index)
		for v := range vnodes {
			d.Reset()
			_, _ = d.WriteString(key)
			_, _ = d.Write([]byte{'#'})
			_, _ = d.Write(strconv.AppendInt(num[:0], int64(v), 10))
			r.points = append(r.points, ringPoint{hash: d.Sum64(), pos: int32(i)})
		}
	}
	slices.SortFunc(r.points, comparePoints)
	return r
}

// comparePoints orders ring points by hash, then by position. Equal
// hashes are astronomically rare; with the position as well, the order is
// total (two points equal in both are the same value), so the ring does not
// depend on the sort algorithm.
func comparePoints(a, b ringPoint) int {
	if c := cmp.Compare(a.hash, b.hash); c != 0 {
		return c
	}
	return cmp.Compare(a.pos, b.pos)
}

// matches reports whether the ring was built over exactly these replicas.
func (r *hashRing) matches(rs []ReplicaView) bool {
	if len(r.members) != len(rs) {
		return false
	}
	for i := range rs {
		if r.members[i].url != rs[i].URL || r.members[i].index != rs[i].Index {
			return false
		}
	}
	return true
}

// walk visits the replicas clockwise from h's point, each once, healthy ones
// only, and returns the position of the first healthy replica met and of the
// first that accept takes (-1 when none; accept nil takes the first).
func (r *hashRing) walk(h uint64, rs []ReplicaView, accept func(pos int) bool) (first, chosen int) {
	first, chosen = -1, -1
	n := len(r.points)
	if n == 0 {
		return
	}
	// First point with hash ≥ h (binary search), wrapping past the end.
	lo, hi := 0, n
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if r.points[mid].hash < h {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	var stack [4]uint64
	seen := stack[:]
	if len(r.members) > 64*len(stack) {
		seen = make([]uint64, (len(r.members)+63)/64)
	}
	distinct := 0
	for k := 0; k < n && distinct < len(r.members); k++ {
		pos := int(r.points[(lo+k)%n].pos)
		w, b := pos/64, uint64(1)<<(pos%64)
		if seen[w]&b != 0 {
			continue
		}
		seen[w] |= b
		distinct++
		if !rs[pos].Healthy {
			continue
		}
		if first < 0 {
			first = pos
		}
		if accept == nil || accept(pos) {
			return first, pos
		}
	}
	return first, -1
}

// ringCache holds the ring of the replica list last seen. Rebuilding it is a
// pure function of the list, so the cache is a memo, not policy state: Pick
// may refresh it and a dry run stays a dry run. Readers never block.
type ringCache struct {
	vnodes int
	cur    atomic.Pointer[hashRing]
}

func (c *ringCache) get(rs []ReplicaView) *hashRing {
	if r := c.cur.Load(); r != nil && r.matches(rs) {
		return r
	}
	r := buildRing(rs, c.vnodes)
	c.cur.Store(r)
	return r
}

// headRunes returns the first k characters (runes) of s.
func headRunes(s string, k int) string {
	if len(s) <= k {
		return s // at most len(s) ≤ k runes
	}
	i := 0
	for n := 0; n < k && i < len(s); n++ {
		if c := s[i]; c < utf8.RuneSelf {
			i++
			continue
		}
		_, w := utf8.DecodeRuneInString(s[i:])
		i += w
	}
	return s[:i]
}

// hashKey is xxhash64 of the concatenation of parts, without building it.
func hashKey(parts ...string) uint64 {
	var d xxhash.Digest
	d.Reset()
	for _, p := range parts {
		_, _ = d.WriteString(p)
	}
	return d.Sum64()
}
