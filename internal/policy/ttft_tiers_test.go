package policy

import (
	"math"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/costmodel"
)

// A host-tier hit is priced between a GPU hit and a prefill: the estimate
// adds the load of the host tier's blocks (the profile's PCIe time) and
// computes the rest; the tier-blind estimates price it as a GPU hit or as
// a miss.
func TestTTFTHostHitBetweenGPUHitAndPrefill(t *testing.T) {
	req := ttftReq(1) // 100 blocks
	n := len(req.Blocks)
	est := func(hostHits string, v ReplicaView) float64 {
		p := peerNew(t, "ttft", map[string]any{"host_hits": hostHits}).(*TTFT)
		v.Healthy = true
		ms, _ := p.Estimate(req, &v, 0)
		return ms
	}
	gpu := est("load", ReplicaView{Match: n})
	host := est("load", ReplicaView{Match: 10, MatchHost: n})
	none := est("load", ReplicaView{})
	if !(gpu < host && host < none) {
		t.Fatalf("gpu %v, host %v, prefill %v: a host hit is not between", gpu, host, none)
	}
	p := peerNew(t, "ttft", nil).(*TTFT)
	prof := p.o.Profile
	// 10 blocks on the GPU, 89 loaded; the last block, whose last token
	// is never loaded, is computed.
	want := prof.HostLoadMs(89*16) + prof.PrefillMs(16, 1584, p.o.MaxBatchTokens)
	if math.Abs(host-want) > 1e-9 {
		t.Fatalf("host hit %v ms, want load + last token %v", host, want)
	}
	if g, want := est("gpu", ReplicaView{Match: 10, MatchHost: n}), est("load", ReplicaView{Match: n - 1}); g != want {
		t.Fatalf("host hits as GPU hits: %v, a GPU hit of the same blocks %v", g, want)
	}
	if m := est("miss", ReplicaView{Match: 10, MatchHost: n}); m != est("miss", ReplicaView{Match: 10}) {
		t.Fatalf("host hits as misses: %v", m)
	}
	if _, err := New("ttft", Options{Params: map[string]any{"host_hits": "disk"}}); err == nil {
		t.Fatal("host_hits disk accepted")
	}
}

// With pulls, a long prefix whose holder is saturated goes to an idle
// replica pulling it from the holder: faster than waiting for the holder
// or recomputing. Without pulls the idle replica computes it; a short
// prefix is not worth a pull's latency.
func TestTTFTPullsFromSaturatedHolder(t *testing.T) {
	for _, c := range []struct {
		name  string
		pulls bool
		text  string
		want  int  // position chosen
		pull  bool // with a pull from position 0
	}{
		{"pulls", true, strings.Repeat("abcd", 8000), 1, true},
		{"no pulls", false, strings.Repeat("abcd", 8000), 1, false},
		{"short prefix", true, strings.Repeat("abcd", 40), 1, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, err := New("ttft", Options{Seed: 7, Pulls: c.pulls})
			if err != nil {
				t.Fatal(err)
			}
			req := peerReq(1, c.text, peerT0)
			rs := peerViews(2)
			rs[0].Match = len(req.Blocks)
			rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = 200000, 20, 20 // saturated
			pos, d := peerPick(t, p, req, rs)
			if pos != c.want || (d.Pull != nil) != c.pull {
				t.Fatalf("chose %d with pull %+v (scores %v)", pos, d.Pull, d.Scores)
			}
			if c.pull && (d.Pull.Replica != rs[0].Index || d.Pull.URL != rs[0].URL || d.Pull.Blocks != len(req.Blocks)-1 ||
				d.Matched != len(req.Blocks)-1) {
				t.Fatalf("pull %+v, matched %d", d.Pull, d.Matched)
			}
		})
	}
}

