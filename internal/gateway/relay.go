package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/prompt"
)

// relay passes the replica's answer to the client: the header at once, then
// an SSE stream event by event (flushed, as httputil does with
// FlushInterval -1) or any other body as it comes, in bounded memory. It
// sets the attempt's verdict: served, rejected (4xx), failed (5xx, or the
// stream broke, went idle or overran its bounds), clientGone (the client
// left or stopped reading) or gatewayLimit.
func (g *Gateway) relay(x *exchange, a *attempt, ctx context.Context, cancel context.CancelCauseFunc, resp *http.Response) {
	h := x.w.Header()
	id := h["X-Request-Id"] // begin's, set again over the replica's below
	dropKvgateHeaders(resp.Header)
	moveHeaders(h, resp.Header)
	setTarget(h, g.rt.Replica(a.tk.Replica), a.prefill)
	g.addReceipt(h, x, a)
	setPullFrom(x, a)
	if len(id) == 1 && id[0] == x.id {
		h["X-Request-Id"] = id // no new slice for the same value
	} else {
		h.Set("X-Request-Id", x.id)
	}
	a.started = true
	x.w.WriteHeader(resp.StatusCode)
	x.cut.arm(x.w)
	defer x.cut.disarm()
	var rerr, werr error
	if openai.IsEventStream(resp.Header) {
		rerr, werr = g.relayStream(x, a, ctx, cancel, resp.Body)
	} else {
		rerr, werr = g.relayBody(x, a, resp.Body)
	}
	switch {
	case werr != nil && cutByLimit(context.Cause(x.ctx)):
		a.v, a.err = gatewayLimit, errors.Join(context.Cause(x.ctx), werr) // the client stopped reading; the limit ended it
	case werr != nil:
		a.v, a.err = clientGone, errors.Join(errClientWrite, werr)
	case rerr != nil && x.r.Context().Err() != nil:
		a.v, a.err = clientGone, x.r.Context().Err() // the read broke because the client left
	case rerr != nil:
		a.v, a.err = g.brokenVerdict(ctx, rerr)
		// A body cut midway must not reach the client as a whole one: abort
		// the connection (streams ended with an SSE error event already).
		a.abort = !openai.IsEventStream(resp.Header)
	case resp.StatusCode >= 500:
		a.v, a.err = failed, errors.New("replica answered "+resp.Status)
	case resp.StatusCode >= 400:
		a.v, a.err = rejected, errors.New("replica answered "+resp.Status)
	default:
		a.v = served
	}
	if !x.parsed.Stream || a.v != served {
		a.tk.PrefillDone() // an answer is over: its prefill is, at the latest
	}
}

// brokenVerdict classifies a response that broke after it started.
func (g *Gateway) brokenVerdict(ctx context.Context, err error) (verdict, error) {
	if c := context.Cause(ctx); cutByLimit(c) {
		return gatewayLimit, c
	} else if c != nil && !errors.Is(c, context.Canceled) {
		return failed, c
	}
	return failed, err
}

// errStreamIncomplete: the replica closed a stream cleanly before [DONE].
var errStreamIncomplete = errors.New("the replica's stream ended without data: [DONE]")

// relayStream copies SSE events to the client, noting the first token and
// the usage. Between events the replica may be silent at most
// stream_idle_timeout. A stream that breaks, ends early or overruns the
// line bound ends with an SSE error event: never a retry, tokens were sent.
func (g *Gateway) relayStream(x *exchange, a *attempt, ctx context.Context, cancel context.CancelCauseFunc,
	body io.Reader) (rerr, werr error) {
	idle := g.idleTimer(cancel)
	defer idle.stop()
	idle.stop() // armed by the first reset below
	er := openai.NewEventReader(body, g.cfg.MaxStreamLineBytes)
	sawDone := false
	var ms messagesStream
	for {
		// Only the wait for the replica counts as its silence, never the
		// time a slow client takes to read (write_timeout bounds that).
		idle.reset()
		ev, err := er.Next()
		idle.stop()
		if err == nil {
			if x.hideUsage && ev.HasData && usageOnly(ev.Data) {
				g.inspect(ev.Data, a, &sawDone) // the gateway's, not the client's
				continue
			}
			if werr := g.relayEvent(x, a, ev, &sawDone, &ms); werr != nil {
				if sawDone {
					// The client had the answer's end and hung up: what
					// the replica sends after it (vLLM's [DONE] after a
					// Messages stream's message_stop) is not missed.
					return nil, nil
				}
				return nil, werr
			}
			continue
		}
		if sawDone || (x.kind == prompt.Other && errors.Is(err, io.EOF)) {
			// The answer was whole: a client that closes on [DONE] may
			// cancel the read of the replica's EOF, and is still served.
			// (An endpoint the gateway does not know ends its stream as it
			// likes: a clean end is an end.)
			return nil, nil
		}
		if errors.Is(err, io.EOF) {
			err = errStreamIncomplete
		}
		if x.r.Context().Err() == nil {
			x.writeStreamError(ctx, err)
		}
		return err, nil
	}
}

