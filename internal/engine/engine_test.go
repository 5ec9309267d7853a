package engine

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/testutil"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// ---- test helpers: prompts, a discrete-event driver, invariants ----

// seg is a run of prompt blocks whose contents are identified by content:
// two prompts that start with the same segs share those blocks' hashes.
type seg struct {
	content uint64
	blocks  int
}

// chain is the chained block hashes of the segments' blocks
// (testutil.Chain: a block's hash depends on its content, its position and
// every block before it, as internal/prompt's hashes of real tokens do).
func chain(segs ...seg) []uint64 {
	var ids []uint64
	for _, s := range segs {
		for range s.blocks {
			ids = append(ids, s.content)
		}
	}
	return testutil.Chain(0x5eed, ids...)
}

// req builds a request whose prompt is the given segments plus extra tokens
// in a last partial block.
func req(id uint64, bs, extra, maxTokens int, segs ...seg) *Request {
	h := chain(segs...)
	return &Request{ID: id, PromptTokens: len(h)*bs + extra, BlockHashes: h, MaxTokens: maxTokens}
}

type arrival struct {
	at time.Duration
	r  *Request
}

type reqResult struct {
	arrival, first, finish time.Duration
	cached                 int
	tokens, firsts         int
	finished               bool
	firstStep              int // index of the step that emitted the first token
}

func (r *reqResult) ttft() time.Duration { return r.first - r.arrival }

// drive runs arrivals (sorted by time) through e in virtual time: requests
// that arrive during a step are added when it ends, with their own arrival
// time. onStep, if set, sees every step. Bounded in steps.
func drive(tb testing.TB, e *Engine, arr []arrival, onStep func(StepResult)) map[uint64]*reqResult {
	tb.Helper()
	const maxSteps = 2_000_000
	res := make(map[uint64]*reqResult, len(arr))
	var now time.Duration
	next := 0
	for steps := 0; ; steps++ {
		if steps > maxSteps {
			tb.Fatalf("no quiescence after %d steps (stats %+v)", maxSteps, e.Stats())
		}
		for next < len(arr) && arr[next].at <= now {
			a := arr[next]
			if err := e.Add(a.r, a.at); err != nil {
				tb.Fatalf("Add(%d): %v", a.r.ID, err)
			}
			res[a.r.ID] = &reqResult{arrival: a.at}
			next++
		}
		if !e.HasWork() {
			if next == len(arr) {
				return res
			}
			now = arr[next].at
			continue
		}
		sr := e.Step(now)
		if sr.End <= sr.Start {
			tb.Fatalf("step with work took no time: %+v", sr)
		}
		for _, o := range sr.Outputs {
			r := res[o.ReqID]
			if r == nil || r.finished {
				tb.Fatalf("output for unknown or finished request %d", o.ReqID)
			}
			r.tokens += o.NewTokens
			if o.First {
				r.firsts++
				r.first, r.cached, r.firstStep = sr.End, o.CachedTokens, steps
			}
			if o.Finished {
				r.finished, r.finish = true, sr.End
			}
		}
		if onStep != nil {
			onStep(sr)
		}
		now = sr.End
	}
}

func newEngine(tb testing.TB, cfg Config) *Engine {
	tb.Helper()
	e, err := New(cfg)
	if err != nil {
		tb.Fatalf("New: %v", err)
	}
	return e
}

// eventSet replays the GPU's KV events like a precise prefix index would,
// failing on an event that contradicts the set (store of a present hash,
// removal of an absent one). The host tier's events are hostSet's.
type eventSet map[uint64]bool

func (s eventSet) apply(tb testing.TB, evs []KVEvent) {
	tb.Helper()
	s.applyMedium(tb, evs, MediumGPU)
}

func (s eventSet) applyMedium(tb testing.TB, evs []KVEvent, m Medium) {
	tb.Helper()
	for _, ev := range evs {
		if ev.Medium != m && ev.Kind != Cleared {
			continue
		}
		switch ev.Kind {
		case Stored:
			for _, h := range ev.BlockHashes {
				if s[h] {
					tb.Fatalf("Stored %x twice", h)
				}
				s[h] = true
			}
		case Removed:
			for _, h := range ev.BlockHashes {
				if !s[h] {
					tb.Fatalf("Removed %x never stored", h)
				}
				delete(s, h)
			}
		case Cleared:
			clear(s)
		default:
			tb.Fatalf("bad event kind %v", ev.Kind)
		}
	}
}

// checkInvariants verifies the block manager against the request tables.
func checkInvariants(tb testing.TB, e *Engine, events eventSet) {
	tb.Helper()
	p := e.pool
	refs := make([]int32, p.n)
	live := 0
	for _, s := range e.running {
		if s.state != stRunning {
			tb.Fatalf("tombstone %d left in running", s.id)
		}
		live++
		// A request that loaded its prefix holds its whole prompt's blocks
		// from its admission on, as a remote prefill does.
		if want := e.blocksFor(s.computed); len(s.blocks) != want &&
			(len(s.blocks) < want || len(s.blocks) > e.blocksFor(s.prompt)) {
			tb.Fatalf("req %d: %d blocks for %d computed tokens", s.id, len(s.blocks), s.computed)
		}
		for _, b := range s.blocks {
			refs[b]++
		}
	}
	if live != e.live || live > e.cfg.MaxSeqs {
		tb.Fatalf("live %d, counted %d, cap %d", e.live, live, e.cfg.MaxSeqs)
	}
	for i := range e.waiting.len() {
		s := e.waiting.at(i)
		if s.state != stWaiting || (len(s.blocks) != 0 && !s.pulled) {
			tb.Fatalf("waiting req %d in state %d with %d blocks", s.id, s.state, len(s.blocks))
		}
		if s.pulled {
			countTransferBlocks(tb, e, s, refs)
		}
	}
	checkTransferState(tb, e, refs)
	free := 0
	for b := range p.n {
		if refs[b] != p.ref[b] {
			tb.Fatalf("block %d: ref %d, held by %d", b, p.ref[b], refs[b])
		}
		if p.ref[b] == 0 {
			free++
		}
		if p.hashed[b] {
			if got := p.cache.Get(p.hash[b]); got == nil || *got != int32(b) {
				tb.Fatalf("block %d hashed %x but cache has %v", b, p.hash[b], got)
			}
		}
	}
	walked := 0
	for b := p.next[p.n]; b != int32(p.n); b = p.next[b] {
		if p.ref[b] != 0 {
			tb.Fatalf("held block %d in the free queue", b)
		}
		walked++
	}
	if free != p.free || walked != p.free {
		tb.Fatalf("free: counter %d, ref-0 blocks %d, queue length %d", p.free, free, walked)
	}
	for h, b := range p.cache.All() {
		if !p.hashed[b] || p.hash[b] != h {
			tb.Fatalf("cache %x → block %d which carries %x (%v)", h, b, p.hash[b], p.hashed[b])
		}
	}
	if events != nil {
		if len(events) != p.cache.Len() {
			tb.Fatalf("event replay holds %d hashes, engine caches %d", len(events), p.cache.Len())
		}
		for h := range events {
			if p.cache.Get(h) == nil {
				tb.Fatalf("event replay holds %x, engine does not", h)
			}
		}
	}
}

