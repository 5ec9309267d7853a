package policy

import (
	"math"
	"strings"
	"testing"
)

// The tier-aware peers credit a host-tier hit below a GPU hit and above a
// miss, as their code weighs it: Dynamo's host_cache_hit_weight (0.75)
// against its device credit (1), llm-d's precise scorer's cpu weight
// (0.8) against the gpu's (1).
func TestPeersWeighHostTier(t *testing.T) {
	req := ttftReq(1)
	n := len(req.Blocks)
	views := func() []ReplicaView {
		rs := peerViews(3)
		rs[0].Match = n                     // GPU
		rs[1].Match, rs[1].MatchHost = 0, n // host tier
		return rs                           // rs[2]: none
	}
	d := peerNew(t, "dynamo", map[string]any{"router_queue_threshold": nil}).(*Dynamo)
	rs := views()
	var cost [3]float64
	for i := range rs {
		cost[i] = d.prefillCost(req, &rs[i])
	}
	if !(cost[0] < cost[1] && cost[1] < cost[2]) {
		t.Fatalf("dynamo prefill costs %v: host not between GPU and none", cost)
	}
	if want := (float64(req.Tokens)/16 - 0.75*float64(n)); cost[1] != want {
		t.Fatalf("dynamo host credit: cost %v, want %v", cost[1], want)
	}
	p := peerNew(t, "precise", map[string]any{"speculative_indexing": false})
	_, dec := peerPick(t, p, req, views())
	s := dec.Scores
	if !(s[0] > s[1] && s[1] > s[2]) || s[0]-s[2] != 2 || s[1]-s[2] != 2*0.8 {
		t.Fatalf("precise scores %v: want the prefix scorer's 2 × (1, 0.8, 0)", s)
	}
	if _, dec := peerPick(t, p, req, views()[1:]); dec.Matched != n {
		t.Fatalf("precise counts %d blocks held, want the unweighted %d", dec.Matched, n)
	}
}

// llm-d's tiered-prefix-cache guide: a second producer for the CPU tier,
// its LRU sized by hand, keeps a prompt the GPU producer's LRU forgot, and
// its scorer still prefers the replica holding it.
func TestLLMDCPUProducer(t *testing.T) {
	a, b := strings.Repeat("abcd", 1600), strings.Repeat("wxyz", 1600)
	route := func(p Policy, text string, id uint64, replica int) {
		req := peerReq(id, text, peerT0)
		p.(Observer).Observe(Event{Kind: Routed, Req: req, Replica: peerBase + replica, Decision: Decision{Replica: peerBase + replica}})
	}
	for _, c := range []struct {
		name    string
		params  map[string]any
		offload int     // Options.OffloadBlocks
		lead    float64 // replica 0's score over replica 1's for a
	}{
		// Prefix 3 × 5/25 blocks.
		{"gpu producer only", map[string]any{"auto_tune": false, "lru_capacity_per_server": 30}, 0, 0.6},
		// GPU prefix 1 × 5/25 + CPU prefix 1 × 25/25.
		{"with the cpu producer", map[string]any{"auto_tune": false, "lru_capacity_per_server": 30,
			"prefix_weight": 1, "cpu_prefix_weight": 1, "cpu_lru_capacity_per_server": 1000}, 0, 1.2},
		// A known host tier makes the guide's configuration the default.
		{"tiered by the host tier", map[string]any{"auto_tune": false, "lru_capacity_per_server": 30}, 1000, 1.2},
		// Named parameters still override it: no CPU producer.
		{"tiered, cpu producer off", map[string]any{"auto_tune": false, "lru_capacity_per_server": 30,
			"cpu_prefix_weight": 0}, 1000, 0.2},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, err := New("llmd", Options{Seed: 7, Params: c.params, OffloadBlocks: c.offload})
			if err != nil {
				t.Fatal(err)
			}
			route(p, a, 1, 0)
			route(p, b, 2, 0) // 25 blocks of 64 tokens: the GPU's LRU of 30 keeps 5 of a's
			_, d := peerPick(t, p, peerReq(3, a, peerT0), peerViews(2))
			if lead := d.Scores[0] - d.Scores[1]; math.Abs(lead-c.lead) > 1e-9 {
				t.Fatalf("scores %v: lead %v, want %v", d.Scores, lead, c.lead)
			}
		})
	}
}

// llm-d's p2p-source-producer: among the holders within one block of the
// most, sampled by 1/(1+waiting); a pull only when the source holds more
// than the chosen replica.
func TestP2PSource(t *testing.T) {
	req := ttftReq(1)
	n := len(req.Blocks)
	rs := peerViews(4)
	rs[0].Match = n
	rs[1].Match, rs[1].MatchHost = 2, n-1 // within one block: a candidate too
	rs[2].Match = n / 2
	src := map[int]int{}
	for id := range uint64(400) {
		req.ID = id
		p := P2PSource(req, rs, rs[3].Index, 1, 16)
		if p == nil {
			t.Fatalf("no pull for request %d", id)
		}
		src[p.Replica]++
		if want := min(rs[p.Replica-peerBase].Local(), n); p.Blocks != want {
			t.Fatalf("pull %+v, want %d blocks", p, want)
		}
	}
	if src[rs[0].Index] < 150 || src[rs[1].Index] < 150 || len(src) != 2 {
		t.Fatalf("sources %v: want both holders near the most, evenly", src)
	}
	// A queue of 3 waiting weighs a holder 1/4 against 1.
	rs[1].HaveMetrics, rs[1].Waiting = true, 3
	clear(src)
	for id := range uint64(400) {
		req.ID = id
		src[P2PSource(req, rs, rs[3].Index, 1, 16).Replica]++
	}
	if src[rs[1].Index] > 130 || src[rs[1].Index] < 40 {
		t.Fatalf("sources %v: the queued holder should get about a fifth", src)
	}
	// The chosen replica holds as much: no pull; nobody holds any: no pull.
	if p := P2PSource(req, rs, rs[0].Index, 1, 16); p != nil && p.Replica == rs[0].Index {
		t.Fatalf("pull from the chosen replica: %+v", p)
	}
	if p := P2PSource(req, peerViews(3), peerBase, 1, 16); p != nil {
		t.Fatalf("pull with nothing held: %+v", p)
	}
}
