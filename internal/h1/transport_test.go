package h1

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fallback counts the requests the lean path passed on.
type fallback struct{ n atomic.Int32 }

func (f *fallback) RoundTrip(*http.Request) (*http.Response, error) {
	f.n.Add(1)
	return nil, errors.New("fallback")
}

// server is a net/http server on loopback that counts the connections it
// accepted.
func server(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int32) {
	var conns atomic.Int32
	s := httptest.NewUnstartedServer(h)
	s.Config.ConnState = func(_ net.Conn, st http.ConnState) {
		if st == http.StateNew {
			conns.Add(1)
		}
	}
	s.Start()
	t.Cleanup(s.Close)
	return s, &conns
}

func newT(t *testing.T, o Options) *Transport {
	if o.Fallback == nil {
		o.Fallback = &fallback{}
	}
	tr := New(o)
	t.Cleanup(tr.CloseIdleConnections)
	return tr
}

func post(t *testing.T, tr http.RoundTripper, url, body string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	return tr.RoundTrip(req)
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	return string(b)
}

func TestContentLengthBodyAndReuse(t *testing.T) {
	s, conns := server(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.Header().Set("X-Got", r.Header.Get("Content-Type")+"|"+r.URL.RawQuery)
		_, _ = w.Write(append([]byte("echo:"), b...))
	})
	tr := newT(t, Options{})
	for i := range 3 {
		resp, err := post(t, tr, s.URL+"/v1/completions?a=1", `{"prompt":"hi"}`)
		if err != nil {
			t.Fatal(err)
		}
		if got := readAll(t, resp); got != `echo:{"prompt":"hi"}` || resp.Header.Get("X-Got") != "application/json|a=1" {
			t.Fatalf("round %d: body %q header %q", i, got, resp.Header.Get("X-Got"))
		}
		if n := tr.Idle(s.Listener.Addr().String()); n != 1 {
			t.Fatalf("round %d: %d idle connections, want 1", i, n)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d connections for 3 sequential requests, want 1", n)
	}
}

// A chunked (SSE) answer reaches the caller chunk by chunk, as the replica
// flushes: the second is written only after the caller read the first.
func TestChunkedStreamsAsItArrives(t *testing.T) {
	next := make(chan struct{})
	s, conns := server(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: one\n\n")
		w.(http.Flusher).Flush()
		<-next
		_, _ = io.WriteString(w, "data: two\n\n")
	})
	tr := newT(t, Options{})
	resp, err := post(t, tr, s.URL, "{}")
	if err != nil {
		t.Fatal(err)
	}
	if resp.ContentLength != -1 || len(resp.TransferEncoding) != 1 {
		t.Fatalf("not chunked: length %d, encoding %v", resp.ContentLength, resp.TransferEncoding)
	}
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); err != nil || line != "data: one\n" {
		t.Fatalf("first event %q, %v", line, err)
	}
	close(next)
	if rest := readAll(t, &http.Response{Body: io.NopCloser(br)}); rest != "\ndata: two\n\n" {
		t.Fatalf("rest %q", rest)
	}
	_ = resp.Body.Close()
	if n := tr.Idle(s.Listener.Addr().String()); n != 1 {
		t.Fatalf("%d idle after a chunked body read to its end, want 1", n)
	}
	resp, err = post(t, tr, s.URL, "{}")
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close() // early: the connection goes with it
	if n := tr.Idle(s.Listener.Addr().String()); n != 0 || conns.Load() != 1 {
		t.Fatalf("%d idle after an early close (want 0), %d connections (want 1)", n, conns.Load())
	}
}

func TestConnectionCloseIsNotReused(t *testing.T) {
	s, _ := server(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Connection", "close")
		_, _ = io.WriteString(w, "bye")
	})
	tr := newT(t, Options{})
	resp, err := post(t, tr, s.URL, "{}")
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, resp); got != "bye" || !resp.Close {
		t.Fatalf("body %q close %v", got, resp.Close)
	}
	if n := tr.Idle(s.Listener.Addr().String()); n != 0 {
		t.Fatalf("%d idle after Connection: close", n)
	}
}

