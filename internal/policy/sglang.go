package policy

import (
	"container/heap"
	"encoding/binary"
	"fmt"
	"math/bits"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
	"unsafe"
)

func init() {
	register("sglang", func(o Options) (Policy, error) {
		p := sglangParams{
			CacheThreshold: 0.5, BalanceAbs: 32, BalanceRel: 1.1,
			EvictionIntervalSecs: 30, MaxTreeSize: 10000, HardCapChars: 1 << 24,
		}
		if err := decodeParams(o.Params, &p); err != nil {
			return nil, err
		}
		if p.CacheThreshold < 0 || p.CacheThreshold > 1 || p.BalanceAbs < 0 || p.BalanceRel < 1 ||
			p.EvictionIntervalSecs < 0 || p.MaxTreeSize < 1 || p.HardCapChars < p.MaxTreeSize {
			return nil, fmt.Errorf("%w: need 0 ≤ cache_threshold ≤ 1, balance_abs_threshold ≥ 0, "+
				"balance_rel_threshold ≥ 1, eviction_interval_secs ≥ 0, max_tree_size ≥ 1", ErrParam)
		}
		return &SGLang{
			p: p, blockChars: 4 * o.BlockSize, g: newRNG(o.Seed),
			roots: map[sgPartition]*sgNode{}, chars: map[int]int{},
		}, nil
	})
}

type sglangParams struct {
	CacheThreshold       float64 `json:"cache_threshold"`
	BalanceAbs           int     `json:"balance_abs_threshold"`
	BalanceRel           float64 `json:"balance_rel_threshold"`
	EvictionIntervalSecs float64 `json:"eviction_interval_secs"`
	// MaxTreeSize bounds each replica's share of the tree, in characters.
	MaxTreeSize int `json:"max_tree_size"`
	// HardCapChars bounds a replica's share between two evictions (kvgate's
	// memory bound; SGLang's tree grows unbounded between its evictions).
	HardCapChars int `json:"hard_cap_chars"`
	// RandomTies breaks least-load ties at random; SGLang takes the first.
	RandomTies bool `json:"random_ties"`
}

// SGLang is the SGLang router's cache_aware policy.
//
// It keeps one approximate radix tree (a compressed trie over the
// characters of the routed texts) shared by all replicas: each node records,
// per tenant (replica slot) holding it, the last time a request routed there
// passed through it. Because a routed text is inserted along its whole path,
// a tenant holding a node holds all its ancestors, and eviction (least
// recently used leaves first) keeps that true. Routing:
//
//   - imbalanced, i.e. (max load − min load) > balance_abs_threshold AND
//     max load > min load × balance_rel_threshold: the least loaded replica;
//   - else the longest prefix of the text in the tree: if it covers more
//     than cache_threshold of the text, the replica holding the deepest
//     matched node (the least loaded if several do); else the least loaded.
//
// Load ties go to the first replica in order, as SGLang's min_by_key does
// (random_ties: at random). The text is inserted for the chosen replica when
// the request is Routed, whichever path chose it. SGLang's router evicts
// from a background thread every eviction interval; here eviction runs
// lazily from Observe once the interval has passed in event time, and also
// at once when a tenant grows past hard_cap_chars (16M characters), so that
// memory stays bounded however fast (virtual) time runs between two
// evictions. Between evictions the tree keeps everything, as SGLang's does.
//
// Trees are kept per cache partition (model, adapter, salt), as SGLang keeps
// one per model: a prefix cached under another adapter is no hit.
type SGLang struct {
	p          sglangParams
	blockChars int
	g          *rng

	mu        sync.RWMutex
	roots     map[sgPartition]*sgNode
	chars     map[int]int // tenant → characters of the tree it holds
	lastEvict time.Time
	started   bool
}

var _ Policy = (*SGLang)(nil)
var _ Observer = (*SGLang)(nil)

type sgPartition struct{ model, adapter, salt string }

