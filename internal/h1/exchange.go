package h1

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"strings"
	"sync/atomic"
)

var (
	errHeaderTooLarge = errors.New("h1: response header larger than the limit")
	errTooMany1xx     = errors.New("h1: too many 1xx responses")
	errSwitching      = errors.New("h1: 101 Switching Protocols to a request that asked no upgrade")
	errReadClosed     = errors.New("h1: read on closed response body")
	errShortBody      = errors.New("h1: request body shorter than its Content-Length")
)

// max1xx bounds the informational responses skipped before the final one
// (net/http's own bound).
const max1xx = 5

// nothingWritten is a write error before any byte of the request reached
// the connection; noResponse a read error before any byte of the
// response came. On a reused connection both mean the replica closed it
// while it sat idle.
type nothingWritten struct{ error }
type noResponse struct{ error }

func (e nothingWritten) Unwrap() error { return e.error }
func (e noResponse) Unwrap() error     { return e.error }

// retryable: the failed exchange on a reused connection may be sent again
// on a new one. A request that was written is sent again only if it is
// idempotent (its replica may have started on it), as net/http does.
func retryable(req *http.Request, err error) bool {
	var nw nothingWritten
	if errors.As(err, &nw) {
		return true
	}
	var nr noResponse
	if !errors.As(err, &nr) {
		return false
	}
	switch req.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return req.Header.Get("Idempotency-Key") != "" || req.Header.Get("X-Idempotency-Key") != ""
}

// roundTrip sends req on c and reads the response's header. The
// context's end aborts the exchange (the connection's deadline), until
// the body is read or closed. On error c is closed.
func (c *conn) roundTrip(ctx context.Context, req *http.Request, maxHeader int64) (*http.Response, error) {
	stop := context.AfterFunc(ctx, c.abort)
	trace := httptrace.ContextClientTrace(ctx)
	err := c.writeRequest(req)
	if trace != nil && trace.WroteRequest != nil {
		trace.WroteRequest(httptrace.WroteRequestInfo{Err: err})
	}
	var resp *http.Response
	if err == nil {
		resp, err = c.readResponse(req, trace, maxHeader)
	}
	if err != nil {
		stop()
		_ = c.nc.Close()
		return nil, err
	}
	b := &body{c: c, rc: resp.Body, ctx: ctx, stop: stop, keep: !resp.Close && !req.Close}
	if resp.Body == http.NoBody {
		b.finish(true) // nothing to read: the connection is free now
		return resp, nil
	}
	resp.Body = b
	return resp, nil
}

// countWriter counts the bytes that reached the connection.
type countWriter struct {
	c *conn
	n int64
}

func (w *countWriter) Write(b []byte) (int, error) {
	n, err := w.c.nc.Write(b)
	w.n += int64(n)
	return n, err
}

// writeRequest writes req's request line, header and body, and flushes.
// The body is closed whatever happens, as net/http's transport does.
func (c *conn) writeRequest(req *http.Request) error {
	err := c.writeHead(req)
	if err == nil && req.Body != nil && req.Body != http.NoBody {
		c.body = io.LimitedReader{R: req.Body, N: req.ContentLength} // io.CopyN without its allocation
		var n int64
		n, err = c.bw.ReadFrom(&c.body)
		c.body.R = nil
		if err == nil && n < req.ContentLength {
			err = errShortBody
		}
	}
	closeBody(req)
	if err == nil {
		err = c.bw.Flush()
	}
	if err != nil && c.out.n == 0 {
		return nothingWritten{err}
	}
	return err
}

// writeHead writes the request line and the header. Names and values are
// checked as net/http checks them: a bad one fails the request before any
// byte is written.
func (c *conn) writeHead(req *http.Request) error {
	c.out.n = 0
	host := req.Host
	if host == "" {
		host = req.URL.Host
	}
	uri := req.URL.RequestURI()
	if !validValue(host) || !validURI(uri) || !validMethod(req.Method) {
		return fmt.Errorf("h1: invalid request line or host %q", host)
	}
	w := c.bw
	_, _ = w.WriteString(req.Method)
	_ = w.WriteByte(' ')
	_, _ = w.WriteString(uri)
	_, _ = w.WriteString(" HTTP/1.1\r\nHost: ")
	_, _ = w.WriteString(host)
	_, _ = w.WriteString("\r\n")
	if ua, ok := req.Header["User-Agent"]; !ok {
		_, _ = w.WriteString("User-Agent: Go-http-client/1.1\r\n")
	} else if len(ua) > 0 && ua[0] != "" {
		if err := writeField(w, "User-Agent", ua[0]); err != nil {
			return err
		}
	}
	if n := bodyLength(req); n > 0 || n == 0 && needsLength(req.Method) {
		_, _ = w.WriteString("Content-Length: ")
		var buf [20]byte
		_, _ = w.Write(strconv.AppendInt(buf[:0], n, 10))
		_, _ = w.WriteString("\r\n")
	}
	if req.Close && !hasToken(req.Header["Connection"], "close") {
		_, _ = w.WriteString("Connection: close\r\n")
	}
	for k, vs := range req.Header {
		if excluded(k) {
			continue
		}
		for _, v := range vs {
			if err := writeField(w, k, v); err != nil {
				return err
			}
		}
	}
	_, err := w.WriteString("\r\n")
	return err
}

