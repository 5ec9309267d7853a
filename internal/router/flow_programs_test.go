package router

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// newFlowProgRig is a flow rig of one replica of 100 blocks (1,600 tokens)
// whose policy places programs, with KV admission holding new programs for
// at most wait.
func newFlowProgRig(t *testing.T, wait time.Duration) *flowRig {
	t.Helper()
	return newFlowRigWith(t, 1, tightFlow(), func(c *Config) {
		c.Policy = placer{c.Policy}
		c.BlocksPerReplica = 100
		c.Programs = ProgramConfig{KVAdmission: true, AdmissionWait: wait, AdmissionMinContext: -1}
	})
}

// ofProgram makes a request the first turn of program id.
func ofProgram(id string) func(*policy.Request) {
	return func(r *policy.Request) { SetProgram(r, id) }
}

// scrape is an empty scrape of replica 0 now (the queue and the parked
// programs move).
func (fr *flowRig) scrape() { fr.rt.SetMetrics(0, Metrics{NumBlocks: 100, BlockSize: 16}, fr.now) }

// A new program held past AdmissionWait is placed without room, but not
// past the flow controller: while the pool is saturated it waits its turn
// in the queue like any request, rather than being sent at once, ahead of
// the requests waiting there (and its retries after it).
func TestFlowHeldProgramPlacedAnywayWaitsItsTurn(t *testing.T) {
	fr := newFlowProgRig(t, 2*time.Second)
	mustSubmit(t, fr, "a", "A", 0, 900, ofProgram("a"))
	fr.first("a")
	mustSubmit(t, fr, "b", "B", 0, 900, ofProgram("b")) // held: no room
	mustSubmit(t, fr, "d", "D", 0, 100)                 // the pool is saturated
	mustSubmit(t, fr, "e", "E", 0, 100)                 // waits in the queue
	fr.now = fr.now.Add(2500 * time.Millisecond)
	fr.scrape()
	if got := fr.order(); got != "a d" || fr.rt.Queued() != 2 || fr.rt.ProgramStats().Waiting != 0 {
		t.Fatalf("b past its admission wait with the pool saturated: released %q, %d waiting, %+v; want b queued beside e",
			fr.order(), fr.rt.Queued(), fr.rt.ProgramStats())
	}
	fr.first("d")
	next := fr.released[len(fr.released)-1]
	fr.first(next)
	if got := fr.order(); got != "a d b e" && got != "a d e b" || fr.rt.Queued() != 0 {
		t.Fatalf("released %q, %d waiting; want b and e in turn, b placed without room", got, fr.rt.Queued())
	}
	if tk := fr.tickets["b"]; tk.req.NoDefer {
		t.Fatal("b's request left with NoDefer set: its retries would skip the flow controller")
	}
}

// A new program held for room joins its pool's queue on whichever
// goroutine moves the held programs (a first token, a scrape), which sets
// its expiry while its caller may be reading it (Expires; go test -race).
func TestFlowExpiresWhileHeldProgramQueues(t *testing.T) {
	fr := newFlowProgRig(t, time.Hour)
	mustSubmit(t, fr, "a", "A", 0, 900, ofProgram("a"))
	fr.first("a")
	b := mustSubmit(t, fr, "b", "B", 0, 900, ofProgram("b")) // held: no room
	mustSubmit(t, fr, "c", "C", 0, 100)                      // the pool is saturated
	fr.now = fr.now.Add(time.Second)
	read := make(chan time.Time)
	go func() { read <- b.Expires() }() // the gateway's waitInQueue
	fr.scrape()                         // b joins the queue
	<-read
	if b.Expires().IsZero() || b.Enqueued().IsZero() || fr.rt.Queued() != 1 {
		t.Fatalf("b should wait in the queue: expires %v, %d queued", b.Expires(), fr.rt.Queued())
	}
}

