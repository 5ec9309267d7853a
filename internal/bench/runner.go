// Package bench drives load through a gateway (or any OpenAI-compatible
// endpoint) and measures each request the way vLLM's and SGLang's serving
// benchmarks do: time to the first content token of the SSE stream, inter-
// token latency, end-to-end latency, and the replica's own count of cached
// prompt tokens from the usage chunk.
package bench

import (
	"bytes"
	"container/heap"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/workload"
)

// Config is one load run.
type Config struct {
	Target string // base URL of the gateway (…/v1/… is appended)
	// Targets, when set, are several gateways in front of the same
	// replicas (Target is ignored): requests go to them in turn, as a
	// Service spreads them, so a conversation's turns meet different ones.
	Targets []string
	Model   string
	// Concurrency > 0: closed loop with that many clients; 0: open loop at
	// the requests' arrival times (Poisson or trace timestamps).
	Concurrency int
	// MaxInFlight bounds an open loop's outstanding requests (default 4096):
	// past it, arrivals wait, and the run says so.
	MaxInFlight int
	// TimeScale > 1 when the replicas run faster than real time (kvgate sim
	// --time-scale): arrival gaps and think times are divided by it, and
	// figures are in model time. A replica that tells its own times (the
	// sim's usage.kvgate_sim) has its part counted once in model time and
	// the rest once in real time (splitRecord); an answer without them has
	// its measured latencies multiplied by the scale.
	TimeScale float64
	// Timeline, when set, is the model time the run paces itself by: the
	// embedded fleet's (sim.Fleet.Timeline), whose elastic model time waits
	// for an engine that falls behind; the run's arrivals and think times
	// then wait for it too, so that a slow host slows the run down instead
	// of crowding the engines. nil: the wall clock × TimeScale.
	Timeline *sim.Timeline
	// RequestTimeout bounds one request (model time; default 10 min).
	RequestTimeout time.Duration
	// MaxDuration bounds the whole run in wall time (default 1 h).
	MaxDuration time.Duration
	// Replicas are the targets known before the run (optional), in index
	// order, as targetName names them (URL, or URL#k for a data-parallel
	// rank): a target that gets no request still has its index, and counts
	// in the imbalance. A response naming any other target gets the next
	// free index. See Targets.
	Replicas []string
	Client   *http.Client
	// Progress, if set, is called after each request.
	Progress func(done, total int)
	// Header adds headers to every request (e.g. Authorization).
	Header http.Header
	// Keys are the tenants' API keys (workload.Request.Tenant to key): a
	// tenant's request is sent with its key as Authorization: Bearer, its
	// priority (when not 0) as the body's priority and its deadline as
	// X-Kvgate-Deadline-Ms, in wall time; its record names tenant and
	// priority. Its priority goes in the body only with SendPriority: an
	// engine scheduling first come first served refuses one (vLLM's 400).
	Keys         map[string]string
	SendPriority bool
	// GatewayQueues: the gateway holds requests back (flow control), so a
	// request's send does not hold an elastic Timeline until the replica
	// has it: the engines' model time must go on to drain the gateway's
	// queue (with a hold per queued request it would stand still).
	GatewayQueues bool
}

// NewClient is the load generator's HTTP client: keep-alive connections
// for as many concurrent requests as a run may have, no compression (SSE
// must arrive as sent).
func NewClient() *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4096, MaxIdleConns: 4096, DisableCompression: true}}
}

// ErrDeadline reports a run cut by MaxDuration: the records so far are returned.
var ErrDeadline = errors.New("bench: run exceeded its maximum duration")

// Run sends reqs and returns a record per request (in request order) and
// the run's wall time in model time units.
func Run(ctx context.Context, cfg Config, reqs []workload.Request) ([]report.Record, time.Duration, error) {
	if cfg.TimeScale <= 0 {
		cfg.TimeScale = 1
	}
	if cfg.RequestTimeout <= 0 {
		cfg.RequestTimeout = 10 * time.Minute
	}
	if cfg.MaxDuration <= 0 {
		cfg.MaxDuration = time.Hour
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = 4096
	}
	if cfg.Client == nil {
		cfg.Client = NewClient()
		defer cfg.Client.CloseIdleConnections() // leave no connection open at the target
	}
	if cfg.Timeline == nil {
		cfg.Timeline = sim.NewTimeline(nil, cfg.TimeScale, 0)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.MaxDuration)
	defer cancel()
	r := &runner{cfg: cfg, tl: cfg.Timeline, reqs: reqs, recs: make([]report.Record, len(reqs)),
		ready: make(chan struct{}, 1), dependents: make(map[int][]int), batchLeft: map[int]int{}, batchNext: map[int][]int{}}
	r.start = r.tl.Now()
	for i := range reqs {
		if p := reqs[i].Prev; p >= 0 && p < len(reqs) {
			r.dependents[p] = append(r.dependents[p], i)
		}
		if b := reqs[i].Batch; b > 0 {
			r.batchLeft[b]++
			if gated(&reqs[i]) {
				r.batchNext[b-1] = append(r.batchNext[b-1], i)
			}
		}
	}
	err := r.run(ctx)
	wall := r.since()
	if errors.Is(ctx.Err(), context.DeadlineExceeded) && err == nil {
		err = ErrDeadline
	}
	return r.recs, wall, err
}

