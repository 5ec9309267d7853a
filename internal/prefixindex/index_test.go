package prefixindex

import (
	"errors"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
	"pgregory.net/rapid"
)

// linearMatch is the plain definition Match must agree with.
func linearMatch(ix *Index, hashes []uint64) []int {
	out := make([]int, ix.Replicas())
	for r := range out {
		for _, h := range hashes {
			if !ix.Holds(r, h) {
				break
			}
			out[r]++
		}
	}
	return out
}

// chain makes block hashes for a path of a random tree: prompts share prefixes.
func chain(ids []int) []uint64 {
	u := make([]uint64, len(ids))
	for i, id := range ids {
		u[i] = uint64(id)
	}
	return testutil.Chain(7, u...)
}

func TestMatchAgreesWithLinearScan(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		replicas := rapid.IntRange(1, 130).Draw(t, "replicas") // crosses shard boundaries
		capacity := rapid.IntRange(0, 40).Draw(t, "capacity")
		maxEntries := rapid.IntRange(0, 400).Draw(t, "maxEntries")
		ix, err := New(Config{Replicas: replicas, BlocksPerReplica: capacity, MaxEntries: maxEntries})
		if err != nil {
			t.Fatal(err)
		}
		gen := rapid.SliceOfN(rapid.IntRange(0, 3), 0, 24) // small alphabet: lots of shared prefixes
		for range rapid.IntRange(1, 60).Draw(t, "ops") {
			p := chain(gen.Draw(t, "prompt"))
			if err := ix.Insert(rapid.IntRange(0, replicas-1).Draw(t, "r"), p); err != nil {
				t.Fatal(err)
			}
			q := chain(gen.Draw(t, "query"))
			got := ix.Match(q, nil)
			want := linearMatch(ix, q)
			for r := range want {
				if got[r] != want[r] {
					t.Fatalf("replica %d: match %d, linear %d", r, got[r], want[r])
				}
			}
			if ix.Len() > ix.cfg.MaxEntries {
				t.Fatalf("len %d over cap %d", ix.Len(), ix.cfg.MaxEntries)
			}
			for r := range replicas {
				if capacity > 0 && ix.ReplicaLen(r) > capacity {
					t.Fatalf("replica %d holds %d > %d", r, ix.ReplicaLen(r), capacity)
				}
			}
		}
	})
}

func TestLRUEvictsLeavesFirst(t *testing.T) {
	ix, _ := New(Config{Replicas: 1, BlocksPerReplica: 6})
	a := chain([]int{1, 2, 3, 4, 5})
	b := chain([]int{1, 2, 9, 9})
	_ = ix.Insert(0, a)
	_ = ix.Insert(0, b) // 7 distinct blocks > 6: evicts a's last block, never a shared head
	if got := ix.Match(a, nil)[0]; got != 4 {
		t.Fatalf("a matches %d, want 4 (its leaf evicted)", got)
	}
	if got := ix.Match(b, nil)[0]; got != 4 {
		t.Fatalf("b matches %d, want 4", got)
	}
	if ix.ReplicaLen(0) != 6 || ix.Len() != 6 {
		t.Fatalf("len %d/%d", ix.ReplicaLen(0), ix.Len())
	}
}

func TestRemoveClearAndBadSlot(t *testing.T) {
	ix, _ := New(Config{Replicas: 3})
	a := chain([]int{1, 2, 3})
	_ = ix.Insert(0, a)
	_ = ix.Insert(2, a)
	if m := ix.Match(a, nil); m[0] != 3 || m[1] != 0 || m[2] != 3 {
		t.Fatalf("match %v", m)
	}
	_ = ix.Remove(0, a[1:]) // correction: replica 0 reported only one cached block
	if m := ix.Match(a, nil); m[0] != 1 || m[2] != 3 {
		t.Fatalf("after remove %v", m)
	}
	_ = ix.Clear(2)
	if m := ix.Match(a, nil); m[2] != 0 || ix.Len() != 1 || ix.Blocks() != 1 {
		t.Fatalf("after clear %v len %d", m, ix.Len())
	}
	if err := ix.Insert(3, a); !errors.Is(err, ErrReplica) {
		t.Fatalf("slot 3: %v", err)
	}
	if _, err := New(Config{Replicas: -1}); err == nil {
		t.Fatal("negative config accepted")
	}
}