// A request held for its own candidates (a retry excluding the replica
// that failed it; an adapter only some replicas list) does not hold the
// requests behind it that a replica with room can take, nor newcomers: it
// waits for its own, they go. The queue released in order and stopped at
// the first request held, and a newcomer queued behind it: every tenant
// waited behind one retry while a replica had room.
func TestFlowNarrowHeadDoesNotBlockTheQueue(t *testing.T) {
	fr := newFlowRig(t, 2, tightFlow())
	mustSubmit(t, fr, "a1", "A", 0, 100) // r0
	mustSubmit(t, fr, "a2", "A", 0, 100) // r1: the pool is saturated
	req := fr.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: "retry " + strings.Repeat("abcd", 100), Prompts: 1, MaxTokens: 10}, "", "")
	req.Tenant = "A"
	tk, x, err := fr.rt.Submit(req, 1) // a retry that failed on r1: r0 alone
	if err != nil || tk != nil || x == nil {
		t.Fatalf("the retry should wait: %v %v %v", tk, x, err)
	}
	mustSubmit(t, fr, "b1", "B", 0, 100) // behind the retry (A before B: equal counters)
	fr.first("a2")                       // r1 has room, r0 not: the retry is held alone, b1 goes
	if tk := fr.tickets["b1"]; tk == nil || tk.Replica != 1 {
		t.Fatalf("b1 waits behind the retry while r1 has room: released %q, %d waiting", fr.order(), fr.rt.Queued())
	}
	fr.first("b1")
	if _, err := fr.submit("c1", "C", 0, 100); err != nil || fr.tickets["c1"] == nil {
		t.Fatalf("c1, with only the retry waiting and r1 free: %v, released %q", err, fr.order())
	}
	select {
	case <-x.Done():
		t.Fatal("the retry went while r0 was saturated")
	default:
	}
	fr.first("a1") // r0 has room: the retry goes there
	<-x.Done()
	if tk, err := x.Result(); err != nil || tk.Replica != 0 || fr.rt.Queued() != 0 {
		t.Fatalf("the retry: %v %v, %d waiting", tk, err, fr.rt.Queued())
	}
}

// The same for a model only some replicas list (a LoRA adapter loaded on
// r0 alone): its requests wait for r0, the base model's go to r1.
func TestFlowAdapterOnOneReplicaDoesNotBlockTheQueue(t *testing.T) {
	fr := newFlowRig(t, 2, tightFlow())
	fr.rt.Replica(0).SetServed(NewServed([]Model{{ID: "m", Root: "m"}, {ID: "lora", Parent: "m"}}, nil))
	fr.rt.Replica(1).SetServed(NewServed([]Model{{ID: "m", Root: "m"}}, nil))
	mustSubmit(t, fr, "a1", "A", 0, 100) // r0, saturated now
	req := fr.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "lora", Text: "adapter " + strings.Repeat("abcd", 100), Prompts: 1, MaxTokens: 10}, "", "")
	req.Tenant = "A"
	tk, x, err := fr.rt.Submit(req)
	if err != nil || tk != nil || x == nil {
		t.Fatalf("the adapter's request should wait for r0: %v %v %v", tk, x, err)
	}
	if _, err := fr.submit("b1", "B", 0, 100); err != nil || fr.tickets["b1"] == nil || fr.tickets["b1"].Replica != 1 {
		t.Fatalf("b1 waits behind the adapter's request while r1 has room: %v, released %q", err, fr.order())
	}
	fr.first("a1")
	<-x.Done()
	if tk, err := x.Result(); err != nil || tk.Replica != 0 {
		t.Fatalf("the adapter's request: %v %v", tk, err)
	}
}

