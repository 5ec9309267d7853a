package ui

import (
	"strings"
	"testing"
	"time"
)

// The page's script is the only one, and it renders data as text: no
// markup is built from strings.
func TestUIPageIsSelfContained(t *testing.T) {
	page := string(page)
	for _, bad := range []string{"innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "<link", "src=", "@import", "url("} {
		if strings.Contains(page, bad) {
			t.Errorf("ui/index.html contains %q", bad)
		}
	}
	if strings.Count(page, "<script>") != 1 || strings.Count(page, "<style>") != 1 {
		t.Error("the page must have exactly one inline script and one inline style (their hashes are its CSP)")
	}
}

// The tallies keep the last decisions (newest first) and a window of
// buckets: an attempt older than the window is in no bucket, and a
// replica forgotten has no tally left.
func TestTalliesWindowAndDecisions(t *testing.T) {
	s := NewTallies()
	start := time.Unix(1_000_000, 0)
	for k := range decisions + 5 {
		s.Note(Attempt{At: start.Add(time.Duration(k) * time.Second), Replica: "a", RequestID: string(rune('A' + k)),
			Served: true, Prompt: 10, Cached: 4, TTFT: time.Duration(k) * time.Millisecond})
	}
	now := start.Add(Buckets * BucketWidth) // the first bucket has left the window
	snap := s.Snapshot(now)
	if len(snap.Decisions) != decisions || snap.Decisions[0].RequestID != string(rune('A'+decisions+4)) {
		t.Fatalf("%d decisions, newest %q", len(snap.Decisions), snap.Decisions[0].RequestID)
	}
	var inWindow int64
	for _, p := range snap.Series {
		inWindow += p.Attempts
	}
	if len(snap.Series) != Buckets || snap.Attempts != decisions+5 || inWindow >= snap.Attempts {
		t.Fatalf("series of %d buckets holds %d of %d attempts", len(snap.Series), inWindow, snap.Attempts)
	}
	if r := snap.Replicas["a"].HitRate(); r == nil || *r != 0.4 {
		t.Fatalf("hit rate %v, want 0.4", r)
	}
	s.Forget("a")
	if s.Replicas() != 0 {
		t.Fatal("a forgotten replica keeps its tally")
	}
}