// Fed a million unique prompts, the index stays under its cap.
func TestMillionUniquePromptsStayUnderCap(t *testing.T) {
	const cap = 20000
	prompts := 1_000_000
	if testing.Short() {
		prompts = 100_000 // still 20 times the cap in blocks
	}
	ix, _ := New(Config{Replicas: 8, MaxEntries: cap})
	rng := rand.New(rand.NewPCG(1, 2))
	hs := make([]uint64, 4)
	for i := range prompts {
		for j := range hs {
			hs[j] = rng.Uint64()
		}
		_ = ix.Insert(i%8, hs)
		if ix.Len() > cap {
			t.Fatalf("after %d prompts: %d entries > cap %d", i, ix.Len(), cap)
		}
	}
	if ix.Len() < cap-4 || ix.Blocks() > cap {
		t.Fatalf("len %d blocks %d", ix.Len(), ix.Blocks())
	}
	for _, sh := range ix.shards {
		if int(sh.used) > cap+4 {
			t.Fatalf("node slab grew to %d", sh.used)
		}
	}
}

func TestPrecise(t *testing.T) {
	ix, _ := New(Config{Replicas: 2})
	p := NewPrecise(ix, "m", 4)
	text := "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!@#$" // 66 bytes: 16 tokens, 4 blocks of 4
	ids := prompt.Approx{}.Encode(nil, text)
	want := prompt.ApproxBlockHashes(nil, prompt.Key{Model: "m"}.Root(), text, 4)
	// The engine reports its own hashes, in two events: blocks 0-1, then 2-3 with a parent.
	e := []uint64{101, 102, 103, 104}
	if err := p.Stored(1, "", e[:2], nil, ids[:8], 4, ""); err != nil {
		t.Fatal(err)
	}
	if err := p.Stored(1, "", e[2:], &e[1], ids[8:16], 4, ""); err != nil {
		t.Fatal(err)
	}
	if m := ix.Match(want, nil); m[0] != 0 || m[1] != 4 {
		t.Fatalf("match %v", m)
	}
	if err := p.Removed(1, []uint64{104, 999}); err != nil {
		t.Fatal(err)
	}
	if m := ix.Match(want, nil); m[1] != 3 {
		t.Fatalf("after removal %v", m)
	}
	unknown := uint64(555)
	if err := p.Stored(0, "", e[2:3], &unknown, ids[8:12], 4, ""); !errors.Is(err, ErrUnknownParent) {
		t.Fatalf("unknown parent: %v", err)
	}
	if err := p.Stored(0, "", e[:1], nil, ids[:3], 4, ""); !errors.Is(err, ErrBlockSize) {
		t.Fatalf("short tokens: %v", err)
	}
	// A different adapter is a different partition.
	_ = p.Stored(0, "", []uint64{7}, nil, ids[:4], 4, "lora")
	if m := ix.Match(want, nil); m[0] != 0 {
		t.Fatalf("adapter matched base model: %v", m)
	}
	_ = p.Cleared(1)
	if m := ix.Match(want, nil); m[1] != 0 {
		t.Fatalf("after clear %v", m)
	}
}

// BenchmarkMemoryPerEntry reports heap bytes per (block, replica) entry with
// 1M entries over 16 replicas (prompts of 64 blocks, each block held by one
// replica; a shared block held by several replicas costs less per entry).
func BenchmarkMemoryPerEntry(b *testing.B) {
	for b.Loop() {
		runtime.GC()
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		ix, _ := New(Config{Replicas: 16, MaxEntries: 1 << 20})
		rng := rand.New(rand.NewPCG(3, 4))
		hs := make([]uint64, 64)
		for i := 0; ix.Len() < 1<<20; i++ {
			for j := range hs {
				hs[j] = rng.Uint64()
			}
			_ = ix.Insert(i%16, hs)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(ix.Len()), "bytes/entry")
		runtime.KeepAlive(ix)
	}
}

