package gateway

import (
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// A recording keeps no client string: a request's session (its body's
// user without a program, up to the body's size) is numbered in the
// file by its hash. Before, the writer's queue and the file's session
// table held every session string until the file rotated: 48 requests of
// distinct 1 MiB users held 48 MiB (at the default 4,096 queued and 2 Mi
// table entries, gigabytes).
func TestRecordHoldsNoSessionStrings(t *testing.T) {
	const n, size = 48, 1 << 20
	r, _, path := testRecorder(t, RecordConfig{Buffer: n})
	heap := func() uint64 {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	before := heap()
	for i := range n {
		user := strings.Repeat("u", size) + strconv.Itoa(i)
		x := &exchange{start: recordEpoch, kind: prompt.Completion, req: &policy.Request{Tokens: 20, Blocks: []uint64{1}, Model: "m", Session: user}}
		r.record(x, &attempt{v: served, output: 4})
	}
	queued := heap()
	for range n {
		r.write(<-r.ch) // as the writer does: the session table fills
	}
	written := heap()
	r.close()
	for what, now := range map[string]uint64{"queued": queued, "written": written} {
		if now > before && now-before > n*size/4 {
			t.Errorf("%s: %d MiB more on the heap for %d requests of 1 MiB users", what, (now-before)>>20, n)
		}
	}
	lines := readLines(t, path)
	if len(lines) != n || !strings.Contains(lines[0], `"session":0`) || !strings.Contains(lines[n-1], `"session":`+strconv.Itoa(n-1)) {
		t.Fatalf("%d lines, first %s", len(lines), lines[0])
	}
}
