package replay

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/kvevents/enginekv"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// The replay and the gateway follow KV events alike: the batches a replay
// delivers, sent over the wire as vLLM frames and read back as the gateway
// reads them (router.KVFromWire), give a second router the same trust and
// the same precise index, batch by batch, a lost batch included.
func TestReplayAndGatewayFollowAlike(t *testing.T) {
	reqs := smallShared(t, 10)
	cfg := Config{Replicas: 3, KVBlocks: 600}.WithDefaults()
	pol, err := policy.New("precise", policy.Options{Seed: cfg.Seed, BlockSize: cfg.BlockSize, Profile: cfg.Profile})
	if err != nil {
		t.Fatal(err)
	}
	names := make([]string, cfg.Replicas)
	for i := range names {
		names[i] = cfg.engineName(i)
	}
	var now time.Time
	wire, err := router.New(router.Config{Replicas: names, Policy: pol, BlockSize: cfg.BlockSize,
		BlocksPerReplica: cfg.KVBlocks, Precise: true, Model: cfg.Model, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	pl, _ := newPlan(reqs)
	var vr *virtualRun
	batches, gaps, pending := 0, 0, -1
	cfg.observe = func(ev observation) {
		if ev.kv == nil {
			return
		}
		if pending >= 0 { // both routers have followed the previous batch now
			compareFollowers(t, vr.gateways[0].router, wire, pending)
			pending = -1
		}
		batches++
		if ev.kv.replica == 1 && ev.kv.seq == 20 {
			*ev.drop = true // lost on the way to both
			return
		}
		frames, err := kvevents.EncodeFrames(fmt.Sprintf("kv@%s@%s", names[ev.kv.replica], cfg.Model), ev.kv.seq,
			kvevents.Batch{Events: enginekv.Events(ev.kv.events)}, kvevents.FormMap)
		if err != nil {
			t.Fatal(err)
		}
		m, err := kvevents.DecodeFrames(frames)
		if err != nil {
			t.Fatal(err)
		}
		now = epoch.Add(ev.at)
		if wire.FollowKV(ev.kv.replica, router.KVFromWire(m), now, nil).Gap {
			gaps++
		}
		pending = ev.kv.replica
	}
	vr, err = newVirtualRun(cfg, pl, PolicySpec{Name: "precise"})
	if err != nil {
		t.Fatal(err)
	}
	if err := vr.loop(context.Background()); err != nil {
		t.Fatal(err)
	}
	if batches < 100 || gaps != 1 {
		t.Fatalf("%d batches, %d gaps: the test did not exercise the follower", batches, gaps)
	}
	for i := range names {
		compareFollowers(t, vr.gateways[0].router, wire, i)
	}
	// The same requests see the same matches.
	for k := range reqs[:50] {
		r := &reqs[k]
		text := r.Text()
		p := parsed(r, text, cfg.Model)
		a, b := vr.gateways[0].router.Views(vr.gateways[0].router.Prepare(&p, "", "")), wire.Views(wire.Prepare(&p, "", ""))
		for i := range a {
			if a[i].Match != b[i].Match {
				t.Fatalf("request %d on %s: match %d in the replay, %d through the wire", k, names[i], a[i].Match, b[i].Match)
			}
		}
	}
}

// compareFollowers checks two routers agree on replica i's trust and its
// precise index.
func compareFollowers(t *testing.T, a, b *router.Router, i int) {
	t.Helper()
	if a.Replica(i).PreciseSynced() != b.Replica(i).PreciseSynced() {
		t.Fatalf("replica %d: in sync %v in the replay, %v through the wire", i, a.Replica(i).PreciseSynced(), b.Replica(i).PreciseSynced())
	}
	sa, sb := a.Precise().Index().Snapshot(i), b.Precise().Index().Snapshot(i)
	slices.Sort(sa)
	slices.Sort(sb)
	if !slices.Equal(sa, sb) {
		t.Fatalf("replica %d: precise index of %d blocks in the replay, %d through the wire", i, len(sa), len(sb))
	}
}