type sgNode struct {
	text     string
	parent   *sgNode
	children []*sgNode
	tenants  []sgStamp
}

// sgStamp is a tenant's last access to a node, in Unix nanoseconds of the
// router's (possibly virtual) clock.
type sgStamp struct {
	tenant int
	at     int64
}

func (*SGLang) Name() string { return "sglang" }

func (n *sgNode) child(c byte) *sgNode {
	for _, ch := range n.children {
		if ch.text[0] == c {
			return ch
		}
	}
	return nil
}

func (n *sgNode) stamp(t int) int {
	for k := range n.tenants {
		if n.tenants[k].tenant == t {
			return k
		}
	}
	return -1
}

// commonPrefix is the length of the longest common prefix of a and b,
// compared eight bytes at a time.
func commonPrefix(a, b string) int {
	n := min(len(a), len(b))
	ab, bb := strBytes(a), strBytes(b)
	i := 0
	for ; i+8 <= n; i += 8 {
		if x := binary.LittleEndian.Uint64(ab[i:]) ^ binary.LittleEndian.Uint64(bb[i:]); x != 0 {
			return i + bits.TrailingZeros64(x)/8
		}
	}
	for i < n && a[i] == b[i] {
		i++
	}
	return i
}

// posOf returns the position in rs of the replica in slot idx (-1: absent).
func posOf(rs []ReplicaView, idx int) int {
	if idx >= 0 && idx < len(rs) && rs[idx].Index == idx {
		return idx
	}
	for i := range rs {
		if rs[i].Index == idx {
			return i
		}
	}
	return -1
}

// matchInto walks text down the tree and sets out[pos] to the number of
// bytes of text matched by the deepest node that replica pos holds (partial
// edges count their matched part, as SGLang's prefix_match does).
func (s *SGLang) matchInto(req *Request, rs []ReplicaView, out []int) {
	node := s.roots[sgPartition{req.Model, req.Adapter, req.Salt}]
	if node == nil {
		return
	}
	text, depth := req.Text, 0
	for depth < len(text) {
		ch := node.child(text[depth])
		if ch == nil {
			return
		}
		rest := text[depth:]
		k := len(ch.text)
		full := len(rest) >= k && rest[:k] == ch.text
		if !full {
			k = commonPrefix(ch.text, rest)
		}
		depth += k
		// Ancestors were credited before; a tenant of ch goes deeper.
		for _, st := range ch.tenants {
			if i := posOf(rs, st.tenant); i >= 0 {
				out[i] = depth
			}
		}
		if !full {
			return
		}
		node = ch
	}
}

// countRunes counts the characters of UTF-8 text: the bytes that are not
// continuation bytes (10xxxxxx), 32 bytes at a time (SWAR: bit 7 set and
// bit 6 clear, then a population count; all-ASCII words skipped). It equals
// utf8.RuneCountInString on valid UTF-8 and is several times faster on long
// prompts.
func countRunes(s string) int {
	b := strBytes(s)
	const hi = 0x8080808080808080
	cont, i := 0, 0
	for ; i+32 <= len(b); i += 32 {
		w0 := binary.LittleEndian.Uint64(b[i:])
		w1 := binary.LittleEndian.Uint64(b[i+8:])
		w2 := binary.LittleEndian.Uint64(b[i+16:])
		w3 := binary.LittleEndian.Uint64(b[i+24:])
		if (w0|w1|w2|w3)&hi == 0 {
			continue
		}
		cont += bits.OnesCount64(w0&^(w0<<1)&hi) + bits.OnesCount64(w1&^(w1<<1)&hi) +
			bits.OnesCount64(w2&^(w2<<1)&hi) + bits.OnesCount64(w3&^(w3<<1)&hi)
	}
	for ; i < len(b); i++ {
		if b[i]&0xC0 == 0x80 {
			cont++
		}
	}
	return len(s) - cont
}

// strBytes views s as bytes without copying; the bytes must not be written.
func strBytes(s string) []byte { return unsafe.Slice(unsafe.StringData(s), len(s)) }

