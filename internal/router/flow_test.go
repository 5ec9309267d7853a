package router

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// flowRig is a router with flow control on, a fake clock and a policy
// that sends each request to the replica with the least pending prefill
// (lowest index on ties) and estimates its first token est later.
type flowRig struct {
	t   *testing.T
	rt  *Router
	now time.Time
	est time.Duration
	// released lists the requests the queue let go, by their text, with
	// their error's reason ("" when routed).
	released []string
	tickets  map[string]*Ticket
	// exclude is the replicas the next submit excludes (a retry's).
	exclude []int
}

func newFlowRig(t *testing.T, replicas int, fc FlowConfig) *flowRig {
	t.Helper()
	return newFlowRigWith(t, replicas, fc, nil)
}

// newFlowRigWith is newFlowRig with the router's config changed by mod.
func newFlowRigWith(t *testing.T, replicas int, fc FlowConfig, mod func(*Config)) *flowRig {
	t.Helper()
	fr := &flowRig{t: t, now: time.Unix(1000, 0), tickets: map[string]*Ticket{}}
	names := make([]string, replicas)
	for i := range names {
		names[i] = fmt.Sprintf("r%d", i)
	}
	least := policyFunc(func(req *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
		best := -1
		for i, r := range rs {
			if r.Healthy && (best < 0 || r.PendingPrefill < rs[best].PendingPrefill) {
				best = i
			}
		}
		if best < 0 {
			return policy.Decision{}, policy.ErrNoReplica
		}
		return policy.Decision{Replica: best, EstTTFT: fr.est}, nil
	})
	fc.Enabled = true
	cfg := Config{Replicas: names, Policy: least, Now: func() time.Time { return fr.now }, Flow: fc}
	if mod != nil {
		mod(&cfg)
	}
	rt, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	fr.rt = rt
	return fr
}

// tightFlow saturates a replica as soon as anything is pending on it.
func tightFlow() FlowConfig {
	return FlowConfig{Saturation: SaturationRule{QueueMs: 1}}
}

// submit sends a request named name (its prompt: name and tokens×4
// characters) of tenant at priority prio; it is routed now (true) or
// waits; a shed one fails the test unless wantShed.
func (fr *flowRig) submit(name, tenant string, prio, tokens int, mod ...func(*policy.Request)) (*Waiting, error) {
	fr.t.Helper()
	return fr.submitWith(nil, name, tenant, prio, tokens, mod...)
}

// submitWith is submit decided by pol (nil: the rig's policy), as the
// gateway routes a request pinned to a replica or by load.
func (fr *flowRig) submitWith(pol policy.Policy, name, tenant string, prio, tokens int, mod ...func(*policy.Request)) (*Waiting, error) {
	fr.t.Helper()
	text := name + " " + strings.Repeat("abcd", tokens)
	req := fr.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, Prompts: 1, MaxTokens: 10}, "", "")
	req.Tenant, req.Priority = tenant, prio
	for _, m := range mod {
		m(req)
	}
	tk, w, err := fr.rt.SubmitWith(pol, req, fr.exclude...)
	if err != nil {
		return nil, err
	}
	if tk != nil {
		fr.tickets[name] = tk
		fr.released = append(fr.released, name)
		return nil, nil
	}
	w.OnRouted = func(tk *Ticket, err error) {
		if fr.shedOut(name, err) {
			return
		}
		fr.tickets[name] = tk
		fr.released = append(fr.released, name)
	}
	return w, nil
}

// shedOut records name's leaving the queue shed (err, a *ShedError: its
// reason) and reports whether it was; any other error fails the test.
func (fr *flowRig) shedOut(name string, err error) bool {
	if err == nil {
		return false
	}
	var se *ShedError
	if !errors.As(err, &se) {
		fr.t.Errorf("%s left the queue with %v", name, err)
		return true
	}
	fr.released = append(fr.released, name+":"+se.Reason)
	return true
}

// first reports the first token of name's ticket (its prefill ends).
func (fr *flowRig) first(name string) {
	fr.t.Helper()
	tk, ok := fr.tickets[name]
	if !ok {
		fr.t.Fatalf("%s was not routed", name)
	}
	tk.FirstToken(fr.now)
}