// ---- the "engine tests show" ----

func TestSecondIdenticalPromptHitsCache(t *testing.T) {
	const prompt = 4000 // 250 full blocks of 16: the whole prompt is hashed
	tests := []struct {
		name    string
		profile string
		second  time.Duration // arrival of the second request
		extra   int           // tokens past the last full block
	}{
		{"after the first finished", "llama3-8b-h100", 10 * time.Second, 0},
		{"while the first decodes", "llama3-8b-h100", 500 * time.Millisecond, 0},
		{"70b profile", "llama3-70b-h100-tp2", 10 * time.Second, 0},
		{"partial last block", "llama3-8b-h100", 10 * time.Second, 7},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			prof := costmodel.MustLookup(tc.profile)
			e := newEngine(t, Config{Profile: prof})
			bs := e.Config().BlockSize
			blocks := (prompt - tc.extra) / bs
			a := req(1, bs, tc.extra, 100, seg{7, blocks})
			b := req(2, bs, tc.extra, 100, seg{7, blocks})
			res := drive(t, e, []arrival{{0, a}, {tc.second, b}}, nil)
			r1, r2 := res[1], res[2]
			if r1.cached != 0 {
				t.Errorf("first request cached %d, want 0", r1.cached)
			}
			// Alone and uncached, the first TTFT is the cost model's prefill time.
			if want := prof.PrefillTime(a.PromptTokens, 0, e.Config().MaxBatchTokens); absDur(r1.ttft()-want) > time.Microsecond {
				t.Errorf("first TTFT %v, cost model says %v", r1.ttft(), want)
			}
			if r2.cached < a.PromptTokens-bs || r2.cached >= a.PromptTokens {
				t.Errorf("second cached %d of %d, want ≥ prompt − one block and < prompt", r2.cached, a.PromptTokens)
			}
			ratio := float64(r1.ttft()) / float64(r2.ttft())
			t.Logf("TTFT %v then %v (×%.1f), cached %d/%d", r1.ttft(), r2.ttft(), ratio, r2.cached, a.PromptTokens)
			if ratio < 5 {
				t.Errorf("second TTFT %v only ×%.1f smaller than %v", r2.ttft(), ratio, r1.ttft())
			}
			st := e.Stats()
			if st.PrefixQueries != int64(2*a.PromptTokens) || st.PrefixHits != int64(r2.cached) {
				t.Errorf("prefix stats %d/%d, want %d/%d", st.PrefixHits, st.PrefixQueries, r2.cached, 2*a.PromptTokens)
			}
		})
	}
}

func absDur(d time.Duration) time.Duration {
	if d < 0 {
		return -d
	}
	return d
}

func TestTTFTGrowsWithQueueDepth(t *testing.T) {
	const prompt = 2000
	prof := costmodel.MustLookup(costmodel.Default)
	var prevMean time.Duration
	var ttft1 time.Duration
	for _, depth := range []int{1, 2, 4, 8, 16, 32} {
		t.Run(fmt.Sprint(depth), func(t *testing.T) {
			e := newEngine(t, Config{})
			var arr []arrival
			for i := range depth {
				arr = append(arr, arrival{0, req(uint64(i), 16, 0, 16, seg{uint64(100 + i), prompt / 16})})
			}
			res := drive(t, e, arr, nil)
			var sum, last time.Duration
			for _, r := range res {
				sum += r.ttft()
				last = max(last, r.ttft())
			}
			mean := sum / time.Duration(depth)
			// Physics: the last first token needs every queued prefill token computed.
			floor := time.Duration(float64(depth*prompt) * prof.C1 * float64(time.Millisecond))
			t.Logf("depth %2d: mean TTFT %v, last %v (floor %v)", depth, mean, last, floor)
			if last < floor {
				t.Errorf("last TTFT %v below the compute floor %v", last, floor)
			}
			if mean <= prevMean {
				t.Errorf("mean TTFT %v did not grow from %v", mean, prevMean)
			}
			prevMean = mean
			if depth == 1 {
				ttft1 = last
			}
			if depth == 32 && last < 10*ttft1 {
				t.Errorf("32 queued: last TTFT %v, < 10× the lone TTFT %v", last, ttft1)
			}
		})
	}
}

