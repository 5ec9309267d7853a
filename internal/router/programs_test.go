package router

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// placer is least load that places programs (policy.PlacesPrograms).
type placer struct{ policy.Policy }

func (placer) PlacesPrograms() bool { return true }

// progFleet is a router of n replicas of blocks blocks each (16 tokens)
// under pol, on a clock the test moves.
type progFleet struct {
	rt  *Router
	now time.Time
}

func newProgFleet(t *testing.T, pol policy.Policy, n, blocks int, pc ProgramConfig) *progFleet {
	t.Helper()
	f := &progFleet{now: time.Unix(1000, 0)}
	urls := make([]string, n)
	for i := range urls {
		urls[i] = "r" + string(rune('a'+i))
	}
	rt, err := New(Config{Replicas: urls, Policy: pol, Now: func() time.Time { return f.now },
		BlocksPerReplica: blocks, Programs: pc})
	if err != nil {
		t.Fatal(err)
	}
	f.rt = rt
	return f
}

// req is a request of program id ("" none) with a prompt of tokens tokens
// (4 characters each) made of word, and 16 output tokens.
func (f *progFleet) req(id, word string, tokens int) *policy.Request {
	p := &prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: strings.Repeat(word, tokens*4/len(word)), MaxTokens: 16, Prompts: 1}
	return f.rt.Prepare(p, id, "")
}

func leastLoadPolicy(t *testing.T) policy.Policy {
	t.Helper()
	p, err := policy.New("least_load", policy.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestProgramIdentityOrder(t *testing.T) {
	f := newProgFleet(t, leastLoadPolicy(t), 2, 1000, ProgramConfig{})
	parsed := func(key, user string) *prompt.Parsed {
		return &prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: "hello", PromptCacheKey: key, User: user, Prompts: 1}
	}
	cases := []struct {
		name, key, header, user, session string
		program                          bool
	}{
		{"prompt_cache_key first", "pck", "hdr", "u", "pck", true},
		{"then the header", "", "hdr", "u", "hdr", true},
		{"none: the user, no program", "", "", "u", "u", false},
		{"nothing", "", "", "", "", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			req := f.rt.Prepare(parsed(c.key, c.user), c.header, "")
			if req.Session != c.session || (req.Program.ID != 0) != c.program {
				t.Fatalf("session %q program %d, want %q program %v", req.Session, req.Program.ID, c.session, c.program)
			}
		})
	}
	a := f.rt.Prepare(parsed("k", ""), "", "")
	b := f.rt.Prepare(parsed("", ""), "k", "")
	other := f.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m2", Text: "x", PromptCacheKey: "k", Prompts: 1}, "", "")
	if a.Program.ID != b.Program.ID || a.Program.ID == other.Program.ID {
		t.Fatalf("one id names one program within a model only: %d %d %d", a.Program.ID, b.Program.ID, other.Program.ID)
	}
	long := strings.Repeat("x", 10_000)
	r1 := f.rt.Prepare(parsed(long, ""), "", "")
	r2 := f.rt.Prepare(parsed(long+"y", ""), "", "")
	if len(r1.Session) != MaxProgramID || r1.Session == r2.Session || r1.Program.ID == r2.Program.ID {
		t.Fatalf("long ids: %d bytes, %q vs %q", len(r1.Session), r1.Session[len(r1.Session)-20:], r2.Session[len(r2.Session)-20:])
	}
}