func (fr *flowRig) done(name string, out int) {
	fr.t.Helper()
	fr.tickets[name].Done(fr.now, Outcome{CachedTokens: -1, OutputTokens: out})
}

func (fr *flowRig) order() string { return strings.Join(fr.released, " ") }

// The gate: with every replica's prefill queue full, requests wait in
// the router; each first token lets the next one go.
func TestFlowHoldsWhileSaturated(t *testing.T) {
	fr := newFlowRig(t, 2, tightFlow())
	for _, n := range []string{"a1", "a2", "a3", "a4"} {
		if _, err := fr.submit(n, "A", 0, 100); err != nil {
			t.Fatal(err)
		}
	}
	if got := fr.order(); got != "a1 a2" || fr.rt.Queued() != 2 {
		t.Fatalf("released %q with %d waiting; want a1 a2 routed (one per replica), two waiting", got, fr.rt.Queued())
	}
	fr.first("a1")
	if got := fr.order(); got != "a1 a2 a3" {
		t.Fatalf("after a1's first token: %q", got)
	}
	for _, n := range []string{"a2", "a3"} {
		fr.first(n)
	}
	if got := fr.order(); got != "a1 a2 a3 a4" || fr.rt.Queued() != 0 {
		t.Fatalf("after every first token: %q, %d waiting", got, fr.rt.Queued())
	}
}

// Bands are strict: a more urgent request waiting goes before every less
// urgent one, whenever it came.
func TestFlowBandsStrict(t *testing.T) {
	fr := newFlowRig(t, 1, tightFlow())
	mustSubmit(t, fr, "x", "A", 0, 100)
	mustSubmit(t, fr, "low1", "A", 2, 100)
	mustSubmit(t, fr, "mid", "B", 1, 100)
	mustSubmit(t, fr, "top", "B", 0, 100)
	mustSubmit(t, fr, "low2", "B", 2, 100)
	for _, n := range []string{"x", "top", "mid", "low1"} {
		fr.first(n)
	}
	if got, want := fr.order(), "x top mid low1 low2"; got != want {
		t.Fatalf("order %q, want %q", got, want)
	}
}

func mustSubmit(t *testing.T, fr *flowRig, name, tenant string, prio, tokens int, mod ...func(*policy.Request)) *Waiting {
	t.Helper()
	w, err := fr.submit(name, tenant, prio, tokens, mod...)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return w
}

// Within a band tenants share by weight: B (weight 3) and A (weight 1),
// both always waiting with equal requests, are served 3:1.
func TestFlowWeightedFairShare(t *testing.T) {
	fr := newFlowRig(t, 1, FlowConfig{Saturation: SaturationRule{QueueMs: 1}, Tenants: map[string]FlowTenant{"B": {Weight: 3}}})
	mustSubmit(t, fr, "start", "C", 0, 100)
	for i := range 40 {
		mustSubmit(t, fr, fmt.Sprintf("A%d", i), "A", 0, 100)
		mustSubmit(t, fr, fmt.Sprintf("B%d", i), "B", 0, 100)
	}
	last := "start"
	served := map[byte]int{}
	for range 40 {
		fr.first(last)
		fr.done(last, 10)
		last = fr.released[len(fr.released)-1]
		served[last[0]]++
	}
	if served['B'] < 28 || served['B'] > 32 || served['A']+served['B'] != 40 {
		t.Fatalf("served A %d, B %d of 40; want B's 3/4 (30 ± 2)", served['A'], served['B'])
	}
}

