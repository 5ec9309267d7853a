package gateway

import (
	"errors"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/router"
)

// verdict is how one attempt at a replica ended, from the replica's point
// of view. It alone decides what the attempt means for the replica's
// breaker, the router's ticket, the prefix index and the metrics, in
// settle: only the replica's own failures count against it.
type verdict int

const (
	// served: the replica answered 2xx and the answer was relayed whole.
	served verdict = iota
	// skipped: the replica's breaker was half-open with a trial in flight;
	// nothing was sent (route again, no attempt spent).
	skipped
	// refused: the replica refused before any work — the connection was
	// refused or broke before the request was written, or it answered 503.
	// Counts against it; the request may go elsewhere.
	refused
	// busy: the replica answered 429. Busy is not broken: it does not count;
	// the request may go elsewhere.
	busy
	// failed: the replica failed after the request was written — a reset or
	// timeout before the first byte, a 5xx, or a stream broken midway. Counts
	// against it; never retried (it may have started the work, or the input
	// may be what breaks it).
	failed
	// rejected: the replica answered 4xx: the client's fault. Does not count;
	// the index forgets the request.
	rejected
	// clientGone: the client went away or stopped reading. Does not count.
	clientGone
	// gatewayLimit: the gateway's own limit ended it (request_timeout, a
	// drain at shutdown). Does not count.
	gatewayLimit
)

func (v verdict) String() string {
	return [...]string{"served", "skipped", "refused", "busy", "failed", "rejected", "client_gone", "gateway_limit"}[v]
}

// retryable reports whether the request surely did not start on the replica,
// so that another replica may take it.
func (v verdict) retryable() bool { return v == refused || v == busy || v == skipped }

// retryable reports whether the exchange may try again elsewhere after a:
// its verdict is retryable, or it is a prefill step that failed (nothing
// reached the client, and no decode step started).
func (a *attempt) retryable() bool {
	return a.v.retryable() || a.notHere || (a.step == stepPrefill && a.v == failed && !a.started)
}

// Steps of a disaggregated request (attempt.step; "" for a whole request).
const (
	stepPrefill = "prefill"
	stepDecode  = "decode"
)

// Causes an attempt's context is cancelled with: each maps to a verdict.
var (
	errFirstByteTimeout = errors.New("the replica sent no response header within first_byte_timeout")
	errIdleTimeout      = errors.New("the replica's stream was idle longer than stream_idle_timeout")
	errRequestTimeout   = errors.New("the request took longer than request_timeout")
	errDrained          = errors.New("the gateway is shutting down and its drain_timeout has passed")
	errClientWrite      = errors.New("writing to the client failed or timed out")
)

// attempt is one try of an exchange at one replica.
type attempt struct {
	tk *router.Ticket
	// step is the step of a disaggregated request (stepPrefill,
	// stepDecode), "" for a whole request.
	step string
	// body is what is sent (nil: the client's body).
	body []byte
	// prefill is the prefill replica whose KV the decode step pulls (and a
	// prefill step's own replica), named in X-Kvgate-Prefill; nil: none.
	prefill *router.Replica
	// kv is a prefill step's answer's kv_transfer_params (nil: none).
	kv []byte
	// pullFrom is the peer the replica pulls the prompt's prefix from
	// (kvpulls.go), named in X-Kvgate-Pull-From; nil: none.
	pullFrom *router.Replica
	// kvID is the X-Request-Id the replica gets when the attempt moves KV
	// (a prefill/decode pair's steps, a peer pull): kvTransferID; "": the
	// client's (exchange.id).
	kvID string
	// noKV: a prefill step answered 2xx without kv_transfer_params.
	noKV bool
	// took is how long a prefill step took.
	took    time.Duration
	v       verdict
	err     error // what went wrong, for logs (nil when served)
	status  int   // the replica's HTTP status (0: none)
	started bool  // the response header went to the client: no retry, no error page
	abort   bool  // a non-streamed body broke midway: abort the client's connection
	// refusal is a 503/429 kept to pass on if no other replica takes it.
	refusal *bufferedResponse
	// notHere: a lookup's 404, kept in refusal: the replica does not hold
	// the response named; the next replica is asked.
	notHere bool
	// prefillCached is, of a decode step pulling a prefill step's KV, the
	// cached prompt tokens the prefill replica reported (-1: none): the
	// request's cache hit, where the decode replica's own usage counts the
	// pulled prompt as cached (the route receipt's prefill_cached_tokens).
	prefillCached int
	// respID is the id of the response a Responses call created (relay);
	// respNoted: its home was remembered (passthrough.created).
	respID    string
	respNoted bool
	// span is the attempt's upstream span (nil: tracing off).
	span trace.Span
	// settled is the attempt as settle hands it to the sinks.
	settled settledAttempt
	cached  int // the replica's usage.prompt_tokens_details.cached_tokens (-1: none)
	prompt  int // its usage.prompt_tokens (0: no usage seen)
	output  int
	firstAt time.Time
}

