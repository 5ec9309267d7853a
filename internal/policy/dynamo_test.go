package policy

import (
	"errors"
	"math"
	"testing"
)

// dynReq is a request of tokens prompt tokens whose full blocks hash to blocks.
func dynReq(id uint64, tokens int, blocks ...uint64) *Request {
	return &Request{ID: id, Now: peerT0, Model: "m", Tokens: tokens, Blocks: blocks}
}

// dynSeq is the hashes a..b.
func dynSeq(a, b uint64) []uint64 {
	var s []uint64
	for h := a; h <= b; h++ {
		s = append(s, h)
	}
	return s
}

func dynEvent(p Policy, kind EventKind, req *Request, slot int) {
	peerObserve(p, Event{Kind: kind, At: peerT0, Req: req, Decision: Decision{Replica: slot}, Replica: slot, OutputTokens: 500})
}

// TestDynamoDefaults pins the defaults of `python -m dynamo.frontend
// --router-mode kv` (ai-dynamo/dynamo components/src/dynamo/common/
// configuration/groups/kv_router_args.py): overlap credit 1, prefill load
// scale 1, temperature 0, router queue threshold 16, KV events on,
// conditional prefill off (its cap 5000 tokens), host tier credit 0.75
// (lib/kv-router's default_host_cache_hit_weight); and the
// deprecated overlap_score_weight's mapping (nonzero → prefill_load_scale,
// 0 → both 0).
func TestDynamoDefaults(t *testing.T) {
	p := peerNew(t, "dynamo", nil).(*Dynamo)
	want := dynamoParams{OverlapScoreCredit: 1, HostCacheHitWeight: 0.75, PrefillLoadScale: 1,
		QueueThreshold: nullableFloat{V: 16, Set: true}, ConditionalPrefillMaxNewTokens: 5000}
	if p.params != want || p.maxBatch != 8192 || p.blockSize != 16 || !WantsKVEvents(p) {
		t.Fatalf("params %+v, max batch %v, block %v, KV events %v", p.params, p.maxBatch, p.blockSize, WantsKVEvents(p))
	}
	for _, c := range []struct {
		weight, credit, scale float64
	}{{3, 1, 3}, {0.5, 1, 0.5}, {0, 0, 0}} {
		p := peerNew(t, "dynamo", map[string]any{"overlap_score_weight": c.weight, "prefill_load_scale": 7}).(*Dynamo)
		if p.params.OverlapScoreCredit != c.credit || p.params.PrefillLoadScale != c.scale {
			t.Errorf("overlap_score_weight %v: credit %v scale %v, want %v %v",
				c.weight, p.params.OverlapScoreCredit, p.params.PrefillLoadScale, c.credit, c.scale)
		}
	}
	for _, bad := range []map[string]any{
		{"router_queue_threshold": -1}, {"router_queue_threshold": "soon"}, {"prefill_load_scale": -1},
		{"overlap_score_credit": -0.5}, {"overlap_score_weight": -1},
	} {
		if _, err := New("dynamo", Options{Params: bad}); !errors.Is(err, ErrParam) {
			t.Errorf("params %v: err = %v, want ErrParam", bad, err)
		}
	}
}