// The fairness unit is GPU work: a tenant whose prompts the chosen
// replica holds costs only its uncached tokens, so it is served more
// requests than one whose equal prompts are computed whole.
func TestFlowCacheHitsCostLess(t *testing.T) {
	fr := newFlowRig(t, 1, tightFlow())
	shared := strings.Repeat("the same long system prompt ", 80) // ≈ 560 tokens, cached
	warm := fr.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: shared, KeyText: shared, Prompts: 1}, "", "")
	if err := fr.rt.Index().Insert(0, warm.Blocks); err != nil {
		t.Fatal(err)
	}
	mustSubmit(t, fr, "start", "C", 0, 10)
	for i := range 30 {
		mustSubmit(t, fr, fmt.Sprintf("H%d", i), "H", 0, 0, func(r *policy.Request) {
			*r = *fr.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: shared + fmt.Sprint(i), Prompts: 1, MaxTokens: 10}, "", "")
			r.Tenant = "H"
		})
		mustSubmit(t, fr, fmt.Sprintf("M%d", i), "M", 0, 560)
	}
	last, served := "start", map[byte]int{}
	for range 30 {
		fr.first(last)
		fr.done(last, 10)
		last = fr.released[len(fr.released)-1]
		served[last[0]]++
	}
	if served['H'] < 3*served['M'] {
		t.Fatalf("served H (cached) %d, M (uncached) %d: the cached tenant should get several times more", served['H'], served['M'])
	}
}

// Within a tenant: rank first, then the earliest deadline, then arrival.
func TestFlowEDFWithinTenant(t *testing.T) {
	fr := newFlowRig(t, 1, tightFlow())
	mustSubmit(t, fr, "x", "A", 0, 10)
	mustSubmit(t, fr, "late", "A", 0, 10, func(r *policy.Request) { r.Deadline = fr.now.Add(30 * time.Second) })
	mustSubmit(t, fr, "none", "A", 0, 10)
	mustSubmit(t, fr, "soon", "A", 0, 10, func(r *policy.Request) { r.Deadline = fr.now.Add(5 * time.Second) })
	mustSubmit(t, fr, "ranked", "A", 0, 10, func(r *policy.Request) { r.Rank = -1 })
	for _, n := range []string{"x", "ranked", "soon", "late"} {
		fr.first(n)
	}
	if got, want := fr.order(), "x ranked soon late none"; got != want {
		t.Fatalf("order %q, want %q", got, want)
	}
}

// Without deadlines the queue releases requests by when their first token
// could come at the earliest: their arrival plus their own prefill as
// their policy prices it (policy.QueueOrderer; here 0.04 ms a token). A short prompt that came 10 ms after a long one (4,000
// tokens: 160 ms of prefill) goes before it; one that came 200 ms after it
// does not (the long one's wait is bounded by its prefill); a request with
// a deadline goes before both, however long. A policy that does not price
// it (the peers') is first come first served.
func TestFlowQueueByReadyTime(t *testing.T) {
	for _, c := range []struct {
		msPerToken float64
		want       string
	}{{0.04, "x dl short long later"}, {0, "x dl long short later"}} {
		fr := newFlowRigWith(t, 1, tightFlow(), func(cfg *Config) {
			if c.msPerToken > 0 {
				cfg.Policy = queueOrdered{cfg.Policy, c.msPerToken}
			}
		})
		mustSubmit(t, fr, "x", "A", 0, 10)
		mustSubmit(t, fr, "long", "A", 0, 4000)
		fr.now = fr.now.Add(10 * time.Millisecond)
		mustSubmit(t, fr, "short", "A", 0, 10)
		fr.now = fr.now.Add(190 * time.Millisecond)
		mustSubmit(t, fr, "later", "A", 0, 10)
		mustSubmit(t, fr, "dl", "A", 0, 4000, func(r *policy.Request) { r.Deadline = fr.now.Add(30 * time.Second) })
		for _, n := range strings.Fields(c.want) {
			fr.first(n)
		}
		if got := fr.order(); got != c.want {
			t.Errorf("%v ms a token: order %q, want %q", c.msPerToken, got, c.want)
		}
	}
}

