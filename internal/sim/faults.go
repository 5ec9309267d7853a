package sim

import (
	"context"
	"net"
	"net/http"
	"time"
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
// replica goes away as a crashed process does (listener closed, so new
// connections are refused, and open connections cut), then comes back on
// the same port.
func (r *Replica) refuseWindow() {
	defer r.wg.Done()
	t := r.clock.NewTimer(r.faults.RefuseAfter)
	defer t.Stop()
	select {
	case <-t.C():
	case <-r.done:
		return
	}
	r.refusing.Store(true)
	_ = r.ln.Close()
	r.connMu.Lock()
	for c := range r.conns {
		_ = c.Close()
	}
	r.connMu.Unlock()

	t.Reset(r.faults.RefuseFor)
	select {
	case <-t.C():
	case <-r.done:
		return
	}
	// Listening again can fail briefly if the port is taken by someone
	// else meanwhile; retry with a capped backoff until closed.
	delay := 10 * time.Millisecond
	for {
		var lc net.ListenConfig
		ln, err := lc.Listen(context.Background(), "tcp", r.addr)
		if err == nil {
			r.refusing.Store(false)
			r.ln = ln
			r.reopen <- ln
			return
		}
		t.Reset(delay)
		select {
		case <-t.C():
		case <-r.done:
			return
		}
		delay = min(2*delay, time.Second)
	}
}
