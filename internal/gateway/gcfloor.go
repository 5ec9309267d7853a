package gateway

import (
	"runtime"
	"runtime/debug"
	rtmetrics "runtime/metrics"
	"sync"
	"sync/atomic"
)

// The heap floor (gc_heap_floor): GOGC's pacing with a floor. The gateway's
// live heap is small (a few MiB with a small index) and every proxied
// request allocates some 20 kB in net/http and the request path, so at
// GOGC=100 the collector ran every ~4 MiB allocated: every ~200 requests,
// some 130 collections in 5 s under wrk, its marking and assists several
// percent of the proxy's CPU. With a floor the heap goal is
// max(live × (1 + GOGC/100), floor): after each collection (a cleanup on a
// sentinel object that the collection freed, armed anew each cycle) the GC
// percentage is set to what gives that goal for the live heap just marked.
// A heap past the floor is paced by GOGC alone, so a growing index never
// makes the goal run away; GOMEMLIMIT still bounds it all. GOGC=off is
// left alone. The GC is the process's: one floor runs at a time.

// maxGCHeapFloor bounds gc_heap_floor: 1 TiB.
const maxGCHeapFloor = 1 << 40

// maxFloorPercent caps the percentage a tiny live heap would ask for.
const maxFloorPercent = 10000

// heapFloor paces the collector for one floor (startHeapFloor).
type heapFloor struct {
	floor uint64
	base  int // GOGC as it was
	mu    sync.Mutex
	done  bool
	last  int // the percentage set last
	// adjusted, when set (tests), hears the percentage of each cycle.
	adjusted func(int)
}

// heapFloorOn: a floor runs in the process.
var heapFloorOn atomic.Bool

// startHeapFloor starts pacing the collector for floor bytes (0: off) and
// returns what stops it and gives GOGC back; a no-op when another floor
// runs or GOGC is off.
func startHeapFloor(floor int64, adjusted func(int)) (stop func()) {
	if floor <= 0 || !heapFloorOn.CompareAndSwap(false, true) {
		return func() {}
	}
	base := gcPercent()
	if base < 0 {
		heapFloorOn.Store(false)
		return func() {}
	}
	h := &heapFloor{floor: uint64(floor), base: base, last: base, adjusted: adjusted}
	h.cycle()
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.done = true
		debug.SetGCPercent(h.base)
		heapFloorOn.Store(false)
	}
}

// gcSentinel is freed by the next collection: its cleanup runs after it.
// (It holds a pointer, so it is never one of the tiny allocator's blocks,
// whose cleanups wait for their neighbours.)
type gcSentinel struct{ _ *heapFloor }

// cycle sets the percentage for the live heap and arms the next cycle.
func (h *heapFloor) cycle() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.done {
		return
	}
	p := floorPercent(liveHeap(), h.floor, h.base)
	if p != h.last {
		debug.SetGCPercent(p)
		h.last = p
	}
	if h.adjusted != nil {
		h.adjusted(p)
	}
	runtime.AddCleanup(new(gcSentinel), (*heapFloor).cycle, h)
}

// floorPercent is the GC percentage whose goal for a live heap of live
// bytes is the floor, or base when base's goal is above it already.
func floorPercent(live, floor uint64, base int) int {
	if live == 0 || live+live*uint64(base)/100 >= floor {
		return base
	}
	return int(min((floor-live)*100/live, maxFloorPercent))
}

// liveHeap is the heap the last collection marked live, in bytes.
func liveHeap() uint64 {
	s := []rtmetrics.Sample{{Name: "/gc/heap/live:bytes"}}
	rtmetrics.Read(s)
	if s[0].Value.Kind() != rtmetrics.KindUint64 {
		return 0
	}
	return s[0].Value.Uint64()
}

// gcPercent is GOGC as it is now (-1: off).
func gcPercent() int {
	s := []rtmetrics.Sample{{Name: "/gc/gogc:percent"}}
	rtmetrics.Read(s)
	if s[0].Value.Kind() != rtmetrics.KindUint64 {
		return 100
	}
	return int(s[0].Value.Uint64())
}
