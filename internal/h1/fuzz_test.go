package h1

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
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
