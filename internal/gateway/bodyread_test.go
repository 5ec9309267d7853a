package gateway

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/testutil"
)

// realGW is a gateway on its own http.Server (Gateway.Server(): its header
// timeout, its limits) on a loopback listener, as kvgate serve runs it.
type realGW struct {
	g    *Gateway
	addr string
	clk  *clock.Fake
}

// serveReal starts cfg's gateway on a fake clock; wrap (optional) wraps
// its listener.
func serveReal(t *testing.T, cfg Config, wrap func(net.Listener) net.Listener) *realGW {
	t.Helper()
	clk := clock.NewFake(time.Time{})
	g, err := New(cfg, Options{Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if wrap != nil {
		ln = wrap(ln)
	}
	srv := g.Server()
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.Serve(ln) }()
	ctx, stop := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); g.Run(ctx) }()
	t.Cleanup(func() {
		// Shutdown waits for the connections' goroutines (a connection
		// closing after a cut body lingers in net/http's closeWriteAndWait).
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if srv.Shutdown(sctx) != nil {
			_ = srv.Close()
		}
		<-served
		stop()
		<-ran
	})
	eventually(t, "models listed", func() bool { return len(g.Fleet().Models()) > 0 })
	return &realGW{g: g, addr: addr, clk: clk}
}

// bodyGauge is kvgate_request_body_bytes: the body bytes the gateway holds.
func bodyGauge(t *testing.T, g *Gateway) int64 {
	return int64(counterValue(t, g.reg, "kvgate_request_body_bytes", nil))
}

// clientFrom is an HTTP client whose connections come from the loopback
// address ip (127.0.0.2 is another host to the gateway), with a generous
// overall timeout: a request the gateway makes wait fails the test.
func clientFrom(ip string) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	return &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{DialContext: d.DialContext}}
}

// trickle is an upload that declares a large body and sends it slowly.
type trickle struct{ c net.Conn }

// startTrickle connects from ip, sends the headers of a POST declaring
// length bytes of JSON (with key as its bearer token, if any) and the
// first n bytes of its body.
func startTrickle(t *testing.T, addr, ip, key string, length, n int) *trickle {
	t.Helper()
	return startTrickleTo(t, addr, ip, key, "/v1/completions", "application/json", length, n)
}

// startTrickleTo is startTrickle to path, with a body of content type ct.
func startTrickleTo(t *testing.T, addr, ip, key, path, ct string, length, n int) *trickle {
	t.Helper()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	c, err := d.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	auth := ""
	if key != "" {
		auth = "Authorization: Bearer " + key + "\r\n"
	}
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Type: %s\r\nContent-Length: %d\r\n\r\n", path, auth, ct, length)
	tr := &trickle{c: c}
	tr.send(t, n)
	return tr
}

func (tr *trickle) send(t *testing.T, n int) {
	t.Helper()
	if _, err := io.WriteString(tr.c, strings.Repeat(" ", n)); err != nil {
		t.Fatal(err)
	}
}