func TestProgramHomeFootprintAndTTL(t *testing.T) {
	f := newProgFleet(t, leastLoadPolicy(t), 3, 1000, ProgramConfig{IdleTTL: 30 * time.Second})
	first := f.req("agent-1", "alpha ", 200)
	if first.Program.Continues {
		t.Fatal("a program never seen continues")
	}
	tk, err := f.rt.Route(first)
	if err != nil {
		t.Fatal(err)
	}
	home := tk.Replica
	views := f.rt.Views(f.req("", "x", 10))
	if views[home].Programs != 1 || views[home].ProgramTokens != 216 {
		t.Fatalf("home's programs %d tokens %d, want 1 and 216", views[home].Programs, views[home].ProgramTokens)
	}
	f.now = f.now.Add(time.Minute) // in flight: still live however long
	if v := f.rt.Views(f.req("", "x", 10)); v[home].Programs != 1 {
		t.Fatalf("a program with a turn in flight expired")
	}
	tk.Done(f.now, Outcome{CachedTokens: -1})
	next := f.req("agent-1", "alpha ", 300)
	f.rt.Views(next)
	if !next.Program.Continues || next.Program.Home != home || next.Program.Tokens != 216 || next.Program.Turns != 1 {
		t.Fatalf("second turn sees %+v, want home %d, 216 tokens, 1 turn", next.Program, home)
	}
	f.now = f.now.Add(30 * time.Second)
	next.Now = f.now
	views = f.rt.Views(next)
	if views[home].Programs != 0 || views[home].ProgramTokens != 0 {
		t.Fatalf("idle past the TTL, still reserving %d tokens", views[home].ProgramTokens)
	}
	if !next.Program.Continues || next.Program.Home != home {
		t.Fatalf("its home is forgotten with its reservation: %+v", next.Program)
	}
	if st := f.rt.ProgramStats(); st.Tracked != 1 || st.Live != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestProgramTableCapped(t *testing.T) {
	f := newProgFleet(t, leastLoadPolicy(t), 2, 1000, ProgramConfig{MaxPrograms: 3})
	for i := range 10 {
		tk, err := f.rt.Route(f.req("p"+string(rune('a'+i)), "w ", 20))
		if err != nil {
			t.Fatal(err)
		}
		tk.Done(f.now, Outcome{CachedTokens: -1})
		f.now = f.now.Add(time.Second)
	}
	if st := f.rt.ProgramStats(); st.Tracked != 3 || st.Live != 3 {
		t.Fatalf("stats %+v, want 3 tracked", st)
	}
	old := f.req("pa", "w ", 20)
	f.rt.Views(old)
	last := f.req("pj", "w ", 20)
	f.rt.Views(last)
	if old.Program.Continues || !last.Program.Continues {
		t.Fatalf("the oldest is forgotten, the newest kept: %+v %+v", old.Program, last.Program)
	}
	views := f.rt.Views(last)
	if views[0].Programs+views[1].Programs != 3 {
		t.Fatalf("reservations of forgotten programs remain: %d + %d", views[0].Programs, views[1].Programs)
	}
}

// A new program goes where the live programs leave room; where none has,
// it waits until one idles past its TTL, or until AdmissionWait.
func TestProgramAdmission(t *testing.T) {
	// 2 replicas of 100 blocks (1,600 tokens); share 0.9: 1,440 tokens of programs each.
	f := newProgFleet(t, placer{leastLoadPolicy(t)}, 2, 100, ProgramConfig{KVAdmission: true, IdleTTL: 10 * time.Second, AdmissionWait: 2 * time.Second, AdmissionMinContext: -1})
	big := func(id, word string) *policy.Request { return f.req(id, word, 900) } // 916 tokens with output
	a, err := f.rt.Route(big("a", "aa "))
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := f.rt.Submit(big("b", "bb "))
	if err != nil || b == nil {
		t.Fatalf("b: %v %v", b, err)
	}
	if a.Replica == b.Replica {
		t.Fatalf("two programs that fit only apart share replica %d", a.Replica)
	}
	a.Done(f.now, Outcome{CachedTokens: -1})
	b.Done(f.now, Outcome{CachedTokens: -1})
	tk, w, err := f.rt.Submit(big("c", "cc "))
	if err != nil || tk != nil || w == nil {
		t.Fatalf("no room: c should wait, got %v %v %v", tk, w, err)
	}
	if f.rt.Queued() != 1 {
		t.Fatalf("queued %d", f.rt.Queued())
	}
	// A continuing program never waits (least load places it; ttft
	// would keep it home).
	f.now = f.now.Add(5 * time.Second)
	a2, _, err := f.rt.Submit(big("a", "aa "))
	if err != nil || a2 == nil {
		t.Fatalf("a's next turn: %v %v", a2, err)
	}
	a2.Done(f.now, Outcome{CachedTokens: -1})
	f.now = f.now.Add(6 * time.Second) // b idles past its TTL, a not yet
	f.rt.SetMetrics(0, Metrics{NumBlocks: 100, BlockSize: 16}, f.now)
	<-w.Done()
	tk, err = w.Result()
	if err != nil || tk.Replica == a2.Replica {
		t.Fatalf("c went to %v (%v), want the replica a's live program leaves free", tk, err)
	}
	// None has room again: past AdmissionWait the program is placed anyway.
	_, w2, _ := f.rt.Submit(big("d", "dd "))
	if w2 == nil {
		t.Fatal("d should wait")
	}
	f.now = f.now.Add(2 * time.Second)
	f.rt.SetMetrics(1, Metrics{NumBlocks: 100, BlockSize: 16}, f.now)
	<-w2.Done()
	if tk, err := w2.Result(); err != nil || tk == nil {
		t.Fatalf("d after AdmissionWait: %v", err)
	}
	// A waiting program leaves when its client does.
	_, w3, _ := f.rt.Submit(big("e", "ee "))
	if w3 == nil || !f.rt.Cancel(w3) || f.rt.Queued() != 0 {
		t.Fatalf("cancel: %v, queued %d", w3, f.rt.Queued())
	}
}

// Admission holds new programs only once the programs that went idle were
// long (AdmissionMinContext): while none has, a new program with no room is
// placed at once; once programs of 916 tokens have idled past their TTL,
// one is held.
func TestProgramAdmissionOnlyOnceProgramsAreLong(t *testing.T) {
	f := newProgFleet(t, placer{leastLoadPolicy(t)}, 2, 100, ProgramConfig{KVAdmission: true, IdleTTL: 10 * time.Second, AdmissionMinContext: 500})
	big := func(id, word string) *policy.Request { return f.req(id, word, 900) } // 916 tokens with output
	fill := func(ids ...string) {
		t.Helper()
		for _, id := range ids {
			tk, w, err := f.rt.Submit(big(id, id+" "))
			if err != nil || tk == nil || w != nil {
				t.Fatalf("%s: %v %v %v", id, tk, w, err)
			}
			tk.Done(f.now, Outcome{CachedTokens: -1})
		}
	}
	fill("a", "b", "c") // c: no room, but no program has idled yet: placed at once
	f.now = f.now.Add(11 * time.Second)
	if st := f.rt.ProgramStats(); st.Live != 0 {
		t.Fatalf("live programs past their TTL: %+v", st)
	}
	fill("d", "e")
	tk, w, err := f.rt.Submit(big("g", "gg "))
	if err != nil || tk != nil || w == nil {
		t.Fatalf("programs were long and no replica has room: g should wait, got %v %v %v", tk, w, err)
	}
	if !f.rt.Cancel(w) {
		t.Fatal("cancel")
	}
}

// Policies that do not place programs (the peers) get no admission.
func TestProgramAdmissionOnlyForPlacers(t *testing.T) {
	f := newProgFleet(t, leastLoadPolicy(t), 1, 100, ProgramConfig{KVAdmission: true})
	for _, id := range []string{"a", "b"} {
		tk, w, err := f.rt.Submit(f.req(id, id+" ", 900))
		if err != nil || tk == nil || w != nil {
			t.Fatalf("%s: %v %v %v", id, tk, w, err)
		}
	}
}

func TestBursts(t *testing.T) {
	f := newProgFleet(t, placer{leastLoadPolicy(t)}, 3, 1000, ProgramConfig{BurstWindow: 100 * time.Millisecond, BurstCap: 3})
	var got []int
	for range 5 {
		tk, err := f.rt.Route(f.req("", "sample ", 300))
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, tk.Replica)
	}
	if got[1] != got[0] || got[2] != got[0] || got[3] == got[0] || got[4] != got[3] {
		t.Fatalf("burst of 5 with a cap of 3 went to %v: three together, then two elsewhere", got)
	}
	d, _, err := f.rt.DryRun(f.req("", "sample ", 300))
	if err != nil || d.Replica != got[3] || !strings.HasPrefix(d.Reason, "burst:") {
		t.Fatalf("dry run: %+v %v", d, err)
	}
	f.now = f.now.Add(101 * time.Millisecond)
	d, _, _ = f.rt.DryRun(f.req("", "sample ", 300))
	if strings.HasPrefix(d.Reason, "burst:") {
		t.Fatalf("past the window, still a burst: %s", d.Reason)
	}
	if tk, _ := f.rt.Route(f.req("", "other ", 300)); tk.Replica == got[3] && tk.Decision.Reason[:6] == "burst:" {
		t.Fatal("another prompt joined the burst")
	}
}