func TestKVCapacityRespected(t *testing.T) {
	tests := []struct {
		name      string
		numBlocks int
		prompts   int
		shared    int // blocks of a common prefix
	}{
		{"distinct prompts", 256, 40, 0},
		{"shared system prompt", 256, 40, 20},
		{"cache of one prompt", 70, 12, 8},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEngine(t, Config{NumBlocks: tc.numBlocks})
			var arr []arrival
			var reqs []*Request
			for i := range tc.prompts {
				r := req(uint64(i), 16, 8, 8, seg{1, tc.shared}, seg{uint64(10 + i), 62 - tc.shared})
				reqs = append(reqs, r)
				arr = append(arr, arrival{time.Duration(i) * 200 * time.Millisecond, r})
			}
			events := eventSet{}
			maxUsage, removed := 0.0, 0
			drive(t, e, arr, func(sr StepResult) {
				events.apply(t, sr.KV)
				for _, ev := range sr.KV {
					if ev.Kind == Removed {
						removed += len(ev.BlockHashes)
					}
				}
				st := e.Stats()
				if st.KVUsage < 0 || st.KVUsage > 1 || st.CachedBlocks > tc.numBlocks {
					t.Fatalf("usage %v, cached blocks %d of %d", st.KVUsage, st.CachedBlocks, tc.numBlocks)
				}
				maxUsage = max(maxUsage, st.KVUsage)
				checkInvariants(t, e, events)
			})
			st := e.Stats()
			t.Logf("max usage %.2f, evicted %d, removed events %d, cached %d", maxUsage, st.EvictedBlocks, removed, st.CachedBlocks)
			if st.EvictedBlocks == 0 || int64(removed) != st.EvictedBlocks {
				t.Errorf("evicted %d, Removed events carried %d hashes", st.EvictedBlocks, removed)
			}
			if maxUsage < 0.2 || st.KVUsage != 0 {
				t.Errorf("usage peaked at %v and ended at %v", maxUsage, st.KVUsage)
			}
			if st.RequestsFinished != int64(tc.prompts) {
				t.Errorf("finished %d of %d", st.RequestsFinished, tc.prompts)
			}
			first, last := reqs[0], reqs[len(reqs)-1]
			if got := e.PeekCached(first.BlockHashes, first.PromptTokens); got > tc.shared*16 {
				t.Errorf("oldest prompt still has %d tokens cached beyond the shared %d", got, tc.shared*16)
			}
			if got := e.PeekCached(last.BlockHashes, last.PromptTokens); got != len(last.BlockHashes)*16 {
				t.Errorf("newest prompt has %d tokens cached, want %d", got, len(last.BlockHashes)*16)
			}
		})
	}
}

func TestDeterminism(t *testing.T) {
	type trace struct {
		ends []time.Duration
		outs []Output
	}
	run := func(seed uint64, jitter float64) trace {
		e := newEngine(t, Config{NumBlocks: 600, Seed: seed, Jitter: jitter, MaxSeqs: 16, MaxBatchTokens: 2048})
		rng := rand.New(rand.NewPCG(42, 1))
		var arr []arrival
		var at time.Duration
		for i := range 60 {
			at += time.Duration(rng.ExpFloat64() * float64(150*time.Millisecond))
			arr = append(arr, arrival{at, req(uint64(i), 16, rng.IntN(16), 1+rng.IntN(64),
				seg{uint64(rng.IntN(3)), 10 + rng.IntN(30)}, seg{uint64(1000 + i), rng.IntN(40)})})
		}
		var tr trace
		drive(t, e, arr, func(sr StepResult) {
			tr.ends = append(tr.ends, sr.End)
			tr.outs = append(tr.outs, sr.Outputs...)
		})
		return tr
	}
	tests := []struct {
		name       string
		seedA      uint64
		seedB      uint64
		jitter     float64
		wantEqual  bool
		wantJitter bool
	}{
		{"no jitter, any seed", 1, 2, 0, true, false},
		{"jitter, same seed", 7, 7, 0.2, true, true},
		{"jitter, other seed", 7, 8, 0.2, false, true},
	}
	base := run(0, 0)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a, b := run(tc.seedA, tc.jitter), run(tc.seedB, tc.jitter)
			eq := slices.Equal(a.ends, b.ends) && slices.Equal(a.outs, b.outs)
			if eq != tc.wantEqual {
				t.Errorf("runs equal = %v, want %v (%d vs %d steps)", eq, tc.wantEqual, len(a.ends), len(b.ends))
			}
			if differs := !slices.Equal(a.ends, base.ends); differs != tc.wantJitter {
				t.Errorf("timings differ from the jitter-free run = %v, want %v", differs, tc.wantJitter)
			}
		})
	}
}

// ---- scheduler ----

func TestChunkingRespectsBudget(t *testing.T) {
	prof := costmodel.MustLookup(costmodel.Default)
	tests := []struct {
		budget, maxSeqs, prompt int
		wantSteps               int // steps to the first token of a lone request
	}{
		{64, 4, 1000, 16},
		{512, 16, 3000, 6},
		{8192, 256, 3000, 1},
		{1000, 8, 3000, 3},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("budget %d", tc.budget), func(t *testing.T) {
			// A lone request: its prefill is split into ⌈prompt/budget⌉ chunks.
			e := newEngine(t, Config{MaxBatchTokens: tc.budget, MaxSeqs: tc.maxSeqs})
			r := req(1, 16, tc.prompt%16, 4, seg{1, tc.prompt / 16})
			res := drive(t, e, []arrival{{0, r}}, nil)
			if got := res[1].firstStep + 1; got != tc.wantSteps {
				t.Errorf("first token after %d steps, want %d", got, tc.wantSteps)
			}
			want := prof.PrefillTime(tc.prompt, 0, tc.budget)
			if absDur(res[1].ttft()-want) > time.Duration(tc.wantSteps)*time.Nanosecond {
				t.Errorf("TTFT %v, cost model %v", res[1].ttft(), want)
			}

			// Many requests: no step exceeds the budget, and a step leaves budget
			// unused only when nothing else could be scheduled.
			e = newEngine(t, Config{MaxBatchTokens: tc.budget, MaxSeqs: tc.maxSeqs})
			var arr []arrival
			for i := range 20 {
				arr = append(arr, arrival{time.Duration(i) * 5 * time.Millisecond,
					req(uint64(i), 16, i, 8, seg{uint64(50 + i), tc.prompt / 16})})
			}
			full := 0
			drive(t, e, arr, func(sr StepResult) {
				if sr.Tokens > tc.budget {
					t.Fatalf("step of %d tokens, budget %d", sr.Tokens, tc.budget)
				}
				st := e.Stats()
				if sr.Tokens < tc.budget && st.Waiting > 0 && st.Running < tc.maxSeqs && st.Preemptions == 0 {
					t.Fatalf("step of %d < %d tokens while %d wait and %d run", sr.Tokens, tc.budget, st.Waiting, st.Running)
				}
				if sr.Tokens == tc.budget {
					full++
				}
			})
			if full == 0 {
				t.Errorf("no step used the whole budget")
			}
		})
	}
}