// More requests held alone than one pass decides on (maxPassedOver): those
// with the same candidates as one found held are passed over without a
// decision, and the request behind them goes.
func TestFlowManyHeldAloneArePassedOver(t *testing.T) {
	fr := newFlowRig(t, 2, tightFlow())
	fr.rt.Replica(0).SetServed(NewServed([]Model{{ID: "m", Root: "m"}, {ID: "lora", Parent: "m"}}, nil))
	fr.rt.Replica(1).SetServed(NewServed([]Model{{ID: "m", Root: "m"}}, nil))
	mustSubmit(t, fr, "a1", "A", 0, 100) // r0
	mustSubmit(t, fr, "a2", "A", 0, 100) // r1: the pool is saturated
	n := 2*maxPassedOver + 1
	for i := range n {
		text := fmt.Sprintf("adapter %d %s", i, strings.Repeat("abcd", 100))
		req := fr.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "lora", Text: text, Prompts: 1, MaxTokens: 10}, "", "")
		req.Tenant = "A"
		if tk, w, err := fr.rt.Submit(req); err != nil || tk != nil || w == nil {
			t.Fatalf("adapter request %d should wait: %v %v %v", i, tk, w, err)
		}
	}
	mustSubmit(t, fr, "b1", "B", 0, 100) // behind them all (A before B: equal counters)
	fr.first("a2")                       // r1 has room
	if tk := fr.tickets["b1"]; tk == nil || tk.Replica != 1 || fr.rt.Queued() != n {
		t.Fatalf("b1 waits behind %d adapter requests while r1 has room: released %q, %d waiting", n, fr.order(), fr.rt.Queued())
	}
}

// holdAgain brings new program b to be held for room a second time, after
// a trip through the queue (the pool was saturated when it tried again):
// it carries the expiry the queue gave it. The replica holds program a.
func holdAgain(t *testing.T, fr *flowRig) *Waiting {
	t.Helper()
	b := queueHeld(t, fr)
	fr.first("c") // b leaves the queue, still without room: held again
	if fr.rt.ProgramStats().Waiting != 1 {
		t.Fatalf("b should be held again: %+v", fr.rt.ProgramStats())
	}
	return b
}

// queueHeld brings new program b, held for room (the replica holds
// program a), to wait in the queue behind c, whose first token releases it.
func queueHeld(t *testing.T, fr *flowRig) *Waiting {
	t.Helper()
	mustSubmit(t, fr, "a", "A", 0, 900, ofProgram("a"))
	fr.first("a")
	b := mustSubmit(t, fr, "b", "B", 0, 900, ofProgram("b")) // held: no room
	mustSubmit(t, fr, "c", "C", 0, 100)                      // the pool is saturated
	fr.now = fr.now.Add(time.Second)
	fr.scrape() // b joins the queue
	if b.Expires().IsZero() || fr.rt.Queued() != 1 || fr.rt.ProgramStats().Waiting != 0 {
		t.Fatalf("b should wait in the queue with an expiry: %v, %d queued", b.Expires(), fr.rt.Queued())
	}
	return b
}

// A new program held again after a trip through the queue is shed when
// its expiry comes, like any request waiting: Expire answered nil ("it
// left the queue") while it still waited, and its caller (the gateway)
// then waited on Done past the request's TTL for a placement that might
// never come.
func TestFlowExpireHeldProgram(t *testing.T) {
	fr := newFlowProgRig(t, time.Hour)
	b := holdAgain(t, fr)
	fr.now = b.Expires()
	err := fr.rt.Expire(b)
	if reason(err) != ShedTTL {
		t.Fatalf("expire of b, held again: %v; want shed (ttl)", err)
	}
	if st := fr.rt.ProgramStats(); st.Waiting != 0 || fr.rt.Queued() != 0 {
		t.Fatalf("b still waits after its expiry: %+v, %d queued", st, fr.rt.Queued())
	}
	if fr.rt.Expire(b) != nil || fr.rt.Cancel(b) {
		t.Fatal("b expired twice")
	}
}