// noteUsage keeps what an answer's usage says, bounded (boundedUsage).
func (a *attempt) noteUsage(u *openai.Usage) {
	a.cached, a.prompt, a.output = boundedUsage(u)
}

// maxUsageTokens bounds each count of a replica's usage: 2^24 tokens, as
// max_tokens and a program's context are bounded.
const maxUsageTokens = 1 << 24

// boundedUsage is a replica's usage as the gateway may count it (a
// replica's answer is an outside value): prompt and output tokens in [0,
// maxUsageTokens], cached tokens at most the prompt's, or -1 (not
// reported) when absent or negative. Unbounded, a negative count made the
// token counters panic after the answer was relayed, and a huge one spent
// a tenant's quota.
func boundedUsage(u *openai.Usage) (cached, prompt, output int) {
	prompt = min(max(u.PromptTokens, 0), maxUsageTokens)
	output = min(max(u.CompletionTokens, 0), maxUsageTokens)
	if cached = u.Cached(); cached < 0 {
		cached = -1
	} else {
		cached = min(cached, prompt)
	}
	return cached, prompt, output
}

// payload is what the attempt sends: its body, or the client's.
func (a *attempt) payload(x *exchange) []byte {
	if a.body != nil {
		return a.body
	}
	return x.body
}

// outcome is what a verdict means for the replica and the request: its
// health (the breaker's, through the ticket), whether the prefix index
// forgets the request, and whether the attempt reached the replica at all.
type outcome struct {
	health router.Health
	forget forgetRule
	// sent: the attempt went to the replica. A skipped one (its breaker
	// said no) sent nothing: it is routed again and counted then, so the
	// sinks that count attempts leave it out.
	sent bool
}

// forgetRule says when the prefix index forgets a settled request
// (Ticket.Reject): when the replica did not take it.
type forgetRule int8

const (
	keep            forgetRule = iota // the replica took it (or nothing was sent)
	forget                            // refused, or the client's fault
	forgetUnstarted                   // failed: forgotten unless its answer had started
)

// outcomes maps every verdict to its outcome: the one table settle reads.
// Only the replica's own failures count against it; a client's 4xx, a
// client gone, the gateway's limit, a 429 and a loop (508, turned into
// rejected by try) are neutral.
var outcomes = [...]outcome{
	served:       {health: router.HealthOK, sent: true},
	skipped:      {},
	refused:      {health: router.HealthFailed, forget: forget, sent: true},
	busy:         {sent: true},
	failed:       {health: router.HealthFailed, forget: forgetUnstarted, sent: true},
	rejected:     {forget: forget, sent: true},
	clientGone:   {sent: true},
	gatewayLimit: {sent: true},
}

// settle ends an attempt, together and once: its outcome (outcomes) goes
// to the ticket (the breaker's health, the router's counters and
// observers, the prefix index), and the settled attempt to the sinks
// (metrics, the live view, the access log, tracing, the recording, the
// debug log).
func (g *Gateway) settle(x *exchange, a *attempt) {
	o := outcomes[a.v]
	if o.forget == forget || o.forget == forgetUnstarted && !a.started {
		a.tk.Reject() // the replica did not take it: the index forgets
	}
	end := g.clock.Now()
	a.tk.Done(end, router.Outcome{CachedTokens: a.cached, OutputTokens: a.output, Err: a.failure(), Health: o.health})
	if a.v == served && a.tk.Underpredicted(a.cached) {
		g.underpredicted(a.tk.Replica)
	}
	a.settled = settledAttempt{x: x, a: a, end: end, sent: o.sent, name: g.rt.Name(a.tk.Replica), policy: a.tk.Policy(),
		branch: branchOf(a.tk), ttft: -1, route: g.receiptOf(x, a)}
	s := &a.settled // in the attempt, which the sinks share: nothing more to allocate
	if !a.firstAt.IsZero() {
		s.ttft = a.firstAt.Sub(x.start)
	}
	for _, k := range g.sinks.all {
		k(s)
	}
}

// failure is the error the ticket's observers hear (nil: served).
func (a *attempt) failure() error {
	switch {
	case a.v == served:
		return nil
	case a.err != nil:
		return a.err
	}
	return errors.New(a.v.String())
}

// underpredictedWarnAt is how many underpredictions, and at least half of
// the checks, make the misconfiguration warning.
const underpredictedWarnAt = 10

// underpredicted counts a request whose engine hit more of the prompt than
// the trusted precise index predicted, and warns once when it keeps
// happening: the classic silent 0 % hit rate of events that never match.
func (g *Gateway) underpredicted(i int) {
	g.met.underpredicted.WithLabelValues(g.rt.Name(i)).Inc()
	under, checks := g.rt.Replica(i).Underpredicted()
	if under < underpredictedWarnAt || 2*under < checks {
		return
	}
	g.logOnce(i, "underpredicted", slog.LevelWarn, "kv events: the replica keeps reporting more cached prompt tokens "+
		"than its KV events predicted: the events do not match requests. Check that kvgate tokenizes as the replica "+
		"(--tokenizer remote), the model name of the events' topic, and the block size", "underpredicted", under, "checked", checks)
}