// Turn priority (#27): a program's next turn leaves the queue before a new
// program's first turn that came before it, so that the programs under
// way finish rather than all slowing down as more start.
func TestFlowTurnPriority(t *testing.T) {
	fr := newFlowRig(t, 1, tightFlow())
	prog := func(id uint64) func(*policy.Request) { return func(r *policy.Request) { r.Program.ID = id } }
	mustSubmit(t, fr, "x", "A", 0, 10, prog(7)) // program 7's first turn, routed
	mustSubmit(t, fr, "new", "A", 0, 10, prog(8))
	mustSubmit(t, fr, "plain", "A", 0, 10)
	mustSubmit(t, fr, "next", "A", 0, 10, prog(7))
	for _, n := range []string{"x", "plain", "next", "new"} {
		if _, ok := fr.tickets[n]; !ok {
			t.Fatalf("%s not routed; order %q", n, fr.order())
		}
		fr.first(n)
	}
	if got, want := fr.order(), "x plain next new"; got != want {
		t.Fatalf("order %q, want %q", got, want)
	}
}

// pinTo is the policy of a request that must go to replica i (a stored
// response's holder: the gateway's pinned).
type pinTo int

func (pinTo) Name() string { return "pin" }

func (p pinTo) PinnedTo() int { return int(p) }

func (p pinTo) Pick(_ *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
	if int(p) >= len(rs) || !rs[p].Healthy {
		return policy.Decision{}, policy.ErrNoReplica
	}
	return policy.Decision{Replica: int(p)}, nil
}

// A request pinned to a saturated replica while another has room is
// routed to its replica, not failed for want of one (the flow controller
// took its replica out of the candidates, and the pinned policy had
// nowhere to send it) nor held for that replica in front of the queue.
// While every replica is saturated it waits its turn like the rest.
func TestFlowPinnedToASaturatedReplica(t *testing.T) {
	fr := newFlowRig(t, 2, tightFlow())
	mustSubmit(t, fr, "a1", "A", 0, 100) // r0, saturated now
	if _, err := fr.submitWith(pinTo(0), "pin0", "A", 0, 10); err != nil {
		t.Fatalf("pinned to the saturated r0 while r1 has room: %v", err)
	}
	if tk := fr.tickets["pin0"]; tk == nil || tk.Replica != 0 {
		t.Fatalf("pinned to r0: order %q, ticket %+v", fr.order(), tk)
	}
	mustSubmit(t, fr, "a2", "A", 0, 100) // r1: every replica saturated
	if _, err := fr.submitWith(pinTo(1), "pin1", "A", 0, 10); err != nil {
		t.Fatal(err)
	}
	mustSubmit(t, fr, "a3", "A", 0, 100)
	if got := fr.order(); got != "a1 pin0 a2" || fr.rt.Queued() != 2 {
		t.Fatalf("with the pool saturated: released %q, %d waiting; want pin1 and a3 waiting", got, fr.rt.Queued())
	}
	for _, n := range []string{"a1", "pin0"} {
		fr.first(n) // r0 has room; r1, pin1's replica, has not
	}
	if got := fr.order(); got != "a1 pin0 a2 pin1 a3" {
		t.Fatalf("once r0 has room: %q; want pin1 to its r1, then a3", got)
	}
	if fr.tickets["pin1"].Replica != 1 || fr.tickets["a3"].Replica != 0 {
		t.Fatalf("pin1 on r%d (want r1), a3 on r%d (want r0)", fr.tickets["pin1"].Replica, fr.tickets["a3"].Replica)
	}
}

// A request waiting past its band's TTL is shed (ttl), as is one at its
// deadline (deadline): by the caller's timer (Expire) or when the queue
// next moves.
func TestFlowTTLAndDeadline(t *testing.T) {
	fr := newFlowRig(t, 1, FlowConfig{Saturation: SaturationRule{QueueMs: 1}, Band: Band{TTL: 10 * time.Second}})
	mustSubmit(t, fr, "x", "A", 0, 10)
	w1 := mustSubmit(t, fr, "ttl", "A", 0, 10)
	mustSubmit(t, fr, "dl", "A", 0, 10, func(r *policy.Request) { r.Deadline = fr.now.Add(3 * time.Second) })
	if !w1.Expires().Equal(fr.now.Add(10 * time.Second)) {
		t.Fatalf("expires %v", w1.Expires())
	}
	fr.now = fr.now.Add(11 * time.Second)
	err := fr.rt.Expire(w1)
	var se *ShedError
	if !errors.As(err, &se) || se.Reason != ShedTTL || !errors.Is(err, ErrShed) || se.RetryAfter < time.Second {
		t.Fatalf("expire: %v", err)
	}
	if fr.rt.Expire(w1) != nil || fr.rt.Cancel(w1) {
		t.Fatal("an expired request is still in the queue")
	}
	fr.first("x") // the queue moves: dl is past its deadline
	if got := fr.order(); got != "x dl:deadline" || fr.rt.Queued() != 0 {
		t.Fatalf("order %q, %d waiting", got, fr.rt.Queued())
	}
}

