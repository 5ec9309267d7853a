package sharedstate

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/kvgate/kvgate/internal/router"
)

// validBatch draws a batch within every bound.
func validBatch(t *rapid.T) (Batch, time.Time) {
	sent := time.Unix(rapid.Int64Range(1e9, 4e9).Draw(t, "sent"), 0)
	name := rapid.StringN(1, 40, MaxNameBytes).Draw(t, "gateway")
	b := Batch{Gateway: name, Seq: rapid.Uint64().Draw(t, "seq"),
		At: sent.Add(time.Duration(rapid.Int64Range(-int64(MaxClockSkew), int64(MaxClockSkew)).Draw(t, "skew")))}
	for range rapid.IntRange(0, 4).Draw(t, "loads") {
		b.Loads = append(b.Loads, ReplicaLoad{Replica: rapid.StringN(0, 20, MaxNameBytes).Draw(t, "replica"), Load: router.Load{
			InFlight:       rapid.Int64Range(0, MaxLoadCount).Draw(t, "inflight"),
			InFlightTokens: rapid.Int64Range(0, MaxLoadTokens).Draw(t, "tokens"),
			PendingPrefill: rapid.Int64Range(0, MaxLoadTokens).Draw(t, "prefill"),
			PendingCount:   rapid.Int64Range(0, MaxLoadCount).Draw(t, "pending")}})
	}
	for range rapid.IntRange(0, 3).Draw(t, "decisions") {
		n := rapid.IntRange(0, 8).Draw(t, "blocks")
		b.Decisions = append(b.Decisions, Decision{Replica: "http://r", Model: "m",
			Offset: rapid.IntRange(0, MaxDecisionBlocks-n).Draw(t, "offset"),
			Tokens: rapid.IntRange(0, MaxDecisionTokens).Draw(t, "dtokens"), Blocks: make([]uint64, n)})
	}
	return b, sent
}

