package sim

import (
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/testutil"
)

// Not elastic, model time is the wall clock × the scale, whatever the
// cores report.
func TestTimelinePlain(t *testing.T) {
	clk := newFakeClock()
	tl := NewTimeline(clk, 4, 0)
	slot := tl.join()
	tl.setEnd(slot, time.Millisecond)
	clk.Advance(10 * time.Millisecond)
	if got := tl.Now(); got != 40*time.Millisecond {
		t.Fatalf("Now = %v, want 40ms", got)
	}
	reached, d, moved := tl.Wait(60 * time.Millisecond)
	if reached || d != 5*time.Millisecond || moved != nil {
		t.Fatalf("Wait(60ms) = %v %v %v, want a 5ms sleep", reached, d, moved)
	}
	if got := tl.WallOf(60 * time.Millisecond).Sub(clk.Now()); got != 5*time.Millisecond {
		t.Errorf("WallOf(60ms) is %v away, want 5ms", got)
	}
}

// Elastic, model time stops at a busy core's step end + slack until the
// core moves on, and then resumes from there (no jump); waiters are told
// when it moves; it never goes back, even when a core reports an end
// already passed.
func TestTimelineElastic(t *testing.T) {
	clk := newFakeClock()
	const slack = time.Millisecond
	tl := NewTimeline(clk, 10, slack)
	a, b := tl.join(), tl.join()
	tl.setEnd(a, 20*time.Millisecond)
	clk.Advance(time.Millisecond) // model 10 ms
	if got := tl.Now(); got != 10*time.Millisecond {
		t.Fatalf("Now = %v, want 10ms", got)
	}
	clk.Advance(5 * time.Millisecond) // model 60 ms at the scale: held at 21 ms
	if got := tl.Now(); got != 21*time.Millisecond {
		t.Fatalf("Now = %v, want 21ms (step end + slack)", got)
	}
	reached, _, moved := tl.Wait(30 * time.Millisecond)
	if reached || moved == nil {
		t.Fatalf("Wait while held: reached %v moved %v, want the hold's channel", reached, moved)
	}
	tl.setEnd(b, 5*time.Millisecond) // b woke at an end already passed: holds where it is
	if got := tl.Now(); got != 21*time.Millisecond {
		t.Fatalf("Now = %v after b's late end, want 21ms (never back)", got)
	}
	tl.setEnd(b, never)
	tl.setEnd(a, 40*time.Millisecond) // a's next step
	select {
	case <-moved:
	default:
		t.Fatal("the hold moved and its waiters were not told")
	}
	clk.Advance(time.Millisecond)
	if got := tl.Now(); got != 31*time.Millisecond {
		t.Fatalf("Now = %v, want 31ms: resumed from the hold", got)
	}
	tl.setEnd(a, never) // idle: nothing holds it back
	clk.Advance(10 * time.Millisecond)
	if got := tl.Now(); got != 131*time.Millisecond {
		t.Fatalf("Now = %v, want 131ms", got)
	}
}

// In an elastic fleet a driver woken late, however late, stretches
// nothing and skips nothing: model time waits for it, so a request's
// engine time is exactly the cost model's steps (the plain fleet's
// TestDriverPacing shows the jump this prevents). Its span in real time
// does grow by the lateness: that is what simulating cost this host.
func TestElasticDriverWokenLate(t *testing.T) {
	clk := newFakeClock()
	f := startFleet(t, Config{Clock: clk, TimeScale: 2, Seed: 1, Elastic: time.Millisecond})
	c := testClient(t)
	url := f.URLs()[0]
	prof := costmodel.MustLookup(costmodel.Default)
	const n = 1000
	body := `{"model":"sim-llama-8b","prompt":` + jsonString(words("ela", n)) +
		`,"max_tokens":3,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`
	done := make(chan testutil.Response, 1)
	go func() { done <- testutil.Post(t, c, url+"/v1/completions", body) }()
	d1 := prof.PrefillTime(n, 0, 8192)
	if got := waitTimer(t, clk); got != d1/2 {
		t.Fatalf("first step waits %v, want %v", got, d1/2)
	}
	clk.Advance(d1 / 2)
	d2 := prof.StepTime(costmodel.Step{Tokens: 1, DecodeCtx: n + 1})
	waitTimer(t, clk)
	late := 200 * time.Millisecond // far beyond MaxLag (5 ms)
	advanceLate(f.Replicas()[0], clk, d2/2+late)
	d3 := prof.StepTime(costmodel.Step{Tokens: 1, DecodeCtx: n + 2})
	// Model time waited at step 2's end + the slack: step 3 starts at step
	// 2's end, its end is a slack less away.
	if got, want := waitTimer(t, clk), (d3-time.Millisecond)/2; got != want {
		t.Fatalf("third step waits %v, want %v: model time waited for the late driver", got, want)
	}
	clk.Advance((d3 - time.Millisecond) / 2)
	r := <-done
	evs := sseEvents(t, r.Body)
	got, ok := ParseTiming([]byte(evs[len(evs)-2]))
	if !ok {
		t.Fatalf("no timing in %s", evs[len(evs)-2])
	}
	if want := ms(d1 + d2 + d3); got.E2Ems < want-1e-5 || got.E2Ems > want+1e-5 {
		t.Errorf("engine e2e %v ms, want %v ms: the steps alone", got.E2Ems, want)
	}
	if want := ms(d1/2 + d2/2 + late + (d3-time.Millisecond)/2); got.WallE2Ems < want-1e-5 || got.WallE2Ems > want+1e-5 {
		t.Errorf("wall e2e %v ms, want %v ms: the steps in real time and the lateness", got.WallE2Ems, want)
	}
}