func TestSequenceCap(t *testing.T) {
	tests := []struct{ maxSeqs, requests int }{{1, 5}, {4, 10}, {16, 40}}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("cap %d", tc.maxSeqs), func(t *testing.T) {
			e := newEngine(t, Config{MaxSeqs: tc.maxSeqs, MaxBatchTokens: 4096})
			var arr []arrival
			for i := range tc.requests {
				arr = append(arr, arrival{0, req(uint64(i), 16, 3, 20, seg{uint64(i), 4})})
			}
			peak := 0
			res := drive(t, e, arr, func(sr StepResult) {
				st := e.Stats()
				if sr.Seqs > tc.maxSeqs || st.Running > tc.maxSeqs {
					t.Fatalf("%d scheduled, %d running, cap %d", sr.Seqs, st.Running, tc.maxSeqs)
				}
				peak = max(peak, st.Running)
			})
			if peak != tc.maxSeqs {
				t.Errorf("peak running %d, want the cap %d", peak, tc.maxSeqs)
			}
			for id, r := range res {
				if !r.finished || r.tokens != 20 {
					t.Errorf("req %d: finished %v with %d tokens", id, r.finished, r.tokens)
				}
			}
		})
	}
}

// ---- KV block manager ----

func TestPreemptionUnderTinyCache(t *testing.T) {
	tests := []struct {
		name                     string
		numBlocks, n, maxTokens  int
		shared, unique, maxSeqs  int
		budget                   int
		wantPreemptions, atLeast int64
	}{
		{"decodes outgrow the cache", 40, 8, 300, 0, 6, 256, 8192, 1, 0},
		{"shared prefix", 48, 10, 200, 4, 3, 256, 8192, 1, 0},
		{"chunked prefills", 64, 12, 150, 0, 20, 8, 128, 1, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEngine(t, Config{NumBlocks: tc.numBlocks, MaxSeqs: tc.maxSeqs, MaxBatchTokens: tc.budget})
			var arr []arrival
			for i := range tc.n {
				arr = append(arr, arrival{time.Duration(i) * time.Millisecond,
					req(uint64(i), 16, 5, tc.maxTokens, seg{99, tc.shared}, seg{uint64(i), tc.unique})})
			}
			events := eventSet{}
			res := drive(t, e, arr, func(sr StepResult) {
				events.apply(t, sr.KV)
				checkInvariants(t, e, events)
			})
			st := e.Stats()
			t.Logf("preemptions %d, evicted %d", st.Preemptions, st.EvictedBlocks)
			if st.Preemptions < tc.wantPreemptions {
				t.Errorf("%d preemptions, want some", st.Preemptions)
			}
			for id, r := range res {
				if !r.finished || r.tokens != tc.maxTokens || r.firsts != 1 {
					t.Errorf("req %d: finished %v, %d tokens (want %d), %d first tokens", id, r.finished, r.tokens, tc.maxTokens, r.firsts)
				}
			}
			if st.GenerationTokens != int64(tc.n*tc.maxTokens) || st.RequestsFinished != int64(tc.n) || st.KVUsage != 0 {
				t.Errorf("stats %+v", st)
			}
			// Prefix lookups count once per request, not again on recompute.
			if want := int64(tc.n * arr[0].r.PromptTokens); st.PrefixQueries != want || st.PromptTokens != want {
				t.Errorf("prefix queries %d, prompt tokens %d, want %d each", st.PrefixQueries, st.PromptTokens, want)
			}
		})
	}
}

func TestFreedBlocksEvictTailFirst(t *testing.T) {
	// 20 blocks of 4 tokens. A holds 10 blocks and finishes; B needs 14:
	// the 10 never-used blocks go first, then A's last four, deepest first.
	e := newEngine(t, Config{NumBlocks: 20, BlockSize: 4, MaxSeqs: 4, MaxBatchTokens: 64})
	a := req(1, 4, 0, 1, seg{1, 10})
	b := req(2, 4, 0, 1, seg{2, 14})
	var removed []uint64
	drive(t, e, []arrival{{0, a}, {time.Second, b}}, func(sr StepResult) {
		for _, ev := range sr.KV {
			if ev.Kind == Removed {
				removed = append(removed, ev.BlockHashes...)
			}
		}
	})
	want := []uint64{a.BlockHashes[9], a.BlockHashes[8], a.BlockHashes[7], a.BlockHashes[6]}
	if !slices.Equal(removed, want) {
		t.Errorf("removed %x, want A's tail %x", removed, want)
	}
	if got := e.PeekCached(a.BlockHashes, a.PromptTokens); got != 6*4 {
		t.Errorf("A keeps %d cached tokens, want its head of 24", got)
	}
}

func TestKVEventsContent(t *testing.T) {
	e := newEngine(t, Config{BlockSize: 4, MaxBatchTokens: 8, MaxSeqs: 2})
	toks := make([]uint32, 18)
	for i := range toks {
		toks[i] = uint32(1000 + i)
	}
	r := req(1, 4, 2, 2, seg{3, 4})
	r.TokenIDs, r.LoraName = toks, "adapter"
	var stored []KVEvent
	drive(t, e, []arrival{{0, r}}, func(sr StepResult) {
		for _, ev := range sr.KV {
			stored = append(stored, ev)
		}
	})
	// Budget 8 = two blocks a step: blocks [0,2) then [2,4), chained by parent.
	want := []KVEvent{
		{Kind: Stored, BlockHashes: r.BlockHashes[0:2], TokenIDs: toks[0:8], BlockSize: 4, LoraName: "adapter"},
		{Kind: Stored, BlockHashes: r.BlockHashes[2:4], TokenIDs: toks[8:16], BlockSize: 4, LoraName: "adapter",
			ParentHash: r.BlockHashes[1], HasParent: true},
	}
	if len(stored) != len(want) {
		t.Fatalf("events %+v, want %+v", stored, want)
	}
	for i := range want {
		g, w := stored[i], want[i]
		if g.Kind != w.Kind || !slices.Equal(g.BlockHashes, w.BlockHashes) || !slices.Equal(g.TokenIDs, w.TokenIDs) ||
			g.ParentHash != w.ParentHash || g.HasParent != w.HasParent || g.BlockSize != w.BlockSize || g.LoraName != w.LoraName {
			t.Errorf("event %d: %+v, want %+v", i, g, w)
		}
	}
	if ev, ok := e.ResetPrefixCache(); !ok || ev.Kind != Cleared || e.Stats().CachedBlocks != 0 ||
		e.PeekCached(r.BlockHashes, r.PromptTokens) != 0 {
		t.Errorf("reset: %+v %v, stats %+v", ev, ok, e.Stats())
	}
}

