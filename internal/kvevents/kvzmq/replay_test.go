package kvzmq

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvgate/kvgate/internal/kvevents"
)

func startReplayPublisher(t *testing.T, o PublisherOptions) *zmqPublisher {
	t.Helper()
	o.ReplayEndpoint = "tcp://127.0.0.1:0"
	p, err := newPublisher(t.Context(), "tcp://127.0.0.1:0", o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func replayEndpointOf(p *zmqPublisher) string { return "tcp://" + p.ReplayAddr().String() }

// collectReplay replays from seq from and returns what fn saw.
func collectReplay(t *testing.T, endpoint string, from uint64) ([]kvevents.Message, ReplayResult) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	var msgs []kvevents.Message
	res, err := Replay(ctx, endpoint, from, func(m kvevents.Message) { msgs = append(msgs, m) })
	if err != nil {
		t.Fatalf("Replay(%d): %v", from, err)
	}
	return msgs, res
}

func checkReplay(t *testing.T, msgs []kvevents.Message, res ReplayResult, want ...int) {
	t.Helper()
	if len(msgs) != len(want) || res.Batches != len(want) || res.Dropped != 0 {
		t.Fatalf("%d messages, result %+v; want seqs %v", len(msgs), res, want)
	}
	for i, m := range msgs {
		if m.Seq != uint64(want[i]) || !sameBatch(m.Batch, testBatch(want[i])) {
			t.Fatalf("message %d: seq %d %s, want seq %d", i, m.Seq, dump(m.Batch), want[i])
		}
	}
	if len(want) > 0 && (res.First != uint64(want[0]) || res.Last != uint64(want[len(want)-1])) {
		t.Errorf("result %+v, want first %d last %d", res, want[0], want[len(want)-1])
	}
}

func TestReplay(t *testing.T) {
	p := startReplayPublisher(t, PublisherOptions{Topic: "kv"})
	if p.ReplayAddr() == nil {
		t.Fatal("no replay address")
	}
	publishN(t, p, 0, 5) // no subscriber: the buffer fills anyway
	msgs, res := collectReplay(t, replayEndpointOf(p), 0)
	checkReplay(t, msgs, res, 0, 1, 2, 3, 4)
	if msgs[0].Topic != "" {
		t.Errorf("3-frame replies carry no topic, got %q", msgs[0].Topic)
	}
	msgs, res = collectReplay(t, replayEndpointOf(p), 3)
	checkReplay(t, msgs, res, 3, 4)
	msgs, res = collectReplay(t, replayEndpointOf(p), 5)
	checkReplay(t, msgs, res)
}

func TestReplayBufferKeepsTheLatest(t *testing.T) {
	p := startReplayPublisher(t, PublisherOptions{Buffer: 3, Form: kvevents.FormArray})
	publishN(t, p, 0, 5)
	msgs, res := collectReplay(t, replayEndpointOf(p), 0)
	checkReplay(t, msgs, res, 2, 3, 4)
	// The ring wraps more than once.
	publishN(t, p, 5, 4)
	msgs, res = collectReplay(t, replayEndpointOf(p), 0)
	checkReplay(t, msgs, res, 6, 7, 8)
}

func TestReplayFirstSeq(t *testing.T) {
	p := startReplayPublisher(t, PublisherOptions{FirstSeq: 1})
	for i := 1; i <= 3; i++ {
		publishN(t, p, i, 1)
	}
	msgs, res := collectReplay(t, replayEndpointOf(p), 0)
	checkReplay(t, msgs, res, 1, 2, 3)
}

// TestReplayWhilePublishing runs replays against a publisher in use; each
// sees a consecutive run of batches.
func TestReplayWhilePublishing(t *testing.T) {
	p := startReplayPublisher(t, PublisherOptions{Buffer: 50})
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := range 300 {
			if err := p.Publish(testBatch(i)); err != nil {
				t.Error(err)
				return
			}
		}
	})
	for range 5 {
		msgs, res := collectReplay(t, replayEndpointOf(p), 0)
		for i := 1; i < len(msgs); i++ {
			if msgs[i].Seq != msgs[i-1].Seq+1 {
				t.Fatalf("replay %+v: seq %d after %d", res, msgs[i].Seq, msgs[i-1].Seq)
			}
		}
	}
	wg.Wait()
}