// Once the queue's drain rate is known, a request whose estimated wait
// passes its TTL is shed at once, not after waiting it out.
func TestFlowShedsEarlyByEstimate(t *testing.T) {
	fc := FlowConfig{Saturation: SaturationRule{QueueMs: 1}, Bands: []Band{{Priority: 1, TTL: 3500 * time.Millisecond}}}
	fr := newFlowRig(t, 1, fc)
	for i := 0; i <= 6; i++ {
		mustSubmit(t, fr, fmt.Sprintf("r%d", i), "A", 0, 1000)
	}
	// One request (≈ 1,000 tokens + 10 out) leaves per second.
	for i := range 4 {
		fr.now = fr.now.Add(time.Second)
		fr.first(fmt.Sprintf("r%d", i))
	}
	// Band 0's r5 and r6 (≈ 2 s of work) and its own: within band 1's 3.5 s.
	if _, err := fr.submit("fits", "A", 1, 1000); err != nil {
		t.Fatalf("a request that fits its TTL was shed: %v", err)
	}
	_, err := fr.submit("late", "B", 1, 1000)
	var se *ShedError
	if !errors.As(err, &se) || se.Reason != ShedTTL || se.RetryAfter < 3*time.Second {
		t.Fatalf("4 s of work ahead with a 3.5 s TTL: %v", err)
	}
	// A more urgent band is ahead of all of it: it still fits.
	if _, err := fr.submit("urgent", "B", -1, 1000); err != nil {
		t.Fatalf("urgent: %v", err)
	}
}

// A request with a deadline goes before its own tenant's requests that
// came earlier (waitHeap.Less), so their work is not ahead of it: one due
// in 2 s behind ~6 s of its tenant's queue is admitted, and goes first.
// Before, the estimate counted the tenant's whole queue and shed it.
func TestFlowDeadlineAheadOfItsTenantsQueue(t *testing.T) {
	fr := newFlowRig(t, 1, FlowConfig{Saturation: SaturationRule{QueueMs: 1}, Band: Band{TTL: time.Minute, MaxQueued: 9}})
	for i := 0; i <= 6; i++ {
		mustSubmit(t, fr, fmt.Sprintf("r%d", i), "A", 0, 1000)
	}
	// One request (≈ 1,000 tokens + 10 out) leaves per second.
	for i := range 4 {
		fr.now = fr.now.Add(time.Second)
		fr.first(fmt.Sprintf("r%d", i))
	}
	for i := 1; i <= 6; i++ {
		mustSubmit(t, fr, fmt.Sprintf("a%d", i), "A", 0, 1000)
	}
	// r5, r6 and a1–a6 wait: about 8 s of the tenant's work.
	if _, err := fr.submit("due", "A", 0, 100, func(r *policy.Request) { r.Deadline = fr.now.Add(2 * time.Second) }); err != nil {
		t.Fatalf("a deadline request that goes first in its tenant's queue was shed: %v", err)
	}
	// A request of no deadline goes after all of them: refused by the
	// full band, it is told to come back after the whole queue's wait.
	_, err := fr.submit("late", "A", 0, 100)
	var se *ShedError
	if !errors.As(err, &se) || se.Reason != ShedQueueFull || se.RetryAfter < 7*time.Second {
		t.Fatalf("a request behind ~8 s of its tenant's work, the band full: %v; want shed (queue full) after ≥ 7 s", err)
	}
	fr.first("r4")
	if got := fr.order(); !strings.HasSuffix(got, "r4 due") {
		t.Fatalf("order %q: the deadline request should go next", got)
	}
}

