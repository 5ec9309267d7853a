package policy

import (
	"math"
	"testing"
)

// TestDynamoCost: hand-computed costs, block size 16, a 160-token prompt.
//
//	A: prefill (320+160)/16 = 30, credit 5,  decode (1600+160)/16 = 110 → 135
//	B: prefill (0+160)/16   = 10, credit 20, decode (800+160)/16  = 60  → 0 + 60 = 60
//	C: prefill (160+160)/16 = 20, credit 0,  decode (496+160)/16  = 41  → 61
func TestDynamoCost(t *testing.T) {
	cases := []struct {
		name   string
		params map[string]any
		costs  []float64
		want   int
	}{
		{"defaults", nil, []float64{135, 60, 61}, 1},
		// Credit × 0.5: A 30−2.5 + 110, B 10−10 + 60.
		{"overlap weight 0.5", map[string]any{"overlap_score_weight": 0.5}, []float64{137.5, 60, 61}, 1},
		// No credit: B pays its prefill and loses to C.
		{"overlap weight 0", map[string]any{"overlap_score_weight": 0}, []float64{140, 70, 61}, 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rs := peerViews(4)
			rs[0].PendingPrefill, rs[0].Match, rs[0].InFlightTokens = 320, 5, 1600
			rs[1].PendingPrefill, rs[1].Match, rs[1].InFlightTokens = 0, 20, 800
			rs[2].PendingPrefill, rs[2].Match, rs[2].InFlightTokens = 160, 0, 496
			rs[3].Healthy = false // would cost 10 + 10
			req := peerReq(1, "", peerT0)
			req.Tokens = 160
			got, d := peerPick(t, peerNew(t, "dynamo", c.params), req, rs)
			if got != c.want {
				t.Errorf("picked %d, want %d", got, c.want)
			}
			for i, want := range c.costs {
				if d.Scores[i] != want {
					t.Errorf("cost[%d] = %v, want %v", i, d.Scores[i], want)
				}
			}
			if d.Scores[3] != 0 || d.Load != c.costs[c.want] || d.Matched != rs[c.want].Match {
				t.Errorf("decision %+v", d)
			}
		})
	}
}

// TestDynamoTemperature: with T > 0 the choice frequencies follow
// p ∝ exp(−(cost − min)/((max − min)·T)); equal costs: uniform; T = 0: argmin.
func TestDynamoTemperature(t *testing.T) {
	rs := peerViews(3)
	// Costs 135, 60, 61 as above.
	rs[0].PendingPrefill, rs[0].Match, rs[0].InFlightTokens = 320, 5, 1600
	rs[1].Match, rs[1].InFlightTokens = 20, 800
	rs[2].PendingPrefill, rs[2].InFlightTokens = 160, 496
	req := peerReq(1, "", peerT0)
	req.Tokens = 160
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
		{"T=1", 1, rs, softmax([]float64{135, 60, 61}, 1)}, // ≈ 0.157, 0.426, 0.417
		{"T=0.1", 0.1, rs, softmax([]float64{135, 60, 61}, 0.1)},
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
