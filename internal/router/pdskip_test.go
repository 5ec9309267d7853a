package router

import (
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/policy"
)

// SkipReason names why a pair has no prefill step: the threshold on a
// replica holding the prompt, one both replica serving it whole, or no
// prefill candidate.
func TestSkipReason(t *testing.T) {
	long := parse(t, "a conversation that is long enough "+strings.Repeat("w", 800))
	rt := newPDRouter(t, mustPolicy(t, "least_load"), "pd", Config{})
	pd, err := rt.RoutePD(rt.Prepare(long, "", ""))
	if err != nil || SkipReason(pd.Decision) != "" {
		t.Fatalf("cold fleet: %v %q", err, SkipReason(pd.Decision))
	}
	endPD(pd, rt.Now())
	pd, _ = rt.RoutePD(rt.Prepare(long, "", ""))
	if got := SkipReason(pd.Decision); got != SkipThreshold {
		t.Fatalf("decode replica holds the prompt: %q (%s)", got, pd.Decision.Reason)
	}
	endPD(pd, rt.Now())
	pd, _ = rt.RoutePD(rt.Prepare(parse(t, "another prompt "+strings.Repeat("x", 800)), "", ""), 0)
	if got := SkipReason(pd.Decision); got != SkipNoPrefill {
		t.Fatalf("prefill replica excluded: %q (%s)", got, pd.Decision.Reason)
	}
	endPD(pd, rt.Now())
	if got := SkipReason(policy.Pair(policy.Decision{Replica: 1}, policy.Decision{Replica: 1}, "x")); got != SkipAggregated {
		t.Fatalf("one both replica: %q", got)
	}
}