// A pooled connection the replica closed is found before the request is
// written on it: the request goes on a new one.
func TestReplicaClosedIdleConnection(t *testing.T) {
	s, conns := server(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	tr := newT(t, Options{})
	for i := range 2 {
		resp, err := post(t, tr, s.URL, "{}")
		if err != nil {
			t.Fatalf("round %d: %v", i, err)
		}
		if got := readAll(t, resp); got != "ok" {
			t.Fatalf("round %d: %q", i, got)
		}
		s.CloseClientConnections()
		waitPeerClosed(t, tr, s.Listener.Addr().String())
	}
	if n := conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2", n)
	}
}

// waitPeerClosed waits (bounded) until the pooled connection sees the
// replica's close: the FIN arrives asynchronously.
func waitPeerClosed(t *testing.T, tr *Transport, addr string) {
	t.Helper()
	p := tr.pool(addr)
	p.mu.Lock()
	idle := append([]*conn(nil), p.idle...)
	p.mu.Unlock()
	for _, c := range idle {
		_ = c.nc.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.br.Peek(1); err == nil {
			t.Fatal("a closed connection had data")
		}
		_ = c.nc.SetReadDeadline(time.Time{})
	}
}

func TestCancelWhileWaitingAndWhileReading(t *testing.T) {
	release := make(chan struct{})
	s, _ := server(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/body" {
			_, _ = io.WriteString(w, "part")
			w.(http.Flusher).Flush()
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	defer close(release) // before the server's Close, which waits for its handlers
	tr := newT(t, Options{})
	cause := errors.New("client gone")
	ctx, cancel := context.WithCancelCause(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+"/header", strings.NewReader("{}"))
	var wrote atomic.Bool
	req = req.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		WroteRequest: func(i httptrace.WroteRequestInfo) {
			wrote.Store(i.Err == nil)
			cancel(cause)
		}}))
	if _, err := tr.RoundTrip(req); !errors.Is(err, cause) || !wrote.Load() {
		t.Fatalf("err %v (want the cause), wrote %v", err, wrote.Load())
	}
	ctx2, cancel2 := context.WithCancelCause(context.Background())
	req, _ = http.NewRequestWithContext(ctx2, http.MethodPost, s.URL+"/body", strings.NewReader("{}"))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != "part" {
		t.Fatalf("%q %v", buf, err)
	}
	cancel2(cause)
	if _, err := resp.Body.Read(buf); !errors.Is(err, cause) {
		t.Fatalf("read after cancel: %v", err)
	}
	_ = resp.Body.Close()
	if n := tr.Idle(s.Listener.Addr().String()); n != 0 {
		t.Fatalf("%d idle after cancellations", n)
	}
}

// rawServer answers every connection with reply (after reading the
// request's header), then closes it.
func rawServer(t *testing.T, reply string) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			br := bufio.NewReader(c)
			if _, err := http.ReadRequest(br); err == nil {
				_, _ = io.WriteString(c, reply)
			}
			_ = c.Close()
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	return "http://" + ln.Addr().String()
}

func TestResponseHeaderBound(t *testing.T) {
	big := "HTTP/1.1 200 OK\r\nX-Big: " + strings.Repeat("a", 2000) + "\r\nContent-Length: 2\r\n\r\nok"
	url := rawServer(t, big)
	if _, err := post(t, newT(t, Options{MaxHeaderBytes: 1024}), url, "{}"); !errors.Is(err, errHeaderTooLarge) {
		t.Fatalf("err %v, want the header bound", err)
	}
	resp, err := post(t, newT(t, Options{MaxHeaderBytes: 4096}), url, "{}")
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, resp); got != "ok" {
		t.Fatalf("%q", got)
	}
}

