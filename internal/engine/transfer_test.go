package engine

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
)

// ---- helpers: invariants of transfers and holds, a driver with events ----

// countTransferBlocks checks that s, which holds its blocks outside the
// running list (pulling, pulled or held), holds the blocks of its whole
// prompt, and counts its references into refs.
func countTransferBlocks(tb testing.TB, e *Engine, s *seq, refs []int32) {
	tb.Helper()
	want := e.blocksFor(s.prompt)
	if s.state == stHeld {
		want = e.blocksFor(s.computed)
	}
	if len(s.blocks) != want {
		tb.Fatalf("req %d (state %d): %d blocks, want %d", s.id, s.state, len(s.blocks), want)
	}
	for _, b := range s.blocks {
		refs[b]++
	}
}

// checkTransferState checks the transfers under way and the holds, and
// counts their blocks into refs.
func checkTransferState(tb testing.TB, e *Engine, refs []int32) {
	tb.Helper()
	for i, s := range e.pulling {
		if s.state != stPulling || (i > 0 && s.pullDone < e.pulling[i-1].pullDone) {
			tb.Fatalf("pulling req %d in state %d, done %v", s.id, s.state, s.pullDone)
		}
		countTransferBlocks(tb, e, s, refs)
	}
	held := 0
	for _, s := range e.seqs {
		if s.state == stHeld {
			held++
			countTransferBlocks(tb, e, s, refs)
		}
	}
	if held != e.held {
		tb.Fatalf("%d held requests, counter %d", held, e.held)
	}
}

// pdDrive is drive for engines with transfers and holds: with no work, or a
// step that scheduled nothing, it steps again at the next event or arrival.
// onStep sees every step, empty ones included.
func pdDrive(tb testing.TB, e *Engine, arr []arrival, onStep func(StepResult)) map[uint64]*reqResult {
	tb.Helper()
	res := make(map[uint64]*reqResult, len(arr))
	var now time.Duration
	next := 0
	for steps := 0; ; steps++ {
		if steps > 1_000_000 {
			tb.Fatalf("no quiescence (stats %+v)", e.Stats())
		}
		for next < len(arr) && arr[next].at <= now {
			if err := e.Add(arr[next].r, arr[next].at); err != nil {
				tb.Fatalf("Add(%d): %v", arr[next].r.ID, err)
			}
			res[arr[next].r.ID] = &reqResult{arrival: arr[next].at}
			next++
		}
		ev, hasEv := e.NextEvent()
		if !e.HasWork() && !(hasEv && ev <= now) {
			switch {
			case hasEv && (next == len(arr) || ev < arr[next].at):
				now = ev
			case next < len(arr):
				now = arr[next].at
				continue
			default:
				return res
			}
		}
		sr := e.Step(now)
		record(tb, res, sr, steps)
		if onStep != nil {
			onStep(sr)
		}
		if sr.Seqs > 0 {
			now = sr.End
			continue
		}
		ev, hasEv = e.NextEvent()
		switch {
		case hasEv && (next == len(arr) || ev < arr[next].at):
			now = ev
		case next < len(arr):
			now = arr[next].at
		case e.HasWork():
			tb.Fatalf("stuck with work and nothing pending (stats %+v)", e.Stats())
		}
	}
}

func record(tb testing.TB, res map[uint64]*reqResult, sr StepResult, step int) {
	tb.Helper()
	for _, o := range sr.Outputs {
		r := res[o.ReqID]
		if r == nil || r.finished {
			tb.Fatalf("output for unknown or finished request %d", o.ReqID)
		}
		r.tokens += o.NewTokens
		if o.First {
			r.firsts++
			r.first, r.cached, r.firstStep = sr.End, o.CachedTokens, step
		}
		if o.Finished {
			r.finished, r.finish = true, sr.End
		}
	}
}

func remote(r *Request, decode bool) *Request {
	if decode {
		r.RemoteDecode = true
	} else {
		r.RemotePrefill = true
	}
	return r
}

// ---- prefill side: the hold ----

