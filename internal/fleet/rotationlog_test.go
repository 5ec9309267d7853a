package fleet

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/testutil"
)

// healthTransport answers every /health with 200 while up, else 503, and
// every other path with 404.
type healthTransport struct{ up atomic.Bool }

func (h *healthTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	code := http.StatusNotFound
	if r.URL.Path == "/health" {
		code = http.StatusServiceUnavailable
		if h.up.Load() {
			code = http.StatusOK
		}
	}
	return &http.Response{StatusCode: code, Status: http.StatusText(code), Body: io.NopCloser(strings.NewReader("")),
		Header: http.Header{}, Request: r}, nil
}

type logSink struct{ testutil.SyncBuffer }

// lines are the info lines logged so far, by message prefix.
func (s *logSink) count(prefix string) int {
	n := 0
	for _, l := range strings.Split(s.String(), "\n") {
		if strings.Contains(l, "level=INFO") && strings.Contains(l, `msg="`+prefix) {
			n++
		}
	}
	return n
}

// A replica leaving rotation (unhealthy or ejected) and coming back is
// logged at info once per transition, however many checks and failures
// report it.
func TestRotationChangesLoggedOncePerTransition(t *testing.T) {
	ht := &healthTransport{}
	ht.up.Store(true)
	sink := &logSink{}
	log := slog.New(slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelDebug}))
	rt, f, clk := newFleet(t, 1, 2, &http.Client{Transport: ht}, Config{Logger: log})
	ctx := context.Background()
	want := func(unhealthy, ejected, back int) {
		t.Helper()
		got := [3]int{sink.count("replica unhealthy"), sink.count("replica ejected"), sink.count("replica back in rotation")}
		if got != [3]int{unhealthy, ejected, back} {
			t.Fatalf("logged unhealthy, ejected, back: %v, want %v\n%s", got, [3]int{unhealthy, ejected, back}, sink.String())
		}
	}
	f.Health(ctx, 0)
	want(0, 0, 0) // in rotation from the start: nothing to say

	ht.up.Store(false)
	for range 3 {
		f.Health(ctx, 0)
	}
	want(1, 0, 0)
	ht.up.Store(true)
	f.Health(ctx, 0)
	f.Health(ctx, 0)
	want(1, 0, 1)

	// Ejected: once, though the failures go on and /health fails too.
	fail(rt, 0)
	fail(rt, 0)
	if rt.Healthy(0) {
		t.Fatal("not ejected")
	}
	fail(rt, 0)
	ht.up.Store(false)
	f.Health(ctx, 0)
	want(1, 1, 1)
	ht.up.Store(true)
	f.Health(ctx, 0) // still in its cooldown
	want(1, 1, 1)
	clk.Advance(11 * time.Second)
	f.Health(ctx, 0)
	if !rt.Healthy(0) {
		t.Fatal("not back after the cooldown")
	}
	want(1, 1, 2)
	// Its trial fails: ejected again, for longer.
	fail(rt, 0)
	want(1, 2, 2)
}

// A forgotten replica's slot keeps nothing of its rotation log or of its
// server's engine warning: the slot's next replica leaving rotation is
// logged as its own first departure.
func TestForgetDropsTheSlotsLogState(t *testing.T) {
	ht := &healthTransport{}
	sink := &logSink{}
	log := slog.New(slog.NewTextHandler(sink, &slog.HandlerOptions{Level: slog.LevelDebug}))
	rt, f, clk := newFleet(t, 2, 2, &http.Client{Transport: ht}, Config{Logger: log})
	f.Health(context.Background(), 1) // b fails its check: out of rotation, logged
	f.checkEngines(1, 4)              // and warned about: 4 engines routed as 1
	if _, err := rt.SetReplicas([]router.Spec{{URL: "http://a"}}); err != nil {
		t.Fatal(err)
	}
	clk.Advance(router.DefaultForgetAfter)
	gone := rt.Forget()
	if len(gone) != 1 || gone[0].Slot != 1 {
		t.Fatalf("forgot %+v", gone)
	}
	f.Forget(gone[0].Slot, gone[0].URL)
	if _, ok := f.loggedOut.Load(1); ok {
		t.Fatal("the forgotten slot's rotation is still logged")
	}
	if _, ok := f.warned.Load("http://b"); ok {
		t.Fatal("the forgotten server's engine warning is kept")
	}
	if _, err := rt.SetReplicas([]router.Spec{{URL: "http://a"}, {URL: "http://c"}}); err != nil {
		t.Fatal(err)
	}
	f.Health(context.Background(), 1) // c, in slot 1, fails its check
	if n := sink.count("replica unhealthy"); n != 2 {
		t.Fatalf("%d departures logged, want b's and c's\n%s", n, sink.String())
	}
}
