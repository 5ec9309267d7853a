package engine

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
)

// checkHost checks the host tier's list and index against each other and
// against the replay of its events (nil: not checked).
func checkHost(tb testing.TB, e *Engine, events eventSet) {
	tb.Helper()
	t := e.host
	if t == nil {
		return
	}
	walked := 0
	for i := t.next[t.n]; i != int32(t.n); i = t.next[i] {
		if p := t.index.Get(t.hash[i]); p == nil || *p != i {
			tb.Fatalf("host slot %d carries %x, index says %v", i, t.hash[i], p)
		}
		walked++
	}
	if walked != t.len() || walked > t.n {
		tb.Fatalf("host list of %d, index of %d, capacity %d", walked, t.len(), t.n)
	}
	if events == nil {
		return
	}
	if len(events) != t.len() {
		tb.Fatalf("host event replay holds %d hashes, tier %d", len(events), t.len())
	}
	for h := range events {
		if !t.has(h) {
			tb.Fatalf("host event replay holds %x, tier does not", h)
		}
	}
}

// runAlone drives r alone through e (transfers included) from now and
// returns its result and the steps' KV events.
func runAlone(tb testing.TB, e *Engine, r *Request, now time.Duration) (*reqResult, []KVEvent) {
	tb.Helper()
	var evs []KVEvent
	res := pdDrive(tb, e, []arrival{{now, r}}, func(sr StepResult) { evs = append(evs, sr.KV...) })
	return res[r.ID], evs
}

// mediumEvents are the events of one kind and medium, their hashes joined.
func mediumEvents(evs []KVEvent, k KVKind, m Medium) []uint64 {
	var out []uint64
	for _, ev := range evs {
		if ev.Kind == k && ev.Medium == m {
			out = append(out, ev.BlockHashes...)
		}
	}
	return out
}

// A prompt evicted from the GPU but kept in the host tier is loaded, not
// computed: its first token comes after the load (the profile's PCIe time
// and latency) and one step computing the last token, the tokens reported
// cached as vLLM counts loaded ones; the tier's events are vLLM's (medium
// CPU, stored when computed, write-through), the loaded blocks are stored on
// the GPU again, and a host hit is priced between a GPU hit and a prefill.
func TestHostTierLoadsEvictedPrompt(t *testing.T) {
	const bs = 16
	a := seg{1, 10}
	ttft := map[string]time.Duration{}
	for _, c := range []struct {
		name       string
		hostBlocks int
		evict      bool
	}{{"gpu", 100, false}, {"host", 100, true}, {"none", 0, true}} {
		e := newEngine(t, Config{NumBlocks: 22, BlockSize: bs, MaxBatchTokens: 2048, HostBlocks: c.hostBlocks})
		first, evs := runAlone(t, e, req(1, bs, 1, 1, a), 0)
		if c.hostBlocks > 0 {
			if got := mediumEvents(evs, Stored, MediumCPU); !slices.Equal(got, chain(a)) {
				t.Fatalf("%s: CPU stored %x, want A's blocks", c.name, got)
			}
		}
		now := first.finish
		if c.evict {
			// B and C take the whole GPU: A's blocks are evicted from it.
			for i, other := range []seg{{2, 10}, {3, 10}} {
				r, _ := runAlone(t, e, req(uint64(2+i), bs, 1, 1, other), now)
				now = r.finish
			}
			if e.PeekCached(chain(a), 161) != 0 {
				t.Fatalf("%s: A still on the GPU", c.name)
			}
		}
		r, evs := runAlone(t, e, req(9, bs, 1, 1, a), now)
		ttft[c.name] = r.ttft()
		if c.name == "host" {
			prof := e.cfg.Profile
			want := prof.HostWireTime(160) + prof.HostLatency() + prof.StepTime(stepOf(1, 161))
			if r.ttft() != want || r.cached != 160 {
				t.Fatalf("host hit: ttft %v cached %d, want %v and 160", r.ttft(), r.cached, want)
			}
			if got := mediumEvents(evs, Stored, MediumGPU); !slices.Equal(got, chain(a)) {
				t.Fatalf("loaded blocks stored on the GPU: %x", got)
			}
			if st := e.Stats(); st.HostLoads != 1 || st.HostLoadTokens != 160 || st.HostEvicted != 0 ||
				st.HostBlocks != 30 || st.HostCapacity != 100 || st.ExternalHits != 160 {
				t.Fatalf("stats %+v", st)
			}
		}
	}
	if !(ttft["gpu"] < ttft["host"] && ttft["host"] < ttft["none"]) {
		t.Fatalf("ttft gpu %v, host %v, none %v: a host hit is not between", ttft["gpu"], ttft["host"], ttft["none"])
	}
}