// A decision whose estimated first token comes after the request's
// deadline sheds it before anything is sent, queue or not.
func TestFlowDeadlineByEstimate(t *testing.T) {
	fr := newFlowRig(t, 2, tightFlow())
	fr.est = 2 * time.Second
	_, err := fr.submit("tight", "A", 0, 10, func(r *policy.Request) { r.Deadline = fr.now.Add(time.Second) })
	var se *ShedError
	if !errors.As(err, &se) || se.Reason != ShedDeadline {
		t.Fatalf("a 1 s deadline with a 2 s estimate: %v", err)
	}
	if fr.rt.InFlight(0)+fr.rt.InFlight(1) != 0 {
		t.Fatal("a shed request was counted in flight")
	}
	mustSubmit(t, fr, "ok", "A", 0, 10, func(r *policy.Request) { r.Deadline = fr.now.Add(3 * time.Second) })
	if fr.order() != "ok" {
		t.Fatalf("order %q", fr.order())
	}
}

// Bounds: a full band refuses; a full pool displaces the newest request
// of its least urgent band for a more urgent one, else refuses; a
// sheddable band's request is refused while the pool is saturated.
func TestFlowCapsAndShedding(t *testing.T) {
	fc := FlowConfig{Saturation: SaturationRule{QueueMs: 1}, MaxQueued: 3,
		Band: Band{MaxQueued: 2}, Bands: []Band{{Priority: 5, Sheddable: true}}}
	fr := newFlowRig(t, 1, fc)
	mustSubmit(t, fr, "x", "A", 0, 10)
	_, err := fr.submit("shed", "A", 5, 10)
	if reason(err) != ShedSaturated {
		t.Fatalf("sheddable while saturated: %v", err)
	}
	mustSubmit(t, fr, "a", "A", 1, 10)
	mustSubmit(t, fr, "b", "A", 1, 10)
	if _, err := fr.submit("c", "A", 1, 10); reason(err) != ShedQueueFull {
		t.Fatalf("third in a band of 2: %v", err)
	}
	mustSubmit(t, fr, "d", "A", 2, 10)
	if _, err := fr.submit("e", "A", 2, 10); reason(err) != ShedQueueFull {
		t.Fatalf("a full pool, nothing less urgent: %v", err)
	}
	mustSubmit(t, fr, "f", "B", 0, 10) // displaces d, the newest of the lowest band
	if _, err := fr.submit("g", "B", 0, 10); err != nil {
		t.Fatalf("g displaces b: %v", err)
	}
	if got := fr.order(); got != "x d:displaced b:displaced" || fr.rt.Queued() != 3 {
		t.Fatalf("order %q, %d waiting", got, fr.rt.Queued())
	}
	for _, n := range []string{"x", "f", "g"} {
		fr.first(n)
	}
	if got := fr.order(); got != "x d:displaced b:displaced f g a" {
		t.Fatalf("order %q", got)
	}
}

// Trunk reservation: a sheddable band never takes the last replica with
// room (its default reserve, one), which an urgent request then finds;
// a reserve of two keeps two; off, it takes the last; a reserve is never
// all of a pool: with every replica free, a sheddable request goes.
func TestFlowSheddableReserve(t *testing.T) {
	for _, tc := range []struct {
		name                string
		replicas, saturated int
		reserve             int
		want                string // the sheddable request's fate
	}{
		{"default, one left", 3, 2, 0, ShedSaturated}, {"default, two left", 3, 1, 0, "routed"},
		{"two, two left", 3, 1, 2, ShedSaturated}, {"none, one left", 3, 2, -1, "routed"},
		{"more than the pool, all free", 2, 0, 5, "routed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fc := tightFlow()
			fc.Bands = []Band{{Priority: 5, Sheddable: true, Reserve: tc.reserve}}
			fr := newFlowRig(t, tc.replicas, fc)
			for i := range tc.saturated {
				mustSubmit(t, fr, fmt.Sprintf("x%d", i), "A", 0, 10)
			}
			got := "routed"
			if _, err := fr.submit("shed", "B", 5, 10); err != nil {
				got = reason(err)
			}
			if got != tc.want {
				t.Fatalf("sheddable with %d of %d replicas saturated: %s, want %s", tc.saturated, tc.replicas, got, tc.want)
			}
			if got == ShedSaturated {
				mustSubmit(t, fr, "urgent", "A", 0, 10)
				if fr.rt.Queued() != 0 || !strings.HasSuffix(fr.order(), "urgent") {
					t.Fatalf("the urgent request did not take a reserved replica: %q, %d waiting", fr.order(), fr.rt.Queued())
				}
			}
		})
	}
}

