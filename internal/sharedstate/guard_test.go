package sharedstate

import (
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"

	"pgregory.net/rapid"
)

// respItem draws a RESP2/RESP3 reply: nested aggregates of strings,
// integers, nulls, errors; it returns the encoding and its longest string.
func respItem(t *rapid.T, depth int) (string, int64) {
	kinds := []string{"bulk", "simple", "int", "null", "verbatim", "bulkerr", "err", "double", "bool"}
	if depth < 3 {
		kinds = append(kinds, "array", "map", "set", "push")
	}
	switch k := rapid.SampledFrom(kinds).Draw(t, "kind"); k {
	case "bulk", "verbatim", "bulkerr":
		body := rapid.StringMatching(`[\x00-\xff]{0,40}`).Draw(t, "body") // CR, LF, '$' and '*' inside
		typ := map[string]string{"bulk": "$", "verbatim": "=", "bulkerr": "!"}[k]
		return fmt.Sprintf("%s%d\r\n%s\r\n", typ, len(body), body), int64(len(body))
	case "simple":
		return "+OK\r\n", 0
	case "int":
		return fmt.Sprintf(":%d\r\n", rapid.Int64().Draw(t, "n")), 0
	case "null":
		return rapid.SampledFrom([]string{"$-1\r\n", "*-1\r\n", "_\r\n"}).Draw(t, "null"), 0
	case "err":
		return "-ERR no\r\n", 0
	case "double":
		return ",3.5\r\n", 0
	case "bool":
		return "#t\r\n", 0
	default:
		n := rapid.IntRange(0, 4).Draw(t, "len")
		typ := map[string]string{"array": "*", "map": "%", "set": "~", "push": ">"}[k]
		items := n
		if k == "map" {
			items = 2 * n
		}
		var b strings.Builder
		fmt.Fprintf(&b, "%s%d\r\n", typ, n)
		var largest int64
		for range items {
			s, l := respItem(t, depth+1)
			b.WriteString(s)
			largest = max(largest, l)
		}
		return b.String(), largest
	}
}

// The scanner finds every string's declared length, whatever the replies
// hold and however the bytes are split between reads.
func TestRespScanFindsEveryLength(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		var stream strings.Builder
		var want int64
		for range rapid.IntRange(1, 4).Draw(t, "replies") {
			s, l := respItem(t, 0)
			stream.WriteString(s)
			want = max(want, l)
		}
		p := []byte(stream.String())
		var sc respScan
		sc.newReply()
		wantFirst, wantDone := firstBulk(stream.String())
		var got int64
		for len(p) > 0 {
			n := rapid.IntRange(1, len(p)).Draw(t, "chunk")
			got = max(got, sc.feed(p[:n]))
			p = p[n:]
		}
		if got != want {
			t.Fatalf("largest string %d, want %d in %q", got, want, stream.String())
		}
		if sc.state != scanType {
			t.Fatalf("scanner ends in state %d, not at an item's start", sc.state)
		}
		if first := sc.firstString(); first != wantFirst || sc.done != wantDone {
			t.Fatalf("first string %q (%v), want %q (%v)", first, sc.done, wantFirst, wantDone)
		}
	})
}

// firstBulk is the first string of a RESP stream when at most maxFirst
// bytes, found the slow way: each item parsed by its type.
func firstBulk(s string) (string, bool) {
	for s != "" {
		line, rest, _ := strings.Cut(s, "\r\n")
		switch line[0] {
		case '$', '=', '!':
			var n int
			if _, err := fmt.Sscanf(line[1:], "%d", &n); err != nil || n < 0 {
				s = rest
				continue
			}
			if n > maxFirst {
				return "", false
			}
			return rest[:n], true
		default:
			s = rest
		}
	}
	return "", false
}

// A reply that declares a string over the cap fails at its header: the
// body is never read (here it is never even sent), and every later read
// fails too.
func TestGuardConnRefusesAtTheHeader(t *testing.T) {
	for _, c := range []struct {
		name, reply, first string
	}{
		{"entry", "*1\r\n*2\r\n$15\r\n1700000000000-0\r\n*2\r\n$1\r\nb\r\n$419430400\r\n", "1700000000000-0"},
		{"verbatim", "=1048577\r\n", ""},
		{"total", strings.Repeat("$1000\r\n"+strings.Repeat("x", 1000)+"\r\n", 5), ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			client, server := net.Pipe()
			defer client.Close()
			defer server.Close()
			g := &guardConn{Conn: client, maxString: 1 << 20, maxReply: 4096}
			go func() {
				_, _ = io.ReadAll(server) // the command
			}()
			go func() {
				_, _ = server.Write([]byte(c.reply))
			}()
			if _, err := g.Write([]byte("*1\r\n$4\r\nPING\r\n")); err != nil {
				t.Fatal(err)
			}
			var err error
			buf := make([]byte, 512)
			for read := 0; err == nil && read <= len(c.reply); {
				var n int
				n, err = g.Read(buf)
				read += n
			}
			if !errors.Is(err, errReplyTooLarge) {
				t.Fatalf("err %v", err)
			}
			if _, err := g.Read(buf); !errors.Is(err, errReplyTooLarge) {
				t.Fatalf("a later read: %v", err)
			}
			var big *replyTooLarge
			if !errors.As(err, &big) || big.first != c.first {
				t.Fatalf("the reply's first string %q, want %q", big.first, c.first)
			}
		})
	}
}

// Replies within the caps pass whole, one command after another (each
// write starts a new budget).
func TestGuardConnPassesSmallReplies(t *testing.T) {
	client, server := net.Pipe()
	defer client.Close()
	defer server.Close()
	g := &guardConn{Conn: client, maxString: 16, maxReply: 64}
	reply := "*2\r\n$5\r\nhello\r\n$16\r\n0123456789abcdef\r\n" // 41 bytes
	go func() {
		buf := make([]byte, 64)
		for {
			if _, err := server.Read(buf); err != nil {
				return
			}
			if _, err := server.Write([]byte(reply)); err != nil {
				return
			}
		}
	}()
	for i := range 3 {
		if _, err := g.Write([]byte("*1\r\n$4\r\nPING\r\n")); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(reply))
		if _, err := io.ReadFull(g, got); err != nil || string(got) != reply {
			t.Fatalf("command %d: %q, %v", i, got, err)
		}
	}
}
