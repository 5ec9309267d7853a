package sharedstate

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

func blocks(rng *rand.Rand, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = rng.Uint64()
	}
	return out
}

// realisticBatch is a busy gateway's batch: 8 replicas' loads and n
// decisions of about 60 new blocks each.
func realisticBatch(seed uint64, n int) Batch {
	rng := rand.New(rand.NewPCG(seed, 1))
	b := Batch{Gateway: "gw-7f3a-12345-9c2e", Seq: 123456, At: time.Unix(1767225600, 123456789)}
	for i := range 8 {
		b.Loads = append(b.Loads, ReplicaLoad{Replica: fmt.Sprintf("http://10.0.0.%d:8000", i+1),
			Load: router.Load{InFlight: int64(rng.IntN(40)), InFlightTokens: int64(rng.IntN(200000)), PendingPrefill: int64(rng.IntN(30000)), PendingCount: int64(rng.IntN(10))}})
	}
	for range n {
		b.Decisions = append(b.Decisions, Decision{Replica: b.Loads[rng.IntN(8)].Replica, Model: "meta-llama/Llama-3.1-8B-Instruct",
			Offset: rng.IntN(200), Tokens: 1000 + rng.IntN(4000), Blocks: blocks(rng, 50+rng.IntN(21))})
	}
	return b
}

// equalBatch compares batches with times by Equal (decoding gives Local).
func equalBatch(a, b Batch) bool {
	if !a.At.Equal(b.At) {
		return false
	}
	a.At, b.At = time.Time{}, time.Time{}
	norm := func(x *Batch) {
		for i := range x.Decisions {
			if len(x.Decisions[i].Blocks) == 0 {
				x.Decisions[i].Blocks = nil
			}
		}
		if len(x.Decisions) == 0 {
			x.Decisions = nil
		}
		if len(x.Loads) == 0 {
			x.Loads = nil
		}
	}
	norm(&a)
	norm(&b)
	return reflect.DeepEqual(a, b)
}

func TestBatchRoundTrip(t *testing.T) {
	cases := map[string]Batch{
		"empty":     {},
		"heartbeat": {Gateway: "g", Seq: 1, At: time.Unix(5, 7), Loads: []ReplicaLoad{{Replica: "http://a", Load: router.Load{InFlight: 3, InFlightTokens: 300, PendingPrefill: -2, PendingCount: 1}}}},
		"no blocks": {Gateway: "g", Decisions: []Decision{{Replica: "http://a", Model: "", Offset: 0, Tokens: 7}}},
		"unicode":   {Gateway: "gäteway", Decisions: []Decision{{Replica: "http://ä#1", Model: "m/ö", Offset: 3, Tokens: 99, Blocks: []uint64{0, 1, 1<<64 - 1}}}},
		"realistic": realisticBatch(1, 20),
	}
	for name, b := range cases {
		t.Run(name, func(t *testing.T) {
			p := AppendBatch(nil, &b)
			got, err := DecodeBatch(p)
			if err != nil {
				t.Fatal(err)
			}
			if !equalBatch(b, got) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, b)
			}
			// Appending keeps what dst held.
			q := AppendBatch([]byte("xy"), &b)
			if !bytes.Equal(q[2:], p) || string(q[:2]) != "xy" {
				t.Fatal("AppendBatch does not append")
			}
			// Every truncation is an error, never a panic.
			for n := range len(p) {
				if _, err := DecodeBatch(p[:n]); !errors.Is(err, ErrCorrupt) {
					t.Fatalf("truncated to %d of %d bytes: err %v", n, len(p), err)
				}
			}
			if _, err := DecodeBatch(append(p, 0)); !errors.Is(err, ErrCorrupt) {
				t.Fatal("a trailing byte decoded")
			}
		})
	}
}

func TestDecodeRefusesOtherVersionsAndKinds(t *testing.T) {
	b := realisticBatch(2, 1)
	p := AppendBatch(nil, &b)
	p[0] = codecVersionPrograms + 1
	if _, err := DecodeBatch(p); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("version %d decoded: %v", p[0], err)
	}
	s := Snapshot{Position: "1-0", Replicas: []ReplicaBlocks{{Replica: "a", Blocks: []uint64{1}}}}
	if _, err := DecodeBatch(AppendSnapshot(nil, &s)); !errors.Is(err, ErrCorrupt) {
		t.Fatal("a snapshot decoded as a batch")
	}
	if _, err := DecodeSnapshot(AppendBatch(nil, &b)); !errors.Is(err, ErrCorrupt) {
		t.Fatal("a batch decoded as a snapshot")
	}
}