// runeBoundary backs a byte offset into s off to a character boundary, so
// that a match ending inside a multi-byte character does not count it.
func runeBoundary(s string, n int) int {
	for n > 0 && n < len(s) && !utf8.RuneStart(s[n]) {
		n--
	}
	return n
}

func (s *SGLang) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	minL, maxL := rs[c[0]].InFlight, rs[c[0]].InFlight
	for _, i := range c[1:] {
		minL, maxL = min(minL, rs[i].InFlight), max(maxL, rs[i].InFlight)
	}

	// depth[pos]: bytes of the text's head that replica pos holds.
	var dbuf [scratchLen]int
	depth := scratch(&dbuf, len(rs))
	s.mu.RLock()
	s.matchInto(req, rs, depth)
	s.mu.RUnlock()
	deepest := 0
	for _, i := range c {
		deepest = max(deepest, depth[i])
	}
	// The match rate counts characters, as SGLang's chars().count() does.
	rate := 0.0
	if len(req.Text) > 0 {
		head := runeBoundary(req.Text, deepest)
		n := countRunes(req.Text[:head])
		rate = float64(n) / float64(n+countRunes(req.Text[head:]))
	}

	var i int
	var reason string
	switch {
	case float64(maxL-minL) > float64(s.p.BalanceAbs) && float64(maxL) > float64(minL)*s.p.BalanceRel:
		i, reason = s.leastLoaded(rs, c, depth, -1), "imbalanced: least loaded"
	case rate > s.p.CacheThreshold:
		i, reason = s.leastLoaded(rs, c, depth, deepest), "match rate over the threshold: holder of the deepest match"
	default:
		i, reason = s.leastLoaded(rs, c, depth, -1), "match rate under the threshold: least loaded"
	}
	// Scores: the fraction of the text (in bytes) each replica holds.
	scores := make([]float64, len(rs))
	if len(req.Text) > 0 {
		for k := range scores {
			scores[k] = float64(depth[k]) / float64(len(req.Text))
		}
	}
	// Characters to blocks through the approximate tokenizer (4 characters
	// per token): an estimate, the tree knows no tokens.
	d := decide(rs, i, reason, depth[i]/s.blockChars, float64(rs[i].InFlight))
	d.Scores = scores
	return d, nil
}

// leastLoaded returns the least loaded candidate among c (those holding
// exactly want bytes when want ≥ 0): the first in order, as SGLang's
// min_by_key, or one at random with random_ties.
func (s *SGLang) leastLoaded(rs []ReplicaView, c []int, depth []int, want int) int {
	best, seen := -1, 0
	for _, i := range c {
		if want >= 0 && depth[i] != want {
			continue
		}
		switch {
		case best < 0 || rs[i].InFlight < rs[best].InFlight:
			best, seen = i, 1
		case rs[i].InFlight == rs[best].InFlight && s.p.RandomTies:
			seen++
			if s.g.IntN(seen) == 0 {
				best = i
			}
		}
	}
	return best
}

// Observe inserts the text of a routed request for the replica it went to.
func (s *SGLang) Observe(ev Event) {
	if ev.Kind != Routed || ev.Req == nil || ev.Replica < 0 {
		return
	}
	at := ev.At.UnixNano()
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.started {
		s.started, s.lastEvict = true, ev.At
	}
	s.insert(ev.Req, ev.Replica, at)
	interval := time.Duration(s.p.EvictionIntervalSecs * float64(time.Second))
	if ev.At.Sub(s.lastEvict) >= interval || s.chars[ev.Replica] > s.p.HardCapChars {
		s.evict()
		s.lastEvict = ev.At
	}
}

