package router

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// followRouter is a 2-replica precise router on a settable clock, with a
// small cache so that "a whole cache's worth stored" is reachable.
func followRouter(t *testing.T, capacity int) (*Router, *time.Time) {
	t.Helper()
	p, _ := policy.New("least_load", policy.Options{Seed: 1})
	now := time.Unix(1000, 0)
	rt, err := New(Config{Replicas: []string{"a", "b"}, Policy: p, Precise: true, Model: "m",
		BlocksPerReplica: capacity, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	return rt, &now
}

// storedFor is a BlockStored of text's first n blocks as an engine with
// blockSize-token blocks reports it (engine hashes: base+k).
func storedFor(text string, blockSize, n int, base uint64, lora string) *kvevents.BlockStored {
	ids := prompt.Approx{}.Encode(nil, text)[:n*blockSize]
	hs := make([]uint64, n)
	for k := range hs {
		hs[k] = base + uint64(k)
	}
	return &kvevents.BlockStored{BlockHashes: hs, TokenIDs: ids, BlockSize: blockSize, LoraName: lora}
}

func msg(seq uint64, evs ...kvevents.Event) KVMessage { return KVMessage{Seq: seq, Events: evs} }

func textOf(i int) string { return strings.Repeat(fmt.Sprintf("prompt %03d ", i), 40) } // 480 bytes: 7 blocks of 16

// match is replica r's match for text's request (model m).
func match(rt *Router, model, text string, r int) int {
	req := rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: model, Text: text, KeyText: text, Prompts: 1}, "", "")
	return rt.Views(req)[r].Match
}

func TestFollowFromStartGapAndRecovery(t *testing.T) {
	rt, now := followRouter(t, 8)
	rep := rt.FollowKV(1, msg(0, storedFor(textOf(0), 16, 4, 100, "")), *now, nil)
	if !rep.Synced || !rep.SyncChanged || rep.Stored != 4 {
		t.Fatalf("followed from 0: %+v", rep)
	}
	if m := match(rt, "m", textOf(0), 1); m != 4 {
		t.Fatalf("match %d, want 4", m)
	}
	// A gap without a replay endpoint: out of sync, what was reported stays.
	rep = rt.FollowKV(1, msg(5, storedFor(textOf(1), 16, 4, 200, "")), *now, nil)
	if !rep.Gap || rep.Expected != 1 || rep.Synced {
		t.Fatalf("gap: %+v", rep)
	}
	if m := match(rt, "m", textOf(0), 1); m != 4 {
		t.Fatalf("blocks reported before the gap forgotten: match %d", m)
	}
	// 4 blocks stored since the gap, then 4 more: a whole cache (8) since.
	rep = rt.FollowKV(1, msg(6, storedFor(textOf(2), 16, 4, 300, "")), *now, nil)
	if !rep.Synced {
		t.Fatalf("a cache's worth stored since the gap must bring it back in sync: %+v", rep)
	}
	// A publisher restart (sequence back to 0): its cache is empty again.
	rep = rt.FollowKV(1, msg(0), *now, nil)
	if !rep.Restart || !rep.Synced {
		t.Fatalf("restart: %+v", rep)
	}
	if m := match(rt, "m", textOf(0), 1); m != 0 {
		t.Fatalf("restarted replica still credited: %d", m)
	}
}

func TestFollowLateJoinTrustsAfterResyncAfter(t *testing.T) {
	rt, now := followRouter(t, 1<<10)
	rt.Replica(0).KVStart(*now)
	// llm-d's simulator counts from 1: a first batch above 0 is a late join.
	rep := rt.FollowKV(0, msg(1, storedFor(textOf(0), 16, 3, 10, "")), *now, nil)
	if rep.Synced {
		t.Fatalf("late join in sync: %+v", rep)
	}
	// What it reported counts at once, even out of sync.
	if m := match(rt, "m", textOf(0), 0); m != 3 {
		t.Fatalf("reported blocks not credited after a late join: %d", m)
	}
	// Out of sync: the approximate index's larger match stands.
	req := rt.Prepare(parse(t, textOf(0)), "", "")
	_ = rt.Index().Insert(0, req.Blocks)
	if m := match(rt, "m", textOf(0), 0); m != len(req.Blocks) {
		t.Fatalf("out of sync: match %d, want the approximate %d", m, len(req.Blocks))
	}
	// ResyncAfter later, with no batch in between, the precise index alone.
	*now = now.Add(ResyncAfter)
	if m := match(rt, "m", textOf(0), 0); m != 3 {
		t.Fatalf("after ResyncAfter: match %d, want the precise 3", m)
	}
}

// replayer is a replay endpoint holding batches [first, first+n).
func replayer(first uint64, batches []KVMessage, calls *[]uint64) Resync {
	return func(from uint64) ([]KVMessage, error) {
		*calls = append(*calls, from)
		var out []KVMessage
		for _, b := range batches {
			if b.Seq >= from && b.Seq >= first {
				out = append(out, b)
			}
		}
		return out, nil
	}
}

