package kvzmq

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/go-zeromq/zmq4"

	"github.com/kvgate/kvgate/internal/kvevents"
)

// zmtpStream is a greeting followed by the given frames, each written with
// its flags and a short or long size as ZMTP does.
func zmtpStream(frames ...[]byte) []byte {
	out := make([]byte, greetingLen)
	for i, f := range frames {
		var flags byte
		if i < len(frames)-1 {
			flags = flagMore
		}
		if len(f) > 255 {
			out = append(out, flags|flagLong)
			out = binary.BigEndian.AppendUint64(out, uint64(len(f)))
		} else {
			out = append(out, flags, byte(len(f)))
		}
		out = append(out, f...)
	}
	return out
}

// testLimits are the default batch limits.
var testLimits = batchLimits(0)

// scanChunks feeds b to a fresh guard in chunks of n bytes.
func scanChunks(b []byte, n int) error {
	g := newFrameGuard(nil, testLimits)
	for len(b) > 0 {
		k := min(n, len(b))
		if err := g.scan(b[:k]); err != nil {
			return err
		}
		b = b[k:]
	}
	return nil
}

func TestFrameGuard(t *testing.T) {
	big := make([]byte, 300)
	ok := append(zmtpStream([]byte("topic"), kvevents.SeqFrame(7), big), zmtpStream(nil)[greetingLen:]...)
	longHdr := func(size uint64) []byte {
		return binary.BigEndian.AppendUint64(append(make([]byte, greetingLen), flagLong), size)
	}
	many := make([][]byte, maxMessageParts+1)
	tests := []struct {
		name   string
		stream []byte
		fail   bool
	}{
		{"three-frames-then-empty", ok, false},
		{"huge-frame", longHdr(1 << 40), true},
		{"frame-at-limit", longHdr(DefaultMaxFrameBytes), false},
		{"frame-over-limit", longHdr(DefaultMaxFrameBytes + 1), true},
		{"too-many-parts", zmtpStream(many...), true},
		{"parts-at-limit", zmtpStream(many[1:]...), false},
	}
	for _, tc := range tests {
		for _, n := range []int{1, 2, 7, 64, 1 << 20} {
			err := scanChunks(tc.stream, n)
			if (err != nil) != tc.fail || (err != nil && (!errors.Is(err, ErrPeer) || !errors.Is(err, ErrFrameSize))) {
				t.Errorf("%s in chunks of %d: %v", tc.name, n, err)
			}
		}
	}
	// The message size counts across frames and starts over per message.
	half := longHdr(testLimits.message / 2)
	half[greetingLen] |= flagMore
	g := newFrameGuard(nil, testLimits)
	if err := g.scan(half); err != nil {
		t.Fatal(err)
	}
	g.body = 0 // as if the body had passed
	hdr := binary.BigEndian.AppendUint64([]byte{flagLong}, testLimits.message/2+1)
	if err := g.scan(hdr); !errors.Is(err, ErrPeer) {
		t.Errorf("message over the limit: %v", err)
	}
}

// TestPublisherSurvivesMisbehavingPeers: the bound PUB socket and the replay
// socket accept anyone, so a bad peer must not crash or exhaust them.
func TestPublisherSurvivesMisbehavingPeers(t *testing.T) {
	p := startReplayPublisher(t, PublisherOptions{})
	for _, addr := range []string{p.Addr().String(), p.ReplayAddr().String()} {
		if _, _, err := dialZMTP(t, addr, zmq4.SocketType("BOGUS")); err == nil {
			t.Fatal("handshake as BOGUS succeeded")
		}
	}
	conn, _, err := dialZMTP(t, p.ReplayAddr().String(), zmq4.Dealer)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Write(binary.BigEndian.AppendUint64([]byte{flagLong}, 1<<40)); err != nil {
		t.Fatal(err)
	}
	readUntilClosed(t, conn)
	publishN(t, p, 0, 2)
	msgs, res := collectReplay(t, replayEndpointOf(p), 0)
	checkReplay(t, msgs, res, 0, 1)
}