func TestResetPrefixCacheRefusesWhileBusy(t *testing.T) {
	e := newEngine(t, Config{})
	if err := e.Add(req(1, 16, 0, 5, seg{1, 10}), 0); err != nil {
		t.Fatal(err)
	}
	e.Step(0)
	if _, ok := e.ResetPrefixCache(); ok {
		t.Fatal("reset succeeded with a running request")
	}
	if e.Stats().CachedBlocks != 10 {
		t.Errorf("cached blocks %d after refused reset", e.Stats().CachedBlocks)
	}
}

func TestAbort(t *testing.T) {
	tests := []struct {
		name      string
		steps     int // steps before the abort
		abortID   uint64
		want      bool
		wantWait  int
		wantCache int // tokens of request 1 still cached after the abort
	}{
		{"running request", 1, 1, true, 1, 10 * 16},
		{"waiting request", 1, 2, true, 0, 10 * 16},
		{"before any step", 0, 1, true, 1, 0},
		{"unknown id", 1, 42, false, 1, 10 * 16},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// Cap 1: request 1 runs, request 2 waits.
			e := newEngine(t, Config{MaxSeqs: 1, MaxBatchTokens: 1024})
			r1 := req(1, 16, 4, 50, seg{1, 10})
			r2 := req(2, 16, 4, 50, seg{2, 10})
			for _, r := range []*Request{r1, r2} {
				if err := e.Add(r, 0); err != nil {
					t.Fatal(err)
				}
			}
			var now time.Duration
			counts := map[uint64]int{}
			step := func() {
				sr := e.Step(now)
				for _, o := range sr.Outputs {
					counts[o.ReqID] += o.NewTokens
				}
				now = sr.End
			}
			for range tc.steps {
				step()
			}
			before := e.Stats()
			if got := e.Abort(tc.abortID); got != tc.want {
				t.Fatalf("Abort = %v, want %v", got, tc.want)
			}
			st := e.Stats()
			if st.Waiting != tc.wantWait {
				t.Errorf("waiting %d, want %d", st.Waiting, tc.wantWait)
			}
			if tc.abortID == 1 && tc.steps > 0 && (before.KVUsage == 0 || st.KVUsage != 0 || st.Running != 0) {
				t.Errorf("usage %v → %v, running %d: blocks not freed", before.KVUsage, st.KVUsage, st.Running)
			}
			if got := e.PeekCached(r1.BlockHashes, r1.PromptTokens); got != tc.wantCache {
				t.Errorf("request 1 cached %d tokens, want %d", got, tc.wantCache)
			}
			// The aborted id is free again; the aborted request emits nothing
			// more, the other one all its tokens.
			if tc.want {
				delete(counts, tc.abortID)
				if err := e.Add(req(tc.abortID, 16, 0, 3, seg{5, 2}), now); err != nil {
					t.Errorf("re-adding aborted id: %v", err)
				}
			}
			for steps := 0; e.HasWork(); steps++ {
				if steps > 1000 {
					t.Fatal("no quiescence")
				}
				step()
			}
			for _, id := range []uint64{1, 2} {
				want := 50
				if tc.want && id == tc.abortID {
					want = 3
				}
				if counts[id] != want {
					t.Errorf("req %d emitted %d tokens in all, want %d", id, counts[id], want)
				}
			}
			checkInvariants(t, e, nil)
			if e.Stats().KVUsage != 0 {
				t.Errorf("usage %v at rest", e.Stats().KVUsage)
			}
		})
	}
}

func TestAddErrors(t *testing.T) {
	e := newEngine(t, Config{NumBlocks: 100, BlockSize: 16, MaxSeqs: 8, MaxBatchTokens: 512})
	if err := e.Add(req(7, 16, 0, 1, seg{1, 2}), 0); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		r    *Request
		want error
	}{
		{"nil", nil, ErrInvalidRequest},
		{"empty prompt", &Request{ID: 1, PromptTokens: 0, MaxTokens: 1}, ErrInvalidRequest},
		{"no output", &Request{ID: 1, PromptTokens: 10, MaxTokens: 0}, ErrInvalidRequest},
		{"too many hashes", &Request{ID: 1, PromptTokens: 31, MaxTokens: 1, BlockHashes: chain(seg{1, 2})}, ErrInvalidRequest},
		{"token ids mismatch", &Request{ID: 1, PromptTokens: 32, MaxTokens: 1, TokenIDs: make([]uint32, 31)}, ErrInvalidRequest},
		{"prompt too long", &Request{ID: 1, PromptTokens: 1601, MaxTokens: 1}, ErrTooLong},
		{"output too long", &Request{ID: 1, PromptTokens: 1000, MaxTokens: 602}, ErrTooLong},
		{"exactly fits", &Request{ID: 1, PromptTokens: 1000, MaxTokens: 601}, nil},
		// No client number is added to another: these must not wrap around.
		{"max_tokens MaxInt", &Request{ID: 3, PromptTokens: 10, MaxTokens: math.MaxInt}, ErrTooLong},
		{"prompt MaxInt", &Request{ID: 3, PromptTokens: math.MaxInt, MaxTokens: 1}, ErrTooLong},
		{"both MaxInt", &Request{ID: 3, PromptTokens: math.MaxInt, MaxTokens: math.MaxInt}, ErrTooLong},
		{"max_tokens MaxInt−prompt+2", &Request{ID: 3, PromptTokens: 10, MaxTokens: math.MaxInt - 8}, ErrTooLong},
		{"fewer hashes than blocks", &Request{ID: 2, PromptTokens: 100, MaxTokens: 1, BlockHashes: chain(seg{1, 2})}, nil},
		{"duplicate id", &Request{ID: 7, PromptTokens: 10, MaxTokens: 1}, ErrDuplicateID},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := e.Add(tc.r, 0)
			if !errors.Is(err, tc.want) || (tc.want == nil) != (err == nil) {
				t.Errorf("Add: %v, want %v", err, tc.want)
			}
		})
	}
}

