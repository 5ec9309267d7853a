package policy

import (
	"errors"
	"strings"
	"testing"
)

func TestParseRole(t *testing.T) {
	for s, want := range map[string]Role{"": RoleBoth, "both": RoleBoth, "prefill": RolePrefill, "decode": RoleDecode} {
		if r, err := ParseRole(s); err != nil || r != want {
			t.Errorf("ParseRole(%q) = %v, %v", s, r, err)
		}
	}
	if _, err := ParseRole("Prefill"); err == nil {
		t.Error("ParseRole accepted Prefill")
	}
	if !RoleBoth.Prefills() || !RoleBoth.Decodes() || RolePrefill.Decodes() || RoleDecode.Prefills() {
		t.Error("role sides")
	}
	if Role(7).String() != "Role(7)" || RoleDecode.String() != "decode" {
		t.Error("role names")
	}
}

func TestPairOfOneReplicaIsAggregated(t *testing.T) {
	pd := Pair(Decision{Replica: 3}, Decision{Replica: 3}, "x")
	if !pd.SkipPrefill || pd.Prefill.Replica != -1 || pd.Decode.Replica != 3 || pd.Reason != "aggregated" {
		t.Fatalf("%+v", pd)
	}
	if pd := Pair(Decision{Replica: 2}, Decision{Replica: 3}, "x"); pd.SkipPrefill || pd.Reason != "x" {
		t.Fatalf("%+v", pd)
	}
}

// SGLang's PD router picks each side by its policy and never skips the
// prefill step, however much of the prompt the decode worker holds.
func TestSGLangPairNeverSkipsPrefill(t *testing.T) {
	p := peerNew(t, "sglang", nil)
	req := pdReq(1)
	prefill, decode := pdViews("ppdd")
	both(prefill, decode, 3, func(v *ReplicaView) { v.Match = len(req.Blocks) })
	both(prefill, decode, 0, func(v *ReplicaView) { v.InFlight = 200 }) // beyond balance_abs_threshold 64
	pd := pickPair(t, p, req, prefill, decode)
	if pd.SkipPrefill || pd.Prefill.Replica != prefill[1].Index || (pd.Decode.Replica != decode[2].Index && pd.Decode.Replica != decode[3].Index) {
		t.Fatalf("%+v", pd)
	}
}

// Dynamo's disaggregated routing: the prefill router by prefill cost (no
// decode blocks), the decode router by active blocks with overlap off; the
// conditional prefill, when on, keeps a request its decode worker mostly
// holds there.
func TestDynamoPair(t *testing.T) {
	p := peerNew(t, "dynamo", nil).(*Dynamo)
	req := pdReq(1)
	prefill, decode := pdViews("ppdd")
	// Prefill replica 1 holds the prompt; decode replica 3 holds it too,
	// but its decode batch is fuller than 2's.
	both(prefill, decode, 1, func(v *ReplicaView) { v.Match = 400 })
	both(prefill, decode, 3, func(v *ReplicaView) { v.Match = 500 })
	busy := peerReq(50, strings.Repeat("busy", 4000), peerT0)
	p.Observe(Event{Kind: Routed, Req: busy, Replica: decode[3].Index, Phase: PhaseDecode})
	// A prefill step is not tracked: decode replica 2 stays empty.
	p.Observe(Event{Kind: Routed, Req: peerReq(51, strings.Repeat("pfx", 4000), peerT0), Replica: decode[2].Index, Phase: PhasePrefill})
	pd := pickPair(t, p, req, prefill, decode)
	if pd.SkipPrefill || pd.Prefill.Replica != prefill[1].Index || pd.Decode.Replica != decode[2].Index {
		t.Fatalf("%+v", pd)
	}
	if got, want := pd.Decode.Scores[2], float64(len(req.Blocks)); got != want {
		t.Fatalf("decode cost %v, want the request's %v blocks", got, want)
	}
	if got, want := pd.Decode.Scores[3], float64(len(req.Blocks)+len(busy.Blocks)); got != want {
		t.Fatalf("decode cost %v, want %v (active blocks each counted)", got, want)
	}
	cp := peerNew(t, "dynamo", map[string]any{"conditional_prefill": true, "conditional_prefill_max_new_tokens": 16}).(*Dynamo)
	if pd := pickPair(t, cp, req, prefill, decode); !pd.SkipPrefill || pd.Decode.Replica != decode[3].Index {
		t.Fatalf("conditional prefill, the prompt held on 3: %+v", pd)
	}
	both(prefill, decode, 3, func(v *ReplicaView) { v.Match = 100 })
	if pd := pickPair(t, cp, req, prefill, decode); pd.SkipPrefill {
		t.Fatalf("conditional prefill, 6,400 tokens lacking: %+v", pd)
	}
}

// llm-d's pd-profile-handler: decode server first, then the decider on
// its match in llm-d's own index, then the prefill server.
func TestLLMDPairDecider(t *testing.T) {
	req := pdReq(1)
	for _, c := range []struct {
		params map[string]any
		held   bool
		skip   bool
	}{
		{nil, false, false}, {nil, true, true},
		{map[string]any{"non_cached_tokens": 0}, true, false}, // always disaggregate
	} {
		l := peerNew(t, "llmd", c.params).(*LLMD)
		prefill, decode := pdViews("pd")
		if c.held { // llm-d's index learnt the prompt on the decode server
			l.Observe(Event{Kind: Routed, Req: req, Replica: decode[1].Index, Phase: PhaseDecode})
		}
		pd := pickPair(t, l, req, prefill, decode)
		if pd.SkipPrefill != c.skip || pd.Decode.Replica != decode[1].Index {
			t.Fatalf("%v, held %v: %+v", c.params, c.held, pd)
		}
	}
}

// Round robin cycles each side on its own cursor: every replica serves.
func TestRoundRobinPairUsesEveryReplica(t *testing.T) {
	p := peerNew(t, "round_robin", nil)
	prefill, decode := pdViews("ppddd")
	seen := map[int]int{}
	for i := range 12 {
		pd := pickPair(t, p, pdReq(uint64(i)), prefill, decode)
		seen[pd.Prefill.Replica]++
		seen[pd.Decode.Replica]++
	}
	for i, want := range []int{6, 6, 4, 4, 4} {
		if seen[prefill[i].Index] != want {
			t.Fatalf("replica %d served %d steps, want %d (%v)", i, seen[prefill[i].Index], want, seen)
		}
	}
}

// Every PairPicker answers ErrNoReplica without candidates.
func TestPairPickersWithoutCandidates(t *testing.T) {
	for _, name := range Names() {
		p := peerNew(t, name, nil)
		pp, ok := p.(PairPicker)
		if !ok {
			continue
		}
		prefill, decode := pdViews("pd")
		decode[1].Healthy = false
		if _, err := pp.PickPair(pdReq(1), prefill, decode); !errors.Is(err, ErrNoReplica) {
			t.Errorf("%s: no decode candidate: %v", name, err)
		}
	}
}
