package sim

import (
	"context"
	"errors"
	"net"
	"net/http"
)

// serve runs the HTTP server on ln and, after each outage (refuse window
// or crash), on the listener that replaces it, until the server is closed.
func (r *Replica) serve(ln net.Listener) {
	defer r.wg.Done()
	for {
		err := r.srv.Serve(ln)
		if errors.Is(err, http.ErrServerClosed) {
			return
		}
		// The listener was closed by an outage: wait for the next one.
		select {
		case ln = <-r.reopen:
		case <-r.done:
			return
		}
	}
}

// trackConn keeps the open connections so that an outage can cut them.
func (r *Replica) trackConn(c net.Conn, s http.ConnState) {
	r.connMu.Lock()
	defer r.connMu.Unlock()
	switch s {
	case http.StateNew:
		if r.down.Load() {
			_ = c.Close() // accepted just before the listener closed
			return
		}
		r.conns[c] = struct{}{}
	case http.StateClosed, http.StateHijacked:
		delete(r.conns, c)
	}
}

// shutdown stops the replica: graceful until ctx ends (in-flight requests
// finish, the driver keeps stepping for them), then abrupt. It waits for
// every goroutine it started.
func (r *Replica) shutdown(ctx context.Context) error {
	err := r.srv.Shutdown(ctx)
	if errors.Is(err, net.ErrClosed) {
		// An outage closed the listener while Serve was still returning
		// from it: the listener is closed as asked, not a failure.
		err = nil
	}
	if err != nil {
		_ = r.srv.Close()
	}
	handlersGone := r.gate.close()
	close(r.done) // ends the driver, waiting handlers and the fault timer
	r.sideCancel()
	<-handlersGone
	r.wg.Wait()
	r.side.CloseIdleConnections()
	// An outage may have opened a listener Serve never took.
	select {
	case ln := <-r.reopen:
		_ = ln.Close()
	default:
	}
	if perr := r.closeKVEvents(); perr != nil && err == nil {
		err = perr
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		// Cut short as asked: not a failure of the replica.
		err = nil
	}
	return err
}
