package policy

import (
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

// prebleReqT is a request of tokens prompt tokens and maxTokens output.
func prebleReqT(id uint64, tokens, maxTokens int, at time.Time) *Request {
	return &Request{ID: id, Now: at, Model: "m", Tokens: tokens, MaxTokens: maxTokens, Blocks: make([]uint64, tokens/16)}
}

// withoutEviction is params with eviction_cost off: the load cost alone
// (these requests' blocks are all hash 0, meaningless to the LRU).
func withoutEviction(params map[string]any) map[string]any {
	out := map[string]any{"eviction_cost": false}
	for k, v := range params {
		out[k] = v
	}
	return out
}

// TestPrebleLoadCost (eviction cost off): hand-computed load costs with the default profile
// (c1 = 0.04 ms/token, c3 = 3e-6 ms/context token), 16-token blocks, a
// 180 s window. A request of 1000 tokens, 100 output tokens, uncached:
//
//	prefill 1000 × 0.04 = 40 ms; decode 100 × (0.04 + 3e-6 × (1000 + 100/2)) = 4.315 ms.
func TestPrebleLoadCost(t *testing.T) {
	sec := func(s int) time.Time { return peerT0.Add(time.Duration(s) * time.Second) }
	type ev struct {
		kind      EventKind
		at        int
		id        uint64
		tokens    int
		maxTokens int
		matched   int  // Decision.Matched
		elsewhere bool // Decision.Replica is another replica (a retry)
		out       int  // Done: OutputTokens
	}
	cases := []struct {
		name   string
		params map[string]any
		events []ev
		at     int
		cost   float64 // replica 1's
	}{
		{"uncached prefill + decode", nil, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 0, 44.315},
		// 50 cached blocks = 800 tokens: 200 × 0.04 = 8.
		{"cached blocks are free", nil, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100, matched: 50}}, 0, 12.315},
		{"another replica's match is not credited", nil,
			[]ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100, matched: 50, elsewhere: true}}, 0, 44.315},
		// Default expected output 128: 128 × (0.04 + 3e-6 × 1064).
		{"no max_tokens: the default output", nil, []ev{{kind: Routed, id: 1, tokens: 1000}}, 0, 40 + 128*(0.04+3e-6*1064)},
		{"done: no decode work", nil,
			[]ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Done, at: 5, id: 1, out: 100}}, 5, 40},
		{"one of two done", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, id: 2, tokens: 1000, maxTokens: 100},
			{kind: Done, at: 5, id: 1, out: 100}}, 5, 80 + 4.315},
		{"179 s later: still in the window", nil, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 179, 44.315},
		{"180 s later: out of the window", nil, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 180, 4.315},
		{"window_secs 10", map[string]any{"window_secs": 10}, []ev{{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 10, 4.315},
		// Observed output 228 becomes the expectation: 228 × (0.04 + 3e-6 × 1114).
		{"mean observed output", nil, []ev{
			{kind: Routed, id: 1, tokens: 10, maxTokens: 5}, {kind: Done, at: 1, id: 1, out: 228},
			{kind: Routed, at: 2, id: 2, tokens: 1000}}, 2, 0.4 + 40 + 228*(0.04+3e-6*1114)},
		{"two requests add up", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, at: 100, id: 2, tokens: 1000, maxTokens: 100}}, 100, 2 * 44.315},
		{"the older leaves the window first", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, at: 100, id: 2, tokens: 1000, maxTokens: 100}}, 200, 44.315 + 4.315},
		// Not Done within a window: forgotten (its Done was lost).
		{"lost request forgotten", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, at: 181, id: 2, tokens: 1000, maxTokens: 100}}, 181, 44.315},
		{"max_tracked bounds decode tracking", map[string]any{"max_tracked": 1}, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, id: 2, tokens: 1000, maxTokens: 100}}, 0, 44.315 + 40},
		{"re-routed request counted once", nil, []ev{
			{kind: Routed, id: 1, tokens: 1000, maxTokens: 100}, {kind: Routed, id: 1, tokens: 1000, maxTokens: 100}}, 0, 40 + 44.315},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "preble", withoutEviction(c.params))
			rs := peerViews(2)
			for _, e := range c.events {
				req := prebleReqT(e.id, e.tokens, e.maxTokens, sec(e.at))
				d := Decision{Replica: rs[1].Index, Matched: e.matched}
				if e.elsewhere {
					d.Replica = rs[0].Index
				}
				peerObserve(p, Event{Kind: e.kind, At: sec(e.at), Req: req, Decision: d, Replica: rs[1].Index, OutputTokens: e.out})
			}
			_, d := peerPick(t, p, prebleReqT(99, 100, 10, sec(c.at)), rs)
			if math.Abs(d.Scores[1]-c.cost) > 1e-9 || d.Scores[0] != 0 {
				t.Fatalf("costs %v, want [0 %v]", d.Scores, c.cost)
			}
			if pp := p.(*Preble); len(pp.inflight) > pp.params.MaxTracked {
				t.Fatalf("%d tracked, max %d", len(pp.inflight), pp.params.MaxTracked)
			}
		})
	}
}

