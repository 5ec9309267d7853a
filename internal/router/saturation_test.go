package router

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// The saturation gauge is the routed work's rate over the capacity the
// cost model predicts at the objective: at a steady arrival rate it
// settles on rate × (uncached + output tokens) / (N·μ·ρ*), by the formula,
// and a pool with no replica in rotation reads its bound.
func TestSaturationSteadyRate(t *testing.T) {
	prof := costmodel.MustLookup(costmodel.Default)
	const batch, output = 8192, 64
	for _, tc := range []struct {
		rate     float64 // requests per second
		replicas int
	}{{1, 2}, {20, 2}, {80, 4}} {
		t.Run(fmt.Sprintf("%v/s on %d", tc.rate, tc.replicas), func(t *testing.T) {
			now := time.Unix(0, 0)
			p, _ := policy.New("round_robin", policy.Options{Seed: 1})
			urls := make([]string, tc.replicas)
			for i := range urls {
				urls[i] = fmt.Sprintf("http://r%d", i)
			}
			rt, err := New(Config{Replicas: urls, Policy: p, Now: func() time.Time { return now }})
			if err != nil {
				t.Fatal(err)
			}
			for i := range urls {
				rt.SetHealthy(i, true)
			}
			sat := NewSaturation(rt, SaturationConfig{Profile: prof, BatchTokens: batch, Objective: 2 * time.Second, Window: 10 * time.Second})
			var uncached, promptTokens int
			for i := range int(tc.rate * 120) { // two minutes: twelve time constants
				text := fmt.Sprintf("request %d %s", i, strings.Repeat("w", 2000))
				req := rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, MaxTokens: output, Prompts: 1}, "", "")
				req.Now = now
				tk, err := rt.Route(req)
				if err != nil {
					t.Fatal(err)
				}
				uncached, promptTokens = tk.UncachedTokens(), req.Tokens
				tk.Done(now, Outcome{CachedTokens: -1, OutputTokens: output})
				now = now.Add(time.Duration(float64(time.Second) / tc.rate))
				sat.Sample()
			}
			got := sat.Sample()[0]
			// The formula of Saturation's comment, by hand.
			u, pt, o := float64(uncached), float64(promptTokens), float64(output)
			prefillCost := prof.C1 + prof.C2*(pt-u/2)
			decodeCost := prof.C1 + prof.C3*(pt+o/2) + prof.C0/defaultMaxSeqs
			load := tc.rate * (u*prefillCost + o*decodeCost) / 1000
			rho := 1 - math.Ln10*(prof.C0+u*prefillCost)/1000/2
			want := load / (float64(tc.replicas) * rho)
			if math.Abs(got.Saturation-want) > 0.02*want || got.Replicas != tc.replicas {
				t.Fatalf("saturation %.4f on %d replicas, want %.4f (load %.3f, capacity %.3f)", got.Saturation, got.Replicas,
					want, got.Load, got.Capacity)
			}
			for i := range urls {
				rt.SetHealthy(i, false)
			}
			if s := sat.Sample()[0].Saturation; s != maxSaturation {
				t.Fatalf("no replica in rotation with load: %v, want %v", s, maxSaturation)
			}
		})
	}
}

// Requests the policy holds in the router's queue (late binding) are load
// the pool was offered: the gauge counts the queue's growth.
func TestSaturationCountsTheQueue(t *testing.T) {
	prof := costmodel.MustLookup(costmodel.Default)
	now := time.Unix(0, 0)
	rt, err := New(Config{Replicas: []string{"http://a"}, Policy: deferAll{}, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	rt.SetHealthy(0, true)
	sat := NewSaturation(rt, SaturationConfig{Profile: prof, BatchTokens: 8192, Objective: 2 * time.Second, Window: 10 * time.Second})
	text := strings.Repeat("w", 4000)
	// One request routed, so that the pool's per-request means are known.
	tk, err := rt.RouteWith(leastFirst{}, rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, MaxTokens: 64, Prompts: 1}, "", ""))
	if err != nil {
		t.Fatal(err)
	}
	tk.Done(now, Outcome{CachedTokens: -1})
	sat.Sample()
	before := sat.Sample()[0].Load
	for range 50 {
		now = now.Add(100 * time.Millisecond)
		if _, w, err := rt.Submit(rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, MaxTokens: 64, Prompts: 1}, "", "")); err != nil || w == nil {
			t.Fatalf("not deferred: %v", err)
		}
		sat.Sample()
	}
	if after := sat.Sample()[0].Load; after <= before || after <= 0 {
		t.Fatalf("load %v after 50 requests queued in 5 s, %v before: the queue's requests were not counted", after, before)
	}
}

// deferAll defers every request: they wait in the router's queue.
type deferAll struct{}

func (deferAll) Name() string { return "defer_all" }
func (deferAll) Pick(*policy.Request, []policy.ReplicaView) (policy.Decision, error) {
	return policy.Decision{}, policy.ErrDefer
}

// leastFirst picks the first candidate.
type leastFirst struct{}

func (leastFirst) Name() string { return "first" }
func (leastFirst) Pick(_ *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
	for i, r := range rs {
		if r.Healthy {
			return policy.Decision{Replica: i}, nil
		}
	}
	return policy.Decision{}, policy.ErrNoReplica
}
