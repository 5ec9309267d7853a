package replay

import (
	"context"
	"testing"

	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/testutil"
	"github.com/kvgate/kvgate/internal/workload"
)

// tenantRun replays the tenants (specs as --tenant takes them) on 4
// replicas routed by ttft, with flow control fc.
func tenantRun(t *testing.T, fc router.FlowConfig, specs ...string) report.Run {
	t.Helper()
	return tenantRunOn(t, Config{Replicas: 4, Flow: fc}, specs...)
}

// tenantRunOn is tenantRun on the fleet cfg describes.
func tenantRunOn(t *testing.T, cfg Config, specs ...string) report.Run {
	t.Helper()
	var ts []workload.TenantSpec
	for _, s := range specs {
		ts2, err := workload.ParseTenant(s)
		if err != nil {
			t.Fatal(err)
		}
		ts = append(ts, ts2)
	}
	reqs, err := workload.Mix(ts, 1)
	if err != nil {
		t.Fatal(err)
	}
	run, err := Run(context.Background(), cfg, reqs, PolicySpec{Name: "ttft"})
	if err != nil {
		t.Fatal(err)
	}
	return run
}

// The noisy neighbour, in virtual time: B at a steady 8 requests/s, a fifth
// of its share of 4 replicas (about 40 requests/s of 2,000-token prompts);
// A at 200/s, ten times its share. Without flow control B's requests queue
// behind A's in the engines; with it, B's p90 TTFT stays within 1.5× of
// its p90 alone, and A is queued or shed, never lost.
func TestNoisyNeighbour(t *testing.T) {
	testutil.Deterministic(t)
	const b = "name=B,rate=8,requests=160,input_len=2000,output_len=128,range_ratio=0.5"
	const a = "name=A,rate=200,requests=4000,input_len=2000,output_len=128,range_ratio=0.5"
	on := router.FlowConfig{Enabled: true}
	alone := tenantRun(t, on, b).Tenants["B"]
	with := tenantRun(t, on, b, a)
	without := tenantRun(t, router.FlowConfig{}, b, a).Tenants["B"]
	gotB, gotA := with.Tenants["B"], with.Tenants["A"]
	t.Logf("B's p90 TTFT: alone %.0f ms, beside A %.0f ms with flow control, %.0f ms without; A: %d of %d shed",
		alone.TTFTms.P90, gotB.TTFTms.P90, without.TTFTms.P90, gotA.Errors, gotA.Requests)
	if gotB.Errors != 0 || gotB.TTFTms.P90 > 1.5*alone.TTFTms.P90 {
		t.Errorf("B beside A: p90 %.0f ms (%d errors), alone %.0f ms: want ≤ 1.5×", gotB.TTFTms.P90, gotB.Errors, alone.TTFTms.P90)
	}
	if without.TTFTms.P90 < 10*alone.TTFTms.P90 {
		t.Errorf("without flow control B's p90 is %.0f ms: the flood should bury it", without.TTFTms.P90)
	}
	for kind, n := range gotA.ErrKinds {
		if kind != "shed_ttl" {
			t.Errorf("A: %d requests failed with %s: only shed requests may fail", n, kind)
		}
	}
}

// Priority under 2× overload: band 0 at 40 % of the fleet, band 2 (made
// sheddable) at 160 %: band 0's p90 TTFT stays within 1.2× of its p90
// without overload, and band 2's excess is refused (shed), not queued.
func TestPriorityUnderOverload(t *testing.T) {
	testutil.Deterministic(t)
	priorityUnderOverload(t, Config{Replicas: 4})
}

// The same on a prefill/decode fleet (4 prefill and 4 decode replicas):
// a pair goes through the flow controller's queue as the gateway's does
// (router.SubmitPD). The replay called RoutePD directly, and band 0's p90
// was the flood's (11.4 s), nothing shed.
func TestPriorityUnderOverloadPD(t *testing.T) {
	testutil.Deterministic(t)
	priorityUnderOverload(t, Config{PrefillReplicas: 4, DecodeReplicas: 4})
}

// priorityUnderOverload checks the priority bands on the fleet cfg
// describes (its Flow set here).
func priorityUnderOverload(t *testing.T, cfg Config) {
	t.Helper()
	const hi = "name=hi,rate=16,requests=320,input_len=2000,output_len=128,range_ratio=0.5,priority=0"
	const lo = "name=lo,rate=64,requests=1280,input_len=2000,output_len=128,range_ratio=0.5,priority=2"
	cfg.Flow = router.FlowConfig{Enabled: true, Bands: []router.Band{{Priority: 2, Sheddable: true}},
		Tenants: map[string]router.FlowTenant{"lo": {Priority: 2, MaxPriority: 2}}}
	alone := tenantRunOn(t, cfg, hi).Priorities["0"]
	run := tenantRunOn(t, cfg, hi, lo)
	top, low := run.Priorities["0"], run.Priorities["2"]
	t.Logf("band 0 p90: %.0f ms alone, %.0f ms under 2× load; band 2: %d of %d shed", alone.TTFTms.P90, top.TTFTms.P90, low.Errors, low.Requests)
	if top.Errors != 0 || top.TTFTms.P90 > 1.2*alone.TTFTms.P90 {
		t.Errorf("band 0 under overload: p90 %.0f ms (%d errors), %.0f ms without: want ≤ 1.2×", top.TTFTms.P90, top.Errors, alone.TTFTms.P90)
	}
	if low.ErrKinds["shed_saturated"] < low.Requests/4 || low.Errors != low.ErrKinds["shed_saturated"] {
		t.Errorf("band 2: %v of %d: want its excess shed", low.ErrKinds, low.Requests)
	}
}