// A remote-decode request finishes as usual, then holds its blocks: they
// count in the KV usage, cannot be evicted, can still be hit, and are freed
// (cached) by Release.
func TestRemoteDecodeHoldsBlocks(t *testing.T) {
	e := newEngine(t, Config{Role: RolePrefill, NumBlocks: 40, MaxBatchTokens: 1024})
	r1 := remote(req(1, 16, 5, 1, seg{1, 20}), true) // 325 tokens: 21 blocks
	if err := e.Add(r1, 0); err != nil {
		t.Fatal(err)
	}
	sr := e.Step(0)
	if len(sr.Outputs) != 1 || sr.Outputs[0] != (Output{ReqID: 1, NewTokens: 1, First: true, Finished: true, Held: true}) {
		t.Fatalf("outputs %+v", sr.Outputs)
	}
	blocks, ok := e.HeldBlocks(1)
	if !ok || len(blocks) != 21 {
		t.Fatalf("held blocks %v %v", blocks, ok)
	}
	st := e.Stats()
	if st.Held != 1 || st.RequestsFinished != 1 || st.KVUsage != 21.0/40 || st.Running+st.Waiting != 0 || e.HasWork() {
		t.Fatalf("stats %+v", st)
	}
	if got := e.PeekCached(r1.BlockHashes, 400); got != 20*16 {
		t.Errorf("held prompt cached %d tokens, want %d", got, 20*16)
	}
	if at, ok := e.NextEvent(); !ok || at != sr.End+DefaultKVHoldTimeout {
		t.Errorf("next event %v %v, want the hold's timeout at %v", at, ok, sr.End+DefaultKVHoldTimeout)
	}
	// A request needing 30 blocks cannot evict the held ones: it waits.
	r2 := req(2, 16, 0, 1, seg{2, 30})
	if err := e.Add(r2, sr.End); err != nil {
		t.Fatal(err)
	}
	if sr2 := e.Step(sr.End); sr2.Seqs != 0 {
		t.Fatalf("admitted over held blocks: %+v", sr2)
	}
	checkInvariants(t, e, nil)
	if !e.Release(1) || e.Release(1) {
		t.Fatal("Release is not true once, then false")
	}
	if _, ok := e.HeldBlocks(1); ok || e.Stats().HoldsReleased != 1 || e.Stats().Held != 0 {
		t.Fatalf("after release: stats %+v", e.Stats())
	}
	if got := e.PeekCached(r1.BlockHashes, 400); got != 20*16 {
		t.Errorf("released prompt cached %d tokens, want %d (freed, still cached)", got, 20*16)
	}
	if sr3 := e.Step(sr.End); sr3.Seqs != 1 {
		t.Fatalf("request 2 not admitted after the release: %+v", sr3)
	}
	checkInvariants(t, e, nil)
	if err := e.Add(remote(req(3, 16, 0, 1, seg{3, 1}), false), sr.End); !errors.Is(err, ErrWrongRole) {
		t.Errorf("remote prefill on a prefill instance: %v", err)
	}
}

// A hold nobody releases ends KVHoldTimeout after its request finished.
func TestHoldTimeout(t *testing.T) {
	e := newEngine(t, Config{KVHoldTimeout: time.Second})
	if err := e.Add(remote(req(1, 16, 0, 2, seg{1, 4}), true), 0); err != nil {
		t.Fatal(err)
	}
	var end time.Duration
	for e.HasWork() {
		end = e.Step(end).End
	}
	at, ok := e.NextEvent()
	if !ok || at != end+time.Second {
		t.Fatalf("next event %v %v, want %v", at, ok, end+time.Second)
	}
	if sr := e.Step(at - 1); len(sr.Expired) != 0 || e.Stats().Held != 1 {
		t.Fatalf("expired early: %+v", sr)
	}
	sr := e.Step(at)
	if !slices.Equal(sr.Expired, []uint64{1}) || sr.Seqs != 0 || sr.End != sr.Start {
		t.Fatalf("step at the timeout: %+v", sr)
	}
	st := e.Stats()
	if st.Held != 0 || st.HoldsExpired != 1 || st.KVUsage != 0 || e.Release(1) {
		t.Fatalf("after the timeout: %+v", st)
	}
	if _, ok := e.NextEvent(); ok {
		t.Error("an event left")
	}
	if e.Abort(1) {
		t.Error("aborted an expired hold")
	}
}

// ---- decode side: the pull ----