func TestNewConfig(t *testing.T) {
	tests := []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"zero value", Config{}, true},
		{"negative blocks", Config{NumBlocks: -1}, false},
		{"negative block size", Config{BlockSize: -16}, false},
		{"block size beyond int32", Config{BlockSize: math.MaxInt32 + 1}, false},
		{"budget below seq cap", Config{MaxBatchTokens: 100}, false},
		{"budget equals seq cap", Config{MaxBatchTokens: 32, MaxSeqs: 32}, true},
		{"negative seqs", Config{MaxSeqs: -1}, false},
		{"jitter 1", Config{Jitter: 1}, false},
		{"jitter NaN", Config{Jitter: math.NaN()}, false},
		{"bad profile", Config{Profile: costmodel.Profile{Name: "x", C1: 0}}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e, err := New(tc.cfg)
			if tc.ok != (err == nil) || (!tc.ok && !errors.Is(err, ErrInvalidConfig)) {
				t.Fatalf("New: %v, want ok=%v", err, tc.ok)
			}
			if tc.ok {
				st := e.Stats()
				want := tc.cfg.WithDefaults()
				if st.NumBlocks != want.NumBlocks || st.BlockSize != want.BlockSize || e.Config().Profile.Name == "" {
					t.Errorf("stats %+v, config %+v", st, e.Config())
				}
			}
		})
	}
}

func TestPeekCachedAgreesWithReport(t *testing.T) {
	e := newEngine(t, Config{})
	// Warm the cache: a system prompt and one whole conversation.
	warm := []*Request{
		req(100, 16, 0, 4, seg{1, 64}, seg{2, 100}),
		req(101, 16, 5, 4, seg{1, 64}, seg{3, 30}),
	}
	var arr []arrival
	for i, r := range warm {
		arr = append(arr, arrival{time.Duration(i) * time.Second, r})
	}
	drive(t, e, arr, nil)

	tests := []struct {
		name string
		r    *Request
		want int
	}{
		{"cold", req(1, 16, 9, 4, seg{9, 50}), 0},
		{"system prompt only", req(2, 16, 9, 4, seg{1, 64}, seg{8, 10}), 64 * 16},
		{"identical, block-aligned", req(3, 16, 0, 4, seg{1, 64}, seg{2, 100}), 163 * 16},
		{"identical plus a partial block", req(4, 16, 5, 4, seg{1, 64}, seg{3, 30}), 94 * 16},
		{"continued conversation", req(5, 16, 3, 4, seg{1, 64}, seg{2, 100}, seg{4, 20}), 164 * 16},
		{"one block", req(6, 16, 0, 4, seg{1, 1}), 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			peek := e.PeekCached(tc.r.BlockHashes, tc.r.PromptTokens)
			res := drive(t, e, []arrival{{0, tc.r}}, nil)
			if peek != tc.want || res[tc.r.ID].cached != peek {
				t.Errorf("peek %d, reported %d, want %d", peek, res[tc.r.ID].cached, tc.want)
			}
		})
	}
}

// TestRandomWorkloadsKeepInvariants drives random configurations and
// workloads (shared prefixes, chunking, tiny caches, aborts) and checks the
// block manager after every step and the outputs at the end.
func TestRandomWorkloadsKeepInvariants(t *testing.T) {
	for seed := range uint64(40) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 99))
			bs := 1 + rng.IntN(16)
			maxSeqs := 1 + rng.IntN(12)
			cfg := Config{
				NumBlocks:      8 + rng.IntN(200),
				BlockSize:      bs,
				MaxSeqs:        maxSeqs,
				MaxBatchTokens: maxSeqs + rng.IntN(400),
				Seed:           seed,
				Jitter:         0.1 * rng.Float64(),
			}
			e := newEngine(t, cfg)
			capTokens := cfg.NumBlocks * bs
			type plan struct {
				r       *Request
				at      time.Duration
				abortAt int // step index at which to abort, −1 never
			}
			var plans []plan
			var at time.Duration
			for i := range 30 {
				at += time.Duration(rng.IntN(50)) * time.Millisecond
				r := req(uint64(i), bs, rng.IntN(bs), 1+rng.IntN(40),
					seg{uint64(rng.IntN(3)), rng.IntN(10)}, seg{uint64(10 + rng.IntN(20)), rng.IntN(10)})
				if r.PromptTokens == 0 {
					r.PromptTokens = 1
				}
				if r.PromptTokens+r.MaxTokens-1 > capTokens {
					continue // ErrTooLong is tested elsewhere
				}
				abortAt := -1
				if rng.IntN(6) == 0 {
					abortAt = rng.IntN(60)
				}
				plans = append(plans, plan{r, at, abortAt})
			}
			events := eventSet{}
			tokens := map[uint64]int{}
			finished := map[uint64]bool{}
			aborted := map[uint64]bool{}
			var now time.Duration
			next := 0
			for step := 0; ; step++ {
				if step > 100_000 {
					t.Fatalf("no quiescence, stats %+v", e.Stats())
				}
				for next < len(plans) && plans[next].at <= now {
					if err := e.Add(plans[next].r, plans[next].at); err != nil {
						t.Fatal(err)
					}
					next++
				}
				for _, p := range plans[:next] {
					if p.abortAt == step && !finished[p.r.ID] {
						if !e.Abort(p.r.ID) {
							t.Fatalf("abort of live %d failed", p.r.ID)
						}
						aborted[p.r.ID] = true
						checkInvariants(t, e, events)
					}
				}
				if !e.HasWork() {
					if next == len(plans) {
						break
					}
					now = plans[next].at
					continue
				}
				before := map[uint64]bool{}
				for _, s := range e.running {
					before[s.id] = true
				}
				preemptions := e.Stats().Preemptions
				sr := e.Step(now)
				if e.Stats().Preemptions > preemptions {
					for _, s := range e.running {
						if !before[s.id] {
							t.Fatalf("step %d preempted and admitted %d", step, s.id)
						}
					}
				}
				if sr.Tokens > cfg.MaxBatchTokens || sr.Seqs > cfg.MaxSeqs || sr.Tokens == 0 {
					t.Fatalf("step %+v breaks budget %d / cap %d", sr, cfg.MaxBatchTokens, cfg.MaxSeqs)
				}
				events.apply(t, sr.KV)
				for _, o := range sr.Outputs {
					if finished[o.ReqID] || aborted[o.ReqID] {
						t.Fatalf("output for gone request %d", o.ReqID)
					}
					tokens[o.ReqID] += o.NewTokens
					if o.First != (tokens[o.ReqID] == 1) {
						t.Fatalf("req %d: First=%v at token %d", o.ReqID, o.First, tokens[o.ReqID])
					}
					finished[o.ReqID] = o.Finished
				}
				checkInvariants(t, e, events)
				now = sr.End
			}
			for _, p := range plans {
				id := p.r.ID
				if aborted[id] {
					continue
				}
				if !finished[id] || tokens[id] != p.r.MaxTokens {
					t.Errorf("req %d: finished %v with %d of %d tokens", id, finished[id], tokens[id], p.r.MaxTokens)
				}
			}
			if st := e.Stats(); st.KVUsage != 0 || st.Running+st.Waiting != 0 {
				t.Errorf("not at rest: %+v", st)
			}
		})
	}
}

