package clock

import (
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestFakeTimersFireInDeadlineOrder(t *testing.T) {
	c := NewFake(time.Time{})
	start := c.Now()
	var order []string
	var at []time.Duration
	c.AfterFunc(30*time.Millisecond, func() { order = append(order, "c"); at = append(at, c.Since(start)) })
	c.AfterFunc(10*time.Millisecond, func() { order = append(order, "a"); at = append(at, c.Since(start)) })
	c.AfterFunc(10*time.Millisecond, func() { order = append(order, "b"); at = append(at, c.Since(start)) })
	tm := c.NewTimer(20 * time.Millisecond)
	c.Advance(25 * time.Millisecond)
	if got := len(order); got != 2 || order[0] != "a" || order[1] != "b" {
		t.Fatalf("after 25ms fired %v, want [a b]", order)
	}
	select {
	case v := <-tm.C():
		if v.Sub(start) != 20*time.Millisecond {
			t.Fatalf("timer fired with %v, want start+20ms", v.Sub(start))
		}
	default:
		t.Fatal("the 20ms timer did not fire")
	}
	if c.Since(start) != 25*time.Millisecond {
		t.Fatalf("now = start+%v", c.Since(start))
	}
	c.Advance(5 * time.Millisecond)
	if len(order) != 3 || at[2] != 30*time.Millisecond {
		t.Fatalf("order %v at %v", order, at)
	}
}

func TestFakeStopAndReset(t *testing.T) {
	c := NewFake(time.Time{})
	fired := 0
	tm := c.AfterFunc(time.Second, func() { fired++ })
	if !tm.Stop() {
		t.Fatal("Stop of an armed timer reported false")
	}
	c.Advance(2 * time.Second)
	if fired != 0 || tm.Stop() {
		t.Fatalf("stopped timer fired %d times", fired)
	}
	if tm.Reset(time.Second) {
		t.Fatal("Reset of a stopped timer reported it armed")
	}
	c.Advance(time.Second)
	if fired != 1 {
		t.Fatalf("reset timer fired %d times, want 1", fired)
	}
	now := c.NewTimer(0)
	select {
	case <-now.C():
	default:
		t.Fatal("a timer of 0 did not fire at once")
	}
}

func TestFakeTickerCatchesUpWithoutQueueing(t *testing.T) {
	c := NewFake(time.Time{})
	tk := c.NewTicker(100 * time.Millisecond)
	defer tk.Stop()
	c.Advance(350 * time.Millisecond) // three ticks due; the channel holds one
	select {
	case <-tk.C():
	default:
		t.Fatal("no tick")
	}
	select {
	case <-tk.C():
		t.Fatal("ticks queued beyond one")
	default:
	}
	if got := c.Pending(); len(got) != 1 || got[0] != 50*time.Millisecond {
		t.Fatalf("next tick in %v, want 50ms", got)
	}
}

func TestWaitTimersSeesAnotherGoroutineArm(t *testing.T) {
	c := NewFake(time.Time{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		Sleep(c, time.Minute, nil)
	}()
	if !c.WaitTimers(1, 10*time.Second) {
		t.Fatal("the sleeper never armed its timer")
	}
	c.Advance(time.Minute)
	<-done
}

func TestSleepEndsOnDone(t *testing.T) {
	c := NewFake(time.Time{})
	stop := make(chan struct{})
	close(stop)
	if Sleep(c, time.Hour, stop) {
		t.Fatal("Sleep reported a full wait after done")
	}
	if !Sleep(Real(), 0, nil) {
		t.Fatal("a zero sleep is a full wait")
	}
}