// A count larger than the input could hold fails before anything of that
// size is allocated.
func TestDecodeBoundsAllocations(t *testing.T) {
	// Bytes, not allocation counts: the race detector adds allocations.
	huge := []byte{codecVersion, kindBatch, 0xff, 0xff, 0xff, 0xff, 0x0f}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const runs = 100
	for range runs {
		if _, err := DecodeBatch(huge); err == nil {
			t.Fatal("decoded")
		}
	}
	runtime.ReadMemStats(&after)
	if per := (after.TotalAlloc - before.TotalAlloc) / runs; per > 4096 {
		t.Fatalf("%d bytes allocated per decode of a 7-byte garbage input", per)
	}
	// A decision count of 2^40 in a small batch.
	b := Batch{Gateway: "g"}
	p := AppendBatch(nil, &b)
	p = p[:len(p)-1] // drop the decision count (0)
	p = append(p, 0x80, 0x80, 0x80, 0x80, 0x80, 0x20)
	if _, err := DecodeBatch(p); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("err %v", err)
	}
}

func TestSnapshotRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 3))
	s := Snapshot{Position: "1767225600123-4", At: time.Unix(1767225600, 5),
		Replicas: []ReplicaBlocks{{Replica: "http://a", Blocks: blocks(rng, 100)}, {Replica: "http://b"}, {Replica: "http://c#1", Blocks: blocks(rng, 3)}}}
	p := AppendSnapshot(nil, &s)
	got, err := DecodeSnapshot(p)
	if err != nil {
		t.Fatal(err)
	}
	if got.Position != s.Position || !got.At.Equal(s.At) || len(got.Replicas) != 3 || got.Len() != 103 {
		t.Fatalf("got %+v", got)
	}
	for i := range s.Replicas {
		if got.Replicas[i].Replica != s.Replicas[i].Replica || !slices.Equal(got.Replicas[i].Blocks, s.Replicas[i].Blocks) {
			t.Fatalf("replica %d: got %+v", i, got.Replicas[i])
		}
	}
	for n := range len(p) {
		if _, err := DecodeSnapshot(p[:n]); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("truncated to %d: %v", n, err)
		}
	}
}

func testRouter(t testing.TB, names ...string) *router.Router {
	t.Helper()
	if len(names) == 0 {
		names = []string{"http://r0", "http://r1", "http://r2"}
	}
	p, err := policy.New("ttft", policy.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	rt, err := router.New(router.Config{Replicas: names, Policy: p})
	if err != nil {
		t.Fatal(err)
	}
	return rt
}

// A snapshot restored into another router gives it the same index, LRU
// order included, by replica name whatever the slots.
func TestTakeAndRestoreSnapshot(t *testing.T) {
	a := testRouter(t, "http://a", "http://b", "http://c")
	_ = a.Index().Insert(0, []uint64{1, 2, 3})
	_ = a.Index().Insert(0, []uint64{1, 4})
	_ = a.Index().Insert(2, []uint64{9})
	s := TakeSnapshot(a, "7-0", time.Unix(1, 0))
	if s.Position != "7-0" || len(s.Replicas) != 3 || s.Replicas[0].Replica != "http://a" {
		t.Fatalf("snapshot %+v", s)
	}
	if want := []uint64{1, 4, 2, 3}; !slices.Equal(s.Replicas[0].Blocks, want) {
		t.Fatalf("replica a's blocks %v, want %v (most recent first)", s.Replicas[0].Blocks, want)
	}
	// b has the replicas in another order and one a does not know.
	b := testRouter(t, "http://c", "http://x", "http://a")
	if n := s.Restore(b); n != 5 {
		t.Fatalf("restored %d blocks, want 5", n)
	}
	if got := b.Index().Snapshot(2); !slices.Equal(got, s.Replicas[0].Blocks) {
		t.Fatalf("a's blocks restored as %v", got)
	}
	if got := b.Index().Snapshot(0); !slices.Equal(got, []uint64{9}) {
		t.Fatalf("c's blocks restored as %v", got)
	}
	if b.Index().ReplicaLen(1) != 0 {
		t.Fatal("x got blocks")
	}
	// Unknown names are skipped.
	s.Replicas = append(s.Replicas, ReplicaBlocks{Replica: "http://gone", Blocks: []uint64{5}})
	if n := s.Restore(testRouter(t, "http://zz")); n != 0 {
		t.Fatalf("restored %d into a router of other replicas", n)
	}
}

// The encoded size of a realistic batch, per decision (logged; the README
// quotes it), and a check that the overhead over the raw hashes stays small.
func TestEncodedSizePerDecision(t *testing.T) {
	for _, n := range []int{1, 4, 32} {
		b := realisticBatch(uint64(n), n)
		p := AppendBatch(nil, &b)
		hb := Batch{Gateway: b.Gateway, Seq: b.Seq, At: b.At, Loads: b.Loads}
		heartbeat := len(AppendBatch(nil, &hb))
		blocks := 0
		for _, d := range b.Decisions {
			blocks += len(d.Blocks)
		}
		perDecision := float64(len(p)-heartbeat) / float64(n)
		overhead := perDecision - 8*float64(blocks)/float64(n)
		t.Logf("%2d decisions (%.1f blocks each): %d bytes; heartbeat (8 loads) %d bytes; %.1f bytes per decision, %.1f beyond the hashes",
			n, float64(blocks)/float64(n), len(p), heartbeat, perDecision, overhead)
		// One batch's new strings (the model name) amortise over its
		// decisions; beyond them a decision's own fields take a few bytes.
		if n == 32 && overhead > 12 {
			t.Errorf("%.1f bytes per decision beyond the hashes", overhead)
		}
	}
}

func BenchmarkAppendBatch(b *testing.B) {
	batch := realisticBatch(1, 16)
	blocks := 0
	for _, d := range batch.Decisions {
		blocks += len(d.Blocks)
	}
	buf := AppendBatch(nil, &batch)
	b.ReportAllocs()
	b.SetBytes(int64(len(buf)))
	b.ResetTimer()
	for b.Loop() {
		buf = AppendBatch(buf[:0], &batch)
	}
	b.ReportMetric(float64(len(buf))/float64(len(batch.Decisions)), "bytes/decision")
	b.ReportMetric(float64(blocks)/float64(len(batch.Decisions)), "blocks/decision")
}

func BenchmarkDecodeBatch(b *testing.B) {
	batch := realisticBatch(1, 16)
	buf := AppendBatch(nil, &batch)
	b.ReportAllocs()
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		if _, err := DecodeBatch(buf); err != nil {
			b.Fatal(err)
		}
	}
}

