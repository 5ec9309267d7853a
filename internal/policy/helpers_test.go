package policy

import (
	"strings"
	"testing"
)

func TestScratch(t *testing.T) {
	var buf [scratchLen]int
	if s := scratch(&buf, 5); len(s) != 5 || &s[0] != &buf[0] {
		t.Fatalf("scratch(5): len %d, in buf %v", len(s), &s[0] == &buf[0])
	}
	if s := scratch(&buf, scratchLen+1); len(s) != scratchLen+1 || &s[0] == &buf[0] {
		t.Fatalf("scratch(%d): len %d, in buf %v", scratchLen+1, len(s), &s[0] == &buf[0])
	}
	if n := testing.AllocsPerRun(100, func() {
		var b [scratchLen]float64
		s := scratch(&b, scratchLen)
		s[0] = 1
	}); n != 0 {
		t.Fatalf("scratch within the array: %v allocations", n)
	}
}

// Fleets larger than the scratch arrays take the same rules: among 100
// replicas (every third one down), the only idle one, past position 64,
// holding the prompt, wins wherever load or match decides.
func TestPicksPastScratchLen(t *testing.T) {
	rs := peerViews(100)
	for i := range rs {
		rs[i].Healthy = i%3 != 0
		rs[i].InFlight, rs[i].InFlightTokens, rs[i].PendingPrefill, rs[i].PendingCount = 4, 8000, 4000, 2
	}
	const best = 89
	rs[best].InFlight, rs[best].InFlightTokens, rs[best].PendingPrefill, rs[best].PendingCount = 0, 0, 0, 0
	req := peerReq(1, strings.Repeat("abcd", 1600), peerT0)
	rs[best].Match = len(req.Blocks)
	for _, name := range Names() {
		t.Run(name, func(t *testing.T) {
			pos, _ := peerPick(t, peerNew(t, name, nil), req, rs)
			if !rs[pos].Healthy {
				t.Fatalf("chose unhealthy position %d", pos)
			}
			switch name {
			case "least_load", "dynamo", "score", "ttft", "precise", "lru_affinity", "sglang":
				if pos != best {
					t.Fatalf("chose position %d, want %d", pos, best)
				}
			}
		})
	}
}