// A batch within the bounds passes, and pushing any one value out of them
// drops it with that value's reason: the bounds are exactly where Check
// draws them.
func TestCheckBounds(t *testing.T) {
	mutations := []struct {
		reason string
		ok     func(*Batch) bool // whether the batch has the field
		mut    func(*rapid.T, *Batch, time.Time)
	}{
		{"load", hasLoads, func(t *rapid.T, b *Batch, _ time.Time) {
			b.Loads[0].Load.InFlight = rapid.SampledFrom([]int64{-1, -1_000_000, MaxLoadCount + 1, math.MinInt64, math.MaxInt64}).Draw(t, "v")
		}},
		{"load", hasLoads, func(t *rapid.T, b *Batch, _ time.Time) {
			b.Loads[0].Load.PendingPrefill = rapid.SampledFrom([]int64{-1, MaxLoadTokens + 1, math.MaxInt64}).Draw(t, "v")
		}},
		{"load", hasLoads, func(t *rapid.T, b *Batch, _ time.Time) { b.Loads[0].Load.InFlightTokens = -1 }},
		{"load", hasLoads, func(t *rapid.T, b *Batch, _ time.Time) { b.Loads[0].Load.PendingCount = MaxLoadCount + 1 }},
		{"decision", hasDecisions, func(t *rapid.T, b *Batch, _ time.Time) {
			b.Decisions[0].Tokens = rapid.SampledFrom([]int{-1, MaxDecisionTokens + 1, math.MaxInt}).Draw(t, "v")
		}},
		{"decision", hasDecisions, func(t *rapid.T, b *Batch, _ time.Time) {
			b.Decisions[0].Offset = rapid.SampledFrom([]int{-1, MaxDecisionBlocks - len(b.Decisions[0].Blocks) + 1}).Draw(t, "v")
		}},
		{"decision", hasDecisions, func(t *rapid.T, b *Batch, _ time.Time) {
			b.Decisions[0].Offset, b.Decisions[0].Blocks = 0, make([]uint64, MaxDecisionBlocks+1)
		}},
		{"decision", always, func(t *rapid.T, b *Batch, _ time.Time) { b.Decisions = make([]Decision, maxBatchDecisions+1) }},
		{"program", hasDecisions, func(t *rapid.T, b *Batch, _ time.Time) { // oversize
			d := &b.Decisions[0]
			d.Program, d.Tokens = rapid.Uint64Min(1).Draw(t, "program"), rapid.IntRange(MaxProgramTokens+1, MaxDecisionTokens).Draw(t, "v")
			d.Offset = min(d.Offset, MaxProgramTokens)
		}},
		{"program", hasDecisions, func(t *rapid.T, b *Batch, _ time.Time) { // forged: more blocks than tokens
			d := &b.Decisions[0]
			d.Offset = max(d.Offset, 1)
			d.Program, d.Tokens = rapid.Uint64Min(1).Draw(t, "program"), rapid.IntRange(0, d.Offset+len(d.Blocks)-1).Draw(t, "v")
		}},
		{"name", always, func(t *rapid.T, b *Batch, _ time.Time) { b.Gateway = "" }},
		{"name", always, func(t *rapid.T, b *Batch, _ time.Time) { b.Gateway = strings.Repeat("g", MaxNameBytes+1) }},
		{"name", hasLoads, func(t *rapid.T, b *Batch, _ time.Time) { b.Loads[0].Replica = strings.Repeat("r", MaxNameBytes+1) }},
		{"name", hasDecisions, func(t *rapid.T, b *Batch, _ time.Time) { b.Decisions[0].Model = strings.Repeat("m", MaxNameBytes+1) }},
		{"time", always, func(t *rapid.T, b *Batch, sent time.Time) {
			b.At = sent.Add(rapid.SampledFrom([]time.Duration{MaxClockSkew + time.Millisecond, -MaxClockSkew - time.Millisecond, 1000 * time.Hour}).Draw(t, "d"))
		}},
	}
	rapid.Check(t, func(t *rapid.T) {
		b, sent := validBatch(t)
		if err := b.Check(sent); err != nil {
			t.Fatalf("a batch within the bounds refused: %v", err)
		}
		m := mutations[rapid.IntRange(0, len(mutations)-1).Draw(t, "mutation")]
		if !m.ok(&b) {
			t.Skip("no such field")
		}
		m.mut(t, &b, sent)
		err := b.Check(sent)
		var ie *InvalidError
		if !errors.As(err, &ie) || !errors.Is(err, ErrInvalid) || ie.Reason != m.reason {
			t.Fatalf("err %v, want reason %s", err, m.reason)
		}
	})
}

func hasLoads(b *Batch) bool     { return len(b.Loads) > 0 }
func hasDecisions(b *Batch) bool { return len(b.Decisions) > 0 }
func always(*Batch) bool         { return true }

// What a gateway publishes passes every reader's check, whatever its own
// counts: a load dipping below zero, a prompt beyond any context.
func TestPublishedValuesPassTheCheck(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		l := router.Load{InFlight: rapid.Int64().Draw(t, "a"), InFlightTokens: rapid.Int64().Draw(t, "b"),
			PendingPrefill: rapid.Int64().Draw(t, "c"), PendingCount: rapid.Int64().Draw(t, "d")}
		if err := checkLoad(clampLoad(l)); err != nil {
			t.Fatalf("clampLoad(%+v): %v", l, err)
		}
		d := shareable(Decision{Replica: "r", Model: "m", Tokens: rapid.Int().Draw(t, "tokens"), Program: rapid.Uint64().Draw(t, "program"),
			Blocks: make([]uint64, rapid.SampledFrom([]int{0, 1, MaxDecisionBlocks, MaxDecisionBlocks + 1, 3 * MaxDecisionBlocks}).Draw(t, "blocks"))})
		if err := d.check(); err != nil {
			t.Fatalf("shareable: %v", err)
		}
	})
}

