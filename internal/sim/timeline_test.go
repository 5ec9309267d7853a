package sim

import (
	"bufio"
	"io"
	"net/http"
	"strings"
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

// A hold keeps model time at its point (+ slack) until released — its
// waiters are told — or until it has lasted holdFor of wall time; a
// timeline that is not elastic ignores holds.
func TestTimelineHolds(t *testing.T) {
	clk := newFakeClock()
	tl := NewTimeline(clk, 10, time.Millisecond)
	tl.Hold(8, 5*time.Millisecond)
	clk.Advance(10 * time.Millisecond) // 100 ms of model time at the scale
	if got := tl.Now(); got != 6*time.Millisecond {
		t.Fatalf("Now = %v, want 6ms (held at 5 ms + slack)", got)
	}
	reached, d, moved := tl.Wait(50 * time.Millisecond)
	if reached || moved == nil || d != holdFor-10*time.Millisecond {
		t.Fatalf("Wait while held = %v %v %v, want the hold's channel and its expiry %v away", reached, d, moved, holdFor-10*time.Millisecond)
	}
	tl.Release(8)
	select {
	case <-moved:
	default:
		t.Fatal("released, and the waiters were not told")
	}
	clk.Advance(time.Millisecond)
	if got := tl.Now(); got != 16*time.Millisecond {
		t.Fatalf("Now = %v, want 16ms: resumed from the hold", got)
	}
	tl.Hold(12, tl.Now())
	clk.Advance(holdFor - time.Nanosecond)
	if got := tl.Now(); got != 17*time.Millisecond {
		t.Fatalf("Now = %v, want 17ms: still held", got)
	}
	clk.Advance(time.Nanosecond) // the hold has lasted holdFor: it goes
	clk.Advance(time.Millisecond)
	if got := tl.Now(); got != 27*time.Millisecond+10*time.Nanosecond {
		t.Fatalf("Now = %v, want 27.00001ms: the expired hold let go", got)
	}

	plain := NewTimeline(clk, 10, 0)
	plain.Hold(4, 0)
	clk.Advance(time.Millisecond)
	if got := plain.Now(); got != 10*time.Millisecond {
		t.Errorf("a plain timeline held: Now = %v, want 10ms", got)
	}
}

func TestHoldKey(t *testing.T) {
	tests := []struct {
		v   string
		key uint64
		ok  bool
	}{
		{"", 0, false}, {"8", 8, true}, {"0", 0, true}, {"5", 0, false}, {"-4", 0, false}, {"x", 0, false},
		{"18446744073709551612", 18446744073709551612, true}, {"018446744073709551612", 0, false},
	}
	for _, tc := range tests {
		h := http.Header{}
		if tc.v != "" {
			h.Set(HeaderHold, tc.v)
		}
		if k, ok := HoldKey(h); ok != tc.ok || (ok && k != tc.key) {
			t.Errorf("HoldKey(%q) = %d %v, want %d %v", tc.v, k, ok, tc.key, tc.ok)
		}
	}
}

// In an elastic fleet a request with a hold key is released on arrival,
// and its first token and its end are held until the client releases them
// (a client that reads the first token goes on while the rest waits).
func TestHoldsOfARequest(t *testing.T) {
	f := startFleet(t, Config{TimeScale: 1000, Seed: 1, Elastic: time.Millisecond})
	tl := f.Timeline()
	held := func(k uint64) (time.Duration, bool) {
		tl.mu.Lock()
		defer tl.mu.Unlock()
		h, ok := tl.holds[k]
		return h.at, ok
	}
	tl.Hold(40, tl.Now())
	body := `{"model":"sim-llama-8b","prompt":` + jsonString(words("hld", 100)) +
		`,"max_tokens":3,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`
	req, _ := http.NewRequest(http.MethodPost, f.URLs()[0]+"/v1/completions", strings.NewReader(body))
	req.Header.Set(HeaderHold, "40")
	resp, err := testClient(t).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, ok := held(40); ok {
		t.Error("the arrival's hold is still there once the replica answered")
	}
	rd := bufio.NewReader(resp.Body)
	if _, err := rd.ReadString('\n'); err != nil { // the first token's chunk
		t.Fatal(err)
	}
	first, ok := held(41)
	if !ok {
		t.Fatal("no hold at the first token")
	}
	if now := tl.Now(); now > first+time.Millisecond {
		t.Errorf("model time %v passed the first token's hold at %v", now, first)
	}
	tl.Release(41)
	rest, err := io.ReadAll(rd)
	if err != nil || !strings.HasSuffix(string(rest), "data: [DONE]\n\n") {
		t.Fatalf("rest of the stream: %v %q", err, rest)
	}
	if end, ok := held(43); !ok || end < first {
		t.Fatalf("end held %v at %v, first token at %v", ok, end, first)
	}
	tl.Release(43)
}