// TestReplayServerProtocol talks to the replay socket as a REQ would and
// checks that a malformed request is ignored.
func TestReplayServerProtocol(t *testing.T) {
	p := startReplayPublisher(t, PublisherOptions{})
	publishN(t, p, 0, 5)
	_, zc, err := dialZMTP(t, p.ReplayAddr().String(), zmq4.Req)
	if err != nil {
		t.Fatal(err)
	}
	send := func(frames ...[]byte) {
		if err := zc.SendMsg(zmq4.NewMsgFrom(frames...)); err != nil {
			t.Fatal(err)
		}
	}
	send([]byte{}, kvevents.SeqFrame(3), []byte("x")) // three frames: ignored
	send([]byte{}, make([]byte, 9))                   // nine-byte seq: ignored
	send([]byte{}, []byte{4})                         // one-byte seq: from 4
	var got []string
	for {
		msg, err := zc.RecvMsg()
		if err != nil {
			t.Fatal(err)
		}
		if len(msg.Frames) != 3 || len(msg.Frames[0]) != 0 || len(msg.Frames[1]) != 8 {
			t.Fatalf("reply frames %q", msg.Frames)
		}
		seq := binary.BigEndian.Uint64(msg.Frames[1])
		got = append(got, fmt.Sprintf("%d:%d", int64(seq), len(msg.Frames[2])))
		if seq == replayEnd {
			break
		}
	}
	if len(got) != 2 || got[0][:2] != "4:" || got[1] != "-1:0" {
		t.Fatalf("replies %v, want seq 4 then the end marker", got)
	}
}

// serveReplayOnce accepts one connection as a ROUTER and runs fn on it; the
// test waits for it.
func serveReplayOnce(t *testing.T, fn func(zc *zmq4.Conn) error) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		conn, err := ln.Accept()
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(waitTimeout))
		zc, err := zmq4.Open(conn, null.Security(), zmq4.Router, nil, true, nil)
		if err == nil {
			err = fn(zc)
		}
		if err != nil {
			t.Error(err)
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		<-done
	})
	return "tcp://" + ln.Addr().String()
}

// expectRequest reads the replay request and checks its start seq.
func expectRequest(zc *zmq4.Conn, from uint64) error {
	msg, err := zc.RecvMsg()
	if err != nil {
		return err
	}
	if len(msg.Frames) != 2 || len(msg.Frames[0]) != 0 || len(msg.Frames[1]) != 8 || binary.BigEndian.Uint64(msg.Frames[1]) != from {
		return fmt.Errorf("request frames %q, want [\"\", %d as 8 bytes]", msg.Frames, from)
	}
	return nil
}

func TestReplayTopicForm(t *testing.T) {
	ep := serveReplayOnce(t, func(zc *zmq4.Conn) error {
		if err := expectRequest(zc, 7); err != nil {
			return err
		}
		for _, i := range []int{7, 8, 9} {
			frames, err := kvevents.EncodeFrames("kv@r@m", uint64(i), testBatch(i), kvevents.FormMap)
			if err != nil {
				return err
			}
			if i == 8 {
				frames[2] = []byte{0xc1} // not msgpack: skipped
			}
			if err := zc.SendMsg(zmq4.NewMsgFrom(append([][]byte{{}}, frames...)...)); err != nil {
				return err
			}
		}
		return zc.SendMsg(zmq4.NewMsgFrom([]byte{}, []byte{}, kvevents.SeqFrame(replayEnd), []byte{}))
	})
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	var msgs []kvevents.Message
	res, err := Replay(ctx, ep, 7, func(m kvevents.Message) { msgs = append(msgs, m) })
	if err != nil {
		t.Fatal(err)
	}
	if res != (ReplayResult{Batches: 2, Dropped: 1, First: 7, Last: 9}) || len(msgs) != 2 {
		t.Fatalf("result %+v, %d messages", res, len(msgs))
	}
	for i, want := range []int{7, 9} {
		if m := msgs[i]; m.Topic != "kv@r@m" || m.Seq != uint64(want) || !sameBatch(m.Batch, testBatch(want)) {
			t.Errorf("message %d: topic %q seq %d", i, m.Topic, m.Seq)
		}
	}
}