// The publisher splits a backlog of large decisions into entries of about
// maxBatchBytes, each far below a reader's cap, and loses none.
func TestBatchesAreSplitBySize(t *testing.T) {
	s, err := New(Options{URL: "redis://127.0.0.1:1", ShareDecisions: true, Log: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	s.rt = testRouter(t, replicaNames...)
	var queued []router.Learned
	for i := range maxBatchDecisions {
		n := 4000 // 32 KB of hashes: 256 of them are 8 MiB
		if i == 7 {
			n = MaxDecisionBlocks + 10 // a prompt beyond the bound, cut to it
		}
		queued = append(queued, router.Learned{Replica: i % 3, Model: "m", Tokens: 16 * n, Blocks: make([]uint64, n)})
	}
	loads := []ReplicaLoad{{Replica: replicaNames[0], Load: router.Load{InFlight: 1}}}
	total, entries := 0, 0
	for len(queued) > 0 {
		b, taken := s.batchOf(time.Now(), loads, queued)
		if taken == 0 {
			t.Fatal("a batch took nothing")
		}
		p := AppendBatch(nil, &b)
		if len(p) > maxBatchBytes+8*MaxDecisionBlocks+4096 || int64(len(p)) > DefaultMaxEntryBytes/3 {
			t.Fatalf("an entry of %d bytes", len(p))
		}
		if err := b.Check(time.Now()); err != nil {
			t.Fatal(err)
		}
		total += len(b.Decisions)
		entries++
		queued = queued[taken:]
	}
	if total != maxBatchDecisions || entries < 8 {
		t.Fatalf("%d decisions in %d entries", total, entries)
	}
}

// Peers tracks a bounded number of other gateways: a forger naming a new
// one per entry gets no further, and a live one is still applied.
func TestPeersAreBounded(t *testing.T) {
	rt := testRouter(t, "http://a")
	p := NewPeers(rt, "me", time.Minute)
	now := time.Unix(10, 0)
	batch := func(gw string) *Batch {
		return &Batch{Gateway: gw, At: now, Loads: []ReplicaLoad{{Replica: "http://a", Load: router.Load{InFlight: 1}}}}
	}
	for i := range maxPeers + 100 {
		p.Apply(batch(fmt.Sprintf("gw-%d", i)), now)
	}
	if p.Live() != maxPeers || rt.RemoteLoad(0).InFlight != maxPeers {
		t.Fatalf("%d peers live, remote load %+v", p.Live(), rt.RemoteLoad(0))
	}
	if p.Admit("new") || !p.Admit("gw-0") {
		t.Fatal("Admit: a new peer beyond the bound, or a live one refused")
	}
	p.Expire(now.Add(2 * time.Minute))
	if !p.Admit("new") {
		t.Fatal("a new peer refused once the others expired")
	}
}

// A snapshot over the cap is cut to fit it, each replica keeping its most
// recent blocks, and decodes.
func TestSnapshotFit(t *testing.T) {
	s := Snapshot{Position: "1-0", Replicas: []ReplicaBlocks{
		{Replica: "a", Blocks: []uint64{1, 2, 3, 4, 5, 6, 7, 8}}, {Replica: "b", Blocks: []uint64{9, 10, 11, 12}}, {Replica: "c"}}}
	whole := int64(len(AppendSnapshot(nil, &s)))
	s.fit(whole)
	if s.Len() != 12 {
		t.Fatalf("a snapshot within the cap was cut to %d blocks", s.Len())
	}
	s.fit(whole - 40)
	p := AppendSnapshot(nil, &s)
	if int64(len(p)) > whole-40 || s.Len() == 0 {
		t.Fatalf("cut to %d bytes, %d blocks", len(p), s.Len())
	}
	if s.Replicas[0].Blocks[0] != 1 || (len(s.Replicas[1].Blocks) > 0 && s.Replicas[1].Blocks[0] != 9) {
		t.Fatalf("the most recent blocks were not kept: %+v", s.Replicas)
	}
	if _, err := DecodeSnapshot(p); err != nil {
		t.Fatal(err)
	}
}

// One line per minute per reason, with the count held back.
func TestLogLimit(t *testing.T) {
	var l logLimit
	t0 := time.Unix(0, 0)
	if _, ok := l.allow("a", t0); !ok {
		t.Fatal("the first line held")
	}
	for i := range 5 {
		if _, ok := l.allow("a", t0.Add(time.Duration(i)*time.Second)); ok {
			t.Fatal("a line within the minute")
		}
	}
	if _, ok := l.allow("b", t0); !ok {
		t.Fatal("another reason's first line held")
	}
	if held, ok := l.allow("a", t0.Add(logEvery)); !ok || held != 5 {
		t.Fatalf("after a minute: %d held, ok %v", held, ok)
	}
}
