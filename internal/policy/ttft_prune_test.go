package policy

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvgate/kvgate/internal/costmodel"

	"pgregory.net/rapid"
)

// Pruning changes no decision: a pick that skips the replicas whose lower
// bound is past the margin (Request.Explain false) chooses what the
// explained pick that scores every replica chooses, with the same reason,
// estimate, match and pull, and the same score for every replica it did
// estimate; over any views (host-tier matches, loads, corrections and
// flows learnt from any events) and requests, programs with homes
// included.
func TestTTFTPruneChangesNoDecision(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		seed := rapid.Uint64().Draw(rt, "seed")
		opts := Options{Seed: seed, BlockSize: rapid.SampledFrom([]int{1, 16}).Draw(rt, "block_size"),
			OffloadBlocks: rapid.SampledFrom([]int{0, 1000}).Draw(rt, "offload")}
		// The bound's attention term: the default profile's, none, or one
		// that dominates the compute of long prompts.
		opts.Profile = costmodel.MustLookup(costmodel.Default)
		opts.Profile.C2 = rapid.SampledFrom([]float64{opts.Profile.C2, 0, 1e-5}).Draw(rt, "c2")
		pruned, err1 := New("ttft", opts)
		full, err2 := New("ttft", opts)
		if err1 != nil || err2 != nil {
			rt.Fatal(err1, err2)
		}
		n := rapid.IntRange(1, 12).Draw(rt, "replicas")
		for step := range rapid.IntRange(0, 8).Draw(rt, "history") {
			ev := drawEvent(rt, fmt.Sprintf("ev%d", step), n)
			pruned.(Observer).Observe(ev)
			full.(Observer).Observe(ev)
		}
		req := drawRequest(rt, "req", n)
		rs := drawViews(rt, "views", n, len(req.Blocks))
		for i := range rs {
			rs[i].MatchHost = rapid.IntRange(0, len(req.Blocks)+2).Draw(rt, fmt.Sprintf("host%d", i))
		}
		rs2 := append([]ReplicaView(nil), rs...)
		req2 := *req
		req.Explain, req2.Explain = false, true
		a, errA := pruned.Pick(req, rs)
		b, errB := full.Pick(&req2, rs2)
		if !errors.Is(errA, errB) && (errA == nil || errB == nil || errA.Error() != errB.Error()) {
			rt.Fatalf("errors differ: %v and %v", errA, errB)
		}
		if errA != nil {
			return
		}
		if a.Replica != b.Replica || a.Reason != b.Reason || a.Matched != b.Matched || a.EstTTFT != b.EstTTFT ||
			(a.Pull == nil) != (b.Pull == nil) || (a.Pull != nil && *a.Pull != *b.Pull) {
			rt.Fatalf("pruned %+v, explained %+v", a, b)
		}
		for i := range a.Scores {
			if a.Scores[i] != -1 && a.Scores[i] != b.Scores[i] {
				rt.Fatalf("replica %d: score %v pruned, %v explained", i, a.Scores[i], b.Scores[i])
			}
		}
	})
}