// TestDecodeStepsDoNotAllocate: the replay runs hundreds of thousands of
// steps; a steady decode step must not allocate.
func TestDecodeStepsDoNotAllocate(t *testing.T) {
	e := newEngine(t, Config{})
	for i := range 64 {
		if err := e.Add(req(uint64(i), 16, 3, 100_000, seg{uint64(i), 32}), 0); err != nil {
			t.Fatal(err)
		}
	}
	var now time.Duration
	for range 5 { // admit and prefill everything
		now = e.Step(now).End
	}
	if st := e.Stats(); st.Running != 64 || st.Waiting != 0 {
		t.Fatalf("not in steady decode: %+v", st)
	}
	allocs := testing.AllocsPerRun(500, func() {
		sr := e.Step(now)
		if len(sr.Outputs) != 64 {
			t.Fatalf("%d outputs", len(sr.Outputs))
		}
		now = sr.End
	})
	if allocs != 0 {
		t.Errorf("%v allocations per decode step", allocs)
	}
}

// BenchmarkEngine feeds one engine 2,000 requests of ~8k tokens (a shared
// 2k-token system prompt out of 20, a per-conversation 4k history reused by
// the next turn, fresh turns) at a Poisson rate near its capacity, in virtual
// time, and reports simulated requests and steps per wall second.
func BenchmarkEngine(b *testing.B) {
	const n = 2000
	rng := rand.New(rand.NewPCG(1, 2))
	arr := make([]arrival, n)
	var at time.Duration
	for i := range n {
		at += time.Duration(rng.ExpFloat64() * float64(300*time.Millisecond))
		conv := uint64(rng.IntN(200))
		r := req(uint64(i), 16, rng.IntN(16), 64+rng.IntN(192),
			seg{conv % 20, 128}, seg{1000 + conv, 250}, seg{uint64(100_000 + i), 100 + rng.IntN(50)})
		arr[i] = arrival{at, r}
	}
	b.ReportAllocs()
	var steps, hits, queries int64
	var virtual time.Duration
	for b.Loop() {
		e := newEngine(b, Config{DisableKVEvents: true})
		res := drive(b, e, arr, func(StepResult) { steps++ })
		st := e.Stats()
		hits, queries = st.PrefixHits, st.PrefixQueries
		for _, r := range res {
			virtual = max(virtual, r.finish)
		}
	}
	sec := b.Elapsed().Seconds()
	b.ReportMetric(float64(n*b.N)/sec, "requests/s")
	b.ReportMetric(float64(steps)/sec, "steps/s")
	b.ReportMetric(float64(hits)/float64(queries), "hit_rate")
	b.ReportMetric(virtual.Seconds(), "virtual_s")
}

// TestStepTimeFollowsCostModel scripts steps and checks each one's duration
// against the cost model's terms: prefill chunk × context (the cached prefix
// counts as context), one token and its context per decode.
func TestStepTimeFollowsCostModel(t *testing.T) {
	prof := costmodel.MustLookup(costmodel.Default)
	a := req(1, 16, 8, 10, seg{1, 62})            // 1000 tokens
	b := req(2, 16, 4, 10, seg{2, 31})            // 500 tokens
	c := req(3, 16, 8, 10, seg{1, 62})            // A again: 992 cached, 8 to compute
	d := req(4, 16, 0, 10, seg{1, 40}, seg{4, 9}) // 784 tokens, 640 cached
	steps := []struct {
		name string
		add  []*Request
		want costmodel.Step
	}{
		{"prefill alone", []*Request{a}, costmodel.Step{Tokens: 1000, PrefillCtx: 1000 * 1000}},
		{"decode alone", nil, costmodel.Step{Tokens: 1, DecodeCtx: 1001}},
		{"decode and a new prefill", []*Request{b}, costmodel.Step{Tokens: 1 + 500, PrefillCtx: 500 * 500, DecodeCtx: 1002}},
		{"decodes and cached prefills", []*Request{c, d}, costmodel.Step{
			Tokens:     1 + 1 + 8 + 144,
			PrefillCtx: 8*1000 + 144*784,
			DecodeCtx:  1003 + 501,
		}},
		{"four decodes", nil, costmodel.Step{Tokens: 4, DecodeCtx: 1004 + 502 + 1001 + 785}},
	}
	e := newEngine(t, Config{})
	var now time.Duration
	for _, st := range steps {
		for _, r := range st.add {
			if err := e.Add(r, now); err != nil {
				t.Fatal(err)
			}
		}
		sr := e.Step(now)
		if got, want := sr.End-sr.Start, prof.StepTime(st.want); got != want || sr.Tokens != st.want.Tokens {
			t.Errorf("%s: step took %v for %d tokens, cost model %v for %d", st.name, got, sr.Tokens, want, st.want.Tokens)
		}
		now = sr.End
	}
}

// TestPreemptsMostRecentlyAdmitted: when decodes outgrow the cache, the
// newest running request is preempted, goes to the head of the waiting queue,
// and the older ones keep decoding.
func TestPreemptsMostRecentlyAdmitted(t *testing.T) {
	for _, n := range []int{2, 3, 4} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			// Blocks of 4; each request needs 2 blocks for its prompt and
			// grows to 12, all crossing block boundaries in the same steps;
			// the cache holds 12 blocks.
			// One more request waits behind the sequence cap; the preempted
			// one must go ahead of it.
			e := newEngine(t, Config{NumBlocks: 12, BlockSize: 4, MaxSeqs: n, MaxBatchTokens: 64})
			for i := range n + 1 {
				if err := e.Add(req(uint64(i), 4, 0, 40, seg{uint64(i), 2}), 0); err != nil {
					t.Fatal(err)
				}
			}
			var now time.Duration
			for step := 0; e.Stats().Preemptions == 0; step++ {
				if step > 100 {
					t.Fatal("no preemption")
				}
				sr := e.Step(now)
				now = sr.End
				if e.Stats().Preemptions == 0 {
					continue
				}
				if e.Stats().Preemptions != 1 || e.waiting.len() != 2 || e.waiting.at(0).id != uint64(n-1) || e.waiting.at(1).id != uint64(n) {
					t.Fatalf("preempted %d, waiting %d with %d at the head, want one: the newest %d, ahead of %d",
						e.Stats().Preemptions, e.waiting.len(), e.waiting.front().id, n-1, n)
				}
				var got []uint64
				for _, o := range sr.Outputs {
					got = append(got, o.ReqID)
				}
				if want := []uint64{0, 1, 2, 3}[:n-1]; !slices.Equal(got, want) {
					t.Errorf("the preempting step decoded %v, want the older %v", got, want)
				}
			}
		})
	}
}

