package sim

import (
	"context"
	"net"
	"net/http"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// beforeRequest applies the faults decided before a request is read:
// fail-after, an injected error, a stall. It reports whether to go on
// (false: answered or gone) and whether the connection is to die.
func (r *Replica) beforeRequest(w http.ResponseWriter, req *http.Request) (die, ok bool) {
	if fa := r.faults.FailAfter; fa > 0 && r.served.Add(1) > int64(fa) {
		r.failed.Store(true)
		writeError(w, errFailed)
		return false, false
	}
	fail, stall, die := r.draw()
	if fail {
		writeError(w, errInjected)
		return false, false
	}
	if stall && !r.stall(req.Context()) {
		return false, false
	}
	return die, true
}

// draw makes the per-request fault draws.
func (r *Replica) draw() (fail, stall, die bool) {
	f := r.faults
	if f.ErrorRate == 0 && f.StallRate == 0 && f.DieRate == 0 {
		return false, false, false
	}
	r.frngMu.Lock()
	defer r.frngMu.Unlock()
	return r.frng.Float64() < f.ErrorRate, r.frng.Float64() < f.StallRate, r.frng.Float64() < f.DieRate
}

// stall holds a request for the stall duration (on the replica's clock);
// false when the client or the replica went away meanwhile.
func (r *Replica) stall(ctx context.Context) bool {
	t := r.clock.NewTimer(r.faults.Stall)
	defer t.Stop()
	select {
	case <-t.C():
		return true
	case <-ctx.Done():
		return false
	case <-r.done:
		return false
	}
}

// refuseWindow is the --fault-refuse-after/--fault-refuse-for fault: the
// replica goes away as a crashed process does, then comes back on the same
// port.
func (r *Replica) refuseWindow() {
	defer r.wg.Done()
	t := r.clock.NewTimer(r.faults.RefuseAfter)
	defer t.Stop()
	select {
	case <-t.C():
	case <-r.done:
		return
	}
	if r.goDown() {
		r.comeBack(t, r.faults.RefuseFor)
	}
}

// crash is the query-of-death fault (Faults.CrashOn): the replica goes away
// at once and comes back CrashFor later. It is called by the handler of the
// request that crashes it, inside the gate, so that shutdown, which waits
// for the gate before the WaitGroup, cannot miss the goroutine it adds.
func (r *Replica) crash() {
	if !r.goDown() {
		return // already down
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		t := r.clock.NewTimer(r.faults.CrashFor)
		defer t.Stop()
		r.comeBack(t, r.faults.CrashFor)
	}()
}

// goDown takes the replica off the network as a crashed process goes: its
// listener closes, so new connections are refused, and every open
// connection is cut. The engine and its cache survive. False when the
// replica is down already.
func (r *Replica) goDown() bool {
	r.lnMu.Lock()
	defer r.lnMu.Unlock()
	if r.down.Load() {
		return false
	}
	r.down.Store(true)
	_ = r.ln.Close()
	r.connMu.Lock()
	for c := range r.conns {
		_ = c.Close()
	}
	r.connMu.Unlock()
	return true
}

// comeBack waits d on t, then listens on the same address again and hands
// the listener to serve. Listening can fail briefly if the port is taken by
// someone else meanwhile: it retries with a capped backoff until the
// replica stops.
func (r *Replica) comeBack(t clock.Timer, d time.Duration) {
	for delay := 10 * time.Millisecond; ; delay = min(2*delay, time.Second) {
		t.Reset(d)
		select {
		case <-t.C():
		case <-r.done:
			return
		}
		var lc net.ListenConfig
		ln, err := lc.Listen(context.Background(), "tcp", r.addr)
		if err != nil {
			d = delay
			continue
		}
		r.lnMu.Lock()
		r.ln = ln
		r.down.Store(false)
		r.lnMu.Unlock()
		select {
		case r.reopen <- ln:
		case <-r.done:
			_ = ln.Close()
		}
		return
	}
}
