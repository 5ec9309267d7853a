package sharedstate

import (
	"errors"
	"fmt"
	"net"
)

// errReplyTooLarge is what a guarded connection's Read returns (as a
// *replyTooLarge) when a reply carries a string over the cap, or more
// bytes in all than the budget: the command fails, go-redis drops the
// connection, and nothing of that size was allocated.
var errReplyTooLarge = errors.New("sharedstate: Redis reply over the size cap")

// replyTooLarge is errReplyTooLarge with the reply's first string when it
// was short and arrived whole before the cap was passed: in an XRANGE
// reply, the first entry's ID, which the reader skips past.
type replyTooLarge struct {
	first  string
	detail string
}

func (e *replyTooLarge) Error() string { return errReplyTooLarge.Error() + ": " + e.detail }
func (e *replyTooLarge) Unwrap() error { return errReplyTooLarge }

// guardConn bounds what one command's reply may hold. go-redis reads a
// bulk string by allocating its declared length and then reading it
// whole: a 400 MiB stream entry costs 400 MiB per reader, and more than a
// command's timeout to arrive, so that the reader retries the same read
// for ever. guardConn scans the RESP2/RESP3 replies as they arrive (a
// small state machine over the type bytes and the declared lengths, never
// the contents) and fails the read at the header of a string longer than
// maxString, before go-redis sees it, and once a reply passes maxReply
// bytes. A command's write starts a new reply budget; go-redis runs one
// command (or one pipeline) at a time on a connection.
type guardConn struct {
	net.Conn
	maxString, maxReply int64

	n    int64 // reply bytes since the last write
	scan respScan
	err  error // once tripped, every later read fails: the stream is out of step
}

func (c *guardConn) Write(p []byte) (int, error) {
	c.n = 0
	c.scan.newReply()
	return c.Conn.Write(p)
}

func (c *guardConn) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.n += int64(n)
		l := c.scan.feed(p[:n])
		if c.n > c.maxReply {
			c.err = &replyTooLarge{first: c.scan.firstString(), detail: fmt.Sprintf("more than %d bytes", c.maxReply)}
		} else if l > c.maxString {
			c.err = &replyTooLarge{first: c.scan.firstString(), detail: fmt.Sprintf("a string of %d bytes, the cap is %d", l, c.maxString)}
		}
		if c.err != nil {
			return 0, c.err
		}
	}
	return n, err
}

// respScan follows a RESP byte stream: each item starts with a type byte
// and a line; strings with a length ('$' bulk, '=' verbatim, '!' bulk
// error) carry that many bytes and a CRLF after it. Aggregates are just
// their header line. It needs no stack: only where the next type byte is.
type respScan struct {
	state int   // scanType, scanLine, scanLen, scanBody
	typ   byte  // the current item's type
	num   int64 // the declared length being read
	neg   bool
	left  int64 // body bytes (and CRLF) still to skip

	// The reply's first string, kept when short (maxFirst).
	seen      bool // a string header was read in this reply
	capturing bool
	first     []byte
	done      bool // first is whole
}

// maxFirst bounds the first string kept: a stream ID is at most 41 bytes.
const maxFirst = 64

// newReply starts a command's reply: its first string is yet to come.
func (s *respScan) newReply() {
	s.seen, s.capturing, s.done = false, false, false
	s.first = s.first[:0]
}

// firstString is the reply's first string if it was short and whole.
func (s *respScan) firstString() string {
	if !s.done {
		return ""
	}
	return string(s.first)
}

const (
	scanType = iota
	scanLine
	scanLen
	scanBody
)

// feed scans p and returns the largest string length declared in it (0
// when none; once over the caller's cap the connection is dropped, so the
// scanner's state after it does not matter).
func (s *respScan) feed(p []byte) int64 {
	var largest int64
	for i := 0; i < len(p); i++ {
		b := p[i]
		switch s.state {
		case scanType:
			s.typ = b
			if b == '$' || b == '=' || b == '!' {
				s.state, s.num, s.neg = scanLen, 0, false
			} else {
				s.state = scanLine
			}
		case scanLine:
			if b == '\n' {
				s.state = scanType
			}
		case scanLen:
			switch {
			case b >= '0' && b <= '9':
				if s.num < 1<<50 { // beyond any cap; no overflow
					s.num = 10*s.num + int64(b-'0')
				}
			case b == '-':
				s.neg = true // $-1: the RESP2 null
			case b == '\n':
				if s.neg {
					s.state = scanType
					continue
				}
				largest = max(largest, s.num)
				s.state, s.left = scanBody, s.num+2
				if !s.seen {
					s.seen, s.capturing = true, s.num <= maxFirst
				}
			}
		case scanBody:
			skip := min(s.left, int64(len(p)-i))
			if s.capturing {
				s.capture(p[i : i+int(skip)])
			}
			s.left -= skip
			i += int(skip) - 1
			if s.left == 0 {
				s.state = scanType
			}
		}
	}
	return largest
}

// capture keeps the body bytes of the first string (not its CRLF).
func (s *respScan) capture(b []byte) {
	body := int(s.left) - 2 // body bytes still to come before b
	s.first = append(s.first, b[:max(min(len(b), body), 0)]...)
	if int64(len(b)) >= s.left-2 {
		s.capturing, s.done = false, true
	}
}