func TestReplayGivesUpOnEndlessServer(t *testing.T) {
	ep := serveReplayOnce(t, func(zc *zmq4.Conn) error {
		if err := expectRequest(zc, 0); err != nil {
			return err
		}
		for i := range 4 { // never the end marker
			frames, err := kvevents.EncodeFrames("", uint64(i), testBatch(i), kvevents.FormMap)
			if err != nil {
				return err
			}
			if err := zc.SendMsg(zmq4.NewMsgFrom(append([][]byte{{}}, frames[1:]...)...)); err != nil {
				return err
			}
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(t.Context(), waitTimeout)
	defer cancel()
	res, err := ReplayWithOptions(ctx, ep, 0, func(kvevents.Message) {}, ReplayOptions{maxBatches: 3})
	if !errors.Is(err, ErrReplayTooLong) || res.Batches != 4 {
		t.Fatalf("result %+v, error %v", res, err)
	}
}

func TestReplayHonoursContext(t *testing.T) {
	// A server that accepts and never speaks, and one that handshakes and
	// never answers the request.
	silent := func(t *testing.T) string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			defer conn.Close()
			_ = conn.SetReadDeadline(time.Now().Add(waitTimeout))
			_, _ = io.Copy(io.Discard, conn) // until the client hangs up
		}()
		t.Cleanup(func() {
			_ = ln.Close()
			<-done
		})
		return "tcp://" + ln.Addr().String()
	}
	mute := func(t *testing.T) string {
		return serveReplayOnce(t, func(zc *zmq4.Conn) error {
			_, _ = zc.RecvMsg() // the request; then nothing until the client hangs up
			_, _ = zc.RecvMsg()
			return nil
		})
	}
	for name, server := range map[string]func(*testing.T) string{"silent": silent, "mute": mute} {
		t.Run(name, func(t *testing.T) {
			ep := server(t)
			ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
			defer cancel()
			start := time.Now()
			_, err := Replay(ctx, ep, 0, func(kvevents.Message) {})
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("error %v, want the context's deadline", err)
			}
			if d := time.Since(start); d > handshakeTimeout/2 {
				t.Errorf("Replay returned after %v", d)
			}
		})
	}
}

func TestReplayErrors(t *testing.T) {
	if _, err := Replay(t.Context(), "tcp://127.0.0.1:1", 0, nil); !errors.Is(err, ErrNilHandler) {
		t.Errorf("nil fn: %v", err)
	}
	if _, err := Replay(t.Context(), "tcp://*:5558", 0, func(kvevents.Message) {}); !errors.Is(err, ErrEndpoint) {
		t.Errorf("star host: %v", err)
	}
	// A listener is a SUB socket: a DEALER is not compatible with it.
	s := newSink()
	l := startListener(t, t.Context(), "tcp://127.0.0.1:0", s, ListenOptions{})
	if _, err := Replay(t.Context(), listenerEndpoint(l), 0, func(kvevents.Message) {}); !errors.Is(err, ErrConnection) {
		t.Errorf("replay from a SUB socket: %v", err)
	}
	// No replay socket configured.
	p := startPublisher(t, t.Context(), "tcp://127.0.0.1:0", "", kvevents.FormMap)
	if p.ReplayAddr() != nil {
		t.Errorf("ReplayAddr() = %v without a replay endpoint", p.ReplayAddr())
	}
	if _, err := NewPublisher(t.Context(), "tcp://127.0.0.1:0", PublisherOptions{ReplayEndpoint: "tcp://" + p.Addr().String()}); err == nil {
		t.Error("replay endpoint on a port in use: no error")
	}
}