type runner struct {
	cfg        Config
	tl         *sim.Timeline
	reqs       []workload.Request
	recs       []report.Record
	start      time.Duration // model time at the run's start
	dependents map[int][]int
	// batchLeft[b]: the requests of RL batch b not ended (mu); batchNext[b]
	// those of batch b+1 that wait for them (workload.Request.Batch).
	batchLeft map[int]int
	batchNext map[int][]int

	sent atomic.Uint64 // requests sent (the next one's gateway in Targets)
	keys atomic.Uint64 // the last request's hold key (sim.HeaderHold)

	mu    sync.Mutex
	queue readyQueue // requests whose dependencies are met, by release time then index
	ready chan struct{}
	done  int
	seen  map[string]int // targets met that are not in Config.Replicas
}

// item is a request and the model time at which it may be sent.
type item struct {
	idx int
	at  time.Duration // model time since the run's start
}

type readyQueue []item

func (q readyQueue) Len() int { return len(q) }
func (q readyQueue) Less(i, j int) bool {
	if q[i].at != q[j].at {
		return q[i].at < q[j].at
	}
	return q[i].idx < q[j].idx
}
func (q readyQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *readyQueue) Push(x any)   { *q = append(*q, x.(item)) }
func (q *readyQueue) Pop() any {
	old := *q
	it := old[len(old)-1]
	*q = old[:len(old)-1]
	return it
}

func (r *runner) wall(d time.Duration) time.Duration {
	return time.Duration(float64(d) / r.cfg.TimeScale)
}

// since is the model time since the run's start.
func (r *runner) since() time.Duration { return r.tl.Now() - r.start }

func (r *runner) release(it item) {
	r.mu.Lock()
	heap.Push(&r.queue, it)
	r.mu.Unlock()
	select {
	case r.ready <- struct{}{}:
	default:
	}
}

// pacerKey is the hold (sim.Timeline.Hold) at the next arrival; requests'
// keys are multiples of 4 (sim.HeaderHold).
const pacerKey = 3

// next returns the next request to send once its (model) time has come,
// or false when the run is over.
func (r *runner) next(ctx context.Context) (item, bool) {
	for {
		r.mu.Lock()
		if r.done == len(r.reqs) {
			r.mu.Unlock()
			return item{}, false
		}
		var fire <-chan time.Time
		var moved <-chan struct{}
		var timer *time.Timer
		if r.queue.Len() > 0 {
			it := r.queue[0]
			// Model time waits for the sending of the next arrival
			// (released by run once it is on its way).
			r.tl.Hold(pacerKey, r.start+it.at)
			reached, d, mv := r.tl.Wait(r.start + it.at)
			if reached {
				heap.Pop(&r.queue)
				r.mu.Unlock()
				return it, true
			}
			if moved = mv; d > 0 {
				timer = time.NewTimer(d)
				fire = timer.C
			}
		} else {
			r.tl.Release(pacerKey) // nothing to send until a request ends
		}
		r.mu.Unlock()
		select {
		case <-ctx.Done():
		case <-r.ready:
		case <-fire:
		case <-moved:
		}
		if timer != nil {
			timer.Stop()
		}
		if ctx.Err() != nil {
			return item{}, false
		}
	}
}

func (r *runner) run(ctx context.Context) error {
	for i := range r.reqs {
		q := &r.reqs[i]
		r.recs[i] = report.Record{Start: q.At, Replica: -1, Program: int32(q.Program), Batch: int32(q.Batch)}
		if p := q.Prev; (p < 0 || p >= len(r.reqs)) && !(gated(q) && r.batchLeft[q.Batch-1] > 0) {
			r.release(item{idx: i, at: q.At})
		}
	}
	if len(r.reqs) == 0 {
		return nil
	}
	limit := r.cfg.Concurrency
	if limit <= 0 {
		limit = r.cfg.MaxInFlight
	}
	sem := make(chan struct{}, limit)
	var wg sync.WaitGroup
	for {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		it, ok := r.next(ctx)
		if !ok {
			<-sem
			break
		}
		// Model time waits until the replica has the request.
		key := r.keys.Add(4)
		if !r.cfg.GatewayQueues {
			r.tl.Hold(key, r.tl.Now())
		}
		r.tl.Release(pacerKey)
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			r.send(ctx, it, key)
		}()
	}
	r.tl.Release(pacerKey)
	wg.Wait()
	// Requests never sent (cut by the deadline) are errors, not silently lost.
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := range r.recs {
		if r.recs[i].E2E == 0 && !r.recs[i].Err {
			r.recs[i].Err, r.recs[i].ErrKind = true, "not_sent"
		}
	}
	return ctx.Err()
}