// TestPrebleE2 (eviction cost off): exploit when the longest cached prefix
// is longer than the new tokens, else explore; rebalance when the exploit choice's load cost is
// over 1.5 × the least loaded's. Load costs set up by routed requests:
// 1000 tokens → 44.315, 700 → 32.225, 600 → 28.195 (100 output tokens).
func TestPrebleE2(t *testing.T) {
	cases := []struct {
		name   string
		params map[string]any
		loads  []int // tokens routed to each replica first (0: none)
		match  []int
		tokens int
		want   int
		reason string
	}{
		// 10 blocks = 160 tokens > 300 − 160.
		{"exploit the holder though busier", nil, []int{1000, 700}, []int{10, 0}, 300, 0, "exploit"},
		// 44.315 > 1.5 × 28.195 = 42.29.
		{"rebalance off an overloaded holder", nil, []int{1000, 600}, []int{10, 0}, 300, 1, "rebalance"},
		{"rebalance_ratio 2 keeps it", map[string]any{"rebalance_ratio": 2}, []int{1000, 600}, []int{10, 0}, 300, 0, "exploit"},
		// 160 is not > 320 − 160: explore.
		{"explore: cached equals new", nil, []int{0, 700}, []int{10, 0}, 320, 0, "explore"},
		{"explore: the least load cost", nil, []int{1000, 700}, []int{10, 0}, 320, 1, "explore"},
		// 32.225 < 1.5 × 28.195.
		{"exploit: least cost among the holders", nil, []int{1000, 600, 700}, []int{10, 5, 10}, 300, 2, "exploit"},
		{"the same, rebalanced to the idle replica", nil, []int{1000, 0, 700}, []int{10, 5, 10}, 300, 1, "rebalance"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "preble", withoutEviction(c.params))
			rs := peerViews(len(c.loads))
			for i, tok := range c.loads {
				if tok > 0 {
					peerObserve(p, Event{Kind: Routed, At: peerT0, Req: prebleReqT(uint64(i+1), tok, 100, peerT0),
						Decision: Decision{Replica: rs[i].Index}, Replica: rs[i].Index})
				}
				rs[i].Match = c.match[i]
			}
			got, d := peerPick(t, p, prebleReqT(99, c.tokens, 10, peerT0), rs)
			if got != c.want || len(d.Reason) < len(c.reason) || d.Reason[:len(c.reason)] != c.reason {
				t.Fatalf("picked %d (%s, costs %v), want %d (%s)", got, d.Reason, d.Scores, c.want, c.reason)
			}
			if d.Matched != c.match[got] || d.Load != d.Scores[got] {
				t.Fatalf("decision %+v", d)
			}
		})
	}
}

// prebleReqB is a request with the given block hashes (16 tokens each).
func prebleReqB(id uint64, blocks []uint64, maxTokens int, at time.Time) *Request {
	return &Request{ID: id, Now: at, Model: "m", Tokens: 16 * len(blocks), MaxTokens: maxTokens, Blocks: blocks}
}

func hashes(from uint64, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = from + uint64(i)
	}
	return out
}

