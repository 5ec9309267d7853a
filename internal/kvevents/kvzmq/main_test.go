package kvzmq

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// zmq4 v0.17's own PUB socket (used only by the interop test, as an
		// independent peer for our Subscriber) starts pubMWriter.run, which
		// its Close never stops. Our publisher does not use it.
		goleak.IgnoreAnyFunction("github.com/go-zeromq/zmq4.(*pubMWriter).run"),
	)
}
