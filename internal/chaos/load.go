package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
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
	if s.concurrency > 0 {
		closedLoop(ctx, s, send)
	} else {
		openLoop(ctx, s, send)
	}
}

// closedLoop: s.concurrency clients, each sending its next request when its
// last one has returned.
func closedLoop(ctx context.Context, s loadSpec, send func(ctx context.Context, i int)) {
	var wg sync.WaitGroup
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
}

// openLoop: Poisson arrivals at s.rate, at most s.maxInFlight outstanding.
func openLoop(ctx context.Context, s loadSpec, send func(ctx context.Context, i int)) {
	var wg sync.WaitGroup
	defer wg.Wait()
	rng := rand.New(rand.NewPCG(s.seed, 0xa77))
	slots := make(chan struct{}, max(s.maxInFlight, 1))
	t := time.NewTimer(0)
	defer t.Stop()
	<-t.C
	at := time.Now()
	for i := s.first; i < s.first+s.n; i++ {
		if i > s.first {
			at = at.Add(time.Duration(rng.ExpFloat64() / s.rate * float64(time.Second)))
			if d := time.Until(at); d > 0 {
				t.Reset(d)
				select {
				case <-t.C:
				case <-ctx.Done():
					return
				}
			}
		}
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
			return
		}
		wg.Go(func() {
			defer func() { <-slots }()
			send(ctx, i)
		})
	}
}

// result is one request as the client saw it.
type result struct {
	id        string
	as        behaviour
	stream    bool
	status    int
	verdict   verdict
	latency   time.Duration
	replica   string // X-Kvgate-Replica of the answer
	noRetryAt bool   // a 429 or 503 without Retry-After
	// retryAfter: a 429's or 503's Retry-After; retries: how many times
	// doRetrying resent the request after one.
	retryAfter time.Duration
	retries    int
}

// client sends the suite's requests to the gateway.
type client struct {
	http      *http.Client
	slowHTTP  *http.Client // slow readers' client: a small receive buffer
	base      string       // gateway base URL
	model     string
	maxTokens int
	timeout   time.Duration // per request: past it the request is lost (hung)
	prefix    string        // "chaos-<kind>-" for X-Request-Id
	plan      clientPlan
	seed      uint64
	// ordinaryDone opens when every request but the slow readers' has
	// ended: the slow readers stop reading until then.
	ordinaryDone *countdown
	// apiKey, when set, is sent as a bearer token; pad is appended to
	// every request's user text (the hostile scenarios' 1 KB requests).
	apiKey string
	pad    string
}

// systemPrompt is shared by every request, as an application's system
// prompt is: it makes the prefix cache and the cache-aware policies matter.
var systemPrompt = strings.Repeat("You are the reliability suite's assistant; answer briefly and exactly. ", 4)

// body is request i: completions and chat alternate, and so do streamed
// and non-streamed ones, so that each fault meets every response path.
// ignore_eos with max_tokens makes every complete answer exactly wantTokens
// long, which is how the client tells a complete answer from a short one.
func (c *client) body(i int, as behaviour) (data []byte, path string, stream bool, wantTokens int) {
	chat := i%2 == 1
	stream = (i/2)%2 == 1 || as == hangUp || as == slowRead
	user := fmt.Sprintf("Request %d of the chaos run: summarise the numbers %d, %d and %d in one line.", i, i*7, i*13, i*31) + c.pad
	wantTokens = c.maxTokens
	m := map[string]any{"model": c.model, "max_tokens": wantTokens, "ignore_eos": true, "stream": stream}
	switch as {
	case slowRead:
		wantTokens = slowTokens
		m["max_tokens"] = wantTokens
	case overflow:
		// No ignore_eos: a replica that wrongly accepts it still ends.
		m["max_tokens"], m["ignore_eos"] = int64(math.MaxInt64), false
	case poison:
		user = queryOfDeath + " " + user
	case onAdapter:
		m["model"] = chaosAdapter
	}
	path = "/v1/completions"
	if chat {
		path = "/v1/chat/completions"
		m["messages"] = []map[string]string{{"role": "system", "content": systemPrompt}, {"role": "user", "content": user}}
	} else {
		m["prompt"] = systemPrompt + user
	}
	data, _ = json.Marshal(m)
	return data, path, stream, wantTokens
}

// do sends request i and classifies the answer.
func (c *client) do(ctx context.Context, i int) result {
	as := c.plan.behaviour(i, c.seed)
	if as != slowRead && c.ordinaryDone != nil {
		defer c.ordinaryDone.done()
	}
	data, path, stream, want := c.body(i, as)
	res := result{id: fmt.Sprintf("%s%d", c.prefix, i), as: as, stream: stream}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+path, bytes.NewReader(data))
	if err != nil {
		res.verdict = verdict{class: Lost, reason: err.Error()}
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Request-Id", res.id)
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	hc := c.http
	if as == slowRead {
		hc = c.slowHTTP
	}
	start := time.Now()
	resp, err := hc.Do(req)
	if err != nil {
		res.verdict = lostNetErr(err)
		res.latency = time.Since(start)
		return res
	}
	res.status = resp.StatusCode
	res.replica = resp.Header.Get("X-Kvgate-Replica")
	if resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable {
		ra := resp.Header.Get("Retry-After")
		res.noRetryAt = ra == ""
		if s, err := strconv.Atoi(ra); err == nil && s >= 0 {
			res.retryAfter = time.Duration(min(s, 3600)) * time.Second
		}
	}
	res.verdict = classify(resp, stream, want, c.onFirst(ctx, as))
	_ = resp.Body.Close()
	res.latency = time.Since(start)
	return res
}

// onFirst is what the client does at a stream's first token: a client
// hanging up closes the stream at once; a slow reader stops reading until
// every ordinary request has ended (or its deadline), then closes it.
func (c *client) onFirst(ctx context.Context, as behaviour) func() bool {
	switch as {
	case hangUp:
		return func() bool { return true }
	case slowRead:
		return func() bool {
			if c.ordinaryDone != nil {
				select {
				case <-c.ordinaryDone.open:
				case <-ctx.Done():
				}
			}
			return true
		}
	}
	return nil
}

// doRetrying sends request i as a client library does: a clear 429 or 503
// (an OpenAI error body) is sent again after its Retry-After (at least
// 50 ms, at most a second), up to ordinaryRetries times. The result is the
// last attempt's, its latency the whole wait.
func (c *client) doRetrying(ctx context.Context, i int) result {
	start := time.Now()
	var r result
	for try := 0; ; try++ {
		r = c.do(ctx, i)
		r.retries = try
		refused := r.status == http.StatusTooManyRequests || r.status == http.StatusServiceUnavailable
		if try == ordinaryRetries || !refused || r.verdict.class != FailedClear {
			break
		}
		t := time.NewTimer(min(max(r.retryAfter, 50*time.Millisecond), time.Second))
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			r.latency = time.Since(start)
			return r
		}
	}
	r.latency = time.Since(start)
	return r
}