// A remote-prefill request pulls its whole prompt in the profile's transfer
// time, computing nothing meanwhile, then recomputes its last prompt token,
// which samples its first token; vLLM reports prompt − 1 tokens cached.
func TestRemotePrefillPull(t *testing.T) {
	prof := costmodel.MustLookup(costmodel.Default)
	e := newEngine(t, Config{Role: RoleDecode})
	r := remote(req(1, 16, 0, 3, seg{9, 125}), false) // 2,000 tokens
	events := eventSet{}
	var steps []StepResult
	res := pdDrive(t, e, []arrival{{0, r}}, func(sr StepResult) {
		events.apply(t, sr.KV)
		steps = append(steps, sr)
		if len(steps) == 1 {
			st := e.Stats()
			if sr.Seqs != 0 || st.Pulling != 1 || st.Waiting != 1 || st.Running != 0 || st.KVUsage != 125.0/30000 {
				t.Fatalf("first step %+v, stats %+v", sr, st)
			}
		}
		checkInvariants(t, e, events)
	})
	xfer := prof.TransferTime(2000) // 2 ms + 2,000 × 128 KiB at 50 GB/s = 7.24288 ms
	if xfer != 7242880*time.Nanosecond {
		t.Fatalf("transfer %v", xfer)
	}
	if len(steps) != 4 || !slices.Equal(steps[1].Pulls, []Pull{{ReqID: 1, Tokens: 2000, Bytes: 2000 * 131072, End: xfer}}) {
		t.Fatalf("steps %+v", steps)
	}
	first := prof.StepTime(costmodel.Step{Tokens: 1, PrefillCtx: 2000})
	if s := steps[1]; s.Start != xfer || s.End != xfer+first || s.Tokens != 1 {
		t.Errorf("first compute step %+v, want [%v, %v) of 1 token", s, xfer, xfer+first)
	}
	// The pulled blocks are cached when the transfer ends (124 blocks: the
	// last token is not), the last block by the step that computes it.
	if kv := steps[1].KV; len(kv) != 2 || len(kv[0].BlockHashes) != 124 || len(kv[1].BlockHashes) != 1 ||
		kv[1].ParentHash != r.BlockHashes[123] {
		t.Errorf("stored events %+v", kv)
	}
	got := res[1]
	if got.ttft() != xfer+first || got.cached != 1999 || !got.finished || got.tokens != 3 {
		t.Errorf("result %+v, want TTFT %v and 1999 cached", got, xfer+first)
	}
	st := e.Stats()
	if st.Transfers != 1 || st.TransferTokens != 2000 || st.ExternalQueries != 2000 || st.ExternalHits != 2000 ||
		st.PrefixQueries != 2000 || st.PrefixHits != 0 || st.PromptExternal != 2000 || st.PromptLocalHit != 0 ||
		st.PromptComputed != 1 || st.KVUsage != 0 || st.Pulling != 0 {
		t.Errorf("stats %+v", st)
	}
}

// A decode instance pulls only what its own cache lacks: a conversation's
// next turn pulls the new part only.
func TestPullOnlyWhatIsLacking(t *testing.T) {
	prof := costmodel.MustLookup(costmodel.Default)
	e := newEngine(t, Config{Role: RoleDecode})
	turn1 := remote(req(1, 16, 0, 2, seg{7, 60}), false)             // 960 tokens
	turn2 := remote(req(2, 16, 5, 2, seg{7, 60}, seg{8, 40}), false) // 1,605 tokens
	var pulls []Pull
	var outs []Output
	pdDrive(t, e, []arrival{{0, turn1}, {time.Second, turn2}}, func(sr StepResult) {
		pulls = append(pulls, sr.Pulls...)
		for _, o := range sr.Outputs {
			if o.First {
				outs = append(outs, o)
			}
		}
		checkInvariants(t, e, nil)
	})
	if len(pulls) != 2 || pulls[0].Tokens != 960 || pulls[1].Tokens != 645 {
		t.Fatalf("pulls %+v, want 960 then 1,605 − 960 tokens", pulls)
	}
	if d := pulls[1].End - pulls[1].Start; d != prof.TransferTime(645) {
		t.Errorf("second transfer took %v, want %v", d, prof.TransferTime(645))
	}
	if outs[1].CachedTokens != 1604 || outs[1].ExternalTokens != 645 {
		t.Errorf("second turn %+v", outs[1])
	}
	st := e.Stats()
	if st.PrefixHits != 960 || st.PromptLocalHit != 960 || st.PromptExternal != 960+645 || st.ExternalQueries != 960+645 {
		t.Errorf("stats %+v", st)
	}
	// A plain request of the first turn's prompt hits what was pulled.
	if got := e.PeekCached(turn1.BlockHashes, turn1.PromptTokens); got != 59*16 {
		t.Errorf("first turn's prompt cached %d tokens, want %d", got, 59*16)
	}
}

