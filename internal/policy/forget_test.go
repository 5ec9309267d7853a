package policy

import (
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"
)

// slotState is what a policy keeps for a slot (0: nothing), read from its
// inside: every map, tree, LRU and list indexed by slot.
var slotState = map[string]func(p Policy, s int) int{
	"dynamo": func(p Policy, s int) int {
		d := p.(*Dynamo)
		d.mu.RLock()
		defer d.mu.RUnlock()
		n := len(d.blocks[s]) + d.total[s]
		for _, a := range d.active {
			n += b2i(a.slot == s)
		}
		return n
	},
	"llmd": func(p Policy, s int) int {
		l := p.(*LLMD)
		l.mu.Lock()
		defer l.mu.Unlock()
		n := l.ix.ReplicaLen(s) + b2i(slices.Contains(l.noHit, s))
		if s < len(l.sized) {
			n += b2i(l.sized[s])
		}
		if s < len(l.numBlocks) {
			n += l.numBlocks[s]
		}
		return n
	},
	"lru_affinity": func(p Policy, s int) int {
		a := p.(*LRUAffinity)
		a.mu.Lock()
		defer a.mu.Unlock()
		if a.a == nil || s >= len(a.a.lrus) || a.a.lrus[s] == nil {
			return 0
		}
		return a.a.lrus[s].Len()
	},
	"preble": func(p Policy, s int) int {
		q := p.(*Preble)
		q.mu.RLock()
		n := b2i(q.replicas[s] != nil)
		for _, r := range q.inflight {
			n += b2i(r.replica == s)
		}
		q.mu.RUnlock()
		q.numMu.Lock()
		defer q.numMu.Unlock()
		return n + q.numBlocks[s]
	},
	"precise": func(p Policy, s int) int {
		q := p.(*Precise)
		q.mu.RLock()
		defer q.mu.RUnlock()
		return len(q.spec[s])
	},
	"sglang": func(p Policy, s int) int {
		g := p.(*SGLang)
		g.mu.RLock()
		defer g.mu.RUnlock()
		n := g.tree.chars[s]
		for _, root := range g.tree.roots {
			n += stamped(root, s)
		}
		return n
	},
	"ttft": func(p Policy, s int) int {
		t := p.(*TTFT)
		t.mu.Lock()
		defer t.mu.Unlock()
		n := 0
		if sl := t.slot(s); sl != nil {
			n = b2i(sl.learnt) + b2i(sl.flowing)
		}
		for _, pe := range t.pending {
			n += b2i(pe.replica == s)
		}
		return n
	},
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// stamped counts the nodes under n that tenant t holds.
func stamped(n *sgNode, t int) int {
	c := 0
	for _, ch := range n.children {
		c += b2i(ch.stamp(t) >= 0) + stamped(ch, t)
	}
	return c
}

// Every policy keeping state per slot forgets all of it for the slot
// forgotten, and nothing of the others': the replica the router gives the
// slot next starts cold (finding 11).
func TestForgetDropsTheSlotsStateOnly(t *testing.T) {
	for name, state := range slotState {
		t.Run(name, func(t *testing.T) {
			p := peerNew(t, name, nil)
			if _, ok := p.(Forgetter); !ok {
				t.Fatal("not a Forgetter")
			}
			rs := peerViews(3)
			for i := range rs {
				rs[i].NumBlocks = 1000
			}
			at := peerT0
			for k := range 30 {
				req := peerReq(uint64(k+1), strings.Repeat(string(rune('a'+k%5)), 40)+" request "+strings.Repeat("x", 200+k), at)
				_, d := peerPick(t, p, req, rs)
				slot := rs[k%3].Index
				d.Replica, d.EstTTFT = slot, 100*time.Millisecond
				peerObserve(p, Event{Kind: Routed, At: at, Req: req, Decision: d, Replica: slot})
				took := 100 * time.Millisecond * time.Duration(1+2*b2i(k%3 == 1)) // the middle replica is 3× slower
				peerObserve(p, Event{Kind: FirstToken, At: at, Req: req, Decision: d, Replica: slot, TTFT: took})
				if k%2 == 0 { // half stay in flight
					peerObserve(p, Event{Kind: Done, At: at, Req: req, Decision: d, Replica: slot, CachedTokens: -1, OutputTokens: 8})
				}
				at = at.Add(100 * time.Millisecond)
			}
			gone, kept := rs[1].Index, rs[0].Index
			before := state(p, kept)
			if state(p, gone) == 0 || before == 0 {
				t.Fatalf("no state to forget: slot %d has %d, slot %d has %d", gone, state(p, gone), kept, before)
			}
			p.(Forgetter).Forget(gone)
			p.(Forgetter).Forget(gone) // idempotent
			if n := state(p, gone); n != 0 {
				t.Fatalf("slot %d keeps %d after Forget", gone, n)
			}
			if n := state(p, kept); n != before {
				t.Fatalf("slot %d went from %d to %d when another was forgotten", kept, before, n)
			}
			// The policy goes on: the forgotten requests' Done and new picks.
			for k := 1; k < 30; k += 6 {
				req := peerReq(uint64(k+1), "x", at)
				peerObserve(p, Event{Kind: Done, At: at, Req: req, Replica: gone, CachedTokens: -1})
			}
			peerRoute(t, p, peerReq(100, "after the forget", at), rs)
		})
	}
}

// Preble's block table stays consistent: a block's holder count is the
// number of replica LRUs holding it, and a block neither held nor in the
// window has left the table.
func TestPrebleForgetKeepsBlockCounts(t *testing.T) {
	p := peerNew(t, "preble", map[string]any{"eviction_cost": true}).(*Preble)
	rs := peerViews(3)
	at := peerT0
	for k := range 40 {
		req := peerReq(uint64(k+1), strings.Repeat("shared head ", 10)+strings.Repeat(string(rune('a'+k%7)), 100), at)
		_, d := peerPick(t, p, req, rs)
		slot := rs[k%3].Index
		d.Replica = slot
		p.Observe(Event{Kind: Routed, At: at, Req: req, Decision: d, Replica: slot})
	}
	p.Forget(rs[1].Index)
	p.mu.Lock()
	defer p.mu.Unlock()
	held := map[*prebleBlock]int32{}
	for _, r := range p.replicas {
		if r.lru.m == nil {
			continue
		}
		for e := r.lru.root.next; e != &r.lru.root; e = e.next {
			held[e.blk]++
		}
	}
	n := 0
	for _, b := range p.blocks.All() {
		n++
		if b.held != held[b] || (b.held == 0 && b.n == 0) {
			t.Fatalf("block %x: held %d, in %d LRUs, %d uses", b.h, b.held, held[b], b.n)
		}
	}
	if n == 0 {
		t.Fatal("no blocks left: the other replicas' were dropped too")
	}
}

// Dropping a tenant from SGLang's tree leaves the tree a tree built
// without it would be: every other tenant's match for any text, and its
// character count (edges split by the dropped tenant's texts stay split,
// which changes neither).
func TestSGTreeDropTenantIsAsIfNeverInserted(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		text := rapid.StringOfN(rapid.RuneFrom([]rune("abcé")), 1, 12, -1)
		type ins struct {
			tenant int
			text   string
		}
		inserts := rapid.SliceOfN(rapid.Custom(func(t *rapid.T) ins {
			return ins{rapid.IntRange(0, 3).Draw(t, "tenant"), text.Draw(t, "text")}
		}), 1, 30).Draw(t, "inserts")
		drop := rapid.IntRange(0, 3).Draw(t, "drop")
		part := sgPartition{model: "m"}
		all, without := newSGTree(), newSGTree()
		for i, in := range inserts {
			all.insert(part, in.text, in.tenant, int64(i))
			if in.tenant != drop {
				without.insert(part, in.text, in.tenant, int64(i))
			}
		}
		all.dropTenant(drop)
		if _, ok := all.chars[drop]; ok {
			t.Fatalf("tenant %d still counted", drop)
		}
		for u := range 4 {
			if all.chars[u] != without.chars[u] {
				t.Fatalf("tenant %d holds %d chars, %d in a tree without %d", u, all.chars[u], without.chars[u], drop)
			}
		}
		for range 10 {
			probe := text.Draw(t, "probe")
			if got, want := deepest(&all, part, probe), deepest(&without, part, probe); !maps.Equal(got, want) {
				t.Fatalf("match %q: %v, %v in a tree without %d", probe, got, want, drop)
			}
		}
	})
}

func deepest(tr *sgTree, part sgPartition, text string) map[int]int {
	out := map[int]int{}
	tr.match(part, text, func(tenant, depth int) { out[tenant] = max(out[tenant], depth) })
	return out
}