// A pull's source holds the most of the prompt in any tier, a host tier
// included; the chosen replica never pulls from itself.
func TestTTFTPullSource(t *testing.T) {
	p, _ := New("ttft", Options{Seed: 7, Pulls: true})
	req := peerReq(1, strings.Repeat("abcd", 8000), peerT0)
	n := len(req.Blocks)
	rs := peerViews(3)
	rs[0].Match = n / 2
	rs[1].Match, rs[1].MatchHost = 10, n // all of it, mostly in its host tier
	rs[1].PendingPrefill, rs[1].PendingCount, rs[1].InFlight = 200000, 20, 20
	rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = 200000, 20, 20
	pos, d := peerPick(t, p, req, rs)
	if pos != 2 || d.Pull == nil || d.Pull.Replica != rs[1].Index {
		t.Fatalf("chose %d pulling %+v (scores %v)", pos, d.Pull, d.Scores)
	}
}

// Where pulls stop paying, with the 8B profile's costs (c1 0.04 ms a
// token, 128 KiB of KV a token): a pull beats recomputing on an idle
// replica when latency + tokens × 128 KiB / bandwidth < the prefill it
// saves. At 50 GB/s (the default RDMA link) from a few blocks on; at 5
// GB/s from a few hundred tokens; below about 3.3 GB/s (128 KiB / 0.04 ms)
// only for prompts so long that their attention term (c2) makes computing
// them dearer still (80k tokens at 3 GB/s), and at 2 GB/s not even then.
func TestTTFTPullBreakEven(t *testing.T) {
	for _, c := range []struct {
		gbps   float64
		blocks int
		pull   bool
	}{
		{50, 2, false}, {50, 8, true}, {50, 500, true},
		{5, 8, false}, {5, 500, true},
		{3, 500, false}, {3, 5000, true}, {2, 5000, false},
	} {
		prof := costmodel.MustLookup(costmodel.Default)
		prof.TransferGBps = c.gbps
		p, err := New("ttft", Options{Seed: 7, Pulls: true, Profile: prof,
			Params: map[string]any{"margin_rel": 0, "margin_ms": 0, "decode_weight": 0, "eviction_weight": 0}})
		if err != nil {
			t.Fatal(err)
		}
		req := peerReq(1, strings.Repeat("abcd", c.blocks*16+8), peerT0)
		rs := peerViews(2)
		rs[0].Match = len(req.Blocks)
		rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = 1<<20, 50, 50
		_, d := peerPick(t, p, req, rs)
		if (d.Pull != nil) != c.pull {
			t.Errorf("%v GB/s, %d blocks: pull %+v, want %v (scores %v)", c.gbps, c.blocks, d.Pull, c.pull, d.Scores)
		}
	}
}

// With host tiers, a pull's copy crowds the puller's host tier (hostWriteMs):
// a holder with a short queue keeps its conversation, served from its own
// tiers, instead of an idle peer copying it; a saturated one still loses it
// to a pull. Without host tiers the GPU's eviction term prices the copy.
func TestTTFTPullCopyCrowdsHostTier(t *testing.T) {
	for _, c := range []struct {
		name    string
		offload int
		queue   int // the holder's queued prefill tokens
		pull    bool
	}{
		{"host tier, short queue", 120000, 2000, false},
		{"host tier, saturated", 120000, 200000, true},
		{"no host tier, short queue", 0, 2000, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			p, err := New("ttft", Options{Seed: 7, Pulls: true, OffloadBlocks: c.offload})
			if err != nil {
				t.Fatal(err)
			}
			req := peerReq(1, strings.Repeat("abcd", 4000), peerT0)
			rs := peerViews(2)
			rs[0].Match, rs[0].NumBlocks, rs[0].Cached = 20, 3000, 3000
			rs[0].MatchHost = len(req.Blocks)
			rs[1].NumBlocks, rs[1].Cached = 3000, 3000
			rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = c.queue, 2, 2
			pos, d := peerPick(t, p, req, rs)
			if (d.Pull != nil) != c.pull || (c.pull && pos != 1) {
				t.Fatalf("chose %d with pull %+v, want a pull %v (scores %v)", pos, d.Pull, c.pull, d.Scores)
			}
		})
	}
}