func TestFollowResyncsThroughReplay(t *testing.T) {
	rt, now := followRouter(t, 1<<10)
	var all []KVMessage
	for k := range 6 {
		all = append(all, msg(uint64(k), storedFor(textOf(k), 16, 2, uint64(100*k), "")))
	}
	var calls []uint64
	// Late join at 3 with a buffer reaching back to 0: in sync at once.
	rep := rt.FollowKV(0, all[3], *now, replayer(0, all, &calls))
	if !rep.Synced || rep.Replayed != 3 || len(calls) != 1 || calls[0] != 0 {
		t.Fatalf("late join with replay: %+v, calls %v", rep, calls)
	}
	for k := range 4 {
		if m := match(rt, "m", textOf(k), 0); m != 2 {
			t.Fatalf("batch %d: match %d", k, m)
		}
	}
	// A gap (4 lost) filled by the replay: no fallback.
	rep = rt.FollowKV(0, all[5], *now, replayer(0, all, &calls))
	if !rep.Gap || !rep.Synced || rep.SyncChanged || rep.Replayed != 1 || calls[1] != 4 {
		t.Fatalf("gap with replay: %+v, calls %v", rep, calls)
	}
	if m := match(rt, "m", textOf(4), 0); m != 2 {
		t.Fatalf("replayed batch 4 not applied: %d", m)
	}
	// A gap the buffer no longer reaches: the fallback rule.
	rt2, _ := followRouter(t, 1<<10)
	rt2.FollowKV(0, all[0], *now, nil)
	rep = rt2.FollowKV(0, all[5], *now, replayer(4, all, &calls))
	if rep.Synced || rep.Replayed != 1 {
		t.Fatalf("gap beyond the buffer: %+v", rep)
	}
	// An endpoint that fails: the fallback rule, and the error reported.
	rt3, _ := followRouter(t, 1<<10)
	rep = rt3.FollowKV(0, all[2], *now, func(uint64) ([]KVMessage, error) { return nil, errors.New("down") })
	if rep.Synced || rep.ResyncErr == nil {
		t.Fatalf("failed replay: %+v", rep)
	}
}

func TestResyncAtStartAndDuplicates(t *testing.T) {
	rt, now := followRouter(t, 1<<10)
	var all []KVMessage
	for k := range 3 {
		all = append(all, msg(uint64(k), storedFor(textOf(k), 16, 2, uint64(100*k), "")))
	}
	var calls []uint64
	rep := rt.ResyncKV(1, *now, replayer(0, all, &calls))
	if !rep.Synced || rep.Replayed != 3 {
		t.Fatalf("resync at start: %+v", rep)
	}
	if m := match(rt, "m", textOf(0), 1); m != 2 {
		t.Fatalf("a prompt warmed before the start not credited: %d", m)
	}
	// An endpoint with nothing buffered: nothing was published, in sync.
	if rep := rt.ResyncKV(0, *now, replayer(0, nil, &calls)); !rep.Synced {
		t.Fatalf("empty replay buffer: %+v", rep)
	}
	// The live stream delivers 2 again (it raced the replay), then 3.
	if rep = rt.FollowKV(1, all[2], *now, nil); !rep.Duplicate || !rep.Synced {
		t.Fatalf("duplicate: %+v", rep)
	}
	if rep = rt.FollowKV(1, msg(3), *now, nil); rep.Gap || !rep.Synced {
		t.Fatalf("next after the replay: %+v", rep)
	}
	// A publisher restarting right after a replay is a restart, not a duplicate.
	rt2, _ := followRouter(t, 1<<10)
	rt2.ResyncKV(1, *now, replayer(0, all, &calls))
	if rep = rt2.FollowKV(1, msg(0), *now, nil); !rep.Restart || rep.Duplicate || !rep.Synced {
		t.Fatalf("restart after a replay: %+v", rep)
	}
	if m := match(rt2, "m", textOf(0), 1); m != 0 {
		t.Fatalf("the restarted replica still credited: %d", m)
	}
}

// An alias (--served-model-name) shares its base model's cache: events name
// the base (or nothing), requests the alias; an adapter's events carry its
// lora_name and partition the index as its requests do. Engine blocks of 32
// tokens under the index's 16 match too.
func TestFollowAliasAdapterAndBlockSize(t *testing.T) {
	rt, now := followRouter(t, 1<<10)
	models := []Model{{ID: "chat", Root: "org/base-8b"}, {ID: "sql", Root: "/loras/sql", Parent: "chat"}}
	rt.Replica(0).SetServed(NewServed(models, nil))
	rt.Replica(1).SetServed(NewServed(models, nil))
	rt.FollowKV(0, KVMessage{Seq: 0, Model: "org/base-8b", Events: []kvevents.Event{storedFor(textOf(0), 32, 2, 10, "")}}, *now, nil)
	rt.FollowKV(1, KVMessage{Seq: 0, Events: []kvevents.Event{storedFor(textOf(1), 16, 3, 10, "")}}, *now, nil)
	rt.FollowKV(1, KVMessage{Seq: 1, Model: "org/base-8b", Events: []kvevents.Event{storedFor(textOf(2), 16, 2, 50, "sql")}}, *now, nil)
	if m := match(rt, "chat", textOf(0), 0); m != 4 {
		t.Fatalf("alias with the base model's 32-token events: match %d, want 4", m)
	}
	if m := match(rt, "chat", textOf(1), 1); m != 3 {
		t.Fatalf("events with no model in the topic: match %d, want 3", m)
	}
	if m := match(rt, "sql", textOf(2), 1); m != 2 {
		t.Fatalf("adapter: match %d, want 2", m)
	}
	if m := match(rt, "chat", textOf(2), 1); m != 0 {
		t.Fatalf("the adapter's blocks credited to the base model: %d", m)
	}
	rep := rt.FollowKV(0, KVMessage{Seq: 1, Events: []kvevents.Event{storedFor(textOf(3), 24, 1, 90, "")}}, *now, nil)
	if len(rep.Drops) != 1 || rep.Drops[0].Reason != "block_size" {
		t.Fatalf("24-token blocks under 16: %+v", rep)
	}
}
