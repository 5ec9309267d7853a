package h1

import (
	"bufio"
	"bytes"
	"io"
	"net/http"
	"net/textproto"
)

// fastResponse reads the header of the common answer without
// net/http's general parser: HTTP/1.1, a three-digit status from 200 to
// 599 but 204 and 304, a header block wholly in br's buffer, well-formed
// "Name: value" lines, one Content-Length, no Transfer-Encoding, Trailer
// or Connection other than keep-alive, to a request other than HEAD. The
// header's values share one string. Anything else answers nil and
// consumes nothing: http.ReadResponse reads it. FuzzFastResponse holds
// the two to the same answer.
func fastResponse(br *bufio.Reader, req *http.Request) *http.Response {
	if req.Method == http.MethodHead {
		return nil
	}
	buf, _ := br.Peek(br.Buffered())
	end := bytes.Index(buf, []byte("\r\n\r\n"))
	if end < 0 || len(buf) < 12 || string(buf[:9]) != "HTTP/1.1 " {
		return nil
	}
	block := string(buf[:end+2]) // every line with its CRLF: the values' one allocation
	line, rest := cutLine(block)
	code, ok := statusCode(line)
	if !ok {
		return nil
	}
	h, length, ok := fastHeader(rest)
	if !ok {
		return nil
	}
	_, _ = br.Discard(end + 4)
	resp := &http.Response{Status: line[9:], StatusCode: code, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: h, ContentLength: length, Request: req, Body: http.NoBody}
	return resp
}

// cutLine cuts s at its first CRLF.
func cutLine(s string) (line, rest string) {
	for i := 0; i+1 < len(s); i++ {
		if s[i] == '\r' && s[i+1] == '\n' {
			return s[:i], s[i+2:]
		}
	}
	return s, ""
}

// statusCode reads "HTTP/1.1 NNN[ reason]" for NNN in [200, 599], not
// 204 or 304 (no body, whatever the header says).
func statusCode(line string) (int, bool) {
	if len(line) < 12 || line[12:] != "" && line[12] != ' ' {
		return 0, false
	}
	code := 0
	for _, c := range []byte(line[9:12]) {
		if c < '0' || c > '9' {
			return 0, false
		}
		code = code*10 + int(c-'0')
	}
	if code < 200 || code > 599 || code == 204 || code == 304 {
		return 0, false
	}
	for i := 12; i < len(line); i++ {
		if b := line[i]; b < ' ' && b != '\t' || b == 0x7f {
			return 0, false
		}
	}
	return code, true
}

// fastHeader reads the header lines (each ending in CRLF) into a header
// whose value slices share one array; length is its one Content-Length.
func fastHeader(lines string) (h http.Header, length int64, ok bool) {
	n := 0
	for i := 0; i+1 < len(lines); i++ {
		if lines[i] == '\r' && lines[i+1] == '\n' {
			n++
		}
	}
	h = make(http.Header, n)
	vals := make([]string, n)
	length = -1
	for i := 0; lines != ""; i++ {
		if i >= n {
			return nil, 0, false // not reached: every line ends in the CRLF counted
		}
		var line string
		line, lines = cutLine(lines)
		k, v, found := cutColon(line)
		if !found || !validName(k) || !validValue(v) {
			return nil, 0, false
		}
		k = textproto.CanonicalMIMEHeaderKey(k)
		v = trimOWS(v)
		switch k {
		case "Content-Length":
			if length >= 0 {
				return nil, 0, false
			}
			if length, ok = digits(v); !ok {
				return nil, 0, false
			}
		case "Transfer-Encoding", "Trailer":
			return nil, 0, false
		case "Connection":
			if !asciiFold(v, "keep-alive") {
				return nil, 0, false
			}
		}
		vals[i] = v
		if prior, dup := h[k]; dup {
			h[k] = append(prior, v) // capacity 1: a copy, never the next value's slot
			continue
		}
		h[k] = vals[i : i+1 : i+1]
	}
	return h, length, length >= 0
}

func cutColon(line string) (k, v string, ok bool) {
	for i := 0; i < len(line); i++ {
		if line[i] == ':' {
			return line[:i], line[i+1:], true
		}
	}
	return "", "", false
}

// digits reads a Content-Length: decimal digits only, at most 18 (no
// overflow).
func digits(v string) (int64, bool) {
	if v == "" || len(v) > 18 {
		return 0, false
	}
	var n int64
	for _, c := range []byte(v) {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + int64(c-'0')
	}
	return n, true
}

func asciiFold(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := 0; i < len(a); i++ {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// fixedBody is a Content-Length body read from the connection's reader:
// io.EOF comes with its last bytes (so that the connection is pooled
// without another read), io.ErrUnexpectedEOF when the replica closes
// before the end.
type fixedBody struct {
	br   *bufio.Reader
	left int64
}

func (f *fixedBody) Read(p []byte) (int, error) {
	if f.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > f.left {
		p = p[:f.left]
	}
	n, err := f.br.Read(p)
	f.left -= int64(n)
	switch {
	case f.left == 0:
		return n, io.EOF
	case err == io.EOF:
		return n, io.ErrUnexpectedEOF
	}
	return n, err
}

func (f *fixedBody) Close() error { return nil }