func TestInformationalResponsesSkipped(t *testing.T) {
	url := rawServer(t, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"+
		"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok")
	resp, err := post(t, newT(t, Options{}), url, "{}")
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, resp); resp.StatusCode != 201 || got != "ok" {
		t.Fatalf("%d %q", resp.StatusCode, got)
	}
	url = rawServer(t, strings.Repeat("HTTP/1.1 103 Early Hints\r\n\r\n", max1xx+1)+"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
	if _, err := post(t, newT(t, Options{}), url, "{}"); !errors.Is(err, errTooMany1xx) {
		t.Fatalf("err %v", err)
	}
	url = rawServer(t, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n")
	if _, err := post(t, newT(t, Options{}), url, "{}"); !errors.Is(err, errSwitching) {
		t.Fatalf("err %v", err)
	}
}

func TestFallbackTakesWhatTheLeanPathDoesNot(t *testing.T) {
	fb := &fallback{}
	tr := newT(t, Options{Fallback: fb, MaxBody: 8})
	mk := func(url string, body io.Reader, set func(*http.Request)) *http.Request {
		req, _ := http.NewRequest(http.MethodPost, url, body)
		if set != nil {
			set(req)
		}
		return req
	}
	cases := []*http.Request{
		mk("https://127.0.0.1:1/", nil, nil),
		mk("http://u:p@127.0.0.1:1/", nil, nil),
		mk("http://127.0.0.1:1/", strings.NewReader("123456789"), nil),                               // over MaxBody
		mk("http://127.0.0.1:1/", io.MultiReader(strings.NewReader("1")), nil),                       // unknown length
		mk("http://127.0.0.1:1/", strings.NewReader("1"), func(r *http.Request) { r.GetBody = nil }), // streamed
		mk("http://127.0.0.1:1/", nil, func(r *http.Request) { r.Header.Set("Upgrade", "websocket") }),
	}
	for i, req := range cases {
		if tr.Lean(req) {
			t.Fatalf("case %d went lean", i)
		}
		if _, err := tr.RoundTrip(req); err == nil || fb.n.Load() != int32(i+1) {
			t.Fatalf("case %d: err %v, fallback calls %d", i, err, fb.n.Load())
		}
	}
}

func TestBadHeaderFailsBeforeWriting(t *testing.T) {
	s, conns := server(t, func(w http.ResponseWriter, r *http.Request) {})
	tr := newT(t, Options{})
	req, _ := http.NewRequest(http.MethodPost, s.URL, strings.NewReader("{}"))
	req.Header["X-Evil"] = []string{"a\r\nX-Injected: 1"}
	if _, err := tr.RoundTrip(req); err == nil {
		t.Fatal("a header value with CRLF was sent")
	}
	var nw nothingWritten
	req.Header = http.Header{"Bad Name": {"v"}}
	req.Body = io.NopCloser(strings.NewReader("{}"))
	if _, err := tr.RoundTrip(req); !errors.As(err, &nw) {
		t.Fatalf("err %v, want one before writing", err)
	}
	_ = conns
}

func TestIdleBoundAndTimeout(t *testing.T) {
	s, _ := server(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	clk := clock.NewFake(time.Unix(1000, 0))
	tr := newT(t, Options{MaxIdlePerHost: 2, IdleTimeout: 4 * time.Second, Clock: clk})
	var resps []*http.Response
	for range 3 { // three at once: three connections
		resp, err := post(t, tr, s.URL, "{}")
		if err != nil {
			t.Fatal(err)
		}
		resps = append(resps, resp)
	}
	for _, r := range resps {
		_ = readAll(t, r)
	}
	addr := s.Listener.Addr().String()
	if n := tr.Idle(addr); n != 2 {
		t.Fatalf("%d idle, want the bound 2", n)
	}
	clk.Advance(3 * time.Second)
	if n := tr.Idle(addr); n != 2 {
		t.Fatalf("%d idle before the timeout", n)
	}
	clk.Advance(time.Second)
	if n := tr.Idle(addr); n != 0 {
		t.Fatalf("%d idle after the timeout", n)
	}
	if _, ok := tr.pools.Load(addr); ok {
		t.Fatal("an empty pool stayed in the transport's map")
	}
}

func TestTraceHooksAndHeadersSent(t *testing.T) {
	var got http.Header
	var host string
	s, _ := server(t, func(w http.ResponseWriter, r *http.Request) {
		got, host = r.Header.Clone(), r.Host
		w.WriteHeader(204)
	})
	tr := newT(t, Options{})
	var wrote, first atomic.Bool
	ctx := httptrace.WithClientTrace(context.Background(), &httptrace.ClientTrace{
		WroteRequest:         func(i httptrace.WroteRequestInfo) { wrote.Store(i.Err == nil) },
		GotFirstResponseByte: func() { first.Store(true) },
	})
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/health", nil)
	req.Header.Add("Via", "1.1 a")
	req.Header.Add("Via", "1.1 b")
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 204 || !wrote.Load() || !first.Load() {
		t.Fatalf("status %d wrote %v first byte %v", resp.StatusCode, wrote.Load(), first.Load())
	}
	if v := got.Values("Via"); len(v) != 2 || v[1] != "1.1 b" || got.Get("User-Agent") == "" || host != s.Listener.Addr().String() {
		t.Fatalf("header %v host %q", got, host)
	}
	if n := tr.Idle(s.Listener.Addr().String()); n != 1 {
		t.Fatalf("%d idle after a bodiless answer, want 1", n)
	}
}

func TestShortBodyFails(t *testing.T) {
	s, _ := server(t, func(w http.ResponseWriter, r *http.Request) { _, _ = io.Copy(io.Discard, r.Body) })
	tr := newT(t, Options{})
	req, _ := http.NewRequest(http.MethodPost, s.URL, strings.NewReader("ab"))
	req.ContentLength = 10
	if _, err := tr.RoundTrip(req); !errors.Is(err, errShortBody) {
		t.Fatalf("err %v, want a short body", err)
	}
	if n := tr.Idle(s.Listener.Addr().String()); n != 0 {
		t.Fatalf("%d idle after a short body", n)
	}
}

// Sent again on a new connection: a request that reached none of a reused
// one, or an idempotent one that got no answer byte; never a POST that
// was written.
func TestRetryable(t *testing.T) {
	post, _ := http.NewRequest(http.MethodPost, "http://r/", nil)
	get, _ := http.NewRequest(http.MethodGet, "http://r/", nil)
	keyed, _ := http.NewRequest(http.MethodPost, "http://r/", nil)
	keyed.Header.Set("Idempotency-Key", "k")
	eof := io.ErrUnexpectedEOF
	for _, c := range []struct {
		req  *http.Request
		err  error
		want bool
	}{
		{post, nothingWritten{eof}, true}, {post, noResponse{eof}, false}, {post, eof, false},
		{get, noResponse{eof}, true}, {keyed, noResponse{eof}, true}, {get, eof, false},
	} {
		if got := retryable(c.req, c.err); got != c.want {
			t.Errorf("%s %v: retryable %v, want %v", c.req.Method, c.err, got, c.want)
		}
	}
}

// The fast path takes the answers of nginx, vLLM's uvicorn (lowercase
// names) and net/http with a length; the rest goes to http.ReadResponse.
func TestFastResponseTakesTheCommonAnswer(t *testing.T) {
	post, _ := http.NewRequest(http.MethodPost, "http://r/", nil)
	head, _ := http.NewRequest(http.MethodHead, "http://r/", nil)
	for _, c := range []struct {
		req   *http.Request
		reply string
		fast  bool
	}{
		{post, "HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok", true},
		{post, "HTTP/1.1 200 OK\r\ndate: x\r\nserver: uvicorn\r\ncontent-length: 2\r\ncontent-type: application/json\r\n\r\nok", true},
		{post, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", true},
		{post, "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", false},
		{post, "HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", false},
		{post, "HTTP/1.1 204 No Content\r\n\r\n", false},
		{post, "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", false},
		{post, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n", false}, // header not all there
		{head, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n", false},
	} {
		br := bufio.NewReader(strings.NewReader(c.reply))
		_, _ = br.Peek(1)
		if got := fastResponse(br, c.req) != nil; got != c.fast {
			t.Errorf("%s %q: fast %v, want %v", c.req.Method, c.reply, got, c.fast)
		}
	}
}

// BenchmarkReadResponse: an nginx answer's header and body read by the
// fast path and by http.ReadResponse.
func BenchmarkReadResponse(b *testing.B) {
	const reply = "HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Fri, 27 Nov 2026 16:40:00 GMT\r\nContent-Type: application/json\r\n" +
		"Content-Length: 2\r\nConnection: keep-alive\r\n\r\nok"
	req, _ := http.NewRequest(http.MethodPost, "http://r/", nil)
	rd := strings.NewReader(reply)
	br := bufio.NewReader(rd)
	for _, fast := range []bool{true, false} {
		b.Run(map[bool]string{true: "fast", false: "net-http"}[fast], func(b *testing.B) {
			b.ReportAllocs()
			var fb fixedBody
			for b.Loop() {
				rd.Reset(reply)
				br.Reset(rd)
				_, _ = br.Peek(1)
				var resp *http.Response
				if fast {
					resp = fastResponse(br, req)
					fb = fixedBody{br: br, left: resp.ContentLength}
					resp.Body = &fb
				} else {
					resp, _ = http.ReadResponse(br, req)
				}
				if _, err := io.Copy(io.Discard, resp.Body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