// A burst is one tenant's: tenant b sending tenant a's exact prompt
// within the window starts its own burst, placed by the policy, and does
// not take a place in a's group (its cap, per replica, is a's alone).
// Without the tenant in the key, b's request joined a's group and a's
// next sample, past the cap, was placed elsewhere and prefilled again.
func TestBurstsPerTenant(t *testing.T) {
	f := newProgFleet(t, placer{leastLoadPolicy(t)}, 3, 1000, ProgramConfig{BurstWindow: 100 * time.Millisecond, BurstCap: 2})
	route := func(tenant string) *Ticket {
		req := f.req("", "sample ", 300)
		req.Tenant = tenant
		tk, err := f.rt.Route(req)
		if err != nil {
			t.Fatal(err)
		}
		return tk
	}
	a1, b1, a2 := route("a"), route("b"), route("a")
	if strings.HasPrefix(b1.Decision.Reason, "burst:") || b1.Replica == a1.Replica {
		t.Fatalf("b's request joined a's burst on %d: %s", b1.Replica, b1.Decision.Reason)
	}
	if a2.Replica != a1.Replica || !strings.HasPrefix(a2.Decision.Reason, "burst:") {
		t.Fatalf("a's second sample went to %d (%s), not with its first on %d: b's request took its place",
			a2.Replica, a2.Decision.Reason, a1.Replica)
	}
	if b2 := route("b"); b2.Replica != b1.Replica || !strings.HasPrefix(b2.Decision.Reason, "burst:") {
		t.Fatalf("b's second sample went to %d (%s), not with its first on %d", b2.Replica, b2.Decision.Reason, b1.Replica)
	}
}

