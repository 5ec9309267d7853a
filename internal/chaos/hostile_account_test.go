package chaos

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/sim"
)

func TestParseKindSets(t *testing.T) {
	tests := []struct {
		in   string
		want []Kind
	}{
		{"hostile", HostileKinds()},
		{"replica", ReplicaKinds()},
		{"client,forgedloads", append(ClientKinds(), ForgedLoads)},
		{"", Kinds()},
	}
	for _, tc := range tests {
		got, err := ParseKinds(tc.in)
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("ParseKinds(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	for _, k := range HostileKinds() {
		if !slices.Contains(Kinds(), k) {
			t.Errorf("Kinds() leaves out %s", k)
		}
	}
}

// TestDoRetrying: an ordinary client resends a clear 429 or 503 after its
// Retry-After, up to ordinaryRetries times, and nothing else.
func TestDoRetrying(t *testing.T) {
	fl, err := sim.Start(context.Background(), sim.Config{Replicas: 1, TimeScale: 1000, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer fl.Close()
	const clear429 = `{"error":{"message":"slow down","type":"rate_limit_error","code":"rate_limited"}}`
	tests := []struct {
		name     string
		refusals int    // the first answers refused
		status   int    // with this status
		body     string // and this body
		class    Class
		retries  int
	}{
		{"two clear 429s, then an answer", 2, http.StatusTooManyRequests, clear429, Succeeded, 2},
		{"a clear 503, then an answer", 1, http.StatusServiceUnavailable, clear429, Succeeded, 1},
		{"clear 429s for ever", 100, http.StatusTooManyRequests, clear429, FailedClear, ordinaryRetries},
		{"a clear 500 is not retried", 100, http.StatusInternalServerError, clear429, FailedClear, 0},
		{"a 429 without an OpenAI body is lost", 100, http.StatusTooManyRequests, "busy", Lost, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var seen atomic.Int64
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if seen.Add(1) <= int64(tc.refusals) {
					_, _ = io.Copy(io.Discard, r.Body)
					w.Header().Set("Retry-After", "0")
					w.WriteHeader(tc.status)
					_, _ = io.WriteString(w, tc.body)
					return
				}
				fl.Replicas()[0].Handler().ServeHTTP(w, r)
			}))
			defer srv.Close()
			cl := &client{http: srv.Client(), base: srv.URL, model: sim.DefaultModel, maxTokens: 4, timeout: 10 * time.Second, prefix: "t-"}
			r := cl.doRetrying(context.Background(), 0)
			if r.verdict.class != tc.class || r.retries != tc.retries {
				t.Fatalf("%v after %d retries (%s), want %v after %d", r.verdict.class, r.retries, r.verdict.reason, tc.class, tc.retries)
			}
		})
	}
}

// TestPeerVerdict: a hostile scenario is clear only with every ordinary
// request succeeded, no crash and its own checks kept; a skipped one
// asserts nothing. A healthy replica ejected and a slow p99 are timing
// checks (FaultMet): make chaos asserts them, make test does not.
func TestPeerVerdict(t *testing.T) {
	ok := func() *Result {
		return &Result{Kind: ForgedLoads, Sent: 10, Succeeded: 10, InFlightZero: true, Back: true, StayedOut: true, Peers: &PeerAccount{}}
	}
	tests := []struct {
		name   string
		change func(r *Result)
		broken string // a part of the one broken invariant; "" for none
	}{
		{"every ordinary request succeeded", func(*Result) {}, ""},
		{"skipped", func(r *Result) { *r = Result{Kind: ForgedLoads, Peers: &PeerAccount{Skipped: "no redis"}} }, ""},
		{"an empty reply", func(r *Result) { r.Succeeded, r.Lost, r.Peers.EmptyReplies = 9, 1, 1 }, "1 ordinary requests lost"},
		{"a clear error the client cannot retry", func(r *Result) { r.Succeeded, r.FailedClear = 9, 1 }, "1 ordinary requests lost"},
		{"a crash", func(r *Result) { r.Peers.Crashes = []string{"gw: Run returned"} }, "crash: gw"},
		{"the attack's check", func(r *Result) { r.Peers.check(false, "moved %d", 3) }, "moved 3"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := ok()
			tc.change(r)
			inv := r.Invariants()
			switch {
			case tc.broken == "" && len(inv) != 0:
				t.Fatalf("broken: %v", inv)
			case tc.broken != "" && (len(inv) != 1 || !strings.Contains(inv[0], tc.broken)):
				t.Fatalf("invariants %v, want one naming %q", inv, tc.broken)
			}
		})
	}
	r := ok()
	r.Peers.slow("p99 %v", 2*time.Second)
	if r.Clear() || len(r.Invariants()) != 0 || len(r.FaultMet()) != 1 {
		t.Fatalf("a slow p99 is a FaultMet, not an invariant: %v %v", r.Invariants(), r.FaultMet())
	}
	r = ok()
	r.Ejections = 1
	if fm := r.FaultMet(); r.Clear() || len(r.Invariants()) != 0 || len(fm) != 1 || !strings.Contains(fm[0], "ejected") {
		t.Fatalf("an ejection is a FaultMet, not an invariant: %v %v", r.Invariants(), fm)
	}
}
