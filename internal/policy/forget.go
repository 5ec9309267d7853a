package policy

import (
	"slices"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// Forgetter is implemented by policies that keep state per replica slot
// (ReplicaView.Index): trees, windows, LRUs, corrections. The router calls
// Forget when it forgets a removed replica (drained, and removed longer
// than its forget_after), before the slot is given to the next replica
// added, so that the newcomer starts cold instead of inheriting another
// replica's cache, load or corrections. Forget drops everything the
// policy holds for the slot, whatever its size; it may run concurrently
// with Pick and Observe (on other slots), and is idempotent.
type Forgetter interface {
	Forget(slot int)
}

var (
	_ Forgetter = (*Dynamo)(nil)
	_ Forgetter = (*LLMD)(nil)
	_ Forgetter = (*LRUAffinity)(nil)
	_ Forgetter = (*Preble)(nil)
	_ Forgetter = (*Precise)(nil)
	_ Forgetter = (*SGLang)(nil)
	_ Forgetter = (*TTFT)(nil)
)

// Forget drops the slot's active-block multiset and the requests counted
// in it.
func (p *Dynamo) Forget(slot int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.blocks, slot)
	delete(p.total, slot)
	for id, a := range p.active {
		if a.slot == slot {
			delete(p.active, id)
		}
	}
}

// Forget drops the slot's LRU from the policy's own index (its capacity
// is fixed again at the next insert) and its place in the no-hit LRU.
func (l *LLMD) Forget(slot int) {
	_ = l.ix.Clear(slot) // a slot the index never grew to holds nothing
	_ = l.ix.SetCapacity(slot, 0)
	l.mu.Lock()
	defer l.mu.Unlock()
	if slot >= 0 && slot < len(l.numBlocks) {
		l.numBlocks[slot] = 0
	}
	if slot >= 0 && slot < len(l.sized) {
		l.sized[slot] = false
	}
	l.noHit = slices.DeleteFunc(l.noHit, func(s int) bool { return s == slot })
}

// Forget empties the slot's LRU of prefix keys.
func (p *LRUAffinity) Forget(slot int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.a != nil {
		p.a.reset(slot)
	}
}

// reset gives replica r an empty LRU (a new one: the old one's memory goes).
func (a *Affinity) reset(r int) {
	if r < 0 || r >= len(a.lrus) || a.capacity <= 0 {
		return
	}
	a.lrus[r], _ = simplelru.NewLRU[string, struct{}](a.capacity, nil)
}

// Forget drops the slot's window, its tracked requests and its LRU of
// blocks (each block's holder count goes down; a block no longer held nor
// in the window leaves the table).
func (p *Preble) Forget(slot int) {
	p.mu.Lock()
	for id, q := range p.inflight {
		if q.replica == slot {
			p.untrack(id, q)
		}
	}
	if r := p.replicas[slot]; r != nil {
		if l := &r.lru; l.m != nil {
			for e := l.root.next; e != &l.root; e = e.next {
				e.blk.held--
				p.forget(e.blk)
			}
		}
		delete(p.replicas, slot)
	}
	p.mu.Unlock()
	p.numMu.Lock()
	delete(p.numBlocks, slot)
	p.numMu.Unlock()
}

// Forget drops the slot's speculative blocks.
func (p *Precise) Forget(slot int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.spec, slot)
}

// Forget takes the slot out of the tree (as a tenant).
func (s *SGLang) Forget(slot int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tree.dropTenant(slot)
}

// dropTenant removes tenant t from every node, and the nodes left with no
// tenant and no child: SGLang's remove_tenant. Nested sets (a tenant
// holding a node holds its ancestors) make a node without tenants a node
// without tenants below, so a post-order walk frees whole subtrees.
func (tr *sgTree) dropTenant(t int) {
	for part, root := range tr.roots {
		dropTenantBelow(root, t)
		if len(root.children) == 0 {
			delete(tr.roots, part)
		}
	}
	delete(tr.chars, t)
}

func dropTenantBelow(n *sgNode, t int) {
	kept := n.children[:0]
	for _, ch := range n.children {
		if j := ch.stamp(t); j >= 0 {
			ch.tenants = slices.Delete(ch.tenants, j, j+1)
			dropTenantBelow(ch, t)
		}
		if len(ch.tenants) == 0 && len(ch.children) == 0 {
			ch.parent = nil
			continue
		}
		kept = append(kept, ch)
	}
	clear(n.children[len(kept):])
	n.children = kept
}

// Forget drops the slot's TTFT correction, its recent flow and its
// pending estimates.
func (t *TTFT) Forget(slot int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if sl := t.slot(slot); sl != nil {
		*sl = ttftSlot{}
	}
	for id, pe := range t.pending {
		if pe.replica == slot {
			delete(t.pending, id)
		}
	}
}