// TestFCFSByArrival: with one sequence at a time, requests are served in
// order of arrival time, whatever the order of the Add calls.
func TestFCFSByArrival(t *testing.T) {
	tests := []struct {
		name  string
		times []time.Duration // arrival time of request i, added in index order
		want  []uint64        // order of first tokens
	}{
		{"in order", []time.Duration{0, 1, 2, 3}, []uint64{0, 1, 2, 3}},
		{"late adds of earlier arrivals", []time.Duration{3, 1, 2, 0}, []uint64{3, 1, 2, 0}},
		{"ties keep add order", []time.Duration{5, 5, 1, 5}, []uint64{2, 0, 1, 3}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEngine(t, Config{MaxSeqs: 1, MaxBatchTokens: 256})
			for i, at := range tc.times {
				if err := e.Add(req(uint64(i), 16, 1, 2, seg{uint64(i), 3}), at); err != nil {
					t.Fatal(err)
				}
			}
			var got []uint64
			var now time.Duration = 10
			for steps := 0; e.HasWork(); steps++ {
				if steps > 100 {
					t.Fatal("no quiescence")
				}
				sr := e.Step(now)
				for _, o := range sr.Outputs {
					if o.First {
						got = append(got, o.ReqID)
					}
				}
				now = sr.End
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("served %v, want %v", got, tc.want)
			}
		})
	}
}

// TestPriorityScheduling: with vLLM's --scheduling-policy priority the
// waiting queue is ordered by (priority, arrival); without it, priorities
// are ignored.
func TestPriorityScheduling(t *testing.T) {
	prios := []int{2, 0, 1, 0, -1}
	for _, tc := range []struct {
		on   bool
		want []uint64
	}{{false, []uint64{0, 1, 2, 3, 4}}, {true, []uint64{4, 1, 3, 2, 0}}} {
		e := newEngine(t, Config{MaxSeqs: 1, MaxBatchTokens: 256, PriorityScheduling: tc.on})
		for i, p := range prios {
			r := req(uint64(i), 16, 1, 2, seg{uint64(i), 3})
			r.Priority = p
			if err := e.Add(r, time.Duration(i)); err != nil {
				t.Fatal(err)
			}
		}
		var got []uint64
		var now time.Duration = 10
		for steps := 0; e.HasWork() && steps < 100; steps++ {
			sr := e.Step(now)
			for _, o := range sr.Outputs {
				if o.First {
					got = append(got, o.ReqID)
				}
			}
			now = sr.End
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("priority scheduling %v: served %v, want %v", tc.on, got, tc.want)
		}
	}
}

// TestPreemptingStepAdmitsNothing: like vLLM, a step that preempted admits no
// waiting request, even when budget and blocks would allow a small chunk. With
// a budget of 2 and two decoding requests, the preempting step has 1 token of
// budget left and the victim's recompute could restart in it; it must wait.
func TestPreemptingStepAdmitsNothing(t *testing.T) {
	e := newEngine(t, Config{NumBlocks: 12, BlockSize: 4, MaxSeqs: 2, MaxBatchTokens: 2})
	for i := range 2 {
		if err := e.Add(req(uint64(i), 4, 0, 40, seg{uint64(i), 1}), 0); err != nil {
			t.Fatal(err)
		}
	}
	var now time.Duration
	tokens := map[uint64]int{}
	preempted := false
	for steps := 0; e.HasWork(); steps++ {
		if steps > 1000 {
			t.Fatal("no quiescence")
		}
		before := e.Stats().Preemptions
		sr := e.Step(now)
		for _, o := range sr.Outputs {
			tokens[o.ReqID] += o.NewTokens
		}
		now = sr.End
		if e.Stats().Preemptions > before && !preempted {
			preempted = true
			if len(e.running) != 1 || e.running[0].id != 0 || e.waiting.len() != 1 || e.waiting.front().id != 1 {
				t.Fatalf("after the preempting step: running %d (first %d), waiting %d", len(e.running), e.running[0].id, e.waiting.len())
			}
			if sr.Tokens != 1 {
				t.Errorf("preempting step ran %d tokens, want A's decode only", sr.Tokens)
			}
		}
	}
	if !preempted || tokens[0] != 40 || tokens[1] != 40 {
		t.Errorf("preempted %v, tokens %v", preempted, tokens)
	}
}

// LoraRequests follows requests from waiting to running to gone; the base
// model's are not counted.
func TestLoraRequests(t *testing.T) {
	e := newEngine(t, Config{NumBlocks: 100, BlockSize: 16, MaxSeqs: 2, MaxBatchTokens: 512})
	add := func(id uint64, lora string, maxTokens int) {
		r := req(id, 16, 3, maxTokens, seg{id, 1})
		r.LoraName = lora
		if err := e.Add(r, 0); err != nil {
			t.Fatal(err)
		}
	}
	add(1, "sql", 1)
	add(2, "", 1)
	add(3, "chat", 2)
	add(4, "sql", 2)
	check := func(when string, wantRun, wantWait map[string]int) {
		t.Helper()
		run, wait := e.LoraRequests()
		if fmt.Sprint(run) != fmt.Sprint(wantRun) || fmt.Sprint(wait) != fmt.Sprint(wantWait) {
			t.Errorf("%s: running %v waiting %v, want %v and %v", when, run, wait, wantRun, wantWait)
		}
	}
	check("queued", map[string]int{}, map[string]int{"sql": 2, "chat": 1})
	e.Step(0) // 1 and 2 run (MaxSeqs 2) and finish after one token
	check("after step 1", map[string]int{}, map[string]int{"sql": 1, "chat": 1})
	e.Step(0) // 3 and 4 admitted
	check("after step 2", map[string]int{"sql": 1, "chat": 1}, map[string]int{})
	e.Step(0)
	check("done", map[string]int{}, map[string]int{})
}
