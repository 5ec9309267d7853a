// Package testutil holds the helpers kvgate's tests share: polling with a
// deadline (for states no callback announces), a JSON POST, and chained
// block hashes. It imports nothing of kvgate, so leaf packages' tests may
// use it.
package testutil

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"
)

// PollEvery is the polling interval of Eventually and Poll: a bounded wait's
// step, not a wait for an event.
const PollEvery = 2 * time.Millisecond

// ErrDeadline: a condition polled for did not come true in time.
var ErrDeadline = errors.New("condition not met before the deadline")

// Poll checks cond every PollEvery until it holds (nil), the deadline passes
// (ErrDeadline) or ctx ends (ctx.Err()).
func Poll(ctx context.Context, within time.Duration, cond func() bool) error {
	deadline := time.NewTimer(within)
	defer deadline.Stop()
	tick := time.NewTicker(PollEvery)
	defer tick.Stop()
	for {
		if cond() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-deadline.C:
			if cond() {
				return nil
			}
			return ErrDeadline
		case <-tick.C:
		}
	}
}

// BrokenAfter is the least time a test waits for a state before it calls
// itself broken. A state that comes in milliseconds on an idle machine can
// take seconds on one whose cores are busy with other work (make test runs
// packages in parallel, beside whatever else the machine does), and a test
// must fail only when the state never comes: the bound stops a broken
// test, it is not a figure. Waits of tests go through Eventually or Bound.
const BrokenAfter = 2 * time.Minute

// Bound is the bound on a test's wait of d as given: at least BrokenAfter.
func Bound(d time.Duration) time.Duration { return max(d, BrokenAfter) }

// Eventually fails the test unless cond holds within Bound(within): the
// state it polls for must come, however slowly the machine runs.
func Eventually(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	within = Bound(within)
	if err := Poll(context.Background(), within, cond); err != nil {
		t.Fatalf("timed out after %v waiting for %s", within, what)
	}
}

// Response is a finished HTTP exchange.
type Response struct {
	Status int
	Header http.Header
	Body   string
}

// Post sends body as JSON to url with headers given as name, value pairs,
// and reads the whole answer. client nil: http.DefaultClient.
func Post(t testing.TB, client *http.Client, url, body string, hdr ...string) Response {
	t.Helper()
	if client == nil {
		client = http.DefaultClient
	}
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("POST %s: reading the answer: %v", url, err)
	}
	return Response{Status: resp.StatusCode, Header: resp.Header, Body: string(b)}
}

// Chain is a chain of block hashes h_i = mix(h_{i-1}, ids[i]) from seed:
// prompts whose ids share a prefix share that prefix of hashes, as
// internal/prompt's chained hashes do with real tokens.
func Chain(seed uint64, ids ...uint64) []uint64 {
	out := make([]uint64, len(ids))
	h := seed
	for i, id := range ids {
		h = Mix(h ^ Mix(id+uint64(i)*0x9e3779b97f4a7c15))
		out[i] = h
	}
	return out
}

// Mix is SplitMix64's finaliser: a cheap, well-spread 64-bit hash.
func Mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// SyncBuffer is a bytes.Buffer that goroutines (a server's logger, a child
// process's output) write while a test reads it.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String is what was written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Deterministic skips t under the race detector: t computes a large
// deterministic result (a whole trace replayed in virtual time, a report
// rendered), where the detector costs ~25× (internal/replay: 20 s without
// it, 530 s with it on a busy machine) and finds nothing the small tests of
// the same code under -race would not. make test runs the packages holding
// such tests a second time without -race, so every one still runs on every
// make test.
func Deterministic(t testing.TB) {
	t.Helper()
	if RaceEnabled {
		t.Skip("deterministic, single-goroutine replay: make test runs it without -race")
	}
}
