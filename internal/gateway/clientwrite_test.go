package gateway

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/testutil"
)

// smallSendBuffers sets a small kernel send buffer on every connection ln
// accepts, so that a client that stops reading blocks the gateway's
// writes after a few KiB rather than megabytes; closed receives one value
// per connection the gateway closes (nil: not told).
type smallSendBuffers struct {
	net.Listener
	closed chan struct{}
}

func (l smallSendBuffers) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return c, err
	}
	_ = tc.SetWriteBuffer(16 << 10)
	if l.closed == nil {
		return tc, err
	}
	return &notedConn{TCPConn: tc, closed: l.closed}, err
}

// notedConn tells when the gateway closes it.
type notedConn struct {
	*net.TCPConn
	once   sync.Once
	closed chan struct{}
}

func (c *notedConn) Close() error {
	c.once.Do(func() { c.closed <- struct{}{} })
	return c.TCPConn.Close()
}

// dialSmallWindow connects to addr with a small receive buffer, set
// before the handshake (the window it advertises).
func dialSmallWindow(t *testing.T, addr string) net.Conn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, rc syscall.RawConn) error {
		var serr error
		err := rc.Control(func(fd uintptr) { serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 16<<10) })
		if err != nil {
			return err
		}
		return serr
	}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// Finding 13: a client that stops reading a stream (its TCP window shut,
// the gateway's write blocked) does not hold the request past
// request_timeout, whatever write_timeout is (or with none): the cut ends
// the blocked write, the request's slot, ticket and the replica's
// connection are given back, and the replica is not blamed. The replica
// sends one event far larger than the socket buffers, so that the
// client's first bytes of it prove the gateway is inside that write.
func TestBlockedReaderCutByRequestTimeout(t *testing.T) {
	for _, wt := range []time.Duration{10 * time.Minute, 0} {
		t.Run(fmt.Sprint("write_timeout=", wt), func(t *testing.T) {
			event := "data: {\"choices\":[{\"index\":0,\"text\":\"" + strings.Repeat("x", 4<<20) + "\"}]}\n\n"
			replicaGone := make(chan struct{})
			a := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
				_, _ = io.ReadAll(r.Body)
				w.Header().Set("Content-Type", "text/event-stream")
				_, _ = io.WriteString(w, event)
				w.(http.Flusher).Flush()
				<-r.Context().Done()
				close(replicaGone)
			})
			cfg := baseConfig(a.srv.URL)
			cfg.RequestTimeout, cfg.WriteTimeout = Duration(10*time.Second), Duration(wt)
			cfg.MaxStreamLineBytes = 8 << 20
			gw := serveReal(t, cfg, func(ln net.Listener) net.Listener { return smallSendBuffers{Listener: ln} })
			c := dialSmallWindow(t, gw.addr)
			body := `{"model":"m","prompt":"x","stream":true}`
			fmt.Fprintf(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
			br := bufio.NewReaderSize(c, 16)
			seen := ""
			for !strings.Contains(seen, "data: {") { // the first bytes of the event, then never read again
				b, err := br.ReadByte()
				if err != nil {
					t.Fatalf("the stream's first bytes: %v (%q)", err, seen)
				}
				seen += string(b)
			}
			if gw.g.inFlight.Load() != 1 {
				t.Fatalf("%d requests in flight, want the stream's", gw.g.inFlight.Load())
			}
			gw.clk.Advance(cfg.RequestTimeout.D())
			testutil.Eventually(t, 20*time.Second, "the blocked request cut", func() bool { return gw.g.inFlight.Load() == 0 })
			select { // the replica's connection closed: the stub saw its request end
			case <-replicaGone:
			case <-time.After(testutil.Bound(20 * time.Second)): // a generous bound on the whole wait
				t.Fatal("the replica's request never ended")
			}
			rt := gw.g.Router()
			eventually(t, "the ticket released", func() bool { return rt.InFlight(0) == 0 })
			if st := gw.g.Fleet().State(0); st != "closed" || !rt.Healthy(0) {
				t.Fatalf("a client that stopped reading counted against the replica: %s", st)
			}
			if n := counterValue(t, gw.g.reg, "kvgate_attempts_total", map[string]string{"verdict": "gateway_limit"}); n != 1 {
				t.Fatalf("%v gateway_limit verdicts, want 1", n)
			}
		})
	}
}

// Finding 13: write_timeout bounds every write to a client, not only a
// relayed answer's: a client that pipelines requests (HTTP/1.1) and never
// reads the answers fills its window with the gateway's own answers
// (here /v1/models), and the gateway closes its connection at
// write_timeout instead of blocking on it for good. The deadline is the
// socket's (wall time): the test waits for the close, with a generous bound.
func TestUnreadAnswersBoundedByWriteTimeout(t *testing.T) {
	a := newStub(t, "", okStream(1))
	cfg := baseConfig(a.srv.URL)
	cfg.WriteTimeout = Duration(200 * time.Millisecond)
	closed := make(chan struct{}, 16)
	gw := serveReal(t, cfg, func(ln net.Listener) net.Listener { return smallSendBuffers{Listener: ln, closed: closed} })
	c := dialSmallWindow(t, gw.addr)
	sent := make(chan struct{})
	go func() { // until the gateway stops reading (its window shut too) and the connection closes
		defer close(sent)
		req := []byte(strings.Repeat("GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 100))
		for range 1000 { // at most 3.7 MB of requests: 40 MB of answers, far more than any buffer
			if _, err := c.Write(req); err != nil {
				return
			}
		}
	}()
	select {
	case <-closed:
	case <-time.After(testutil.Bound(20 * time.Second)): // a generous bound on the whole wait
		t.Fatal("a client that never reads its answers still holds its connection")
	}
	c.Close()
	<-sent
}
