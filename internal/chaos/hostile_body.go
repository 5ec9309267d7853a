package chaos

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
)

// The request-body door (finding 4): uploads that declare 8 MiB and
// trickle 100 bytes every 2 s.
const (
	trickles       = 40      // per gateway, half from 127.0.0.1 and half from 127.0.0.2
	trickleDeclare = 8 << 20 // the Content-Length each declares
	trickleBytes   = 100     // each write
	trickleEvery   = 2 * time.Second
	// trickleShape is the time the red team's shape is drawn at: a
	// HostileFor shorter than this scales the trickle's period and the
	// gateway's rate grace down, and its minimum rate up, by as much.
	trickleShape = 30 * time.Second
	// ordinaryPad makes an ordinary request's body about 1 KB.
	ordinaryPad = 600
)

// trickleScale is the factor of the scenario's timings: 1 at trickleShape
// or longer, at least 0.1 (a grace of 0.5 s: a loaded machine still sends
// a 1 KB body well within it).
func trickleScale(d time.Duration) float64 {
	return min(max(float64(d)/float64(trickleShape), 0.1), 1)
}

// trickleTally counts what the tricklers met.
type trickleTally struct {
	mu                      sync.Mutex
	opened, cut408, cutElse int
	sent                    int64
}

func (t *trickleTally) add(f func()) {
	t.mu.Lock()
	f()
	t.mu.Unlock()
}

// trickle opens uploads from `from` to addr one after another until ctx
// ends (each ends when the gateway answers or closes it), at most rounds.
func (t *trickleTally) trickle(ctx context.Context, addr, from, key string, every time.Duration, rounds int) {
	for range rounds {
		if ctx.Err() != nil {
			return
		}
		t.upload(ctx, addr, from, key, every)
	}
}

// upload is one trickling upload: headers declaring trickleDeclare bytes,
// then trickleBytes every `every` until the gateway answers (408: cut for
// its rate) or closes the connection, or ctx ends.
func (t *trickleTally) upload(ctx context.Context, addr, from, key string, every time.Duration) {
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}, Timeout: 5 * time.Second}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return
	}
	defer conn.Close()
	auth := ""
	if key != "" {
		auth = "Authorization: Bearer " + key + "\r\n"
	}
	head := fmt.Sprintf("POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"+
		`{"model":"%s","prompt":"`, addr, trickleDeclare, auth, sim.DefaultModel)
	if _, err := io.WriteString(conn, head); err != nil {
		return
	}
	t.add(func() { t.opened++ })
	answered := make(chan int, 1)
	go func() {
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			answered <- 0
			return
		}
		resp.Body.Close()
		answered <- resp.StatusCode
	}()
	chunk := strings.Repeat("a", trickleBytes)
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case st := <-answered:
			t.add(func() {
				if st == http.StatusRequestTimeout {
					t.cut408++
				} else {
					t.cutElse++
				}
			})
			return
		case <-ctx.Done():
			_ = conn.Close()
			<-answered
			return
		case <-tick.C:
		}
		if _, err := io.WriteString(conn, chunk); err == nil {
			t.add(func() { t.sent += trickleBytes })
		}
	}
}

// bodyPeak samples each gateway's kvgate_request_body_bytes until ctx
// ends and returns the largest seen for each.
func bodyPeak(ctx context.Context, gws []*peerGateway, rounds int) func() []float64 {
	top := make([]float64, len(gws))
	done := make(chan struct{})
	go func() {
		defer close(done)
		every(ctx, 10*time.Millisecond, rounds, func() bool {
			for i, pg := range gws {
				top[i] = max(top[i], metricSum(pg.reg, "kvgate_request_body_bytes"))
			}
			return true
		})
	}()
	return func() []float64 {
		<-done
		return top
	}
}

// runTrickle: three replicas, a gateway without API keys and one with
// them (its key known to the attacker, as to any tenant). Against each,
// 40 uploads declare 8 MiB and trickle 100 bytes every 2 s, opening a new
// one each time the gateway ends one, while ordinary 1 KB requests use
// both gateways. The body memory the gateways hold stays below one
// declared body, and the ordinary p99 is at most a second (make chaos).
func runTrickle(ctx context.Context, e *peerEnv, res *Result) error {
	p := res.Peers
	s := trickleScale(e.o.HostileFor)
	every := time.Duration(float64(trickleEvery) * s)
	grace := gateway.Duration(float64(5*time.Second) * s)
	p.Attack = fmt.Sprintf("%d uploads per gateway (from 127.0.0.1 and 127.0.0.2) declare %d MiB and send %d bytes every %v, "+
		"a new one as each ends; body_rate_grace %v, min_body_rate %d B/s (the defaults scaled by %.2f)",
		trickles, trickleDeclare>>20, trickleBytes, every, grace.D(), int64(1024/s), s)
	if _, err := e.startSims(ctx, sim.Config{Replicas: 3}); err != nil {
		return err
	}
	gws, cls, err := e.openAndKeyed(ctx, func(cfg *gateway.Config) {
		cfg.BodyRateGrace, cfg.MinBodyRate = grace, int64(float64(cfg.MinBodyRate)/s)
	})
	if err != nil {
		return err
	}
	for _, cl := range cls {
		cl.pad = " " + strings.Repeat("x", ordinaryPad)
	}
	t := &trickleTally{}
	var peaks []float64
	results := e.attack(ctx, cls, func(actx context.Context) {
		peakOf := bodyPeak(actx, gws, e.attackRounds(10*time.Millisecond))
		var wg sync.WaitGroup
		for k, pg := range gws {
			key := []string{"", chaosClientKey}[k]
			for i := range trickles {
				from := []string{"127.0.0.1", "127.0.0.2"}[i%2]
				wg.Go(func() { t.trickle(actx, strings.TrimPrefix(pg.base, "http://"), from, key, every, 1000) })
			}
		}
		wg.Wait()
		peaks = peakOf()
	}, nil)
	e.account(res, names(gws...), results)
	p.figure("uploads opened %d, cut with 408 %d, ended otherwise %d; %d bytes trickled in all", t.opened, t.cut408, t.cutElse, t.sent)
	for i, pg := range gws {
		ga := p.Gateways[i]
		p.figure("%s: request bodies held at most %.0f bytes (max_body_memory %d MiB); ordinary p99 %s ms; errors by kind: %s",
			pg.name, peaks[i], pg.cfg.MaxBodyMemory>>20, ms(ga.P99), byLabel(pg.reg, "kvgate_request_errors_total", "kind"))
		p.check(peaks[i] < trickleDeclare, "%s held %.0f bytes of request bodies: the uploads reserved what they declared", pg.name, peaks[i])
		if ga.P99 > time.Second {
			p.slow("%s: ordinary p99 %v beside the trickling uploads, want ≤ 1 s", pg.name, ga.P99)
		}
	}
	if t.cut408 == 0 {
		p.slow("no trickling upload was cut with a 408 within the attack")
	}
	return nil
}
