package router

import (
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// views is every replica's view of text's request.
func tierViews(rt *Router, text string) []policy.ReplicaView {
	req := rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, Prompts: 1}, "", "")
	return rt.Views(req)
}

// Precise mode follows the host tier's events (the connector's payload:
// hashes only) into MatchHost: a prompt the GPU evicted is still matched
// in the host tier, counted apart from the GPU's match; the tier's
// removals and a store of an unknown block are reported.
func TestFollowHostTier(t *testing.T) {
	rt, now := followRouter(t, 100)
	text := textOf(0)
	gpu := storedFor(text, 16, 6, 100, "")
	host := &kvevents.BlockStored{BlockHashes: gpu.BlockHashes, BlockSize: 16, Medium: "CPU"}
	rep := rt.FollowKV(1, msg(0, gpu, host), *now, nil)
	if rep.Stored != 6 || rep.StoredHost != 6 || len(rep.Drops) != 0 {
		t.Fatalf("report %+v", rep)
	}
	v := tierViews(rt, text)[1]
	if v.Match != 6 || v.MatchHost != 6 || v.HostBeyond() != 0 || v.Local() != 6 {
		t.Fatalf("view %+v", v)
	}
	rep = rt.FollowKV(1, msg(1, &kvevents.BlockRemoved{BlockHashes: gpu.BlockHashes[2:], Medium: "GPU"}), *now, nil)
	if v = tierViews(rt, text)[1]; rep.Removed != 4 || v.Match != 2 || v.MatchHost != 6 || v.HostBeyond() != 4 {
		t.Fatalf("after the GPU evicted 4: report %+v view %+v", rep, v)
	}
	rep = rt.FollowKV(1, msg(2, &kvevents.BlockRemoved{BlockHashes: gpu.BlockHashes[5:], Medium: "CPU"},
		&kvevents.BlockStored{BlockHashes: []uint64{999}, Medium: "CPU"},
		&kvevents.BlockStored{BlockHashes: []uint64{998}, Medium: "STORAGE"}), *now, nil)
	if v = tierViews(rt, text)[1]; rep.RemovedHost != 1 || v.MatchHost != 5 || len(rep.Drops) != 1 || rep.Drops[0].Reason != "unknown_block" {
		t.Fatalf("host removal and an unknown block: report %+v view %+v", rep, v)
	}
	if v := tierViews(rt, text)[0]; v.Match != 0 || v.MatchHost != 0 {
		t.Fatalf("replica 0 credited: %+v", v)
	}
}

// The approximate index of the host tiers is sized to them and written
// through at routing, as the connector offloads: a prompt the GPU's LRU
// forgot is still matched in the host tier's while it is among its most
// recent; a rejected request is forgotten in both.
func TestApproxHostTier(t *testing.T) {
	p, _ := policy.New("round_robin", policy.Options{Seed: 1})
	now := time.Unix(1000, 0)
	rt, err := New(Config{Replicas: []string{"a"}, Policy: p, Model: "m", BlocksPerReplica: 8, OffloadBlocks: 32,
		Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	route := func(text string) *Ticket {
		req := rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, Prompts: 1}, "", "")
		tk, err := rt.Route(req)
		if err != nil {
			t.Fatal(err)
		}
		return tk
	}
	first := route(textOf(0))
	first.Done(now, Outcome{})
	blocks := len(first.Request().Blocks)
	route(textOf(1)).Done(now, Outcome{}) // as many blocks: the GPU's index (8) forgets most of text 0's
	v := tierViews(rt, textOf(0))[0]
	if v.MatchHost != blocks || v.Match >= blocks-2 || v.HostBeyond() != blocks-v.Match {
		t.Fatalf("view %+v: want text 0's %d blocks in the host tier", v, blocks)
	}
	tk := route(textOf(2))
	tk.Reject()
	if v := tierViews(rt, textOf(2))[0]; v.Match != 0 || v.MatchHost != 0 {
		t.Fatalf("rejected request still indexed: %+v", v)
	}
	// The router counts a request hitting the host tier as cached, not as
	// prefill work: only its last partial block is pending.
	tk = route(textOf(0))
	if got := tk.UncachedTokens(); got != tk.Request().Tokens-blocks*16 {
		t.Fatalf("uncached %d of %d tokens", got, tk.Request().Tokens)
	}
}

// With Pulls, a policy that does not plan pulls gets llm-d's rule after
// its choice: round_robin sends the prompt to the next replica, pulling it
// from its holder; the ticket counts the pulled tokens as a transfer, not
// as prefill. Without Pulls nothing is pulled.
func TestRouterAddsP2PPull(t *testing.T) {
	for _, pulls := range []bool{true, false} {
		p, _ := policy.New("round_robin", policy.Options{Seed: 1})
		now := time.Unix(1000, 0)
		rt, err := New(Config{Replicas: []string{"a", "b", "c"}, Policy: p, Model: "m", Pulls: pulls,
			Now: func() time.Time { return now }})
		if err != nil {
			t.Fatal(err)
		}
		text := textOf(0)
		req := func() *policy.Request {
			return rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, Prompts: 1}, "", "")
		}
		first, err := rt.Route(req()) // to a: the holder
		if err != nil || first.Replica != 0 {
			t.Fatalf("first: %v on %d", err, first.Replica)
		}
		tk, err := rt.Route(req())
		if err != nil || tk.Replica != 1 {
			t.Fatalf("second: %v on %d", err, tk.Replica)
		}
		blocks := len(tk.Request().Blocks)
		switch {
		case pulls && (tk.Decision.Pull == nil || tk.Decision.Pull.Replica != 0 || tk.Decision.Pull.URL != "a"):
			t.Fatalf("pull %+v", tk.Decision.Pull)
		case pulls && (tk.TransferTokens() != blocks*16 || tk.UncachedTokens() != tk.Request().Tokens-blocks*16):
			t.Fatalf("transfer %d, uncached %d", tk.TransferTokens(), tk.UncachedTokens())
		case !pulls && (tk.Decision.Pull != nil || tk.TransferTokens() != 0):
			t.Fatalf("pull without Pulls: %+v", tk.Decision.Pull)
		}
		if d, _, _ := rt.DryRun(req()); (d.Pull != nil) != pulls {
			t.Fatalf("dry run pull %+v", d.Pull)
		}
	}
}
