package chaos

import (
	"context"
	"math/rand/v2"
	"net"
	"net/http"
	"sync/atomic"
	"time"
)

// behaviour is what a client does with one request.
type behaviour int

const (
	ordinary  behaviour = iota
	hangUp              // streams, and closes the stream at its first token
	slowRead            // streams a long answer and stops reading it at its first token
	overflow            // asks for max_tokens 2^63−1: the answer must be a clear 400
	poison              // carries the query of death
	onAdapter           // asks for the LoRA adapter only one replica serves
)

// The client-side scenarios' constants.
const (
	// slowTokens is a slow reader's answer length: a few hundred KiB of SSE,
	// more than the socket buffers between the gateway and a client that
	// stopped reading hold, so the gateway's writes block.
	slowTokens = 2048
	// slowReadBuffer is a slow reader's socket receive buffer.
	slowReadBuffer = 4 << 10
	// queryOfDeath is the input that crashes the replica reading it.
	queryOfDeath = "QUERY-OF-DEATH-7f3a"
	// chaosAdapter is the LoRA adapter one replica of the hetero fleet serves.
	chaosAdapter = "chaos-lora"
)

// clientPlan is a client-side scenario's mix: which requests misbehave.
// The zero value: every request ordinary.
type clientPlan struct {
	hangUp float64 // share of requests (seeded draws) whose client hangs up at the first token
	slow   int     // requests 0 … slow−1 are slow readers
	// overflowEvery > 0: requests i with i % overflowEvery == overflowEvery/2
	// ask for max_tokens 2^63−1.
	overflowEvery int
	// poison: request poisonAt carries the query of death.
	poison   bool
	poisonAt int
	// adapterEvery > 0: requests i with i % adapterEvery == 0 ask for the adapter.
	adapterEvery int
}

// behaviour is what request i's client does; the hang-up draw is seeded by
// (seed, i), so a request behaves the same in every run.
func (p clientPlan) behaviour(i int, seed uint64) behaviour {
	switch {
	case i < p.slow:
		return slowRead
	case p.poison && i == p.poisonAt:
		return poison
	case p.overflowEvery > 0 && i%p.overflowEvery == p.overflowEvery/2:
		return overflow
	case p.adapterEvery > 0 && i%p.adapterEvery == 0:
		return onAdapter
	case p.hangUp > 0 && rand.New(rand.NewPCG(seed, uint64(i))).Float64() < p.hangUp:
		return hangUp
	}
	return ordinary
}

// countdown opens (closes open) when done has been called n times.
type countdown struct {
	left atomic.Int64
	open chan struct{}
}

func newCountdown(n int) *countdown {
	c := &countdown{open: make(chan struct{})}
	c.left.Store(int64(n))
	if n <= 0 {
		close(c.open)
	}
	return c
}

func (c *countdown) done() {
	if c.left.Add(-1) == 0 {
		close(c.open)
	}
}

// slowTransport is a slow reader's transport: each connection's receive
// buffer is shrunk to slowReadBuffer, so that a stream it stops reading
// pushes back on the gateway within a few KiB.
func slowTransport() *http.Transport {
	d := &net.Dialer{Timeout: 5 * time.Second}
	return &http.Transport{
		Proxy:              nil,
		DisableCompression: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if tc, ok := c.(*net.TCPConn); ok && err == nil {
				_ = tc.SetReadBuffer(slowReadBuffer)
			}
			return c, err
		},
	}
}
