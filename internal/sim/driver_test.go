package sim

import (
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/testutil"
)

// advanceLate moves the clock by d while the replica's driver cannot run:
// its timer fires at its deadline, and the driver, woken, sees the clock
// already d on, as a driver whose timer wakes it late does. (clock.Fake
// fires a timer with Now at the timer's deadline; holding the replica's lock
// keeps the driver from reading the clock before Advance is over.)
func advanceLate(r *Replica, clk *clock.Fake, d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	clk.Advance(d)
}

// The driver paces steps by the (fake) wall clock: a step's outputs are
// delivered exactly when the clock reaches its end; a timer that fires late
// by less than MaxLag does not stretch virtual time (the next step starts
// where the last ended), a later one makes virtual time jump to the wall
// clock minus MaxLag.
func TestDriverPacing(t *testing.T) {
	clk := newFakeClock()
	f := startFleet(t, Config{Clock: clk, TimeScale: 2, Seed: 1})
	c := testClient(t)
	url := f.URLs()[0]
	prof := costmodel.MustLookup(costmodel.Default)
	const n = 1000
	body := `{"model":"sim-llama-8b","prompt":` + jsonString(words("pac", n)) + `,"max_tokens":4,"ignore_eos":true}`
	done := make(chan testutil.Response, 1)
	go func() { done <- testutil.Post(t, c, url+"/v1/completions", body) }()

	wall := func(v time.Duration) time.Duration { return v / 2 } // time scale 2
	d1 := prof.PrefillTime(n, 0, 8192)
	if got := waitTimer(t, clk); got != wall(d1) {
		t.Fatalf("first step waits %v, want %v", got, wall(d1))
	}
	clk.Advance(wall(d1) - time.Nanosecond)
	if got := waitTimer(t, clk); got != time.Nanosecond || histCount(scrape(t, c, url), MetricTTFT) != 0 {
		t.Fatalf("delivered early: timer %v", got)
	}
	clk.Advance(time.Nanosecond)

	// Step 2 (decode) is planned at step 1's end; the timer fires 3 ms late.
	d2 := prof.StepTime(costmodel.Step{Tokens: 1, DecodeCtx: n + 1})
	if got := waitTimer(t, clk); got != wall(d2) {
		t.Fatalf("second step waits %v, want %v", got, wall(d2))
	}
	if histCount(scrape(t, c, url), MetricTTFT) != 1 {
		t.Fatal("first token not delivered at the step's end")
	}
	late := 3 * time.Millisecond
	advanceLate(f.Replicas()[0], clk, wall(d2)+late)
	// Within MaxLag: step 3 starts at step 2's end, so it waits late less.
	d3 := prof.StepTime(costmodel.Step{Tokens: 1, DecodeCtx: n + 2})
	if got := waitTimer(t, clk); got != wall(d3)-late {
		t.Fatalf("third step waits %v, want %v", got, wall(d3)-late)
	}
	// Beyond MaxLag (5 ms): step 4 starts at the wall clock minus MaxLag.
	later := 30 * time.Millisecond
	advanceLate(f.Replicas()[0], clk, wall(d3)-late+later)
	d4 := prof.StepTime(costmodel.Step{Tokens: 1, DecodeCtx: n + 3})
	if got := waitTimer(t, clk); got != wall(d4)-DefaultMaxLag {
		t.Fatalf("fourth step waits %v, want %v", got, wall(d4)-DefaultMaxLag)
	}
	clk.Advance(wall(d4))
	r := <-done
	got := decodeCompletion(t, r)
	if got.Usage.CompletionTokens != 4 {
		t.Fatalf("usage %+v", got.Usage)
	}
	e2e, _ := metricValue(scrape(t, c, url), MetricE2E, nil)
	// Virtual: d1 + d2 + d3 + the jump (2 × (later − MaxLag)) + d4.
	want := d1 + d2 + d3 + 2*(later-DefaultMaxLag) + d4
	if diff := e2e - want.Seconds(); diff < -1e-9 || diff > 1e-9 {
		t.Errorf("e2e %.9fs, want %.9fs", e2e, want.Seconds())
	}
}

// Requests that arrive while a step runs join the next step; arrivals while
// idle start a step at their arrival time.
func TestDriverBatchesArrivals(t *testing.T) {
	clk := newFakeClock()
	f := startFleet(t, Config{Clock: clk, Seed: 1})
	c := testClient(t)
	url := f.URLs()[0]
	prof := costmodel.MustLookup(costmodel.Default)
	body := func(tag string) string {
		return `{"model":"sim-llama-8b","prompt":` + jsonString(words(tag, 100)) + `,"max_tokens":2,"ignore_eos":true}`
	}
	done := make(chan testutil.Response, 2)
	go func() { done <- testutil.Post(t, c, url+"/v1/completions", body("aaa")) }()
	d1 := waitTimer(t, clk)
	go func() { done <- testutil.Post(t, c, url+"/v1/completions", body("bbb")) }()
	testutil.Eventually(t, 10*time.Second, "the second request queued", func() bool {
		return f.Replicas()[0].Stats().Waiting == 1
	})
	clk.Advance(d1)
	// Step 2: decode of the first plus prefill of the second.
	want := prof.StepTime(costmodel.Step{Tokens: 101, DecodeCtx: 101, PrefillCtx: 100 * 100})
	if got := waitTimer(t, clk); got != want {
		t.Fatalf("step 2 takes %v, want %v (decode + prefill in one step)", got, want)
	}
	clk.Advance(want)
	decodeCompletion(t, <-done) // the first finished with step 2
	// Step 3: the second's decode alone.
	d3 := prof.StepTime(costmodel.Step{Tokens: 1, DecodeCtx: 101})
	if got := waitTimer(t, clk); got != d3 {
		t.Fatalf("step 3 takes %v, want %v", got, d3)
	}
	clk.Advance(d3)
	decodeCompletion(t, <-done)
}