// TestPrebleEvictionCost pins the eviction cost Preble's server enables
// (WukLab/preble multi_node/global_scheduler_with_time.py,
// virtual_evict_for_routing and get_eviction_prefill_cost, with
// GlobalSchedulerWithTime(enable_eviction=True)): on each candidate, evict
// virtually, least recently used first, as many blocks as the request adds
// there, and charge each evicted block its uses in the 3-minute window ×
// its miss rate × its prefill time.
//
// Two replicas, 16-token blocks, the default profile (c1 0.04 ms/token, c2
// 1e-7, c3 3e-6). At t=0 replica 1 took a cold prompt C (4 blocks), done at
// once; at t=200 replica 0 took a hot prefix H (4 blocks) three times (the
// first uncached, then twice matched: per block 3 uses, miss rate 1/3, so
// 3 × 1/3 = 1 per block); replica 1 took X (1 block, 100 output tokens),
// still in flight. At t=200:
//
//	load cost: replica 0 = 64 × 0.04 = 2.56 (H's first prefill);
//	           replica 1 = 16 × 0.04 + 100 × (0.04 + 3e-6 × 66) = 4.6598
//	evicting H's block k (0-based) costs 1 × (16 × 0.04 + 1e-7 × 16 × 16(k+1)),
//	tail first: 0.6401024, 0.6400768, 0.6400512, 0.6400256 (Σ 2.560256);
//	evicting on replica 1 costs nothing: C's uses left the window, X is in use.
//
// A new request of four blocks thus costs 5.120256 on replica 0 and goes to
// replica 1; of three blocks, 4.4802304 on replica 0, which keeps it.
func TestPrebleEvictionCost(t *testing.T) {
	sec := func(s int) time.Time { return peerT0.Add(time.Duration(s) * time.Second) }
	H, C, X := hashes(100, 4), hashes(200, 4), hashes(300, 1)
	const loadX = 0.64 + 100*(0.04+3e-6*66)
	cases := []struct {
		name    string
		params  map[string]any
		hFlight bool // H's requests still in flight
		req     *Request
		match   [2]int
		want    int
		reason  string
		costs   [2]float64
	}{
		{"four new blocks: evicting the hot prefix moves the request", nil, false,
			prebleReqB(9, hashes(900, 4), 10, sec(200)), [2]int{}, 1, "explore", [2]float64{2.56 + 2.560256, loadX}},
		{"eviction_cost false: the load cost alone", map[string]any{"eviction_cost": false}, false,
			prebleReqB(9, hashes(900, 4), 10, sec(200)), [2]int{}, 0, "explore", [2]float64{2.56, loadX}},
		{"three new blocks: H's tail only, replica 0 keeps it", nil, false,
			prebleReqB(9, hashes(900, 3), 10, sec(200)), [2]int{}, 0, "explore", [2]float64{2.56 + 0.6401024 + 0.6400768 + 0.6400512, loadX}},
		{"one new block: the deepest block of H goes first", nil, false,
			prebleReqB(9, hashes(900, 1), 10, sec(200)), [2]int{}, 0, "explore", [2]float64{2.56 + 0.6401024, loadX}},
		// H + one block, H matched on replica 0: 64 > 16, exploit; of the
		// one block to evict there, H (its own prefix) is not a candidate.
		{"the request's own prefix is not evicted", nil, false,
			prebleReqB(9, append(slices.Clone(H), 905), 10, sec(200)), [2]int{4, 0}, 0, "exploit", [2]float64{2.56, loadX}},
		// In flight: 3 × 100 × (0.04 + 3e-6 × (64 + 50)) of decode on replica 0.
		{"blocks in use are not evicted", nil, true,
			prebleReqB(9, hashes(900, 4), 10, sec(200)), [2]int{}, 1, "explore", [2]float64{2.56 + 3*100*(0.04+3e-6*114), loadX}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "preble", c.params)
			rs := peerViews(2)
			route := func(req *Request, pos, matched int) {
				peerObserve(p, Event{Kind: Routed, At: req.Now, Req: req, Decision: Decision{Replica: rs[pos].Index, Matched: matched}, Replica: rs[pos].Index})
			}
			done := func(req *Request, pos int, at time.Time) {
				peerObserve(p, Event{Kind: Done, At: at, Req: req, Replica: rs[pos].Index, OutputTokens: 100})
			}
			cr := prebleReqB(1, C, 100, sec(0))
			route(cr, 1, 0)
			done(cr, 1, sec(1))
			for k := range 3 {
				hr := prebleReqB(uint64(2+k), H, 100, sec(200))
				route(hr, 0, min(k, 1)*4)
				if !c.hFlight {
					done(hr, 0, sec(200))
				}
			}
			route(prebleReqB(5, X, 100, sec(200)), 1, 0)
			rs[0].Match, rs[1].Match = c.match[0], c.match[1]
			got, d := peerPick(t, p, c.req, rs)
			if got != c.want || !strings.HasPrefix(d.Reason, c.reason) {
				t.Errorf("picked %d (%s), want %d (%s)", got, d.Reason, c.want, c.reason)
			}
			for i := range 2 {
				if math.Abs(d.Scores[i]-c.costs[i]) > 1e-9 {
					t.Errorf("costs %v, want %v", d.Scores, c.costs)
					break
				}
			}
		})
	}
}