// stepOf is the work of a step computing n prompt tokens up to context ctx.
func stepOf(n, ctx int) costmodel.Step {
	return costmodel.Step{Tokens: n, PrefillCtx: float64(n) * float64(ctx)}
}

// The host tier is an LRU touched head last: a full tier evicts a prompt's
// tail first (CPU BlockRemoved), and a later request hits the head the GPU
// kept, loads what the host tier kept after it and computes the rest.
func TestHostTierEvictsTailFirst(t *testing.T) {
	const bs = 16
	e := newEngine(t, Config{NumBlocks: 12, BlockSize: bs, MaxBatchTokens: 2048, HostBlocks: 15})
	a := seg{1, 10}
	r, _ := runAlone(t, e, req(1, bs, 1, 1, a), 0)
	// B takes 11 of the GPU's 12 blocks: all of A's but its first (the GPU
	// frees a prompt's tail first too), and half of A in the host tier.
	r, evs := runAlone(t, e, req(2, bs, 1, 1, seg{2, 10}), r.finish)
	ha := chain(a)
	if got := mediumEvents(evs, Removed, MediumCPU); !slices.Equal(got, []uint64{ha[9], ha[8], ha[7], ha[6], ha[5]}) {
		t.Fatalf("CPU removed %x, want A's last five, last first", got)
	}
	if got := mediumEvents(evs, Removed, MediumGPU); !slices.Equal(got, ha[1:][:9:9]) && len(got) != 9 {
		t.Fatalf("GPU removed %x, want A's blocks but the first", got)
	}
	r, _ = runAlone(t, e, req(3, bs, 1, 1, a), r.finish)
	if st := e.Stats(); r.cached != 5*bs || st.HostLoadTokens != 4*bs || st.PrefixHits != bs {
		t.Fatalf("cached %d, stats %+v: want 1 block on the GPU and 4 loaded", r.cached, st)
	}
	checkHost(t, e, nil)
}

// A request told to pull from a peer pulls what the peer holds beyond its
// own hit over the KV link (the profile's transfer time), and computes the
// rest; a peer holding no more than its own hit makes it compute, without
// an error.
func TestPeerPull(t *testing.T) {
	const bs = 16
	src := newEngine(t, Config{NumBlocks: 100, BlockSize: bs, MaxBatchTokens: 2048})
	dst := newEngine(t, Config{NumBlocks: 100, BlockSize: bs, MaxBatchTokens: 2048})
	a := seg{1, 10}
	runAlone(t, src, req(1, bs, 1, 1, a), 0)
	long := req(2, bs, 1, 1, a, seg{7, 2}) // A and two more blocks: the peer holds 10 of 12
	long.PullBlocks = src.Servable(long.BlockHashes)
	if long.PullBlocks != 10 {
		t.Fatalf("servable %d, want 10", long.PullBlocks)
	}
	r, _ := runAlone(t, dst, long, 0)
	prof := dst.cfg.Profile
	want := prof.TransferTime(160) + prof.StepTime(stepOf(33, 193))
	if r.ttft() != want || r.cached != 160 {
		t.Fatalf("pull: ttft %v cached %d, want %v and 160", r.ttft(), r.cached, want)
	}
	// The same prompt again: dst holds it now; the pull finds nothing more.
	again := req(3, bs, 1, 1, a, seg{7, 2})
	again.PullBlocks = 10
	r, _ = runAlone(t, dst, again, r.finish)
	if r.cached != 12*bs || dst.Stats().PeerPulls != 1 || dst.Stats().PeerPullMisses != 1 {
		t.Fatalf("second: cached %d, stats %+v", r.cached, dst.Stats())
	}
	bad := req(4, bs, 1, 1, a)
	bad.PullBlocks = 11
	if err := dst.Add(bad, r.finish); err == nil {
		t.Fatal("a pull of more blocks than the prompt has was accepted")
	}
}