// TestDynamoCost pins Dynamo's cost (lib/kv-router/src/scheduling/selector/
// default.rs worker_logit; ActiveSequences new_blocks/potential_blocks),
// hand-computed, blocks of 16 tokens, a 160-token request of blocks 1–10:
//
//	A: prefill (320+160)/16 = 30, credit 5;  active X = 1–5,101–120 and Y = 1–5,201–205:
//	   30 distinct blocks (1–5 counted once) + 6–10 new = 35
//	B: prefill 10, credit 10;  active Z = 1–10 and W = 301–340: 50 distinct, none new = 50
//	C: prefill (160+160)/16 = 20, credit 0;  nothing active: 10 new
//	   (its 100,000 in-flight tokens and the output tokens do not count)
//	D: down.
func TestDynamoCost(t *testing.T) {
	X, Y := dynReq(101, 400, append(dynSeq(1, 5), dynSeq(101, 120)...)...), dynReq(102, 160, append(dynSeq(1, 5), dynSeq(201, 205)...)...)
	Z, W := dynReq(103, 160, dynSeq(1, 10)...), dynReq(104, 640, dynSeq(301, 340)...)
	cases := []struct {
		name   string
		params map[string]any
		after  func(p Policy, rs []ReplicaView) // events after the setup
		costs  []float64
		want   int
	}{
		// A 25 + 35, B 0 + 50, C 20 + 10.
		{"defaults", nil, nil, []float64{60, 50, 30}, 2},
		// Credit 2: A 30−10, B clamped at 0.
		{"overlap_score_credit 2", map[string]any{"overlap_score_credit": 2}, nil, []float64{55, 50, 30}, 2},
		{"overlap_score_credit 0", map[string]any{"overlap_score_credit": 0}, nil, []float64{65, 60, 30}, 2},
		// Scale 3: A 75 + 35, B 0 + 50, C 60 + 10.
		{"prefill_load_scale 3", map[string]any{"prefill_load_scale": 3}, nil, []float64{110, 50, 70}, 1},
		{"overlap_score_weight 3 (deprecated)", map[string]any{"overlap_score_weight": 3}, nil, []float64{110, 50, 70}, 1},
		{"overlap_score_weight 0 (deprecated)", map[string]any{"overlap_score_weight": 0}, nil, []float64{35, 50, 10}, 2},
		// W done: B holds Z's 10 blocks, none new: 0 + 10.
		{"done frees its blocks", nil, func(p Policy, rs []ReplicaView) { dynEvent(p, Done, W, rs[1].Index) },
			[]float64{60, 10, 30}, 1},
		// X done: A holds Y's 10, 6–10 new: 25 + 15; a shared block stays while Y holds it.
		{"a shared prefix outlives one holder", nil, func(p Policy, rs []ReplicaView) { dynEvent(p, Done, X, rs[0].Index) },
			[]float64{40, 50, 30}, 2},
		// X routed again to C (a retry): A 25 + 15; C 20 + 25 distinct + 5 new.
		{"a retry moves its blocks", nil, func(p Policy, rs []ReplicaView) { dynEvent(p, Routed, X, rs[2].Index) },
			[]float64{40, 50, 50}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "dynamo", c.params)
			rs := peerViews(4)
			rs[0].PendingPrefill, rs[0].Match = 320, 5
			rs[1].PendingPrefill, rs[1].Match = 0, 10
			rs[2].PendingPrefill, rs[2].Match, rs[2].InFlightTokens = 160, 0, 100000
			rs[3].Healthy = false
			dynEvent(p, Routed, X, rs[0].Index)
			dynEvent(p, Routed, Y, rs[0].Index)
			dynEvent(p, Routed, Z, rs[1].Index)
			dynEvent(p, Routed, W, rs[1].Index)
			if c.after != nil {
				c.after(p, rs)
			}
			got, d := peerPick(t, p, dynReq(1, 160, dynSeq(1, 10)...), rs)
			if got != c.want || !peerNear(d.Scores, append(c.costs, 0)) {
				t.Fatalf("picked %d costs %v, want %d %v", got, d.Scores, c.want, c.costs)
			}
			if d.Load != c.costs[c.want] || d.Matched != rs[c.want].Match {
				t.Fatalf("decision %+v", d)
			}
		})
	}
}