func BenchmarkMatch(b *testing.B) {
	ix, _ := New(Config{Replicas: 16, MaxEntries: 1 << 21})
	rng := rand.New(rand.NewPCG(5, 6))
	hs := make([]uint64, 500)
	for i := 0; ix.Len() < 1<<20; i++ {
		for j := range hs {
			hs[j] = rng.Uint64()
		}
		_ = ix.Insert(i%16, hs)
	}
	_ = ix.Insert(3, hs)
	_ = ix.Insert(9, hs[:200])
	out := make([]int, 16)
	for b.Loop() {
		out = ix.Match(hs, out)
	}
	if out[3] != 500 || out[9] != 200 {
		b.Fatalf("match %v", out)
	}
}

func TestSetCapacity(t *testing.T) {
	ix, _ := New(Config{Replicas: 2, BlocksPerReplica: 100})
	if err := ix.SetCapacity(1, 3); err != nil {
		t.Fatal(err)
	}
	a := chain([]int{1, 2, 3, 4, 5})
	_ = ix.Insert(0, a)
	_ = ix.Insert(1, a)
	if ix.ReplicaLen(0) != 5 || ix.ReplicaLen(1) != 3 {
		t.Fatalf("lens %d %d", ix.ReplicaLen(0), ix.ReplicaLen(1))
	}
	if m := ix.Match(a, nil); m[1] != 3 {
		t.Fatalf("match %v", m)
	}
	if err := ix.SetCapacity(2, 1); !errors.Is(err, ErrReplica) {
		t.Fatal(err)
	}
}

// llm-d's positional events write parent_block_hash 0 for "no parent": the
// blocks start a prompt, unless the replica really stored a block hashed 0.
func TestPreciseParentZeroIsNoParent(t *testing.T) {
	ix, _ := New(Config{Replicas: 1})
	p := NewPrecise(ix, "m", 4)
	text := "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!@#$"
	ids := prompt.Approx{}.Encode(nil, text)
	want := prompt.ApproxBlockHashes(nil, prompt.Key{Model: "m"}.Root(), text, 4)
	zero := uint64(0)
	if err := p.Stored(0, "", []uint64{11, 12}, &zero, ids[:8], 4, ""); err != nil {
		t.Fatalf("parent 0: %v", err)
	}
	if m := ix.Match(want, nil); m[0] != 2 {
		t.Fatalf("blocks after parent 0 not rooted at the prompt's start: match %v", m)
	}
	// A replica whose engine did hash a block to 0 chains from it.
	ix2, _ := New(Config{Replicas: 1})
	p2 := NewPrecise(ix2, "m", 4)
	if err := p2.Stored(0, "", []uint64{0}, nil, ids[:4], 4, ""); err != nil {
		t.Fatal(err)
	}
	if err := p2.Stored(0, "", []uint64{21}, &zero, ids[4:8], 4, ""); err != nil {
		t.Fatal(err)
	}
	if m := ix2.Match(want, nil); m[0] != 2 {
		t.Fatalf("a known block 0 is a parent: match %v", m)
	}
}

// A replica with larger blocks than the index (vLLM --block-size 32 under an
// index of 16): each engine block is two index blocks, chained, removed
// together; a size that is not a multiple is refused.
func TestPreciseLargerEngineBlocks(t *testing.T) {
	ix, _ := New(Config{Replicas: 1})
	p := NewPrecise(ix, "m", 4)
	text := "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!@#$"
	ids := prompt.Approx{}.Encode(nil, text)
	want := prompt.ApproxBlockHashes(nil, prompt.Key{Model: "m"}.Root(), text, 4)
	if err := p.Stored(0, "", []uint64{501}, nil, ids[:8], 8, ""); err != nil {
		t.Fatal(err)
	}
	parent := uint64(501)
	if err := p.Stored(0, "", []uint64{502}, &parent, ids[8:16], 8, ""); err != nil {
		t.Fatal(err)
	}
	if m := ix.Match(want, nil); m[0] != 4 {
		t.Fatalf("8-token engine blocks under a 4-token index: match %v, want 4", m)
	}
	if err := p.Removed(0, []uint64{502}); err != nil {
		t.Fatal(err)
	}
	if m := ix.Match(want, nil); m[0] != 2 || ix.ReplicaLen(0) != 2 {
		t.Fatalf("after removing the second engine block: match %v, %d entries", m, ix.ReplicaLen(0))
	}
	if err := p.Stored(0, "", []uint64{503}, nil, ids[:6], 6, ""); !errors.Is(err, ErrBlockSize) {
		t.Fatalf("6-token blocks under a 4-token index: %v", err)
	}
}

