package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"
)

// loadSpec is one bounded load: n requests, either closed-loop with
// `concurrency` clients or open-loop at `rate` arrivals per second
// (exponential gaps from a seeded source, Poisson arrivals) with at most
// maxInFlight outstanding. The run also ends with ctx.
type loadSpec struct {
	first       int // index of the first request (ids stay unique across phases)
	n           int
	concurrency int
	rate        float64
	maxInFlight int
	seed        uint64
}

// runLoad calls send(ctx, i) for each request index and returns when every
// call has returned; requests not yet started when ctx ends are not sent.
func runLoad(ctx context.Context, s loadSpec, send func(ctx context.Context, i int)) {
	var wg sync.WaitGroup
	if s.concurrency > 0 {
		next := make(chan int)
		for range s.concurrency {
			wg.Go(func() {
				for i := range next {
					send(ctx, i)
				}
			})
		}
	feed:
		for i := s.first; i < s.first+s.n; i++ {
			select {
			case next <- i:
			case <-ctx.Done():
				break feed
			}
		}
		close(next)
		wg.Wait()
		return
	}
	rng := rand.New(rand.NewPCG(s.seed, 0xa77))
	slots := make(chan struct{}, max(s.maxInFlight, 1))
	t := time.NewTimer(0)
	defer t.Stop()
	<-t.C
	at := time.Now()
arrivals:
	for i := s.first; i < s.first+s.n; i++ {
		if i > s.first {
			at = at.Add(time.Duration(rng.ExpFloat64() / s.rate * float64(time.Second)))
			if d := time.Until(at); d > 0 {
				t.Reset(d)
				select {
				case <-t.C:
				case <-ctx.Done():
					break arrivals
				}
			}
		}
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			break arrivals
		}
		wg.Go(func() {
			defer func() { <-slots }()
			send(ctx, i)
		})
	}
	wg.Wait()
}

// result is one request as the client saw it.
type result struct {
	id        string
	stream    bool
	status    int
	verdict   verdict
	latency   time.Duration
	replica   string // X-Kvgate-Replica of the answer
	noRetryAt bool   // a 429 or 503 without Retry-After
}

// client sends the suite's requests to the gateway.
type client struct {
	http      *http.Client
	base      string // gateway base URL
	model     string
	maxTokens int
	timeout   time.Duration // per request: past it the request is lost (hung)
	prefix    string        // "chaos-<kind>-" for X-Request-Id
}

// systemPrompt is shared by every request, as an application's system
// prompt is: it makes the prefix cache and the cache-aware policies matter.
var systemPrompt = strings.Repeat("You are the reliability suite's assistant; answer briefly and exactly. ", 4)

// body is request i: completions and chat alternate, and so do streamed
// and non-streamed ones, so that each fault meets every response path.
// ignore_eos with max_tokens makes every complete answer exactly maxTokens
// long, which is how the client tells a complete answer from a short one.
func (c *client) body(i int) ([]byte, string, bool) {
	chat := i%2 == 1
	stream := (i/2)%2 == 1
	user := fmt.Sprintf("Request %d of the chaos run: summarise the numbers %d, %d and %d in one line.", i, i*7, i*13, i*31)
	m := map[string]any{"model": c.model, "max_tokens": c.maxTokens, "ignore_eos": true, "stream": stream}
	path := "/v1/completions"
	if chat {
		path = "/v1/chat/completions"
		m["messages"] = []map[string]string{{"role": "system", "content": systemPrompt}, {"role": "user", "content": user}}
	} else {
		m["prompt"] = systemPrompt + user
	}
	data, _ := json.Marshal(m)
	return data, path, stream
}

// do sends request i and classifies the answer.
func (c *client) do(ctx context.Context, i int) result {
	data, path, stream := c.body(i)
	res := result{id: fmt.Sprintf("%s%d", c.prefix, i), stream: stream}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, bytes.NewReader(data))
	if err != nil {
		res.verdict = verdict{class: Lost, reason: err.Error()}
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", res.id)
	start := time.Now()
	resp, err := c.http.Do(req)
	if err != nil {
		res.verdict = lostNetErr(err)
		res.latency = time.Since(start)
		return res
	}
	res.status = resp.StatusCode
	res.replica = resp.Header.Get("X-Kvgate-Replica")
	if (resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable) &&
		resp.Header.Get("Retry-After") == "" {
		res.noRetryAt = true
	}
	res.verdict = classify(resp, stream, c.maxTokens)
	_ = resp.Body.Close()
	res.latency = time.Since(start)
	return res
}