func bodyLength(req *http.Request) int64 {
	if req.Body == nil || req.Body == http.NoBody {
		return 0
	}
	return req.ContentLength
}

// needsLength: methods whose empty body is still announced (net/http
// sends "Content-Length: 0" for them).
func needsLength(m string) bool {
	return m == http.MethodPost || m == http.MethodPut || m == http.MethodPatch
}

// excluded: header fields the transport writes itself (net/http's
// reqWriteExcludeHeader).
func excluded(k string) bool {
	switch k {
	case "Host", "User-Agent", "Content-Length", "Transfer-Encoding", "Trailer":
		return true
	}
	return false
}

func hasToken(vs []string, tok string) bool {
	for _, v := range vs {
		for len(v) > 0 {
			var f string
			f, v, _ = cutComma(v)
			if strings.EqualFold(trimOWS(f), tok) {
				return true
			}
		}
	}
	return false
}

// readResponse reads the final response's header (skipping 1xx ones)
// within maxHeader bytes.
func (c *conn) readResponse(req *http.Request, trace *httptrace.ClientTrace, maxHeader int64) (*http.Response, error) {
	c.lim.n = maxHeader
	if _, err := c.br.Peek(1); err != nil {
		return nil, noResponse{c.headerErr(err)}
	}
	if trace != nil && trace.GotFirstResponseByte != nil {
		trace.GotFirstResponseByte()
	}
	if resp := fastResponse(c.br, req); resp != nil {
		c.lim.n = unlimited
		if resp.ContentLength > 0 {
			c.fixed = fixedBody{br: c.br, left: resp.ContentLength}
			resp.Body = &c.fixed // the connection's: one exchange at a time
		}
		return resp, nil
	}
	for i := 0; ; i++ {
		resp, err := http.ReadResponse(c.br, req)
		if err != nil {
			return nil, c.headerErr(err)
		}
		code := resp.StatusCode
		switch {
		case code == http.StatusSwitchingProtocols:
			return nil, errSwitching
		case code >= 100 && code < 200:
			if i >= max1xx {
				return nil, errTooMany1xx
			}
			if code == http.StatusContinue && trace != nil && trace.Got100Continue != nil {
				trace.Got100Continue()
			}
			continue
		}
		c.lim.n = unlimited
		return resp, nil
	}
}

// headerErr names the header limit when it is what ended a read.
func (c *conn) headerErr(err error) error {
	if c.lim.n <= 0 {
		return errHeaderTooLarge
	}
	return err
}

// body is a lean response's body: read from the connection as the caller
// reads; at its end (io.EOF, all of its framing read) the connection goes
// back to the pool if the exchange allows keep-alive; closed early, or
// after an error or the context's end, the connection is closed.
type body struct {
	c    *conn
	rc   io.ReadCloser
	ctx  context.Context
	stop func() bool
	keep bool
	eof  bool
	done atomic.Bool
}

func (b *body) Read(p []byte) (int, error) {
	if b.eof {
		return 0, io.EOF
	}
	if b.done.Load() {
		return 0, errReadClosed
	}
	n, err := b.rc.Read(p)
	switch {
	case err == io.EOF:
		b.eof = true
		b.finish(true)
	case err != nil:
		b.finish(false)
		if b.ctx.Err() != nil {
			err = context.Cause(b.ctx)
		}
	}
	return n, err
}

// Close ends the exchange; a body not read to its end takes its
// connection with it.
func (b *body) Close() error {
	b.finish(false)
	return nil
}

// finish ends the exchange once: the connection is pooled if the body was
// read cleanly to its end, the context did not fire, nothing unread is
// buffered and the exchange allows keep-alive; else closed.
func (b *body) finish(clean bool) {
	if !b.done.CompareAndSwap(false, true) {
		return
	}
	fired := !b.stop()
	c := b.c
	if clean && !fired && b.keep && c.br.Buffered() == 0 && c.p.put(c) {
		return
	}
	_ = c.nc.Close()
}