func reason(err error) string {
	var se *ShedError
	if errors.As(err, &se) {
		return se.Reason
	}
	return fmt.Sprint(err)
}

// Idle time earns no credit: a tenant that comes back after being idle is
// lifted to the others' counter, and the two then share.
func TestFlowIdleEarnsNoCredit(t *testing.T) {
	fr := newFlowRig(t, 1, tightFlow())
	// A is served alone for a while (B idle).
	last := ""
	for i := range 20 {
		n := fmt.Sprintf("A%d", i)
		mustSubmit(t, fr, n, "A", 0, 100)
		fr.first(n)
		fr.done(n, 10)
		last = n
	}
	_ = last
	mustSubmit(t, fr, "x", "C", 0, 100)
	for i := range 10 {
		mustSubmit(t, fr, fmt.Sprintf("B%d", i), "B", 0, 100)
		mustSubmit(t, fr, fmt.Sprintf("a%d", i), "A", 0, 100)
	}
	prev, served := "x", map[byte]int{}
	for range 10 {
		fr.first(prev)
		fr.done(prev, 10)
		prev = fr.released[len(fr.released)-1]
		served[prev[0]]++
	}
	if served['B'] > 6 || served['a'] < 4 {
		t.Fatalf("after A's lone service: B %d, A %d of 10; B must not take all on old credit", served['B'], served['a'])
	}
}

// Off, the queue is late binding's FIFO: a request's tenant and priority
// change nothing, and nothing is bounded.
func TestFlowOffIsFIFO(t *testing.T) {
	rt, err := New(Config{Replicas: []string{"a"}, Policy: &deferring{}})
	if err != nil {
		t.Fatal(err)
	}
	var order []string
	var first *Ticket
	for i, p := range []int{3, 0, 1} {
		text := fmt.Sprint("request ", i)
		req := rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, Prompts: 1}, "", "")
		req.Priority, req.Tenant = p, fmt.Sprint(i)
		tk, w, err := rt.Submit(req)
		switch {
		case err != nil:
			t.Fatal(err)
		case tk != nil:
			first = tk
		default:
			if !w.Expires().IsZero() {
				t.Fatal("an expiry without flow control")
			}
			w.OnRouted = func(tk *Ticket, _ error) { order = append(order, text); tk.FirstToken(time.Now()) }
		}
	}
	first.FirstToken(time.Now())
	if strings.Join(order, ",") != "request 1,request 2" || len(rt.FlowTenants()) != 0 {
		t.Fatalf("order %v", order)
	}
}

// A request's band: its tenant's default when it names none, else what it
// asks clamped to its tenant's range, up to the least urgent band
// configured.
func TestFlowBandOf(t *testing.T) {
	c := FlowConfig{Tenants: map[string]FlowTenant{"gold": {Priority: 1, MaxPriority: -1}, "bulk": {Priority: 3, MaxPriority: 3}},
		Bands: []Band{{Priority: 5, Sheddable: true}}}
	for _, tc := range []struct {
		tenant    string
		requested int
		given     bool
		want      int
	}{
		{"gold", 0, false, 1}, {"gold", -5, true, -1}, {"gold", 2, true, 2}, {"gold", 99, true, 5},
		{"bulk", 0, true, 3}, {"bulk", 4, true, 4}, {"", -3, true, 0}, {"", 7, true, 5}, {"", 7, false, 0},
	} {
		if got := c.BandOf(tc.tenant, tc.requested, tc.given); got != tc.want {
			t.Errorf("%s asking %d (%v): band %d, want %d", tc.tenant, tc.requested, tc.given, got, tc.want)
		}
	}
}