// TestDynamoQueue pins the router queue (lib/kv-router/src/scheduling/
// queue.rs all_workers_busy): Pick defers while every healthy replica's
// active prefill tokens exceed threshold × max_num_batched_tokens, by
// default 16 × 8192 = 131,072; "None" turns it off.
func TestDynamoQueue(t *testing.T) {
	const limit = 16 * 8192
	cases := []struct {
		name     string
		params   map[string]any
		maxBatch int
		pending  []int // replicas 0–2; replica 3 is down with none
		noDefer  bool
		err      error
	}{
		{"every replica over", nil, 0, []int{limit + 1, limit + 1, limit + 1}, false, ErrDefer},
		{"one at the limit", nil, 0, []int{limit + 1, limit, limit + 1}, false, nil},
		{"Request.NoDefer", nil, 0, []int{limit + 1, limit + 1, limit + 1}, true, nil},
		{"router_queue_threshold None", map[string]any{"router_queue_threshold": "None"}, 0, []int{limit + 1, limit + 1, limit + 1}, false, nil},
		{"router_queue_threshold null", map[string]any{"router_queue_threshold": nil}, 0, []int{limit + 1, limit + 1, limit + 1}, false, nil},
		{"threshold 0: any prefill", map[string]any{"router_queue_threshold": 0}, 0, []int{1, 1, 1}, false, ErrDefer},
		{"threshold 0: one idle", map[string]any{"router_queue_threshold": 0}, 0, []int{1, 0, 1}, false, nil},
		{"threshold 1, 2048 batched tokens", map[string]any{"router_queue_threshold": 1}, 2048, []int{2049, 2049, 2049}, false, ErrDefer},
		{"threshold 1, 2048 batched tokens, one at 2048", map[string]any{"router_queue_threshold": 1}, 2048, []int{2049, 2048, 2049}, false, nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, err := New("dynamo", Options{Seed: 1, MaxBatchTokens: c.maxBatch, Params: c.params})
			if err != nil {
				t.Fatal(err)
			}
			rs := peerViews(4)
			for i, n := range c.pending {
				rs[i].PendingPrefill = n
			}
			rs[3].Healthy = false
			req := dynReq(1, 160, dynSeq(1, 10)...)
			req.NoDefer = c.noDefer
			_, err = p.Pick(req, rs)
			if !errors.Is(err, c.err) || (c.err == nil && err != nil) {
				t.Fatalf("err = %v, want %v", err, c.err)
			}
		})
	}
	// No healthy replica: ErrNoReplica, not a wait.
	rs := peerViews(2)
	for i := range rs {
		rs[i].Healthy, rs[i].PendingPrefill = false, limit+1
	}
	if _, err := peerNew(t, "dynamo", nil).Pick(dynReq(1, 160), rs); !errors.Is(err, ErrNoReplica) {
		t.Fatalf("none healthy: err = %v, want ErrNoReplica", err)
	}
}

// TestDynamoTemperature: with T > 0 the choice frequencies follow
// p ∝ exp(−(cost − min)/((max − min)·T)); equal costs: uniform; T = 0: argmin.
func TestDynamoTemperature(t *testing.T) {
	rs := peerViews(3)
	// A request without full blocks: costs are the prefill terms alone,
	// (320+160)/16 − 5 = 25, max(10 − 20, 0) = 0, (160+160)/16 = 20.
	rs[0].PendingPrefill, rs[0].Match = 320, 5
	rs[1].Match = 20
	rs[2].PendingPrefill = 160
	req := dynReq(1, 160)
	costs := []float64{25, 0, 20}
	softmax := func(costs []float64, T float64) []float64 {
		lo, hi := math.Min(costs[0], math.Min(costs[1], costs[2])), math.Max(costs[0], math.Max(costs[1], costs[2]))
		w, sum := make([]float64, 3), 0.0
		for i, c := range costs {
			w[i] = math.Exp(-(c - lo) / ((hi - lo) * T))
			sum += w[i]
		}
		for i := range w {
			w[i] /= sum
		}
		return w
	}
	cases := []struct {
		name string
		T    float64
		rs   []ReplicaView
		want []float64
	}{
		{"T=1", 1, rs, softmax(costs, 1)},
		{"T=0.1", 0.1, rs, softmax(costs, 0.1)},
		{"equal costs: uniform", 1, peerViews(3), []float64{1.0 / 3, 1.0 / 3, 1.0 / 3}},
		{"T=0: the cheapest", 0, rs, []float64{0, 1, 0}},
	}
	const n = 20000
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "dynamo", map[string]any{"temperature": c.T})
			var count [3]int
			for range n {
				d, err := p.Pick(req, c.rs)
				if err != nil {
					t.Fatal(err)
				}
				count[d.Replica-peerBase]++
			}
			for i, want := range c.want {
				// 4.5 standard deviations of a binomial proportion at n = 20000.
				if got := float64(count[i]) / n; math.Abs(got-want) > 4.5*math.Sqrt(want*(1-want)/n)+1e-12 {
					t.Errorf("replica %d chosen %.4f of the time, want %.4f", i, got, want)
				}
			}
		})
	}
}
