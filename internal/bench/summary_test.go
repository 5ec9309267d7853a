package bench

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/report"
)

// bench's verdict calls a difference made by a stall a tie: policy a's
// run had 30 consecutive requests (5 %) delayed (the machine stalled),
// b's did not, which moves a's p90 up by some 15 %. The bootstrap of independent requests alone would name b the
// winner; the live-run interval does not.
func TestSummarizeStallIsNoise(t *testing.T) {
	rng := rand.New(rand.NewPCG(8, 9))
	run := func(policy string, stall bool) ([]report.Record, report.Run) {
		recs := make([]report.Record, 600)
		for i := range recs {
			ttft := 40 + 20*rng.ExpFloat64()
			if stall && i >= 300 && i < 330 {
				ttft += 400
			}
			d := time.Duration(ttft * float64(time.Millisecond))
			recs[i] = report.Record{Start: time.Duration(i) * 10 * time.Millisecond, TTFT: d, E2E: d + 50*time.Millisecond,
				PromptTokens: 100, OutputTokens: 5, Replica: i % 4}
		}
		return recs, Summarize(policy, recs, 4, 0)
	}
	recsA, a := run("a", true)
	_, b := run("b", false)
	if v, _ := report.Decide(report.Result{Runs: []report.Run{a, b}}); v.Clear() {
		t.Errorf("a stall decided the verdict: %s", v.Headline)
	}
	// The bootstrap alone would have named b.
	iid := report.Summarize("a", recsA, 4, 0)
	if v, _ := report.Decide(report.Result{Runs: []report.Run{iid, b}}); !v.Clear() || v.Best != "b" {
		t.Errorf("the bootstrap alone: %s", v.Headline)
	}
	// A clear difference stays clear.
	_, c := run("c", false)
	fast := make([]report.Record, 600)
	for i := range fast {
		d := time.Duration((20 + 8*rng.ExpFloat64()) * float64(time.Millisecond))
		fast[i] = report.Record{Start: time.Duration(i) * 10 * time.Millisecond, TTFT: d, E2E: d, PromptTokens: 100, OutputTokens: 5, Replica: i % 4}
	}
	f := Summarize("fast", fast, 4, 0)
	if v, _ := report.Decide(report.Result{Runs: []report.Run{c, f}}); !v.Clear() || v.Best != "fast" {
		t.Errorf("a clear win: %s", v.Headline)
	}
}