// A new program held for room waits under flow control's expiry from the
// start, as in the queue, and keeps it through the queue and back: its
// caller sheds it then (Expire). Without one, the gateway's wait ended at
// its own queue timeout and routed it past the gate, uncharged; and each
// trip through the queue gave it a new TTL.
func TestFlowHeldProgramKeepsItsExpiry(t *testing.T) {
	fr := newFlowProgRig(t, time.Hour)
	mustSubmit(t, fr, "a", "A", 0, 900, ofProgram("a"))
	fr.first("a")
	held := fr.now
	b := mustSubmit(t, fr, "b", "B", 0, 900, ofProgram("b")) // held: no room
	want := held.Add(fr.rt.pools[0].q.fl.cfg.band(0).TTL)
	if fr.rt.ProgramStats().Waiting != 1 || !b.Expires().Equal(want) {
		t.Fatalf("b held for room: %+v, expires %v; want held, expiring %v", fr.rt.ProgramStats(), b.Expires(), want)
	}
	mustSubmit(t, fr, "c", "C", 0, 100) // the pool is saturated
	fr.now = fr.now.Add(time.Second)
	fr.scrape() // b joins the queue
	if fr.rt.Queued() != 1 || !b.Expires().Equal(want) {
		t.Fatalf("b in the queue: %d queued, expires %v; want its first expiry %v", fr.rt.Queued(), b.Expires(), want)
	}
	fr.first("c") // b leaves the queue, still without room: held again
	if fr.rt.ProgramStats().Waiting != 1 || !b.Expires().Equal(want) {
		t.Fatalf("b held again: %+v, expires %v; want %v", fr.rt.ProgramStats(), b.Expires(), want)
	}
	fr.now = want
	if err := fr.rt.Expire(b); reason(err) != ShedTTL {
		t.Fatalf("b at its expiry: %v; want shed (ttl)", err)
	}
}

// A new program held for room waits AdmissionWait at most from when it was
// first held: a trip through the flow controller's queue (the pool was
// saturated when room was tried again) does not start its wait over. It
// did: each return to the held programs restarted the clock, so a program
// bouncing between the two under load was never placed.
func TestFlowHeldProgramWaitsAdmissionWaitOnce(t *testing.T) {
	fr := newFlowProgRig(t, 2*time.Second)
	mustSubmit(t, fr, "a", "A", 0, 900, ofProgram("a")) // a's program reserves ~910 of 1,600 tokens
	fr.first("a")
	if w := mustSubmit(t, fr, "b", "B", 0, 900, ofProgram("b")); w == nil || fr.rt.ProgramStats().Waiting != 1 {
		t.Fatalf("b has no room: it should be held; order %q", fr.order())
	}
	mustSubmit(t, fr, "c", "C", 0, 100) // the pool is saturated now
	fr.now = fr.now.Add(time.Second)
	fr.scrape() // b tries again: the pool is saturated, b joins the queue
	if fr.rt.ProgramStats().Waiting != 0 || fr.rt.Queued() != 1 {
		t.Fatalf("b should wait in the queue: %+v, %d queued", fr.rt.ProgramStats(), fr.rt.Queued())
	}
	fr.first("c") // b leaves the queue: still no room, held again
	fr.now = fr.now.Add(1500 * time.Millisecond)
	fr.scrape() // 2.5 s since b was first held
	if got := fr.order(); got != "a c b" {
		t.Fatalf("b held 2.5 s with an admission wait of 2 s: released %q, %+v", got, fr.rt.ProgramStats())
	}
}