// Other sequences keep running while a request pulls; it joins the first
// step that starts after its transfer.
func TestDecodesRunDuringPull(t *testing.T) {
	prof := costmodel.MustLookup(costmodel.Default)
	e := newEngine(t, Config{})
	long := req(1, 16, 0, 60, seg{1, 10})
	pull := remote(req(2, 16, 0, 2, seg{2, 250}), false) // 4,000 tokens: 12.5 ms on the link
	at := 50 * time.Millisecond
	var done time.Duration // the transfer starts with the first step at or after its arrival
	var joined bool
	pdDrive(t, e, []arrival{{0, long}, {at, pull}}, func(sr StepResult) {
		if done == 0 && sr.Start >= at {
			done = sr.Start + prof.TransferTime(4000)
		}
		switch {
		case sr.Start < done && sr.Start >= at:
			if sr.Seqs != 1 || sr.Tokens != 1 {
				t.Fatalf("step during the transfer %+v", sr)
			}
		case done > 0 && sr.Start >= done && !joined:
			joined = true
			if sr.Seqs != 2 || sr.Tokens != 2 || len(sr.Pulls) != 1 {
				t.Fatalf("first step after the transfer %+v", sr)
			}
		}
	})
	if !joined {
		t.Fatal("the pulled request never joined")
	}
}

// Transfers share the engine's link, first come first served: the second's
// bytes wait for the first's.
func TestTransfersShareTheLink(t *testing.T) {
	prof := costmodel.MustLookup(costmodel.Default)
	e := newEngine(t, Config{})
	for i := range uint64(2) {
		if err := e.Add(remote(req(i+1, 16, 0, 1, seg{10 + i, 125}), false), 0); err != nil {
			t.Fatal(err)
		}
	}
	if sr := e.Step(0); sr.Seqs != 0 || e.Stats().Pulling != 2 {
		t.Fatalf("both not pulling: %+v", sr)
	}
	wire, lat := prof.TransferWireTime(2000), prof.TransferLatency()
	if at, _ := e.NextEvent(); at != wire+lat {
		t.Fatalf("first done at %v, want %v", at, wire+lat)
	}
	sr := e.Step(wire + lat)
	if len(sr.Pulls) != 1 || sr.Pulls[0].ReqID != 1 {
		t.Fatalf("pulls %+v", sr.Pulls)
	}
	if e.pulling[0].pullDone != 2*wire+lat {
		t.Errorf("second done at %v, want %v", e.pulling[0].pullDone, 2*wire+lat)
	}
}

// Roles: a remote decode is refused on a decode instance, a remote prefill
// on a prefill one, both at once everywhere; plain requests everywhere.
func TestRoles(t *testing.T) {
	for _, role := range []Role{RoleBoth, RolePrefill, RoleDecode} {
		e := newEngine(t, Config{Role: role})
		if got, err := ParseRole(role.String()); err != nil || got != role {
			t.Errorf("ParseRole(%q) = %v, %v", role, got, err)
		}
		for i, tc := range []struct {
			decode, prefill bool
			want            error
		}{
			{false, false, nil},
			{true, false, map[Role]error{RoleDecode: ErrWrongRole}[role]},
			{false, true, map[Role]error{RolePrefill: ErrWrongRole}[role]},
			{true, true, ErrInvalidRequest},
		} {
			r := req(uint64(i), 16, 0, 1, seg{1, 1})
			r.RemoteDecode, r.RemotePrefill = tc.decode, tc.prefill
			if err := e.Add(r, 0); !errors.Is(err, tc.want) || (tc.want == nil && err != nil) {
				t.Errorf("%v: decode %v prefill %v: %v, want %v", role, tc.decode, tc.prefill, err, tc.want)
			}
		}
	}
	if _, err := ParseRole("kv_both"); err == nil {
		t.Error("ParseRole accepted kv_both")
	}
	if _, err := New(Config{Role: 7}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("role 7: %v", err)
	}
	if _, err := New(Config{KVHoldTimeout: -1}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("negative hold timeout: %v", err)
	}
}

