package sharedstate

import (
	"errors"
	"fmt"
	"net"
)

// errReplyTooLarge is what a guarded connection's Read returns when a
// reply carries a string over the cap, or more bytes in all than the
// budget: the command fails, go-redis drops the connection, and nothing of
// that size was allocated.
var errReplyTooLarge = errors.New("sharedstate: Redis reply over the size cap")

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
	return c.Conn.Write(p)
}

func (c *guardConn) Read(p []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.n += int64(n)
		if c.n > c.maxReply {
			c.err = fmt.Errorf("%w: more than %d bytes", errReplyTooLarge, c.maxReply)
		} else if l := c.scan.feed(p[:n]); l > c.maxString {
			c.err = fmt.Errorf("%w: a string of %d bytes, the cap is %d", errReplyTooLarge, l, c.maxString)
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
			}
		case scanBody:
			skip := min(s.left, int64(len(p)-i))
			s.left -= skip
			i += int(skip) - 1
			if s.left == 0 {
				s.state = scanType
			}
		}
	}
	return largest
}