func (s *SGLang) insert(req *Request, t int, at int64) {
	part := sgPartition{req.Model, req.Adapter, req.Salt}
	node := s.roots[part]
	if node == nil {
		node = &sgNode{}
		s.roots[part] = node
	}
	text := req.Text
	for len(text) > 0 {
		ch := node.child(text[0])
		if ch == nil {
			// A new leaf: its own copy of the text, so that the tree never
			// pins a request's (possibly much longer) prompt in memory.
			leaf := &sgNode{text: strings.Clone(text), parent: node, tenants: []sgStamp{{t, at}}}
			node.children = append(node.children, leaf)
			s.chars[t] += len(text)
			return
		}
		k := commonPrefix(ch.text, text)
		if k < len(ch.text) {
			// Split the edge at k: a new inner node takes the common part
			// and the tenants of ch (they hold all of ch, so all of it).
			// Both halves are copied so that neither pins the other.
			mid := &sgNode{
				text: strings.Clone(ch.text[:k]), parent: node, children: []*sgNode{ch},
				tenants: append([]sgStamp(nil), ch.tenants...),
			}
			for j, x := range node.children {
				if x == ch {
					node.children[j] = mid
				}
			}
			ch.text, ch.parent = strings.Clone(ch.text[k:]), mid
			ch = mid
		}
		if j := ch.stamp(t); j >= 0 {
			ch.tenants[j].at = at
		} else {
			ch.tenants = append(ch.tenants, sgStamp{t, at})
			s.chars[t] += len(ch.text)
		}
		text = text[k:]
		node = ch
	}
}

// evict trims every tenant holding more than max_tree_size characters by
// removing its least recently used leaves (nodes it holds where none of its
// children is held by it), as SGLang's evict_tenant_by_size does: a node
// left with no tenant leaves the tree, and a parent becoming the tenant's
// leaf joins the queue.
func (s *SGLang) evict() {
	for t, n := range s.chars {
		if n <= s.p.MaxTreeSize {
			continue
		}
		var q sgHeap
		for _, root := range s.roots {
			collectLeaves(root, t, &q)
		}
		heap.Init(&q)
		for s.chars[t] > s.p.MaxTreeSize && q.Len() > 0 {
			it := heap.Pop(&q).(sgItem)
			node := it.node
			j := node.stamp(t)
			node.tenants = append(node.tenants[:j], node.tenants[j+1:]...)
			s.chars[t] -= len(node.text)
			parent := node.parent
			if len(node.tenants) == 0 && len(node.children) == 0 {
				for k, x := range parent.children {
					if x == node {
						parent.children = append(parent.children[:k], parent.children[k+1:]...)
						break
					}
				}
				node.parent = nil
			}
			if parent.parent != nil { // not a partition root
				if k := parent.stamp(t); k >= 0 && !heldBelow(parent, t) {
					heap.Push(&q, sgItem{parent, parent.tenants[k].at})
				}
			}
		}
		if s.chars[t] == 0 {
			delete(s.chars, t)
		}
	}
	for part, root := range s.roots {
		if len(root.children) == 0 {
			delete(s.roots, part)
		}
	}
}

func heldBelow(n *sgNode, t int) bool {
	for _, ch := range n.children {
		if ch.stamp(t) >= 0 {
			return true
		}
	}
	return false
}

// collectLeaves adds t's leaves under n (n itself excluded) to q.
func collectLeaves(n *sgNode, t int, q *sgHeap) {
	for _, ch := range n.children {
		k := ch.stamp(t)
		if k < 0 {
			continue // nested sets: nothing of t below either
		}
		if heldBelow(ch, t) {
			collectLeaves(ch, t, q)
		} else {
			*q = append(*q, sgItem{ch, ch.tenants[k].at})
		}
	}
}

type sgItem struct {
	node *sgNode
	at   int64
}

// sgHeap is a min-heap of leaves by last access time.
type sgHeap []sgItem

func (h sgHeap) Len() int           { return len(h) }
func (h sgHeap) Less(i, j int) bool { return h[i].at < h[j].at }
func (h sgHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *sgHeap) Push(x any)        { *h = append(*h, x.(sgItem)) }
func (h *sgHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	*h = old[:len(old)-1]
	return it
}
