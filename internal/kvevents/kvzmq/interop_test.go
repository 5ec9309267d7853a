package kvzmq

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvgate/kvgate/internal/kvevents"
)

// The publisher and subscriber here speak ZMTP through zmq4's connection
// layer; these tests check them against zmq4's own socket implementations,
// an independent PUB and SUB.

func TestInteropZMQ4SubReceivesOurPublisher(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	p := startPublisher(t, ctx, "tcp://127.0.0.1:0", "kv@r0@m", kvevents.FormMap)

	sub := zmq4.NewSub(ctx, zmq4.WithDialerMaxRetries(0))
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	if err := sub.Dial(endpointOf(p)); err != nil {
		t.Fatal(err)
	}
	// zmq4's Recv blocks without a timeout: read on a goroutine, forward on
	// a channel large enough that the reader never waits.
	got := make(chan zmq4.Msg, 4096)
	readerDone := make(chan struct{})
	go func() {
		defer close(readerDone)
		for {
			msg, err := sub.Recv()
			if err != nil {
				return
			}
			select {
			case got <- msg:
			default:
			}
		}
	}()
	defer func() {
		cancel()
		_ = sub.Close()
		<-readerDone
	}()

	// Slow joiner: publish until one arrives, then one more to check.
	deadline := time.After(waitTimeout)
	var first kvevents.Message
wait:
	for i := 0; ; i++ {
		if i >= 2000 {
			t.Fatal("nothing arrived")
		}
		if err := p.Publish(testBatch(i)); err != nil {
			t.Fatal(err)
		}
		select {
		case msg := <-got:
			m, err := kvevents.DecodeFrames(msg.Frames)
			if err != nil {
				t.Fatal(err)
			}
			first = m
			break wait
		case <-time.After(5 * time.Millisecond):
		case <-deadline:
			t.Fatal("nothing arrived")
		}
	}
	if first.Topic != "kv@r0@m" || !sameBatch(first.Batch, testBatch(int(first.Seq))) {
		t.Fatalf("zmq4 SUB got %+v", first)
	}
}

func TestInteropOurSubscriberReceivesZMQ4Pub(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	pub := zmq4.NewPub(ctx)
	defer pub.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	s := newSink()
	startSubscriber(t, ctx, "tcp://"+pub.Addr().String(), "kv", s)

	var seq uint64
	publish := func(b kvevents.Batch) error {
		frames, err := kvevents.EncodeFrames("kv@r1@m", seq, b, kvevents.FormArray)
		if err != nil {
			return err
		}
		seq++
		return pub.Send(zmq4.NewMsgFrom(frames...))
	}
	warmUp(t, publish, s)
	for i := range 20 {
		if err := publish(testBatch(i)); err != nil {
			t.Fatal(err)
		}
	}
	s.waitUntil(t, "20 batches from zmq4's PUB", func(msgs []kvevents.Message, _ [][2]uint64, _ []error) bool {
		return len(msgs) > 0 && msgs[len(msgs)-1].Seq == seq-1
	})
	msgs, gaps, errs := s.snapshot()
	if len(gaps) != 0 {
		t.Errorf("gaps %v", gaps)
	}
	for _, err := range errs {
		if !errors.Is(err, ErrConnection) {
			t.Errorf("error %v", err)
		}
	}
	last := msgs[len(msgs)-20:]
	for i, m := range last {
		if !sameBatch(m.Batch, testBatch(i)) || m.Topic != "kv@r1@m" {
			t.Fatalf("message %d: %s", i, dump(m.Batch))
		}
	}
}
