package replay

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/report"
)

// Compare's jobs run at once, and the result is byte for byte the one of
// running them one after another: the bounds, the oracle's run and
// capacity, every policy's run and capacity, and the progress reports in
// the order of the policies.
func TestCompareParallelEqualsSequential(t *testing.T) {
	reqs := smallShared(t, 5)
	slo := SLO{TTFTP90: 150 * time.Millisecond}
	specs := specsOf(t, "round_robin", "llmd", "preble", "ttft")
	compare := func(parallel int) ([]byte, []string) {
		var order []string
		res, err := Compare(context.Background(), Config{Replicas: 4, Seed: 5}, reqs, specs, Options{
			Oracle: true, Capacity: &slo, Parallel: parallel,
			Progress: func(spec PolicySpec, run report.Run) {
				if run.Extra["capacity_vs_bound"] == 0 || run.Extra["hit_rate_vs_bound"] == 0 {
					t.Errorf("%s reported before its shares of the bounds: %v", spec.RunName(), run.Extra)
				}
				order = append(order, spec.RunName())
			},
		})
		if err != nil {
			t.Fatal(err)
		}
		var b bytes.Buffer
		if err := report.WriteJSON(&b, res); err != nil {
			t.Fatal(err)
		}
		return b.Bytes(), order
	}
	seq, seqOrder := compare(1)
	for _, n := range []int{2, 8} {
		par, parOrder := compare(n)
		if !bytes.Equal(seq, par) {
			t.Errorf("parallel %d: the result differs from the sequential one:\n%s\nvs\n%s", n, par, seq)
		}
		if len(parOrder) != len(specs) || !slices.Equal(parOrder, seqOrder) {
			t.Errorf("parallel %d: progress in order %v, want %v", n, parOrder, seqOrder)
		}
	}
}

// parallel runs n jobs at once: two jobs each waiting for the other to
// have started both finish.
func TestParallelRunsJobsAtOnce(t *testing.T) {
	started := [2]chan struct{}{make(chan struct{}), make(chan struct{})}
	job := func(me int) func(context.Context) error {
		return func(context.Context) error {
			close(started[me])
			<-started[1-me]
			return nil
		}
	}
	var done []int
	if err := parallel(context.Background(), 2, []func(context.Context) error{job(0), job(1)}, func(i int) { done = append(done, i) }); err != nil {
		t.Fatal(err)
	}
	if len(done) != 2 {
		t.Fatalf("done for %v", done)
	}
}

// A failure cancels the jobs still running and is returned once they
// have ended; no job is reported done after it; of two failures the one
// of the earlier job wins, as one after another it would have come first;
// the caller's cancellation wins over both. With n = 1 the jobs run one
// at a time, in order.
func TestParallelFailures(t *testing.T) {
	errA, errB := errors.New("a"), errors.New("b")
	waitThen := func(err error) func(context.Context) error {
		return func(ctx context.Context) error {
			<-ctx.Done() // cancelled by the other job's failure
			if err != nil {
				return err
			}
			return ctx.Err()
		}
	}
	fail := func(err error) func(context.Context) error {
		return func(context.Context) error { return err }
	}
	var done []int
	note := func(i int) { done = append(done, i) }
	if err := parallel(context.Background(), 2, []func(context.Context) error{waitThen(nil), fail(errB)}, note); !errors.Is(err, errB) || len(done) != 0 {
		t.Errorf("a failure: %v, done %v; want b, none", err, done)
	}
	if err := parallel(context.Background(), 2, []func(context.Context) error{waitThen(errA), fail(errB)}, note); !errors.Is(err, errA) {
		t.Errorf("two failures: %v, want the earlier job's, a", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := parallel(ctx, 2, []func(context.Context) error{fail(errA)}, note); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled: %v", err)
	}
	var active, most atomic.Int32
	one := func(context.Context) error {
		most.Store(max(most.Load(), active.Add(1)))
		active.Add(-1)
		return nil
	}
	done = nil
	if err := parallel(context.Background(), 1, []func(context.Context) error{one, one, one}, note); err != nil || most.Load() != 1 || len(done) != 3 ||
		done[0] != 0 || done[1] != 1 || done[2] != 2 {
		t.Errorf("n = 1: %v, %d at once, done %v; want one at a time, in order", err, most.Load(), done)
	}
}
