package replay

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/workload"
)

// conversations is a multiturn workload whose hits come from each
// conversation's own history: a short system prompt, long turns, and
// caches large enough to hold every conversation, so that a turn misses
// only when its gateway does not know where the previous one went.
func conversations(t testing.TB) []workload.Request {
	t.Helper()
	n := 48.0
	if testing.Short() {
		n = 24
	}
	reqs, err := workload.Generate(workload.Spec{Name: "multiturn", Seed: 1, Params: map[string]float64{
		"conversations": n, "turns": 6, "system_prompt_len": 16, "user_len_min": 300, "user_len_max": 500,
		"output_len": 64, "think_ms": 500,
	}})
	if err != nil {
		t.Fatal(err)
	}
	workload.Arrivals(reqs, 8, 1)
	return reqs
}

func runGateways(t *testing.T, reqs []workload.Request, policy string, cfg Config) report.Run {
	t.Helper()
	cfg.Replicas, cfg.Seed = 4, 1
	run, err := Run(context.Background(), cfg, reqs, PolicySpec{Name: policy})
	if err != nil {
		t.Fatal(err)
	}
	if run.Errors != 0 || run.Requests != len(reqs) {
		t.Fatalf("%d requests, %d errors", run.Requests, run.Errors)
	}
	return run
}

// Four gateways sharing their decisions at 10 ms hit about as often as
// one gateway; without sharing, a conversation's turns land on gateways
// that do not know where its history is, and hit clearly less.
func TestGatewaysShareState(t *testing.T) {
	reqs := conversations(t)
	for _, pol := range []string{"ttft", "llmd"} {
		t.Run(pol, func(t *testing.T) {
			one := runGateways(t, reqs, pol, Config{})
			shared := runGateways(t, reqs, pol, Config{Gateways: 4, SyncDelay: 10 * time.Millisecond})
			none := runGateways(t, reqs, pol, Config{Gateways: 4, GatewaySync: SyncNone})
			t.Logf("hit rate: 1 gateway %.3f, 4 shared at 10ms %.3f, 4 none %.3f", one.HitRate, shared.HitRate, none.HitRate)
			if shared.HitRate < 0.95*one.HitRate {
				t.Errorf("shared hit rate %.3f < 0.95 × one gateway's %.3f", shared.HitRate, one.HitRate)
			}
			if none.HitRate > shared.HitRate-0.1 {
				t.Errorf("none hit rate %.3f, shared %.3f: want at least 10 points less", none.HitRate, shared.HitRate)
			}
			if shared.Extra["gateways"] != 4 || none.Extra["gateways"] != 4 || one.Extra["gateways"] != 0 {
				t.Errorf("extra gateways: shared %v, none %v, one %v", shared.Extra["gateways"], none.Extra["gateways"], one.Extra["gateways"])
			}
			if shared.Extra["sync_decisions"] != float64(len(reqs)) || shared.Extra["sync_decisions_applied"] != 3*float64(len(reqs)) {
				t.Errorf("decisions shared %v, applied %v; want %d and 3× that", shared.Extra["sync_decisions"], shared.Extra["sync_decisions_applied"], len(reqs))
			}
			if _, ok := none.Extra["sync_batches"]; ok {
				t.Errorf("none published batches: %v", none.Extra)
			}
		})
	}
}

// Decisions that arrive after the conversation has ended do not help: at a
// delay longer than the whole workload, sharing is worth much less than at
// 10 ms. The gateways' heartbeats keep every peer live even when each
// arrives long after it was sent (the TTL counts from arrival).
func TestGatewaysSyncDelay(t *testing.T) {
	reqs := conversations(t)
	fast := runGateways(t, reqs, "ttft", Config{Gateways: 4, SyncDelay: 10 * time.Millisecond})
	slow := runGateways(t, reqs, "ttft", Config{Gateways: 4, SyncDelay: time.Minute})
	t.Logf("hit rate: shared at 10ms %.3f, at 1 min %.3f", fast.HitRate, slow.HitRate)
	if slow.HitRate > fast.HitRate-0.1 {
		t.Errorf("hit rate at a 1 min delay %.3f, at 10 ms %.3f: want at least 10 points less", slow.HitRate, fast.HitRate)
	}
	for _, r := range []report.Run{fast, slow} {
		if n := r.Extra["sync_peers_expired"]; n != 0 {
			t.Errorf("delay %v ms: %v deliveries found a peer expired", r.Extra["sync_delay_ms"], n)
		}
		if r.Extra["sync_bytes"] <= 0 || r.Extra["sync_bytes_per_decision"] <= 0 {
			t.Errorf("no sync cost reported: %v", r.Extra)
		}
	}
}

// One gateway is the replay as it was: the sync settings change nothing,
// and the run reports no gateway figures.
func TestOneGatewayIsUnchanged(t *testing.T) {
	reqs := smallShared(t, 1)
	for _, pol := range []string{"ttft", "dynamo", "precise"} {
		t.Run(pol, func(t *testing.T) {
			base, err := Run(context.Background(), Config{Replicas: 4, Seed: 1, Staleness: 20 * time.Millisecond}, reqs, PolicySpec{Name: pol})
			if err != nil {
				t.Fatal(err)
			}
			one, err := Run(context.Background(), Config{Replicas: 4, Seed: 1, Staleness: 20 * time.Millisecond,
				Gateways: 1, GatewaySync: SyncShared, SyncDelay: time.Second, SyncLoads: LoadsOnChange}, reqs, PolicySpec{Name: pol})
			if err != nil {
				t.Fatal(err)
			}
			a, _ := json.Marshal(base)
			b, _ := json.Marshal(one)
			if string(a) != string(b) {
				t.Fatalf("one gateway with sync settings differs:\n%s\n%s", a, b)
			}
			if _, ok := one.Extra["gateways"]; ok {
				t.Errorf("one gateway's run reports gateways: %v", one.Extra)
			}
		})
	}
}