// FuzzDecodeBatch: any input decodes or fails cleanly; what decodes
// re-encodes to what decodes the same.
func FuzzDecodeBatch(f *testing.F) {
	for i, n := range []int{0, 1, 3} {
		b := realisticBatch(uint64(i), n)
		f.Add(AppendBatch(nil, &b))
	}
	small := Batch{Gateway: "g", Seq: 2, At: time.Unix(0, 1), Loads: []ReplicaLoad{{Replica: "a", Load: router.Load{InFlight: -1}}},
		Decisions: []Decision{{Replica: "a", Model: "m", Offset: 1, Tokens: 2, Blocks: []uint64{3}}, {Replica: "b", Model: "m"}}}
	f.Add(AppendBatch(nil, &small))
	small.Decisions[1].Program = 9 // version 2
	f.Add(AppendBatch(nil, &small))
	f.Add([]byte{codecVersion, kindBatch})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, p []byte) {
		b, err := DecodeBatch(p)
		if err != nil {
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error %v is not ErrCorrupt", err)
			}
			return
		}
		q := AppendBatch(nil, &b)
		b2, err := DecodeBatch(q)
		if err != nil {
			t.Fatalf("re-encoding does not decode: %v", err)
		}
		if !equalBatch(b, b2) {
			t.Fatalf("re-encoding decodes differently:\n%+v\n%+v", b, b2)
		}
	})
}

// FuzzDecodeSnapshot: the same for snapshots.
func FuzzDecodeSnapshot(f *testing.F) {
	s := Snapshot{Position: "1-2", At: time.Unix(3, 4), Replicas: []ReplicaBlocks{{Replica: "a", Blocks: []uint64{1, 2}}, {Replica: "b"}}}
	f.Add(AppendSnapshot(nil, &s))
	f.Add([]byte{codecVersion, kindSnapshot, 0, 0, 0})
	f.Fuzz(func(t *testing.T, p []byte) {
		s, err := DecodeSnapshot(p)
		if err != nil {
			return
		}
		s2, err := DecodeSnapshot(AppendSnapshot(nil, &s))
		if err != nil || s2.Position != s.Position || len(s2.Replicas) != len(s.Replicas) || s2.Len() != s.Len() {
			t.Fatalf("re-encoding: %v %+v %+v", err, s, s2)
		}
	})
}
