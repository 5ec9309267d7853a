package router

import (
	"errors"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
)

// breakerRouter is a router of n replicas whose breakers open after
// ejectAfter consecutive failures for 10 s, on a fake clock; it returns
// the ejections OnEject heard.
func breakerRouter(t *testing.T, n, ejectAfter int) (*Router, *clock.Fake, *[]Ejection) {
	t.Helper()
	pol, err := policy.New("least_load", policy.Options{})
	if err != nil {
		t.Fatal(err)
	}
	urls := []string{"http://a", "http://b", "http://c"}[:n]
	clk := clock.NewFake(time.Unix(100, 0))
	var ejected []Ejection
	rt, err := New(Config{Replicas: urls, Policy: pol, Now: clk.Now, OnEject: func(e Ejection) { ejected = append(ejected, e) },
		Breaker: BreakerConfig{EjectAfter: ejectAfter, Cooldown: 10 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	return rt, clk, &ejected
}

// ticketTo commits a request to replica i whatever its state, as a request
// routed just before its breaker opened is.
func ticketTo(rt *Router, i int) *Ticket {
	req := rt.Prepare(parse(nil, "a prompt"), "", "")
	return rt.commit(req, policy.Decision{Replica: i}, &policy.ReplicaView{}, 0, policy.PhaseNone)
}

// end ends a ticket with health h.
func end(rt *Router, tk *Ticket, h Health) {
	tk.Done(rt.Now(), Outcome{CachedTokens: -1, Health: h})
}

// try sends one request to replica i through its breaker: admitted, it
// ends with health h; refused, it ends reporting nothing. It reports
// whether the breaker admitted it.
func try(rt *Router, i int, h Health) bool {
	tk := ticketTo(rt, i)
	ok := tk.Allow()
	end(rt, tk, h)
	return ok
}

func fail(rt *Router, i int)    { try(rt, i, HealthFailed) }
func succeed(rt *Router, i int) { try(rt, i, HealthOK) }

// healthCheck is what the fleet's health loop does with a check's result.
func healthCheck(rt *Router, clk *clock.Fake, i int, ok bool) {
	rt.Replica(i).SetHealthOK(ok, clk.Now())
}

func breakerState(rt *Router, clk *clock.Fake, i int) string {
	return rt.Replica(i).Breaker.State(clk.Now())
}

func TestEjectionAndReturn(t *testing.T) {
	rt, clk, ejected := breakerRouter(t, 2, 3)
	fail(rt, 1)
	fail(rt, 1)
	succeed(rt, 1) // a success resets the count
	fail(rt, 1)
	fail(rt, 1)
	if !rt.Healthy(1) || breakerState(rt, clk, 1) != "closed" {
		t.Fatal("ejected before 3 consecutive failures")
	}
	fail(rt, 1)
	if rt.Healthy(1) || breakerState(rt, clk, 1) != "open" || len(*ejected) != 1 {
		t.Fatalf("not ejected after 3: healthy %v ejections %v", rt.Healthy(1), *ejected)
	}
	if e := (*ejected)[0]; e.Slot != 1 || e.Name != "http://b" || e.Cooldown != 10*time.Second {
		t.Fatalf("ejection heard as %+v", e)
	}
	healthCheck(rt, clk, 1, true) // a health check during the cooldown keeps it out
	if rt.Healthy(1) {
		t.Fatal("back during cooldown")
	}
	clk.Advance(11 * time.Second)
	healthCheck(rt, clk, 1, true) // the health check after the cooldown brings it back
	if !rt.Healthy(1) || rt.Replica(1).Breaker.Open(clk.Now()) {
		t.Fatal("not back after cooldown")
	}
	healthCheck(rt, clk, 1, false)
	if rt.Healthy(1) {
		t.Fatal("failing health check kept it in")
	}
}

// The breaker: closed → open after EjectAfter failures → half-open after
// the cooldown (one trial at a time) → closed on the trial's success, or
// open again, for twice as long, on its failure.
func TestBreakerStates(t *testing.T) {
	rt, clk, ejected := breakerRouter(t, 1, 2)
	step := func(what, want string) {
		t.Helper()
		if got := breakerState(rt, clk, 0); got != want {
			t.Fatalf("%s: state %s, want %s", what, got, want)
		}
	}
	step("start", "closed")
	if !try(rt, 0, HealthNeutral) {
		t.Fatal("closed breaker refused")
	}
	fail(rt, 0)
	fail(rt, 0)
	step("2 failures", "open")
	if try(rt, 0, HealthOK) || rt.Healthy(0) {
		t.Fatal("open breaker let a request through")
	}
	clk.Advance(10 * time.Second)
	healthCheck(rt, clk, 0, true) // the health check after the cooldown
	step("cooldown over", "half-open")
	trial := ticketTo(rt, 0)
	if !rt.Healthy(0) || !trial.Allow() || !trial.pass.Trial {
		t.Fatal("half-open breaker refused its trial")
	}
	if try(rt, 0, HealthOK) {
		t.Fatal("half-open breaker let a second request through beside the trial")
	}
	end(rt, trial, HealthFailed) // the trial fails: open again, for 20 s
	step("trial failed", "open")
	if n := len(*ejected); n != 2 || (*ejected)[1].Cooldown != 20*time.Second {
		t.Fatalf("ejections %+v, want a second one of 20 s", *ejected)
	}
	clk.Advance(15 * time.Second)
	step("15 s into a doubled cooldown", "open")
	clk.Advance(5 * time.Second)
	healthCheck(rt, clk, 0, true)
	step("doubled cooldown over", "half-open")
	if !try(rt, 0, HealthNeutral) { // the client left: the trial slot is free again, still half-open
		t.Fatal("no trial")
	}
	step("neutral trial", "half-open")
	if !try(rt, 0, HealthOK) {
		t.Fatal("no second trial")
	}
	step("trial succeeded", "closed")
	if !try(rt, 0, HealthNeutral) {
		t.Fatal("closed breaker refused")
	}
	// A passing /health does not reset the passive failure count.
	fail(rt, 0)
	healthCheck(rt, clk, 0, true)
	fail(rt, 0)
	step("failures around a health check", "open")
}

// Reports from requests admitted before an opening are stale: they cannot
// release or use up the trial, reopen, or close the breaker early.
func TestBreakerIgnoresStalePasses(t *testing.T) {
	rt, clk, _ := breakerRouter(t, 1, 2)
	long, long2, long3 := ticketTo(rt, 0), ticketTo(rt, 0), ticketTo(rt, 0) // long streams admitted while closed
	long.Allow()
	long2.Allow()
	long3.Allow()
	fail(rt, 0)
	fail(rt, 0) // opens
	end(rt, long2, HealthOK)
	if breakerState(rt, clk, 0) != "open" {
		t.Fatal("a success admitted before the opening closed the breaker in its cooldown")
	}
	clk.Advance(10 * time.Second)
	healthCheck(rt, clk, 0, true)
	trial := ticketTo(rt, 0)
	if !trial.Allow() || !trial.pass.Trial {
		t.Fatal("no trial")
	}
	end(rt, long, HealthNeutral) // a long stream's client hangs up
	if try(rt, 0, HealthNeutral) {
		t.Fatal("a stale neutral freed the trial slot: two trials at once")
	}
	end(rt, long3, HealthFailed) // another fails
	if breakerState(rt, clk, 0) != "half-open" {
		t.Fatalf("a stale failure reopened the breaker: %s", breakerState(rt, clk, 0))
	}
	end(rt, trial, HealthOK)
	if breakerState(rt, clk, 0) != "closed" {
		t.Fatalf("the trial's success did not close it: %s", breakerState(rt, clk, 0))
	}
}

// A ticket reports its health once, with the pass Allow gave it: ending it
// again reports nothing, and a ticket the breaker refused, or never asked,
// reports nothing at all.
func TestTicketReportsHealthOnce(t *testing.T) {
	rt, clk, ejected := breakerRouter(t, 1, 2)
	tk := ticketTo(rt, 0)
	tk.Allow()
	end(rt, tk, HealthFailed)
	end(rt, tk, HealthFailed) // Done again: nothing
	if breakerState(rt, clk, 0) != "closed" {
		t.Fatal("one failed request counted twice")
	}
	unasked := ticketTo(rt, 0)
	end(rt, unasked, HealthFailed) // never sent: never admitted
	if breakerState(rt, clk, 0) != "closed" {
		t.Fatal("a request the breaker never admitted counted")
	}
	if unasked.Allow() {
		t.Fatal("an ended ticket was admitted")
	}
	fail(rt, 0)
	if breakerState(rt, clk, 0) != "open" || len(*ejected) != 1 {
		t.Fatalf("two failures: %s, ejections %v", breakerState(rt, clk, 0), *ejected)
	}
	refused := ticketTo(rt, 0)
	if refused.Allow() || refused.Allow() {
		t.Fatal("an open breaker admitted a request")
	}
	clk.Advance(10 * time.Second)
	healthCheck(rt, clk, 0, true)
	end(rt, refused, HealthFailed) // refused while open: says nothing of the half-open replica
	if breakerState(rt, clk, 0) != "half-open" || len(*ejected) != 1 {
		t.Fatalf("a refused request's failure reported: %s, ejections %v", breakerState(rt, clk, 0), *ejected)
	}
	// A ticket routed through the router reports the same way.
	req := rt.Prepare(parse(t, "routed"), "", "")
	routed, err := rt.Route(req)
	if err != nil || !routed.Allow() || !routed.pass.Trial {
		t.Fatalf("routed %v, %v: want the trial", routed, err)
	}
	end(rt, routed, HealthOK)
	if breakerState(rt, clk, 0) != "closed" {
		t.Fatal("the routed trial's success did not close the breaker")
	}
	if _, err := rt.Route(rt.Prepare(parse(t, "x"), "", ""), 0); !errors.Is(err, policy.ErrNoReplica) {
		t.Fatalf("every replica excluded: %v", err)
	}
}