// Forget empties a slot for another replica: its blocks, its capacity
// (back to BlocksPerReplica) and, in precise mode, its engine hashes (an
// event naming the forgotten replica's blocks as parents is unknown).
func TestForgetEmptiesTheSlot(t *testing.T) {
	ix, _ := New(Config{Replicas: 2, BlocksPerReplica: 100})
	p := NewPrecise(ix, "m", 4)
	text := "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!@#$" // 4 blocks of 4 tokens
	ids := prompt.Approx{}.Encode(nil, text)
	e := []uint64{101, 102, 103, 104}
	for r := range 2 {
		if err := p.Stored(r, "", e[:2], nil, ids[:8], 4, ""); err != nil {
			t.Fatal(err)
		}
	}
	if err := ix.SetCapacity(1, 1); err != nil {
		t.Fatal(err)
	}
	if err := p.Forget(1); err != nil {
		t.Fatal(err)
	}
	if ix.ReplicaLen(1) != 0 || ix.ReplicaLen(0) != 2 || ix.Len() != 2 {
		t.Fatalf("lens %d %d, %d entries: want slot 1 empty, slot 0 kept", ix.ReplicaLen(0), ix.ReplicaLen(1), ix.Len())
	}
	if err := p.Stored(1, "", e[2:], &e[1], ids[8:16], 4, ""); !errors.Is(err, ErrUnknownParent) {
		t.Fatalf("a block of the forgotten replica as parent: %v", err)
	}
	if err := p.Stored(0, "", e[2:], &e[1], ids[8:16], 4, ""); err != nil {
		t.Fatalf("the kept replica's parent: %v", err)
	}
	_ = ix.Insert(1, chain([]int{1, 2, 3, 4, 5}))
	if ix.ReplicaLen(1) != 5 {
		t.Fatalf("capacity after Forget: %d blocks kept of 5, want BlocksPerReplica's 100", ix.ReplicaLen(1))
	}
	if err := p.Forget(2); !errors.Is(err, ErrReplica) {
		t.Fatal(err)
	}
}

// BenchmarkMatchScale is the match at fleet scale: 256 replicas (8 shards)
// in an index of 4M blocks, an 8,000-block prompt held by every fourth
// replica to a depth of its own, so that every shard resolves many lengths.
func BenchmarkMatchScale(b *testing.B) {
	const replicas, blocks = 256, 4 << 20
	ix, _ := New(Config{Replicas: replicas, MaxEntries: blocks, BlocksPerReplica: 1 << 20})
	rng := rand.New(rand.NewPCG(5, 6))
	hs := make([]uint64, 500)
	for i := 0; ix.Len() < blocks-blocks/8; i++ {
		for j := range hs {
			hs[j] = rng.Uint64()
		}
		_ = ix.Insert(i%replicas, hs)
	}
	full := make([]uint64, 8000)
	for j := range full {
		full[j] = rng.Uint64()
	}
	for r := 0; r < replicas; r += 4 {
		_ = ix.Insert(r, full[:(r+1)*len(full)/(2*replicas)])
	}
	out, lens := make([]int, replicas), make([]int, replicas)
	for b.Loop() {
		out, lens = ix.MatchLens(full, out, lens)
	}
	for r := range replicas {
		want := 0
		if r%4 == 0 {
			want = (r + 1) * len(full) / (2 * replicas)
		}
		if out[r] != want {
			b.Fatalf("replica %d matched %d, holds %d", r, out[r], want)
		}
	}
}
