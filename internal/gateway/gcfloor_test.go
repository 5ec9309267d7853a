package gateway

import (
	"runtime"
	"testing"
)

// floorPercent gives the percentage whose goal is the floor for a small
// live heap, GOGC's own once that goal passes the floor, and at most
// maxFloorPercent for a tiny heap.
func TestFloorPercent(t *testing.T) {
	const mib = 1 << 20
	for _, c := range []struct {
		live, floor uint64
		base, want  int
	}{
		{4 * mib, 64 * mib, 100, 1500},
		{32 * mib, 64 * mib, 50, 100},
		{32 * mib, 64 * mib, 100, 100}, // GOGC's goal is the floor already
		{40 * mib, 64 * mib, 100, 100},
		{500 * mib, 64 * mib, 100, 100},
		{1024, 64 * mib, 100, maxFloorPercent},
		{0, 64 * mib, 100, 100},
	} {
		if got := floorPercent(c.live, c.floor, c.base); got != c.want {
			t.Errorf("floorPercent(%d, %d, %d) = %d, want %d", c.live, c.floor, c.base, got, c.want)
		}
	}
}

// A floor sets the percentage at once and again after each collection
// (its cleanup, re-armed each cycle), runs once per process, and gives
// GOGC back when stopped.
func TestHeapFloorPacesAndStops(t *testing.T) {
	base := gcPercent()
	if base < 0 {
		t.Skip("GOGC=off")
	}
	const floor = 1 << 40 // far above this process's heap: the percentage rises
	set := make(chan int, 16)
	stop := startHeapFloor(floor, func(p int) { set <- p })
	p := <-set
	if want := floorPercent(liveHeap(), floor, base); p != want || gcPercent() != p {
		t.Fatalf("percentage %d (GOGC reads %d), want %d", p, gcPercent(), want)
	}
	if again := startHeapFloor(floor, func(int) { t.Error("a second floor ran") }); again == nil {
		t.Fatal("no stop")
	} else {
		again() // a no-op: the first floor still runs
	}
	if !heapFloorOn.Load() {
		t.Fatal("the second floor's stop stopped the first")
	}
	runtime.GC()
	if p2 := <-set; p2 != floorPercent(liveHeap(), floor, base) {
		t.Errorf("after a collection: %d", p2)
	}
	stop()
	if got := gcPercent(); got != base {
		t.Errorf("GOGC %d after stop, want %d", got, base)
	}
	runtime.GC() // the armed cleanup runs, finds the floor done, and sets nothing
	if heapFloorOn.Load() {
		t.Error("still on after stop")
	}
}