// relayEvent writes one event of a stream to the client, then reads it for
// the first token, the usage and the end (a first token counts once it is
// the client's). A Responses stream's id is read before the write: the
// client may name the response as soon as it reads it (a GET; a
// background response's cancel), and the gateway must know its home and
// owner by then (exchange.created).
func (g *Gateway) relayEvent(x *exchange, a *attempt, ev openai.Event, sawDone *bool, ms *messagesStream) error {
	if x.kind == prompt.Responses && ev.HasData && a.respID == "" {
		g.responseCreated(x, a, ev.Data)
	}
	if err := x.write(ev.Raw); err != nil {
		return err
	}
	switch {
	case !ev.HasData:
	case x.kind == prompt.Responses:
		g.inspectResponses(ev.Data, a, sawDone)
	case x.kind == prompt.Messages:
		g.inspectMessages(ev.Data, a, ms, sawDone)
	default:
		g.inspect(ev.Data, a, sawDone)
	}
	return nil
}

// writeStreamError ends a stream cut short with its error event; in a
// Messages stream, Anthropic's: an event named "error" (Anthropic's
// clients dispatch on an event's name) whose data is its error shape.
func (x *exchange) writeStreamError(ctx context.Context, err error) {
	e := streamError(ctx, err)
	if x.kind == prompt.Messages {
		_ = x.write(fmt.Appendf(nil, "event: error\ndata: %s\n\n", e.anthropicBody(x.id)))
		return
	}
	_ = x.write(openai.SSEErrorEvent(e.Message, e.Type, e.Code))
}

// streamError is the error that ends a stream cut short, with the status
// it would have had before the stream started.
func streamError(ctx context.Context, err error) *apiError {
	e := &apiError{Status: http.StatusBadGateway, Type: "server_error", Code: "upstream_stream_error",
		Message: "the replica's stream broke after it started; the response is incomplete"}
	switch c := context.Cause(ctx); {
	case errors.Is(c, errRequestTimeout):
		e.Status, e.Code = http.StatusGatewayTimeout, "request_timeout"
		e.Message = "the request took longer than the gateway's request_timeout; the response is incomplete"
	case errors.Is(c, errDrained):
		e.Status, e.Code, e.Message = http.StatusServiceUnavailable, "gateway_shutdown", "the gateway is shutting down; the response is incomplete"
	case errors.Is(c, errIdleTimeout):
		e.Status, e.Code, e.Message = http.StatusGatewayTimeout, "upstream_stream_idle", "the replica's stream stalled; the response is incomplete"
	case errors.Is(err, errStreamIncomplete):
		e.Message = "the replica's stream ended before it was complete; the response is incomplete"
	}
	return e
}

// write sends bytes to the client and flushes them (withWriteDeadline
// bounds both).
func (x *exchange) write(p []byte) error {
	if _, err := x.w.Write(p); err != nil {
		return err
	}
	return x.rc.Flush()
}

// cutWriteGrace is how long writes to a client may still take once
// request_timeout or the drain has cut its request: time for a reading
// client to take the SSE error event that ends its stream; a client whose
// TCP window stays shut that long is not reading.
const cutWriteGrace = time.Second

// withWriteDeadline bounds every write to a client, the gateway's own
// answers (errors, /v1/models, /metrics) included: each write and flush
// within write_timeout of its start, so that a client that stops reading
// (its TCP window shut; with HTTP/1.1 pipelining it can send requests
// without reading the answers) loses its connection instead of holding
// it; and once request_timeout or the drain has cut a request, within
// cutWriteGrace of the cut. It is the outermost handler, so that every
// writer below writes through it (net/http clears the deadline after
// each answer).
func (g *Gateway) withWriteDeadline(h http.Handler) http.Handler { return &writeBounded{g: g, next: h} }

// writeBounded is withWriteDeadline's handler.
type writeBounded struct {
	g    *Gateway
	next http.Handler
}

func (b *writeBounded) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b.next.ServeHTTP(&deadlineWriter{ResponseWriter: w, g: b.g, rc: *http.NewResponseController(w)}, r)
}