// Aborts: a request pulling frees its blocks (what it had not received is
// not cached); one waiting with its pulled blocks frees them cached.
func TestAbortDuringTransfer(t *testing.T) {
	e := newEngine(t, Config{MaxBatchTokens: 1024})
	pulling := remote(req(1, 16, 0, 1, seg{1, 10}), false)
	if err := e.Add(pulling, 0); err != nil {
		t.Fatal(err)
	}
	e.Step(0)
	if !e.Abort(1) || e.Stats().KVUsage != 0 || e.Stats().Pulling != 0 || e.Stats().RequestsAborted != 1 {
		t.Fatalf("abort while pulling: %+v", e.Stats())
	}
	if _, ok := e.NextEvent(); ok || e.PeekCached(pulling.BlockHashes, pulling.PromptTokens) != 0 {
		t.Fatal("an aborted transfer left an event or cached blocks")
	}
	checkInvariants(t, e, nil)
	// Cap 2: request 2 runs and request 3 starts pulling (a transfer takes
	// no running slot, but needs one free to start, as in vLLM); request 4
	// takes the second slot before the transfer ends, so request 3 then
	// waits with its pulled blocks.
	e = newEngine(t, Config{MaxSeqs: 2, MaxBatchTokens: 1024})
	if err := e.Add(req(2, 16, 0, 100, seg{2, 2}), 0); err != nil {
		t.Fatal(err)
	}
	waiting := remote(req(3, 16, 0, 1, seg{3, 250}), false) // 14.5 ms to pull
	if err := e.Add(waiting, 0); err != nil {
		t.Fatal(err)
	}
	now := e.Step(0).End // 11.3 ms
	if err := e.Add(req(4, 16, 0, 100, seg{4, 2}), now); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		now = e.Step(now).End
	}
	if s := e.seqs[3]; s == nil || !s.pulled || e.Stats().Waiting != 1 {
		t.Fatalf("request 3 not waiting with its pulled blocks: %+v", e.Stats())
	}
	checkInvariants(t, e, nil)
	if !e.Abort(3) || e.PeekCached(waiting.BlockHashes, waiting.PromptTokens) != 249*16 {
		t.Fatalf("abort of a pulled request: cached %d", e.PeekCached(waiting.BlockHashes, waiting.PromptTokens))
	}
	checkInvariants(t, e, nil)
}

// TestRandomTransfersKeepInvariants mixes plain, remote-prefill and
// remote-decode requests, aborts and releases on one engine (RoleBoth) with
// a small cache, checking the block manager and the events after every step.
func TestRandomTransfersKeepInvariants(t *testing.T) {
	for seed := range uint64(30) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 7))
			bs := 1 + rng.IntN(16)
			cfg := Config{NumBlocks: 30 + rng.IntN(200), BlockSize: bs, MaxSeqs: 1 + rng.IntN(8),
				KVHoldTimeout: time.Duration(1+rng.IntN(500)) * time.Millisecond}
			cfg.MaxBatchTokens = cfg.MaxSeqs + rng.IntN(300)
			e := newEngine(t, cfg)
			var arr []arrival
			var at time.Duration
			for i := range 40 {
				at += time.Duration(rng.IntN(30)) * time.Millisecond
				r := req(uint64(i), bs, rng.IntN(bs), 1+rng.IntN(20),
					seg{uint64(rng.IntN(3)), rng.IntN(8)}, seg{uint64(10 + rng.IntN(20)), rng.IntN(8)})
				r.PromptTokens = max(r.PromptTokens, 1)
				if r.PromptTokens+r.MaxTokens-1 > cfg.NumBlocks*bs {
					continue
				}
				kind := rng.IntN(3)
				r.RemoteDecode, r.RemotePrefill = kind == 1, kind == 2
				arr = append(arr, arrival{at, r})
			}
			events := eventSet{}
			pdDrive(t, e, arr, func(sr StepResult) {
				events.apply(t, sr.KV)
				checkInvariants(t, e, events)
				for _, o := range sr.Outputs {
					if o.Held && rng.IntN(2) == 0 && !e.Release(o.ReqID) {
						t.Fatalf("release of held %d failed", o.ReqID)
					}
				}
				if ids := liveIDs(e); len(ids) > 0 && rng.IntN(20) == 0 {
					e.Abort(ids[rng.IntN(len(ids))])
					checkInvariants(t, e, events)
				}
			})
			st := e.Stats()
			if st.KVUsage != 0 || st.Running+st.Waiting+st.Held != 0 {
				t.Errorf("not at rest: %+v", st)
			}
		})
	}
}

// liveIDs are the ids of the engine's requests, sorted.
func liveIDs(e *Engine) []uint64 {
	var ids []uint64
	for id := range e.seqs {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}