// gated reports whether q waits for the batch before its own (a request of
// batch b > 1 without a predecessor).
func gated(q *workload.Request) bool { return q.Prev < 0 && q.Batch > 1 }

// send runs one request (hold key: see do) and releases its dependents,
// and the next batch when it ends its own.
func (r *runner) send(ctx context.Context, it item, key uint64) {
	q := &r.reqs[it.idx]
	sent := r.since()
	rec := r.do(ctx, q, key)
	rec.Start = sent
	if q.Prev < 0 && !gated(q) {
		rec.Start = q.At // open loop: measured from the scheduled arrival
	}
	doneAt := r.since()
	r.tl.Release(key + 3) // model time may go on now that the end is noted
	rec.Program, rec.Batch = int32(q.Program), int32(q.Batch)
	r.mu.Lock()
	r.recs[it.idx] = rec
	r.done++
	done := r.done
	next := r.dependents[it.idx]
	if b := q.Batch; b > 0 {
		if r.batchLeft[b]--; r.batchLeft[b] == 0 {
			next = append(slices.Clip(next), r.batchNext[b]...)
		}
	}
	r.mu.Unlock()
	for _, d := range next {
		at := max(r.reqs[d].At, doneAt+r.reqs[d].Think)
		if rec.Err {
			at = doneAt // a failed turn still lets the conversation go on
		}
		r.release(item{idx: d, at: at})
	}
	if r.cfg.Progress != nil {
		r.cfg.Progress(done, len(r.reqs))
	}
	select {
	case r.ready <- struct{}{}:
	default:
	}
}

// body is the JSON request sent for q.
func (r *runner) body(q *workload.Request) ([]byte, string) {
	m := map[string]any{
		"model":          r.cfg.Model,
		"max_tokens":     q.MaxTokens,
		"ignore_eos":     true,
		"stream":         true,
		"stream_options": map[string]any{"include_usage": true},
		"temperature":    0,
	}
	if q.Priority != 0 && r.cfg.SendPriority {
		m["priority"] = q.Priority
	}
	if q.Chat {
		msgs := make([]map[string]string, len(q.Messages))
		for i := range q.Messages {
			m := &q.Messages[i]
			msgs[i] = map[string]string{"role": m.Role, "content": m.Content()}
		}
		m["messages"] = msgs
		b, _ := json.Marshal(m)
		return b, "/v1/chat/completions"
	}
	m["prompt"] = q.Text()
	b, _ := json.Marshal(m)
	return b, "/v1/completions"
}

// targetName is the target that answered: X-Kvgate-Replica, and #RANK for
// a data-parallel rank (X-Kvgate-Rank), as the gateway names it.
func targetName(h http.Header) string {
	name := h.Get("X-Kvgate-Replica")
	if rank := h.Get("X-Kvgate-Rank"); rank != "" && name != "" {
		name += "#" + rank
	}
	return name
}

