package replay

import (
	"context"
	"errors"
	"runtime"
	"sync"
	"sync/atomic"
)

// parallel runs jobs, up to n at once (n < 1: GOMAXPROCS), each on a
// goroutine of its own that ends before parallel returns, and calls
// done(i) on the calling goroutine as job i returns without error, in the
// order they finish. The replay's runs are pure functions of their inputs
// (each its own fleet, router and policy, reading the shared plan), so the
// figures do not depend on n, only the wall time does.
//
// The first job to fail cancels the others' context, and no done is called
// after it; parallel returns, once every job has returned, the caller's
// ctx error if ctx ended, else the error of the first job in job order that
// failed of itself (not by that cancellation), as running them one after
// another would.
func parallel(ctx context.Context, n int, jobs []func(context.Context) error, done func(i int)) error {
	if n < 1 {
		n = runtime.GOMAXPROCS(0)
	}
	n = min(n, len(jobs))
	jctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, len(jobs))
	finished := make(chan int)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1) - 1); i < len(jobs); i = int(next.Add(1) - 1) {
				if errs[i] = jctx.Err(); errs[i] == nil {
					errs[i] = jobs[i](jctx)
				}
				finished <- i
			}
		}()
	}
	go func() {
		wg.Wait()
		close(finished)
	}()
	failed := false
	for i := range finished {
		switch {
		case errs[i] != nil:
			failed = true
			cancel()
		case !failed:
			done(i)
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	for _, err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			return err
		}
	}
	return nil
}