// Another gateway's program records are checked where they enter: a
// context beyond any prompt, or larger than the blocks sent with it, is
// refused, and a flood of new ids never evicts a live program.
func TestApplyRemoteProgramBounded(t *testing.T) {
	cases := []struct {
		name                string
		slot, blocks, toks  int
		id                  uint64
		reason              string // "" accepted
		programs, reserved1 int    // on replica 1 after it
	}{
		{"accepted", 1, 100, 1605, 77, "", 1, 1605},
		{"a partial block more is backed", 1, 100, 1615, 77, "", 1, 1615},
		{"unbacked: more than its blocks", 1, 100, 1616, 77, "unbacked", 0, 0},
		{"unbacked: no blocks", 1, 0, 5000, 77, "unbacked", 0, 0},
		{"negative blocks", 1, -1, 0, 77, "unbacked", 0, 0},
		{"oversize", 1, 1 << 40, 1 << 40, 77, "oversize", 0, 0},
		{"negative context", 1, 1, -1, 77, "oversize", 0, 0},
		{"no such replica: skipped", 5, 100, 1605, 77, "", 0, 0},
		{"negative slot: skipped", -1, 100, 1605, 77, "", 0, 0},
		{"no program: nothing", 1, 100, 1605, 0, "", 0, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newProgFleet(t, leastLoadPolicy(t), 2, 1000, ProgramConfig{MaxPrograms: 4})
			err := f.rt.ApplyRemoteProgram(c.slot, c.id, c.blocks, c.toks, f.now)
			var pe *RemoteProgramError
			if c.reason == "" && err != nil || c.reason != "" && (!errors.As(err, &pe) || pe.Reason != c.reason || !errors.Is(err, ErrRemoteProgram)) {
				t.Fatalf("err %v, want reason %q", err, c.reason)
			}
			views := f.rt.Views(f.req("", "x", 10))
			if views[1].Programs != c.programs || views[1].ProgramTokens != c.reserved1 || views[0].Programs != 0 {
				t.Fatalf("views %+v / %+v", views[0], views[1])
			}
		})
	}
}

// A flood of forged program ids from a peer costs the table's idle
// programs their entries, never a live program (one with a turn in flight,
// or idle less than the TTL) its entry and reservation.
func TestRemoteProgramsNeverEvictLive(t *testing.T) {
	f := newProgFleet(t, leastLoadPolicy(t), 2, 1000, ProgramConfig{MaxPrograms: 4, IdleTTL: time.Second})
	tk, err := f.rt.Route(f.req("local", "a", 100))
	if err != nil {
		t.Fatal(err)
	}
	defer tk.Done(f.now, Outcome{})
	refused := 0
	for id := uint64(100); id < 200; id++ {
		if err := f.rt.ApplyRemoteProgram(0, id, 10, 160, f.now); errors.Is(err, ErrRemoteProgram) {
			refused++
		}
	}
	if st := f.rt.ProgramStats(); st.Tracked != 4 || refused != 97 {
		t.Fatalf("stats %+v, %d refused", st, refused)
	}
	next := f.req("local", "a", 120)
	if f.rt.Views(next); !next.Program.Continues || next.Program.Home != tk.Replica {
		t.Fatalf("the local program lost its home: %+v", next.Program)
	}
	// Once the forged ones are idle past the TTL, new records replace them.
	f.now = f.now.Add(2 * time.Second)
	if err := f.rt.ApplyRemoteProgram(0, 500, 10, 160, f.now); err != nil {
		t.Fatal(err)
	}
}