// replicaIndex maps a target's name (targetName) to an index: its position
// in Config.Replicas, or, for a target not listed there, the next index
// after them in order of first appearance; -1 for no name.
func (r *runner) replicaIndex(name string) int {
	if name == "" {
		return -1
	}
	for i, u := range r.cfg.Replicas {
		if u == name {
			return i
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.seen == nil {
		r.seen = map[string]int{}
	}
	i, ok := r.seen[name]
	if !ok {
		i = len(r.cfg.Replicas) + len(r.seen)
		r.seen[name] = i
	}
	return i
}

// do sends one streamed request and times it. key is its hold on an
// elastic timeline, held from the send: the replica releases it on the
// request's arrival and holds key+1 at its first token, released here on
// reading it, and key+3 at its end, released when send has noted it (key+2:
// a prefill step's answer); released here at the answer's header and end in
// any case, so that a gateway that does not pass sim.HeaderHold on still
// lets model time go.
func (r *runner) do(ctx context.Context, q *workload.Request, key uint64) report.Record {
	defer func() {
		for k := range uint64(3) {
			r.tl.Release(key + k)
		}
	}()
	rec := report.Record{Replica: -1, PromptTokens: q.InputTokens, Tenant: q.Tenant, Priority: q.Priority}
	runCtx := ctx
	ctx, cancel := context.WithTimeout(ctx, r.wall(r.cfg.RequestTimeout))
	defer cancel()
	fail := func(kind string) report.Record {
		switch {
		case runCtx.Err() != nil:
			kind = "canceled" // the run ended (deadline or interrupt), not this request's fault
		case ctx.Err() != nil && (kind == "connect" || kind == "stream_broken"):
			kind = "timeout"
		}
		rec.Err, rec.ErrKind = true, kind
		return rec
	}
	req, err := r.request(ctx, q)
	if err != nil {
		return fail("request")
	}
	if r.tl.Elastic() {
		req.Header.Set(sim.HeaderHold, strconv.FormatUint(key, 10))
	}
	queued := r.cfg.GatewayQueues && r.tl.Elastic()
	var m0 time.Duration
	if queued {
		m0 = r.tl.Now()
	}
	t0 := time.Now()
	resp, err := r.cfg.Client.Do(req)
	if err != nil {
		return fail("connect")
	}
	defer resp.Body.Close()
	r.tl.Release(key)
	var qw queueWait
	if queued {
		qw = queueWaitOf(resp.Header, time.Since(t0), r.tl.Now()-m0)
	}
	rec.Replica = r.replicaIndex(targetName(resp.Header))
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		return fail(fmt.Sprintf("http_%d", resp.StatusCode))
	}
	s := readStream(resp.Body, t0, func() { r.tl.Release(key + 1) })
	e2e := time.Since(t0)
	if s.errKind != "" {
		return fail(s.errKind)
	}
	if !s.done || s.tokens == 0 {
		return fail("incomplete")
	}
	rec.OutputTokens = s.tokens
	if u := s.usage; u != nil {
		rec.PromptTokens, rec.OutputTokens = u.PromptTokens, u.CompletionTokens
		rec.CachedTokens = max(u.Cached(), 0)
	}
	if pc, ok := gateway.ReceiptPrefillCached(resp.Header); ok {
		// Disaggregated: the decode replica's usage counts the prompt it
		// pulled as cached; the hit is the prefill step's (a gateway with
		// route_receipts on says it).
		rec.CachedTokens = min(pc, max(rec.PromptTokens, 0))
	}
	if s.timed {
		splitRecord(&rec, s, e2e, s.timing, qw)
		return rec
	}
	rec.TTFT = time.Duration(float64(s.first) * r.cfg.TimeScale)
	rec.E2E = time.Duration(float64(e2e) * r.cfg.TimeScale)
	rec.MaxITL = time.Duration(float64(s.maxGap) * r.cfg.TimeScale)
	return rec
}

// splitRecord sets a request's latencies from the replica's own account t
// and the wall times the client measured (issue 30).
//
// The engine's part is counted once, in model time: the sim knows it
// exactly. The time outside the replica — the client's wall time minus the
// replica's own span in real time (t.WallTTFTms, t.WallE2Ems: from handing
// the request to its engine to writing the token) — is the gateway's
// routing and relaying, HTTP and the load generator, and it is counted
// once too, in real time, never multiplied by the scale: it is what the
// router costs on this host, not the simulated GPU's time. So TTFT = engine
// + outside, and likewise E2E. What simulating the engine cost the host (a
// sim driver woken late, a handler waiting for the CPU) is in the
// replica's span but in neither part: a GPU would not have paid it.
// Multiplying the whole wall time by the scale, as bench did before, made a
// few ms of real CPU per request in the gateway look like 100 ms at scale
// 20 and reversed verdicts. A replica that gives no span (a non-streamed
// answer has no first-token write) has the engine's time / its scale
// taken off instead.
//
// A wait in the gateway's router queue (q, flow control) is a wait for
// the engines, not the router's cost: it is counted in model time, as the
// engine's part, and its real time taken off the outside part. Counted in
// real time it grew with the host's lag (at --time-scale 0.5, twice the
// model's wait), which the replay, in model time throughout, never saw.
//
// Outside is never negative, and the part after the first token neither.
// The longest gap: the engine's longest plus what the client's longest
// exceeds its wall equivalent by (exact when both are the same gap).
func splitRecord(rec *report.Record, s streamed, e2e time.Duration, t sim.Timing, q queueWait) {
	d := func(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }
	wall := func(model time.Duration) time.Duration { return time.Duration(float64(model) / t.TimeScale) }
	engTTFT, engE2E, engGap := d(t.TTFTms), d(t.E2Ems), d(t.MaxITLms)
	spanTTFT, spanE2E := d(t.WallTTFTms), d(t.WallE2Ems)
	if t.WallTTFTms == 0 {
		spanTTFT, spanE2E = wall(engTTFT), wall(engE2E)
	}
	outTTFT := max(s.first-spanTTFT-q.wall, 0)
	outE2E := max(e2e-spanE2E-q.wall, outTTFT)
	rec.EngineTTFT, rec.EngineE2E = engTTFT, engE2E
	rec.TTFT, rec.E2E = engTTFT+q.model+outTTFT, engE2E+q.model+outE2E
	rec.MaxITL = engGap + max(s.maxGap-wall(engGap), 0)
}

// target is the gateway of the next request: Target, or Targets in turn.
func (r *runner) target() string {
	if n := uint64(len(r.cfg.Targets)); n > 0 {
		return r.cfg.Targets[(r.sent.Add(1)-1)%n]
	}
	return r.cfg.Target
}

// request is the HTTP request for q.
func (r *runner) request(ctx context.Context, q *workload.Request) (*http.Request, error) {
	body, path := r.body(q)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(r.target(), "/")+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if q.Session != "" {
		req.Header.Set("X-Session-Id", q.Session)
	}
	for k, vs := range r.cfg.Header {
		req.Header[k] = vs
	}
	if key := r.cfg.Keys[q.Tenant]; key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if q.Deadline > 0 {
		req.Header.Set(headerDeadline, strconv.FormatInt(max(r.wall(q.Deadline).Milliseconds(), 1), 10))
	}
	return req, nil
}

// headerDeadline is the gateway's TTFT deadline header (in milliseconds;
// internal/gateway's tenants.go).
const headerDeadline = "X-Kvgate-Deadline-Ms"

// streamed is what one SSE answer carried.
type streamed struct {
	first   time.Duration // to the first chunk with a token (openai.Chunk.HasToken)
	last    time.Duration // to the last chunk with a token so far
	maxGap  time.Duration // the longest gap between two chunks with a token
	tokens  int           // chunks with a token
	usage   *openai.Usage // the last usage seen
	timing  sim.Timing    // the replica's own times, from the usage (the sim's)
	timed   bool          // timing was there and valid
	done    bool          // data: [DONE] arrived
	errKind string        // "" or why the stream failed
}

// readStream reads an SSE answer to [DONE] or its end. The first token is
// the first chunk openai.Chunk.HasToken says carries one: text, content,
// reasoning or a tool-call delta, as the gateway counts it; first, if not
// nil, is called when it arrives.
func readStream(body io.Reader, t0 time.Time, first func()) streamed {
	var s streamed
	er := openai.NewEventReader(body, 0)
	for {
		ev, err := er.Next()
		if errors.Is(err, io.EOF) {
			return s
		}
		if err != nil {
			s.errKind = "stream_broken"
			return s
		}
		if !ev.HasData {
			continue
		}
		if openai.IsDone(ev.Data) {
			s.done = true
			return s
		}
		if _, isErr := openai.ParseError(ev.Data); isErr {
			s.errKind = "stream_error"
			return s
		}
		c, err := openai.ParseChunk(ev.Data)
		if err != nil {
			s.errKind = "bad_chunk"
			return s
		}
		if c.HasToken() {
			now := time.Since(t0)
			if s.tokens == 0 {
				s.first = now
				if first != nil {
					first()
				}
			} else {
				s.maxGap = max(s.maxGap, now-s.last)
			}
			s.last = now
			s.tokens++
		}
		if c.Usage != nil {
			s.usage = c.Usage
			s.timing, s.timed = sim.ParseTiming(ev.Data)
		}
	}
}

// queueWait is a request's wait in the gateway's router queue, in model
// time and in real time (zero: it did not wait, or it is not known).
type queueWait struct{ model, wall time.Duration }

// queueWaitOf reads the wait from the gateway's route receipt (its
// queue_ms, in the gateway's clock: model time for the embedded gateway,
// whose clock is the fleet's Timeline) and estimates its real time by the
// rate model time ran at from the send to the answer's header (pre: real,
// preModel: model). A receipt that does not parse, or a wait longer than
// that span, counts as none.
func queueWaitOf(h http.Header, pre, preModel time.Duration) queueWait {
	model, ok := gateway.ReceiptQueueWait(h)
	if !ok || model <= 0 || preModel <= 0 || model > preModel {
		return queueWait{}
	}
	return queueWait{model: model, wall: time.Duration(float64(pre) * (float64(model) / float64(preModel)))}
}
