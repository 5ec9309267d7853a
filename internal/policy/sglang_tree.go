package policy

import (
	"container/heap"
	"encoding/binary"
	"math/bits"
	"strings"
	"unicode/utf8"
)

// sgTree is the SGLang router's approximate radix tree, shared by all
// tenants (replica slots): a compressed trie over the characters of the
// routed texts, one per cache partition, in which each node records per
// tenant holding it the last time a text inserted for that tenant passed
// through it. A text is inserted along its whole path, so a tenant holding
// a node holds all its ancestors, and eviction (least recently used leaves
// first) keeps that true. It is not safe for concurrent use: SGLang locks.
type sgTree struct {
	roots map[sgPartition]*sgNode
	// chars: tenant → characters of the tree it holds (runes, as SGLang's
	// chars().count(); edges split inside a character still add up, since
	// each character has one leading byte).
	chars map[int]int
}

func newSGTree() sgTree {
	return sgTree{roots: map[sgPartition]*sgNode{}, chars: map[int]int{}}
}

// sgPartition is a cache partition: a prefix cached under another model,
// adapter or salt is no hit.
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

// child is the child of n whose edge starts with the first character of
// text (nil: none). Edges are told apart by their first character, as
// SGLang keys children by char, so that an edge never splits inside a
// character and the tenants' character counts add up.
func (n *sgNode) child(text string) *sgNode {
	c := firstCharLen(text)
	for _, ch := range n.children {
		if ch.text[0] == text[0] && (c == 1 || strings.HasPrefix(ch.text, text[:c])) {
			return ch
		}
	}
	return nil
}

// firstCharLen is the length in bytes of text's first character (1 for
// ASCII and for a byte that starts no valid character).
func firstCharLen(text string) int {
	if text[0] < utf8.RuneSelf {
		return 1
	}
	_, n := utf8.DecodeRuneInString(text)
	return n
}

// stamp is the index of tenant t in n.tenants (-1: t does not hold n).
func (n *sgNode) stamp(t int) int {
	for k := range n.tenants {
		if n.tenants[k].tenant == t {
			return k
		}
	}
	return -1
}

// match walks text down part's tree and calls visit(tenant, depth) for
// each tenant of each node on the way, depth being the bytes of text matched
// down to that node (a partial edge counts its matched part, as SGLang's
// prefix_match does). Nodes come root first, so the last call for a tenant
// gives the deepest node it holds.
func (tr *sgTree) match(part sgPartition, text string, visit func(tenant, depth int)) {
	node := tr.roots[part]
	if node == nil {
		return
	}
	depth := 0
	for depth < len(text) {
		ch := node.child(text[depth:])
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
		for _, st := range ch.tenants {
			visit(st.tenant, depth)
		}
		if !full {
			return
		}
		node = ch
	}
}

// insert records text in part's tree for tenant t at time at: t's stamp
// on every node along the path (splitting the edge where the path leaves
// the tree) and a new leaf for the rest.
func (tr *sgTree) insert(part sgPartition, text string, t int, at int64) {
	node := tr.roots[part]
	if node == nil {
		node = &sgNode{}
		tr.roots[part] = node
	}
	for len(text) > 0 {
		ch := node.child(text)
		if ch == nil {
			// A new leaf: its own copy of the text, so that the tree never
			// pins a request's (possibly much longer) prompt in memory.
			leaf := &sgNode{text: strings.Clone(text), parent: node, tenants: []sgStamp{{t, at}}}
			node.children = append(node.children, leaf)
			tr.chars[t] += countRunes(text)
			return
		}
		k := commonPrefix(ch.text, text)
		// Split at a character boundary (the first character matched).
		for first := firstCharLen(text); k > first && k < len(ch.text) && !utf8.RuneStart(ch.text[k]); {
			k--
		}
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
			tr.chars[t] += countRunes(ch.text)
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
func (tr *sgTree) evict(maxChars int) {
	for t, n := range tr.chars {
		if n <= maxChars {
			continue
		}
		var q sgHeap
		for _, root := range tr.roots {
			collectLeaves(root, t, &q)
		}
		heap.Init(&q)
		for tr.chars[t] > maxChars && q.Len() > 0 {
			it := heap.Pop(&q).(sgItem)
			node := it.node
			j := node.stamp(t)
			node.tenants = append(node.tenants[:j], node.tenants[j+1:]...)
			tr.chars[t] -= countRunes(node.text)
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
		if tr.chars[t] == 0 {
			delete(tr.chars, t)
		}
	}
	for part, root := range tr.roots {
		if len(root.children) == 0 {
			delete(tr.roots, part)
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