// answer reads the trickle's HTTP answer (the gateway cut it).
func (tr *trickle) answer(t *testing.T) (int, string) {
	t.Helper()
	_ = tr.c.SetReadDeadline(time.Now().Add(20 * time.Second)) // a generous bound on the whole wait
	resp, err := http.ReadResponse(bufio.NewReader(tr.c), nil)
	if err != nil {
		t.Fatalf("no answer to a cut upload: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// Finding 4: forty uploads that declare 8 MiB and trickle their bytes hold
// only the bytes that arrived (the body-memory gauge says so), and while
// they are open an ordinary small request is admitted at once, from
// another address and from theirs, with and without API keys. The
// gateway's queue_timeout is on a fake clock: a request made to wait for
// memory would wait until the client's own timeout.
func TestTricklingUploadsCostWhatArrived(t *testing.T) {
	for _, key := range []string{"", "k1"} {
		t.Run("keys="+key, func(t *testing.T) {
			a := newStub(t, "", okStream(1))
			cfg := baseConfig(a.srv.URL) // max_body_bytes 8 MiB, max_body_memory 256 MiB
			if key != "" {
				cfg.APIKeys = []string{key}
			}
			cfg.BodyRateGrace = Duration(time.Hour) // the trickles stay open: only memory is tested here
			gw := serveReal(t, cfg, nil)
			const n, first = 40, 100
			var trickles []*trickle
			for range n {
				trickles = append(trickles, startTrickle(t, gw.addr, "127.0.0.1", key, 8<<20, first))
			}
			eventually(t, "the trickles' arrived bytes held", func() bool { return bodyGauge(t, gw.g) == n*first })
			hdr := []string{}
			if key != "" {
				hdr = []string{"Authorization", "Bearer " + key}
			}
			for _, ip := range []string{"127.0.0.2", "127.0.0.1"} {
				r := testutil.Post(t, clientFrom(ip), "http://"+gw.addr+"/v1/completions", `{"model":"m","prompt":"hello"}`, hdr...)
				if r.Status != 200 {
					t.Fatalf("an ordinary request from %s beside %d trickles: %d %s", ip, n, r.Status, r.Body)
				}
			}
			// The trickles are still open and still charged by what arrives.
			for _, tr := range trickles {
				tr.send(t, first)
			}
			eventually(t, "the trickles' next bytes held", func() bool { return bodyGauge(t, gw.g) == 2*n*first })
			for _, tr := range trickles {
				tr.c.Close()
			}
			eventually(t, "the closed trickles' memory given back", func() bool { return bodyGauge(t, gw.g) == 0 })
		})
	}
}

// Finding 4: a streamed upload (a multipart audio file) holds, while the
// gateway reads its first bytes for the form's model, the bytes that
// arrived: charged to the body memory like any body, given back when it ends.
func TestStreamedUploadHeadCharged(t *testing.T) {
	a := newStub(t, "", okStream(1))
	cfg := baseConfig(a.srv.URL)
	cfg.BodyRateGrace = Duration(time.Hour)
	gw := serveReal(t, cfg, nil)
	const n, first = 4, 100
	var trickles []*trickle
	for range n {
		trickles = append(trickles, startTrickleTo(t, gw.addr, "127.0.0.1", "", "/v1/audio/transcriptions",
			"multipart/form-data; boundary=b", 8<<20, first))
	}
	eventually(t, "the uploads' arrived bytes held", func() bool { return bodyGauge(t, gw.g) == n*first })
	for _, tr := range trickles {
		tr.c.Close()
	}
	eventually(t, "their memory given back", func() bool { return bodyGauge(t, gw.g) == 0 })
}

// Finding 4: a body slower than min_body_rate (after body_rate_grace), or
// slower than body_read_timeout in all, is cut with a 408 in the OpenAI
// shape, and its memory is given back; a body that keeps the rate is
// read. The cut is the socket's deadline (wall time): the test waits for
// its answer, with a generous bound, and never times it.
func TestSlowBodyCut(t *testing.T) {
	cases := []struct {
		name        string
		rate        int64
		grace, read time.Duration
		want        string
	}{
		{"min_body_rate", 1000, 200 * time.Millisecond, time.Hour, "min_body_rate"},
		{"body_read_timeout", 0, time.Hour, 200 * time.Millisecond, "body_read_timeout"},
		{"body_read_timeout before the rate", 1000, time.Hour, 200 * time.Millisecond, "body_read_timeout"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := newStub(t, "", okStream(1))
			cfg := baseConfig(a.srv.URL)
			cfg.MinBodyRate, cfg.BodyRateGrace, cfg.BodyReadTimeout = tc.rate, Duration(tc.grace), Duration(tc.read)
			gw := serveReal(t, cfg, nil)
			tr := startTrickle(t, gw.addr, "127.0.0.1", "", 1000, 10)
			status, body := tr.answer(t)
			if status != http.StatusRequestTimeout || !strings.Contains(body, `"code":"body_timeout"`) ||
				!strings.Contains(body, tc.want) || !strings.Contains(body, `"type":"invalid_request_error"`) {
				t.Fatalf("a stalled body: %d %s", status, body)
			}
			eventually(t, "the cut body's memory given back", func() bool { return bodyGauge(t, gw.g) == 0 })
			if n := counterValue(t, gw.g.reg, "kvgate_request_errors_total", map[string]string{"kind": "body_timeout"}); n != 1 {
				t.Fatalf("%v body_timeout errors counted, want 1", n)
			}
			r := testutil.Post(t, clientFrom("127.0.0.1"), "http://"+gw.addr+"/v1/completions", `{"model":"m","prompt":"x"}`)
			if r.Status != 200 {
				t.Fatalf("a prompt body after the cut: %d %s", r.Status, r.Body)
			}
		})
	}
}

// waitingFrom counts the body reads from ip waiting for memory.
func waitingFrom(g *Gateway, ip string) int {
	g.bodies.mu.Lock()
	defer g.bodies.mu.Unlock()
	n := 0
	for e := g.bodies.waiters.Front(); e != nil; e = e.Next() {
		if e.Value.(*bodyWaiter).client.String() == ip {
			n++
		}
	}
	return n
}

// Finding 4: one address cannot hold more than its share of the body
// memory (max_body_memory_share): 127.0.0.2 opens four uploads declaring
// 1 MiB each and sends one of them whole but for its last byte, filling
// its share of 1 MiB but for one byte. Its next request's read waits (429
// at queue_timeout), while a request from another address is admitted at
// once. (Reserving from Content-Length, the four would hold the whole
// budget of 4 MiB.)
func TestBodyMemorySharePerAddress(t *testing.T) {
	a := newStub(t, "", okStream(1))
	cfg := baseConfig(a.srv.URL)
	cfg.MaxBodyBytes, cfg.MaxBodyMemory, cfg.MaxBodyMemoryShare = 1<<20, 4<<20, 0.25 // 1 MiB per address
	cfg.BodyRateGrace = Duration(time.Hour)
	gw := serveReal(t, cfg, nil)
	trickles := []*trickle{startTrickle(t, gw.addr, "127.0.0.2", "", 1<<20, 1<<20-1)}
	for range 3 {
		trickles = append(trickles, startTrickle(t, gw.addr, "127.0.0.2", "", 1<<20, 0))
	}
	eventually(t, "127.0.0.2's share held", func() bool { return bodyGauge(t, gw.g) == 1<<20-1 })
	r := testutil.Post(t, clientFrom("127.0.0.1"), "http://"+gw.addr+"/v1/completions", `{"model":"m","prompt":"hello"}`)
	if r.Status != 200 {
		t.Fatalf("a request from another address: %d %s", r.Status, r.Body)
	}
	got := make(chan string, 1)
	go func() {
		resp, err := clientFrom("127.0.0.2").Post("http://"+gw.addr+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"m","prompt":"hello"}`))
		if err != nil {
			got <- err.Error()
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		got <- fmt.Sprint(resp.StatusCode, " ", string(b))
	}()
	eventually(t, "127.0.0.2's next request waits", func() bool { return waitingFrom(gw.g, "127.0.0.2") == 1 })
	gw.clk.Advance(cfg.QueueTimeout.D())
	if r := <-got; !strings.HasPrefix(r, "429 ") || !strings.Contains(r, "client_body_memory") {
		t.Fatalf("a request past its address's share: %s", r)
	}
	for _, tr := range trickles {
		tr.c.Close()
	}
	eventually(t, "the memory given back", func() bool { return bodyGauge(t, gw.g) == 0 })
}