// With both, a request loads its host tier's blocks over PCIe and pulls the
// peer's beyond them over the KV link at once: its first token waits for
// the slower of the two.
func TestHostLoadAndPullOverlap(t *testing.T) {
	const bs = 16
	src := newEngine(t, Config{NumBlocks: 200, BlockSize: bs, MaxBatchTokens: 4096})
	dst := newEngine(t, Config{NumBlocks: 22, BlockSize: bs, MaxBatchTokens: 4096, HostBlocks: 100})
	a, b := seg{1, 8}, seg{2, 8}
	runAlone(t, src, req(1, bs, 1, 1, a, b), 0)
	r, _ := runAlone(t, dst, req(2, bs, 1, 1, a), 0)
	for i, s := range []seg{{3, 10}, {4, 10}} {
		r, _ = runAlone(t, dst, req(uint64(3+i), bs, 1, 1, s), r.finish)
	}
	full := req(5, bs, 1, 1, a, b)
	full.PullBlocks = src.Servable(full.BlockHashes)
	r, _ = runAlone(t, dst, full, r.finish)
	prof := dst.cfg.Profile
	load := max(prof.HostWireTime(128)+prof.HostLatency(), prof.TransferTime(128))
	if want := load + prof.StepTime(stepOf(1, 257)); r.ttft() != want || r.cached != 256 {
		t.Fatalf("ttft %v cached %d, want %v and 256", r.ttft(), r.cached, want)
	}
}

// TestRandomTiersKeepInvariants mixes plain, remote and pulling requests,
// aborts and releases on an engine with a host tier, checking the block
// manager, the host tier and both media's event replays after every step.
func TestRandomTiersKeepInvariants(t *testing.T) {
	for seed := range uint64(30) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 28))
			bs := 1 + rng.IntN(16)
			cfg := Config{NumBlocks: 30 + rng.IntN(120), BlockSize: bs, MaxSeqs: 1 + rng.IntN(8),
				HostBlocks: 1 + rng.IntN(300), KVHoldTimeout: time.Duration(1+rng.IntN(500)) * time.Millisecond}
			cfg.MaxBatchTokens = cfg.MaxSeqs + rng.IntN(300)
			e := newEngine(t, cfg)
			var arr []arrival
			var at time.Duration
			for i := range 50 {
				at += time.Duration(rng.IntN(30)) * time.Millisecond
				r := req(uint64(i), bs, rng.IntN(bs), 1+rng.IntN(20),
					seg{uint64(rng.IntN(3)), rng.IntN(8)}, seg{uint64(10 + rng.IntN(20)), rng.IntN(8)})
				r.PromptTokens = max(r.PromptTokens, 1)
				if r.PromptTokens+r.MaxTokens-1 > cfg.NumBlocks*bs {
					continue
				}
				switch rng.IntN(4) {
				case 1:
					r.RemoteDecode = true
				case 2:
					r.RemotePrefill = true
				case 3:
					r.PullBlocks = rng.IntN(len(r.BlockHashes) + 1)
				}
				arr = append(arr, arrival{at, r})
			}
			gpu, host := eventSet{}, eventSet{}
			pdDrive(t, e, arr, func(sr StepResult) {
				gpu.apply(t, sr.KV)
				host.applyMedium(t, sr.KV, MediumCPU)
				checkInvariants(t, e, gpu)
				checkHost(t, e, host)
				for _, o := range sr.Outputs {
					if o.Held && rng.IntN(2) == 0 && !e.Release(o.ReqID) {
						t.Fatalf("release of held %d failed", o.ReqID)
					}
				}
				if ids := liveIDs(e); len(ids) > 0 && rng.IntN(20) == 0 {
					e.Abort(ids[rng.IntN(len(ids))])
					checkInvariants(t, e, gpu)
				}
			})
			if st := e.Stats(); st.KVUsage != 0 || st.Running+st.Waiting+st.Held != 0 {
				t.Errorf("not at rest: %+v", st)
			}
		})
	}
}

// Without KV events the host tier works the same and emits nothing.
func TestHostTierWithoutEvents(t *testing.T) {
	const bs = 16
	e := newEngine(t, Config{NumBlocks: 12, BlockSize: bs, HostBlocks: 15, DisableKVEvents: true})
	r, evs := runAlone(t, e, req(1, bs, 1, 1, seg{1, 10}), 0)
	r, evs2 := runAlone(t, e, req(2, bs, 1, 1, seg{2, 10}), r.finish)
	if len(evs)+len(evs2) != 0 || e.host.len() != 15 || len(e.host.out)+len(e.host.stored)+len(e.host.removed) != 0 {
		t.Fatalf("events %v %v, host %d blocks, pending %v", evs, evs2, e.host.len(), e.host.out)
	}
	if _, err := New(Config{HostBlocks: -1}); err == nil {
		t.Fatal("a negative host tier validated")
	}
}