// Two prompts that share every full block and their token count but differ
// past the last full block are two bursts, not one; the same prompt again
// is the same burst.
func TestBurstKeyNamesTheWholePrompt(t *testing.T) {
	req := func(text string) *policy.Request {
		return &policy.Request{Text: text, Tokens: 2004, Blocks: []uint64{7, 8, 9}}
	}
	doc := strings.Repeat("a long shared document. ", 300)
	a, b := burstKey(req(doc+"first question?")), burstKey(req(doc+"other question?"))
	if a == 0 || a == b {
		t.Fatalf("keys %x and %x: want two non-zero keys", a, b)
	}
	if c := burstKey(req(doc + "first question?")); c != a {
		t.Fatalf("the same prompt: %x, want %x", c, a)
	}
}

// A burst's followers count in their replica's BurstPending from routing
// to their first token (or their end without one); its first request and
// other prompts do not: the policy counts them among the decodes to come.
func TestBurstPendingCountsFollowers(t *testing.T) {
	f := newProgFleet(t, placer{leastLoadPolicy(t)}, 2, 1000, ProgramConfig{BurstWindow: 100 * time.Millisecond, BurstCap: -1})
	burstPending := func() []int {
		views := f.rt.Views(f.req("", "x", 10))
		return []int{views[0].BurstPending, views[1].BurstPending}
	}
	var tks []*Ticket
	for range 4 {
		tk, err := f.rt.Route(f.req("", "sample ", 300))
		if err != nil {
			t.Fatal(err)
		}
		tks = append(tks, tk)
	}
	other, err := f.rt.Route(f.req("", "other ", 300))
	if err != nil {
		t.Fatal(err)
	}
	r := tks[0].Replica
	want := []int{0, 0}
	want[r] = 3
	if got := burstPending(); got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("BurstPending %v after a burst of 4 on replica %d, want %v", got, r, want)
	}
	tks[0].FirstToken(f.now) // the first request's own first token: not a follower
	tks[1].FirstToken(f.now)
	tks[1].FirstToken(f.now) // idempotent
	tks[1].Done(f.now, Outcome{})
	tks[2].Done(f.now, Outcome{Err: errors.New("reset")}) // ended without a first token
	other.Done(f.now, Outcome{})
	want[r] = 1
	if got := burstPending(); got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("BurstPending %v, want %v", got, want)
	}
	tks[3].FirstToken(f.now)
	tks[3].Done(f.now, Outcome{})
	tks[0].Done(f.now, Outcome{})
	if got := burstPending(); got[0] != 0 || got[1] != 0 {
		t.Fatalf("BurstPending %v once all ended, want none", got)
	}
}

// Admission's gate (AdmissionMinContext) is each pool's: the long
// contexts of one pool's programs going idle do not hold the new programs
// of another pool whose programs never went idle long. The EWMA was the
// router's: an agents pool made a chat pool's first turns wait.
func TestProgramAdmissionGateIsThePools(t *testing.T) {
	now := time.Unix(1000, 0)
	rt, err := New(Config{
		Specs: []Spec{{URL: "ra", Pool: "agents"}, {URL: "rb", Pool: "chat"}},
		Pools: []Pool{{Name: "agents", Models: []string{"agent"}, Policy: placer{leastLoadPolicy(t)}},
			{Name: "chat", Models: []string{"chat"}, Policy: placer{leastLoadPolicy(t)}}},
		Policy: leastLoadPolicy(t), Now: func() time.Time { return now }, BlocksPerReplica: 100,
		Programs: ProgramConfig{KVAdmission: true, IdleTTL: 10 * time.Second, AdmissionMinContext: 500},
	})
	if err != nil {
		t.Fatal(err)
	}
	req := func(model, id, word string) *policy.Request {
		p := &prompt.Parsed{Kind: prompt.Completion, Model: model, Text: strings.Repeat(word, 900*4/len(word)), MaxTokens: 16, Prompts: 1}
		return rt.Prepare(p, id, "")
	}
	tk, _, err := rt.Submit(req("agent", "a", "aa ")) // 916 tokens on ra
	if err != nil || tk == nil {
		t.Fatalf("a: %v %v", tk, err)
	}
	tk.Done(now, Outcome{CachedTokens: -1})
	now = now.Add(11 * time.Second)
	if st := rt.ProgramStats(); st.Live != 0 { // a idles past its TTL: a long context gone idle in agents
		t.Fatalf("a still live: %+v", st)
	}
	b, _, err := rt.Submit(req("chat", "b", "bb ")) // rb: room for one
	if err != nil || b == nil {
		t.Fatalf("b: %v %v", b, err)
	}
	c, w, err := rt.Submit(req("chat", "c", "cc ")) // no room on rb, but no chat program went idle
	if err != nil || c == nil || w != nil {
		t.Fatalf("c, in a pool whose programs never idled long: held %v, err %v", w != nil, err)
	}
}
