package h1

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"
)

// replyConn is a connection whose replica answers reply, whatever was
// written; reads end with io.EOF (the replica closed).
type replyConn struct {
	r      *bytes.Reader
	closed bool
}

func (c *replyConn) Read(b []byte) (int, error)       { return c.r.Read(b) }
func (c *replyConn) Write(b []byte) (int, error)      { return len(b), nil }
func (c *replyConn) Close() error                     { c.closed = true; return nil }
func (c *replyConn) LocalAddr() net.Addr              { return &net.TCPAddr{} }
func (c *replyConn) RemoteAddr() net.Addr             { return &net.TCPAddr{} }
func (c *replyConn) SetDeadline(time.Time) error      { return nil }
func (c *replyConn) SetReadDeadline(time.Time) error  { return nil }
func (c *replyConn) SetWriteDeadline(time.Time) error { return nil }

const fuzzHeaderLimit = 512

// FuzzResponse feeds a replica's arbitrary reply to the lean path. It must
// not panic; a header section longer than the bound is refused; a body
// reads no more than the reply holds; a connection is pooled only after a
// body framed to its end (never one read up to the replica's close).
func FuzzResponse(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-T: 1\r\n\r\n",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.0 200 OK\r\n\r\nuntil close",
		"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nok",
		"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nok",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nok",
		"HTTP/1.1 200 OK\r\nX: " + strings.Repeat("a", 600) + "\r\n\r\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, reply []byte) {
		rc := &replyConn{r: bytes.NewReader(reply)}
		tr := New(Options{Fallback: &fallback{}, MaxHeaderBytes: fuzzHeaderLimit,
			Dial: func(context.Context, string, string) (net.Conn, error) { return rc, nil }})
		req, _ := http.NewRequest(http.MethodPost, "http://replica:8000/v1/completions", strings.NewReader("{}"))
		resp, err := tr.RoundTrip(req)
		// The header ends at its first empty line (a line's "\n", then
		// "\n" or "\r\n"), as textproto reads it.
		end := bytes.Index(reply, []byte("\n\r\n"))
		if end2 := bytes.Index(reply, []byte("\n\n")); end2 >= 0 && (end < 0 || end2 < end) {
			end = end2
		}
		if err == nil && (end < 0 || end > fuzzHeaderLimit) {
			t.Fatalf("a header past the bound (%d bytes) was accepted", end)
		}
		if err != nil {
			if !rc.closed {
				t.Fatal("a failed exchange left its connection open")
			}
			return
		}
		n, rerr := io.Copy(io.Discard, io.LimitReader(resp.Body, int64(len(reply))+1))
		_ = resp.Body.Close()
		if n > int64(len(reply)) {
			t.Fatalf("read %d body bytes from a %d-byte reply", n, len(reply))
		}
		pooled := tr.Idle("replica:8000") == 1
		if pooled && (rerr != nil || resp.Close || rc.closed) {
			t.Fatalf("pooled after read error %v, close %v, conn closed %v", rerr, resp.Close, rc.closed)
		}
		if !pooled && !rc.closed {
			t.Fatal("a connection neither pooled nor closed")
		}
	})
}

// FuzzFastResponse holds fastResponse to http.ReadResponse: whatever it
// accepts, net/http reads as the same answer (status, protocol, header,
// length, keep-alive, body); what it declines it leaves unread.
func FuzzFastResponse(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
		"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nx-a: 1\r\nX-A: 2\r\n\r\n",
		"HTTP/1.1 404\r\nContent-Length: 3\r\n\r\nabc",
		"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab",
		"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
		"HTTP/1.1 200 OK\r\nX:  a b \t\r\nContent-Length: 1\r\n\r\nx",
		"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		req, _ := http.NewRequest(http.MethodPost, "http://replica/", nil)
		br := bufio.NewReaderSize(bytes.NewReader(data), 4096)
		_, _ = br.Peek(1)
		before := br.Buffered()
		got := fastResponse(br, req)
		if got == nil {
			if br.Buffered() != before {
				t.Fatal("a declined answer was consumed")
			}
			return
		}
		if got.ContentLength > 0 {
			got.Body = &fixedBody{br: br, left: got.ContentLength}
		}
		gotBody, gotErr := io.ReadAll(got.Body)
		want, err := http.ReadResponse(bufio.NewReader(bytes.NewReader(data)), req)
		if err != nil {
			t.Fatalf("accepted what net/http refuses: %v", err)
		}
		wantBody, wantErr := io.ReadAll(want.Body)
		if got.StatusCode != want.StatusCode || got.Status != want.Status || got.Proto != want.Proto ||
			got.ContentLength != want.ContentLength || got.Close != want.Close || len(want.TransferEncoding) > 0 {
			t.Fatalf("answer %d %q %s len %d close %v; net/http %d %q %s len %d close %v te %v", got.StatusCode, got.Status,
				got.Proto, got.ContentLength, got.Close, want.StatusCode, want.Status, want.Proto, want.ContentLength, want.Close,
				want.TransferEncoding)
		}
		if !reflect.DeepEqual(got.Header, want.Header) {
			t.Fatalf("header %q; net/http %q", got.Header, want.Header)
		}
		if !bytes.Equal(gotBody, wantBody) || (gotErr == nil) != (wantErr == nil) {
			t.Fatalf("body %q (%v); net/http %q (%v)", gotBody, gotErr, wantBody, wantErr)
		}
	})
}
