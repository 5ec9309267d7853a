package sharedstate

import (
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

// A batch whose decisions name programs is version 2 and keeps them; one
// without is version 1, as gateways before programs write and read it.
func TestBatchProgramsCodec(t *testing.T) {
	b := realisticBatch(3, 4)
	if p := AppendBatch(nil, &b); p[0] != codecVersion {
		t.Fatalf("no program: version %d", p[0])
	}
	b.Decisions[1].Program, b.Decisions[3].Program = 1<<63|7, 42
	p := AppendBatch(nil, &b)
	if p[0] != codecVersionPrograms {
		t.Fatalf("programs: version %d", p[0])
	}
	got, err := DecodeBatch(p)
	if err != nil || !equalBatch(got, b) || got.Decisions[1].Program != 1<<63|7 || got.Decisions[0].Program != 0 {
		t.Fatalf("round trip: %v %+v", err, got.Decisions)
	}
	for cut := 1; cut < len(p); cut += 7 {
		if _, err := DecodeBatch(p[:len(p)-cut]); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("cut by %d decoded: %v", cut, err)
		}
	}
}

// A program's turn routed on one gateway makes its replica the program's
// home on the other, with its context reserved there: the other keeps the
// program's next turn together with it.
func TestProgramsReachAnotherGateway(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	a, b := newGateway(t, url, "p", true, nil), newGateway(t, url, "p", true, nil)
	text := conversation(7)
	pa := &prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, MaxTokens: 16, Prompts: 1}
	tk, err := a.rt.Route(a.rt.Prepare(pa, "agent-7", ""))
	if err != nil {
		t.Fatal(err)
	}
	defer done(tk)
	home := a.rt.Name(tk.Replica)
	var next *policy.Request
	testutil.Eventually(t, within, "a's program known to b", func() bool {
		next = b.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text + " next", MaxTokens: 16, Prompts: 1}, "agent-7", "")
		views := b.rt.Views(next)
		return next.Program.Continues && b.rt.Name(next.Program.Home) == home && views[next.Program.Home].Programs == 1 &&
			views[next.Program.Home].ProgramTokens == tk.Request().Tokens
	})
	if st := b.rt.ProgramStats(); st.Tracked != 1 || st.Live != 1 {
		t.Fatalf("b's programs %+v", st)
	}
}

// A peer's program records are checked at the door: one whose context is
// beyond any prompt drops its entry (reason program), one whose context
// its blocks do not back is refused by the router while its decision
// applies (counted program too), an honest one is recorded.
func TestForgedProgramsAreRefusedAtTheDoor(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	reg := prometheus.NewRegistry()
	b := newGateway(t, url, "t", true, withRegistry(reg, nil))
	oversize := ghostBatch("forger", "http://r1", 1, 99)
	oversize.Decisions[0].Program, oversize.Decisions[0].Tokens = 5, MaxProgramTokens+1
	ghost(t, url, "t", "", oversize)
	unbacked := ghostBatch("forger", "http://r1", 1, 98)
	unbacked.Decisions[0].Program, unbacked.Decisions[0].Tokens = 6, 1_000_000
	ghost(t, url, "t", "", unbacked)
	honest := ghostBatch("honest", "http://r2", 2, 8)
	honest.Decisions[0].Program, honest.Decisions[0].Tokens = 7, 16+5
	ghost(t, url, "t", "", honest)
	testutil.Eventually(t, within, "the honest peer's program", func() bool { return b.rt.ProgramStats().Tracked == 1 })
	if b.rt.Index().Holds(1, 99) {
		t.Fatal("the oversize program's entry was applied")
	}
	if !b.rt.Index().Holds(1, 98) {
		t.Fatal("the unbacked program's decision was not applied")
	}
	if n := dropped(t, reg, "program"); n != 2 {
		t.Fatalf("dropped{reason=program} = %v, want 2", n)
	}
	if st := b.rt.ProgramStats(); st.Live != 1 {
		t.Fatalf("programs %+v", st)
	}
}