// TestPrebleEvictionWindow: a block's uses leave the window 180 s after
// they were routed, with the next event, as Preble's histogram drops its
// old entries on each update; max_window_blocks drops the oldest earlier.
func TestPrebleEvictionWindow(t *testing.T) {
	sec := func(s int) time.Time { return peerT0.Add(time.Duration(s) * time.Second) }
	cases := []struct {
		name   string
		params map[string]any
		at     int // the tick and the pick
		cost   float64
	}{
		// 179 s: H's use (miss rate 1) and its prefill still count.
		{"in the window", nil, 179, 2.56 + 2.560256},
		{"out of the window", nil, 180, 0},
		// The tick routes one block to replica 1: four blocks of H plus one
		// is over 4, so H's use is dropped (its prefill still counts).
		{"max_window_blocks", map[string]any{"max_window_blocks": 4}, 100, 2.56},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "preble", c.params)
			rs := peerViews(2)
			h := prebleReqB(1, hashes(100, 4), 100, sec(0))
			peerObserve(p, Event{Kind: Routed, At: sec(0), Req: h, Decision: Decision{Replica: rs[0].Index}, Replica: rs[0].Index})
			peerObserve(p, Event{Kind: Done, At: sec(0), Req: h, Replica: rs[0].Index, OutputTokens: 100})
			tick := prebleReqB(2, hashes(500, 1), 100, sec(c.at))
			peerObserve(p, Event{Kind: Routed, At: sec(c.at), Req: tick, Decision: Decision{Replica: rs[1].Index}, Replica: rs[1].Index})
			peerObserve(p, Event{Kind: Done, At: sec(c.at), Req: tick, Replica: rs[1].Index, OutputTokens: 100})
			_, d := peerPick(t, p, prebleReqB(9, hashes(900, 4), 10, sec(c.at)), rs)
			if math.Abs(d.Scores[0]-c.cost) > 1e-9 {
				t.Fatalf("replica 0 cost %v, want %v", d.Scores[0], c.cost)
			}
		})
	}
}

// TestPrebleLRUCapacity: the policy's view of a replica's cache holds
// capacity_blocks, else the replica's NumBlocks as Pick last saw it, else
// Preble's max_tokens_gpu (198,516 tokens: 12,408 blocks of 16); the least
// recently used blocks go first, a prompt's tail before its head, blocks
// in use stay.
func TestPrebleLRUCapacity(t *testing.T) {
	held := func(p *Preble, idx int) []uint64 {
		var out []uint64
		r := p.replicas[idx]
		for e := r.lru.root.next; e != &r.lru.root; e = e.next {
			out = append(out, e.blk.h)
		}
		return out // most recent first
	}
	rs := peerViews(2)
	route := func(p *Preble, id uint64, blocks []uint64) {
		req := prebleReqB(id, blocks, 10, peerT0)
		peerObserve(p, Event{Kind: Routed, At: peerT0, Req: req, Decision: Decision{Replica: rs[0].Index}, Replica: rs[0].Index})
	}
	finish := func(p *Preble, id uint64, blocks []uint64) {
		peerObserve(p, Event{Kind: Done, At: peerT0, Req: prebleReqB(id, blocks, 10, peerT0), Replica: rs[0].Index, OutputTokens: 10})
	}

	p := peerNew(t, "preble", map[string]any{"capacity_blocks": 5}).(*Preble)
	route(p, 1, hashes(10, 3))
	finish(p, 1, hashes(10, 3))
	route(p, 2, hashes(20, 3)) // in flight
	if got, want := held(p, rs[0].Index), []uint64{20, 21, 22, 10, 11}; !slices.Equal(got, want) {
		t.Fatalf("held %v, want %v (12, the oldest tail, evicted)", got, want)
	}
	// 30–33 are in use as they are routed, as 20–22 are: only 10 and 11 go.
	route(p, 3, hashes(30, 4))
	finish(p, 3, hashes(30, 4))
	if got, want := held(p, rs[0].Index), []uint64{30, 31, 32, 33, 20, 21, 22}; !slices.Equal(got, want) {
		t.Fatalf("held %v, want %v (blocks in use kept)", got, want)
	}
	route(p, 4, hashes(40, 1))
	if got, want := held(p, rs[0].Index), []uint64{40, 30, 20, 21, 22}; !slices.Equal(got, want) {
		t.Fatalf("held %v, want %v (33, 32, 31 evicted; in-flight 20–22 kept)", got, want)
	}

	q := peerNew(t, "preble", nil).(*Preble)
	if got := q.capacity(rs[0].Index); got != 12408 {
		t.Fatalf("capacity %d, want 12408 (Preble's max_tokens_gpu)", got)
	}
	views := peerViews(2)
	views[0].NumBlocks = 2
	peerPick(t, q, prebleReqB(9, hashes(900, 1), 10, peerT0), views)
	route(q, 1, hashes(10, 3))
	finish(q, 1, hashes(10, 3))
	route(q, 2, hashes(50, 1))
	if got, want := held(q, rs[0].Index), []uint64{50, 10}; !slices.Equal(got, want) {
		t.Fatalf("held %v, want %v (NumBlocks 2)", got, want)
	}
}