// Precise mode shares loads only (every gateway follows every replica's
// KV events), as the live gateway does.
func TestGatewaysPreciseSharesLoadsOnly(t *testing.T) {
	reqs := smallShared(t, 1)
	run := runGateways(t, reqs, "precise", Config{Gateways: 3, SyncDelay: 10 * time.Millisecond})
	if run.Extra["sync_decisions"] != 0 || run.Extra["sync_batches"] == 0 {
		t.Errorf("precise: %v decisions in %v batches; want loads only", run.Extra["sync_decisions"], run.Extra["sync_batches"])
	}
	if run.Extra["kv_event_errors"] != 0 {
		t.Errorf("kv event errors %v", run.Extra["kv_event_errors"])
	}
}

// Loads published on change go out more often than with decisions and
// heartbeats alone, and deterministic runs stay deterministic.
func TestGatewaysSyncLoads(t *testing.T) {
	reqs := smallShared(t, 1)
	cfg := Config{Gateways: 4, SyncDelay: 10 * time.Millisecond}
	change := runGateways(t, reqs, "ttft", cfg)
	again := runGateways(t, reqs, "ttft", cfg)
	cfg.SyncLoads = LoadsWithBatches
	batch := runGateways(t, reqs, "ttft", cfg)
	a, _ := json.Marshal(change)
	b, _ := json.Marshal(again)
	if string(a) != string(b) {
		t.Fatalf("same config, different runs:\n%s\n%s", a, b)
	}
	if change.Extra["sync_batches"] <= batch.Extra["sync_batches"] {
		t.Errorf("batches: %v on change, %v with decisions", change.Extra["sync_batches"], batch.Extra["sync_batches"])
	}
}

func TestGatewaysInvalid(t *testing.T) {
	reqs := smallShared(t, 1)
	for _, cfg := range []Config{
		{Gateways: -1},
		{Gateways: MaxGateways + 1},
		{Gateways: 2, GatewaySync: "redis"},
		{Gateways: 2, SyncDelay: -time.Millisecond},
		{Gateways: 2, SyncLoads: "sometimes"},
	} {
		if _, err := Run(context.Background(), cfg, reqs, PolicySpec{Name: "ttft"}); !errors.Is(err, ErrConfig) {
			t.Errorf("%+v: err %v, want ErrConfig", cfg, err)
		}
	}
}

func TestNextTick(t *testing.T) {
	ms := time.Millisecond
	for _, tc := range []struct{ now, phase, want time.Duration }{
		{0, 0, 0}, {0, 2 * ms, 2 * ms}, {2 * ms, 2 * ms, 2 * ms}, {3 * ms, 2 * ms, 7 * ms},
		{7 * ms, 2 * ms, 7 * ms}, {7*ms + 1, 2 * ms, 12 * ms}, {11 * ms, 0, 15 * ms},
	} {
		if got := nextTick(tc.now, tc.phase, 5*ms); got != tc.want {
			t.Errorf("nextTick(%v, %v) = %v, want %v", tc.now, tc.phase, got, tc.want)
		}
	}
}

// Each gateway's view of a replica's load (its own counts plus the others'
// last published ones) is the fleet's true load but for the changes of the
// last sync tick and delay: nothing is counted twice, nothing lost.
func TestGatewaysLoadsAddUp(t *testing.T) {
	reqs := conversations(t)
	cfg := Config{Replicas: 4, Seed: 1, Gateways: 3, SyncDelay: 0}.WithDefaults()
	pl, err := newPlan(reqs)
	if err != nil {
		t.Fatal(err)
	}
	vr, err := newVirtualRun(cfg, pl, PolicySpec{Name: "ttft"})
	if err != nil {
		t.Fatal(err)
	}
	checks, exact, busy := 0, 0, 0
	var absErr int64
	vr.cfg.observe = func(o observation) {
		if o.scrape == nil {
			return
		}
		r := o.scrape.replica
		var total router.Load
		for g := range vr.gateways {
			total = total.Add(vr.gateways[g].router.LocalLoad(r))
		}
		if total.InFlight > 0 {
			busy++
		}
		for g := range vr.gateways {
			rt := vr.gateways[g].router
			view := rt.LocalLoad(r).Add(rt.RemoteLoad(r))
			checks++
			if view == total {
				exact++
			}
			absErr += max(view.InFlight-total.InFlight, total.InFlight-view.InFlight)
		}
	}
	if err := vr.loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d of %d views exact (%d busy scrapes), mean |in-flight error| %.3f", exact, checks, busy, float64(absErr)/float64(checks))
	if busy < 20 || float64(exact) < 0.9*float64(checks) || float64(absErr) > 0.1*float64(checks) {
		t.Errorf("%d of %d views exact over %d busy scrapes, total |in-flight error| %d", exact, checks, busy, absErr)
	}
}