// BenchmarkDecisionFlow times a decision as the gateway asks for it
// (Submit, then the ticket's end) with flow control off and on, in one
// run, over BenchmarkDecision's index and prompt: with an empty queue and
// unsaturated replicas the flow controller adds only its saturation check
// and its tenant's accounting (the done-when: within 5 % of off).
func BenchmarkDecisionFlow(b *testing.B) {
	for _, on := range []bool{false, true} {
		b.Run(map[bool]string{false: "off", true: "on"}[on], func(b *testing.B) {
			p, err := policy.New("ttft", policy.Options{Seed: 1})
			if err != nil {
				b.Fatal(err)
			}
			urls := make([]string, 16)
			for i := range urls {
				urls[i] = "http://r" + string(rune('a'+i))
			}
			now := time.Unix(0, 0)
			rt, err := New(Config{Replicas: urls, Policy: p, Now: func() time.Time { return now }, MaxEntries: 2 << 20,
				BlocksPerReplica: 1 << 20, Flow: FlowConfig{Enabled: on}})
			if err != nil {
				b.Fatal(err)
			}
			req := rt.Prepare(benchFill(rt, 5), "", "")
			req.Tenant = "t"
			var lat []time.Duration
			b.ResetTimer()
			for b.Loop() {
				t0 := time.Now()
				tk, w, err := rt.Submit(req)
				if err != nil || w != nil {
					b.Fatal(err, w)
				}
				lat = append(lat, time.Since(t0))
				tk.Done(now, Outcome{CachedTokens: -1, OutputTokens: 16})
			}
			reportLatencies(b, lat)
		})
	}
}

// queueOrdered is a policy that has the router's queue order its deferred
// requests by arrival plus msPerToken a token of their own prefill.
type queueOrdered struct {
	policy.Policy
	msPerToken float64
}

func (q queueOrdered) QueuePrefillMs(uncached int) float64 { return q.msPerToken * float64(uncached) }

// BenchmarkFlowAdmitFullBand times the admission of a request refused
// with 5,000 requests waiting in its band: the estimate of its wait
// (queue.ahead), under the queue's mutex, is all it costs. "own": they
// are its tenant's, whose requests ordered before it only are counted
// (ownAhead, one pass) when the exact figure decides; "other": another
// tenant's, counted by their sum. "full": the band is at its MaxQueued
// (the default 5,000), refused whatever the estimate; "past_ttl": the
// band has room, and the wait estimated passes the request's TTL (the
// exact figure decides; another tenant's request is admitted then, its
// weighted share ahead).
func BenchmarkFlowAdmitFullBand(b *testing.B) {
	for _, c := range []struct {
		name      string
		own, full bool
	}{{"own/full", true, true}, {"other/full", false, true}, {"own/past_ttl", true, false}} {
		b.Run(c.name, func(b *testing.B) {
			band := Band{TTL: time.Minute}
			if !c.full {
				band.MaxQueued = 2 * DefaultBandMaxQueued
			}
			cfg, err := FlowConfig{Enabled: true, Band: band}.withDefaults()
			if err != nil {
				b.Fatal(err)
			}
			q := newQueue(&cfg)
			now := time.Unix(1000, 0)
			for i := range DefaultBandMaxQueued {
				w := &Waiting{req: &policy.Request{Tenant: "A", Tokens: 1000 + i%7, MaxTokens: 10}, prefillMs: float64(i % 13)}
				if _, err := q.admit(w, now); err != nil {
					b.Fatal(err)
				}
			}
			q.fl.rate = 1000 // work a second: the queue's 5 M is past any TTL
			tenant := map[bool]string{true: "A", false: "B"}[c.own]
			w := &Waiting{req: &policy.Request{Tenant: tenant, Tokens: 1000, MaxTokens: 10}, prefillMs: 5}
			b.ResetTimer()
			for b.Loop() {
				if _, err := q.admit(w, now); err == nil {
					b.Fatal("admitted")
				}
			}
		})
	}
}