// deadlineWriter arms the socket's write deadline before each write.
type deadlineWriter struct {
	http.ResponseWriter
	g     *Gateway
	rc    http.ResponseController // of the ResponseWriter below (by value: one allocation less)
	cutAt atomic.Int64            // the cut's deadline, wall Unix ns (0: not cut)
}

func (w *deadlineWriter) arm() {
	if d := w.g.conf().WriteTimeout.D(); d > 0 {
		_ = w.rc.SetWriteDeadline(time.Now().Add(d)) // the socket's own deadline: wall time
	}
	// Loaded after setting: a cut stored before this load is applied
	// again here; one stored after it sets its own deadline after ours.
	if c := w.cutAt.Load(); c != 0 {
		_ = w.rc.SetWriteDeadline(time.Unix(0, c))
	}
}

func (w *deadlineWriter) WriteHeader(code int) { w.arm(); w.ResponseWriter.WriteHeader(code) }

func (w *deadlineWriter) Write(p []byte) (int, error) { w.arm(); return w.ResponseWriter.Write(p) }

func (w *deadlineWriter) FlushError() error { w.arm(); return w.rc.Flush() }

func (w *deadlineWriter) Flush() { _ = w.FlushError() }

func (w *deadlineWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// cut ends every write, the one blocked now included, within
// cutWriteGrace (or write_timeout, when shorter) from now.
func (w *deadlineWriter) cut() {
	d := cutWriteGrace
	if wt := w.g.conf().WriteTimeout.D(); wt > 0 {
		d = min(d, wt)
	}
	by := time.Now().Add(d)
	w.cutAt.Store(by.UnixNano())
	_ = w.rc.SetWriteDeadline(by)
}

// cutByLimit reports whether c, an exchange context's cause, is one of the
// gateway's own limits: request_timeout, the drain.
func cutByLimit(c error) bool { return errors.Is(c, errRequestTimeout) || errors.Is(c, errDrained) }

// writeCut cuts an exchange's writes to its client when request_timeout
// or the drain ends the exchange (fire, called by its context's limits)
// while an answer is relayed (between arm and disarm): cancelling the
// context stops the read from the replica, not a write blocked on a client
// that stopped reading. Disarm waits for a cut in progress (a
// ResponseController must not be used after its handler returns). Part of
// the exchange: nothing to allocate per answer.
type writeCut struct {
	mu    sync.Mutex
	dw    *deadlineWriter // armed: the client's writer (nil: not relaying)
	fired bool
}

// arm watches the writes to w (nothing without withWriteDeadline); a cut
// that came already applies at once.
func (c *writeCut) arm(w http.ResponseWriter) {
	dw := deadlineWriterOf(w)
	if dw == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dw = dw; c.fired {
		dw.cut()
	}
}

func (c *writeCut) disarm() {
	c.mu.Lock()
	c.dw = nil
	c.mu.Unlock()
}

func (c *writeCut) fire() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fired = true; c.dw != nil {
		c.dw.cut()
	}
}

// deadlineWriterOf finds the deadlineWriter under w's wrappers (nil: the
// handler runs without withWriteDeadline).
func deadlineWriterOf(w http.ResponseWriter) *deadlineWriter {
	for {
		switch v := w.(type) {
		case *deadlineWriter:
			return v
		case interface{ Unwrap() http.ResponseWriter }:
			w = v.Unwrap()
		default:
			return nil
		}
	}
}

// inspect reads one event's data for the first token and the usage.
func (g *Gateway) inspect(data []byte, a *attempt, sawDone *bool) {
	if openai.IsDone(data) {
		*sawDone = true
		return
	}
	if !a.firstAt.IsZero() && !bytes.Contains(data, []byte(`"usage"`)) {
		return // past the first token only the usage is of interest: skip the decoding
	}
	c, err := openai.ParseChunk(data)
	if err != nil {
		return
	}
	if a.firstAt.IsZero() && c.HasToken() {
		a.firstAt = g.clock.Now()
		a.tk.FirstToken(a.firstAt)
		traceFirstToken(a)
	}
	if c.Usage != nil {
		a.noteUsage(c.Usage)
	}
}

// usageTail bounds what relayBody keeps of a body to read its usage: the
// usage object closes vLLM's answers, so the last bytes hold it.
const usageTail = 64 << 10