// A held new program's AdmissionWait counts the time it was held for room
// in all, not the time it then waited in the pool's queue (a wait every
// request makes), and not from the start again when it comes back.
func TestFlowHeldProgramQueueTimeIsNotRoomWait(t *testing.T) {
	fr := newFlowProgRig(t, 2*time.Second)
	mustSubmit(t, fr, "a", "A", 0, 900, ofProgram("a"))
	fr.first("a")
	mustSubmit(t, fr, "b", "B", 0, 900, ofProgram("b")) // held for room
	mustSubmit(t, fr, "c", "C", 0, 100)                 // the pool is saturated
	fr.now = fr.now.Add(time.Second)
	fr.scrape() // b tries again: 1 s held; the pool is saturated, b joins the queue
	if fr.rt.Queued() != 1 {
		t.Fatalf("b should wait in the queue: %+v, %d queued", fr.rt.ProgramStats(), fr.rt.Queued())
	}
	fr.now = fr.now.Add(3 * time.Second)
	fr.first("c") // b leaves the queue after 3 s there: still no room, held again
	fr.now = fr.now.Add(500 * time.Millisecond)
	fr.scrape() // held 1.5 s in all
	if got := fr.order(); got != "a c" || fr.rt.ProgramStats().Waiting != 1 {
		t.Fatalf("b held 1.5 s of a 2 s wait (4.5 s since it came): released %q, %+v", got, fr.rt.ProgramStats())
	}
	fr.now = fr.now.Add(600 * time.Millisecond)
	fr.scrape() // held 2.1 s in all
	if got := fr.order(); got != "a c b" {
		t.Fatalf("b held 2.1 s of a 2 s wait: released %q, %+v", got, fr.rt.ProgramStats())
	}
}

// Turn priority puts a new program's first turn after the programs' next
// turns, once: a first turn that was already held for room keeps its
// place by arrival, rather than wait behind the next turns again (at 2×
// the agents rate, demoting them again cost p90 TTFT 959 → 1,185 ms).
func TestFlowHeldProgramKeepsItsTurn(t *testing.T) {
	fr := newFlowProgRig(t, time.Second)
	mustSubmit(t, fr, "a", "A", 0, 900, ofProgram("a"))
	fr.first("a")
	mustSubmit(t, fr, "b", "A", 0, 900, ofProgram("b")) // held for room
	mustSubmit(t, fr, "c", "C", 0, 100)                 // the pool is saturated
	fr.now = fr.now.Add(1200 * time.Millisecond)
	fr.scrape() // b's wait is over: placed without room, in its turn; the pool is saturated
	if fr.rt.Queued() != 1 {
		t.Fatalf("b should wait in the queue: %+v, %d queued", fr.rt.ProgramStats(), fr.rt.Queued())
	}
	fr.now = fr.now.Add(300 * time.Millisecond)
	mustSubmit(t, fr, "x", "A", 0, 100, ofProgram("a")) // program a's next turn
	fr.first("c")
	if got := fr.order(); got != "a c b" {
		t.Fatalf("released %q; want b, held for room first, before program a's next turn x", got)
	}
}

// A new program leaving the queue without room is held for room again in
// a second step (the held programs' lock comes before the queue's). A
// Cancel, or an Expire, between the two steps answered "it left the
// queue, routed" while it was about to be held: the gateway then waited
// on Done for a placement its client no longer wanted (or, expired, past
// its TTL), and the program was placed for nobody. Each now takes it out
// as still waiting, once; the hook (beforePark) runs in that instant.
func TestFlowCancelWhileHeldAgain(t *testing.T) {
	for _, expire := range []bool{false, true} {
		fr := newFlowProgRig(t, time.Hour)
		b := queueHeld(t, fr)
		var still bool
		var err error
		fr.rt.beforePark = func() {
			fr.rt.beforePark = nil
			if expire {
				fr.now = b.Expires()
				err = fr.rt.Expire(b)
				still = err != nil
			} else {
				still = fr.rt.Cancel(b)
			}
		}
		fr.first("c") // b leaves the queue, still without room: to be held again
		if !still || expire && reason(err) != ShedTTL {
			t.Fatalf("expire %v: b, between the queue and being held again, was taken for routed (%v)", expire, err)
		}
		if st := fr.rt.ProgramStats(); st.Waiting != 0 || fr.rt.Queued() != 0 {
			t.Fatalf("expire %v: b still waits after it was taken out: %+v, %d queued", expire, st, fr.rt.Queued())
		}
		select {
		case <-b.Done():
			t.Fatalf("expire %v: b left twice (Done closed after it was taken out)", expire)
		default:
		}
		if fr.rt.Cancel(b) || fr.rt.Expire(b) != nil {
			t.Fatalf("expire %v: b taken out twice", expire)
		}
	}
}