// TestPrebleEvictionStateConsistent: after a seeded random run (shared
// prefixes, retries, lost completions, time passing the window, a small
// max_window_blocks), the block table holds exactly the blocks that the
// window's uses or some replica's LRU hold, with their counts, and every
// LRU is within its capacity but for blocks in use.
func TestPrebleEvictionStateConsistent(t *testing.T) {
	p := peerNew(t, "preble", map[string]any{"capacity_blocks": 40, "max_window_blocks": 300}).(*Preble)
	rs := peerViews(3)
	r := rand.New(rand.NewPCG(3, 4))
	var live []*Request
	for k := range 600 {
		at := peerT0.Add(time.Duration(k) * 700 * time.Millisecond)
		n := 1 + r.IntN(12)
		blocks := make([]uint64, n)
		fam := uint64(r.IntN(5))
		for i := range blocks {
			if i < 4 {
				blocks[i] = 1000*fam + uint64(i) + 1 // a shared head per family
			} else {
				blocks[i] = uint64(k)<<20 | uint64(i)
			}
		}
		req := prebleReqB(uint64(k%150), blocks, 10, at) // ids repeat: retries
		pos := r.IntN(3)
		peerObserve(p, Event{Kind: Routed, At: at, Req: req, Decision: Decision{Replica: rs[pos].Index, Matched: r.IntN(n + 1)}, Replica: rs[pos].Index})
		live = append(live, req)
		if r.IntN(3) > 0 && len(live) > 0 { // some completions are lost
			j := r.IntN(len(live))
			peerObserve(p, Event{Kind: Done, At: at, Req: live[j], Replica: rs[pos].Index, OutputTokens: 5})
			live = append(live[:j], live[j+1:]...)
		}
	}
	uses := map[*prebleBlock]int{}
	total := 0
	for _, u := range p.uses[p.usesHead:] {
		for _, b := range u.blks {
			uses[b]++
		}
		total += len(u.blks)
	}
	if total != p.windowBlocks || total > p.params.MaxWindowBlocks {
		t.Fatalf("window blocks %d, counted %d, max %d", p.windowBlocks, total, p.params.MaxWindowBlocks)
	}
	held := map[*prebleBlock]int{}
	refs := map[*prebleEntry]int{}
	for _, q := range p.inflight {
		for _, e := range q.held {
			refs[e]++
		}
	}
	for idx, rep := range p.replicas {
		n, over := 0, 0
		for e := rep.lru.root.next; e != &rep.lru.root; e = e.next {
			n++
			held[e.blk]++
			if got := rep.lru.m.Get(e.blk.h); got == nil || *got != e {
				t.Fatalf("replica %d: entry %x not in its table", idx, e.blk.h)
			}
			if int(e.ref) != refs[e] {
				t.Fatalf("replica %d: block %x ref %d, %d tracked requests hold it", idx, e.blk.h, e.ref, refs[e])
			}
			if e.ref > 0 {
				over++
			}
		}
		if n != rep.lru.n || n != rep.lru.m.Len() || n > 40+over {
			t.Fatalf("replica %d: %d listed, n %d, table %d, %d in use, capacity 40", idx, n, rep.lru.n, rep.lru.m.Len(), over)
		}
	}
	inTable := 0
	for h, b := range p.blocks.All() {
		inTable++
		if b.h != h || int(b.n) != uses[b] || int(b.held) != held[b] || (b.n == 0 && b.held == 0) {
			t.Fatalf("block %x: n %d held %d, want %d and %d (and not both 0)", h, b.n, b.held, uses[b], held[b])
		}
	}
	for b := range uses {
		if got := p.blocks.Get(b.h); got == nil || *got != b {
			t.Fatalf("block %x of a use is not the table's", b.h)
		}
	}
	for b := range held {
		if got := p.blocks.Get(b.h); got == nil || *got != b {
			t.Fatalf("block %x of an LRU is not the table's", b.h)
		}
	}
	if inTable == 0 {
		t.Fatal("empty table: the run exercised nothing")
	}
}