// relayBody copies a non-streamed body to the client as it comes, keeping
// only its last usageTail bytes to read the usage from.
func (g *Gateway) relayBody(x *exchange, a *attempt, body io.Reader) (rerr, werr error) {
	bp := relayBufs.Get().(*[]byte)
	defer relayBufs.Put(bp)
	buf := *bp
	var tail, head []byte
	for {
		n, err := body.Read(buf)
		if n > 0 {
			// Not flushed chunk by chunk: nobody reads a JSON body before
			// its end, and net/http sends it as its buffer fills and at the
			// handler's return (a flush per chunk cost a chunked write and
			// a syscall each: 17 % of the proxy's CPU under wrk).
			if _, werr := x.w.Write(buf[:n]); werr != nil {
				return nil, werr
			}
			if x.kind == prompt.Responses && len(head) < responsesHeadLen {
				head = append(head, buf[:min(n, responsesHeadLen-len(head))]...)
			}
			switch {
			case tail == nil && errors.Is(err, io.EOF):
				tail = buf[:n] // the whole body in one read: no copy (buf outlives its use below)
			default:
				tail = append(tail, buf[:n]...)
			}
			if len(tail) > 2*usageTail {
				tail = append(tail[:0], tail[len(tail)-usageTail:]...)
			}
		}
		if errors.Is(err, io.EOF) {
			noteBodyUsage(x, a, head, tail)
			return nil, nil
		}
		if err != nil {
			return err, nil
		}
	}
}

// relayBufs are relayBody's copy buffers, 32 KiB each: one per request
// would be allocated and cleared for every answer.
var relayBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// noteBodyUsage notes the usage of a whole answer, read from its first
// (head) and last (tail) bytes in its API's terms: a Responses answer's
// (and its id), a Messages answer's, or the OpenAI usage of the others. A
// count_tokens answer generated nothing: it has none.
func noteBodyUsage(x *exchange, a *attempt, head, tail []byte) {
	var u *openai.Usage
	switch x.kind {
	case prompt.Responses:
		a.respID = responseIDOf(head)
		u = responsesBodyUsage(tail)
	case prompt.Messages:
		u = messagesBodyUsage(tail)
	case prompt.CountTokens:
	default:
		u = usageOf(tail)
	}
	if u != nil {
		a.noteUsage(u)
	}
}

// usageOf reads the usage from the end of a JSON answer: the object after
// the last "usage" key, decoded alone rather than the whole answer; an
// answer without that key may still be a usage object itself.
func usageOf(tail []byte) *openai.Usage {
	obj, ok := lastUsageValue(tail)
	if !ok {
		if bytes.Contains(tail, []byte(`"usage"`)) {
			return nil
		}
		return openai.ParseUsage(tail)
	}
	u, ok := scanUsage(obj)
	if !ok {
		if u = (openai.Usage{}); json.Unmarshal(obj, &u) != nil {
			return nil
		}
	}
	return &u
}

// lastUsageValue is the value of the last "usage" key in the end of a JSON
// answer (a key in quotes cannot occur unescaped inside a JSON string);
// false when there is none.
func lastUsageValue(tail []byte) ([]byte, bool) {
	i := bytes.LastIndex(tail, []byte(`"usage"`))
	if i < 0 {
		return nil, false
	}
	rest := bytes.TrimLeft(tail[i+len(`"usage"`):], " \t\r\n")
	rest, ok := bytes.CutPrefix(rest, []byte(":"))
	if !ok {
		return nil, false
	}
	return usageValue(rest), true
}

// usageValue cuts the object (or array) that rest starts with out of it,
// to decode alone, without a Decoder copying the answer's tail; a null or
// any other value is left whole (it decodes as no usage).
func usageValue(rest []byte) []byte {
	if len(rest) > 0 && (rest[0] == '{' || rest[0] == '[') {
		return rest[:prompt.ValueEnd(rest, 0)]
	}
	return rest
}

// idleWatch ends a stream whose replica stays silent longer than
// stream_idle_timeout: it cancels the attempt (cause errIdleTimeout),
// which unblocks the read.
type idleWatch struct {
	t clock.Timer
	d time.Duration
}

func (g *Gateway) idleTimer(cancel context.CancelCauseFunc) *idleWatch {
	d := g.conf().StreamIdleTimeout.D()
	if d <= 0 {
		return &idleWatch{}
	}
	return &idleWatch{t: g.clock.AfterFunc(d, func() { cancel(errIdleTimeout) }), d: d}
}

func (w *idleWatch) reset() {
	if w.t != nil {
		w.t.Reset(w.d)
	}
}

func (w *idleWatch) stop() {
	if w.t != nil {
		w.t.Stop()
	}
}
