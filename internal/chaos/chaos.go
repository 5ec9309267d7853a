// Package chaos is kvgate's reliability suite: it starts simulated replicas
// with one kind of fault injected (internal/sim's fault injection, or a
// stand-in frontend for what the sim cannot do), a gateway in front of
// them, all in-process on loopback, sends a bounded load through the
// gateway and accounts for every request. The client-side scenarios keep
// the replicas healthy and make the clients misbehave instead: hanging up,
// reading slowly, asking for absurd lengths, sending an input that crashes
// a replica, asking for an adapter only one replica serves. The
// hostile-peers scenarios (hostile.go) attack the gateway's other doors —
// the shared state in Redis, the KV-event socket, request bodies, the
// passthrough paths, the replica list — beside an ordinary load.
//
// Each request ends in exactly one class (see Class): succeeded,
// failed with a clear error, hung up by its client on purpose, or lost. A request is also counted as retried
// when the gateway sent it to more than one replica. The suite checks the
// gateway's retry rule per request — another replica may receive a request
// only when the previous one surely did not start it: the connection failed
// before the request was sent, or the replica refused it (503, 429) — from
// a recording transport under the gateway (keyed by X-Request-Id), and
// reconciles those records with the replicas' own engine counters: a
// replica never generated more requests than the gateway saw answered plus
// the attempts that broke after being sent. Afterwards the gateway's
// in-flight counts must return to zero and every replica that is healthy
// must be back in rotation.
package chaos

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"
)

// Kind names a fault scenario.
type Kind string

// The fault scenarios, one per kind of failure a replica shows in production.
const (
	// Refuse: a replica crashes (listener closed, open connections cut) and
	// comes back on the same port after a while (sim RefuseAfter/RefuseFor).
	Refuse Kind = "refuse"
	// Die: a replica's connection dies after the first chunk of a stream, or
	// before any byte of a non-streamed answer (sim DieRate).
	Die Kind = "die"
	// Stall: a replica holds some requests before any byte; the gateway's
	// first-byte timeout answers them 504 (sim StallRate/Stall). It does
	// not resend them: the replica may have started.
	Stall Kind = "stall"
	// Error500: a replica answers some requests 500 (sim ErrorRate).
	Error500 Kind = "error500"
	// Fail503: a replica's engine dies: every request after the first few,
	// and its /health, answer 503 (sim FailAfter).
	Fail503 Kind = "fail503"
	// Limit429: every replica sits behind a rate limiter answering 429 to a
	// share of requests (a stand-in frontend; the sim has no such fault).
	Limit429 Kind = "limit429"
	// Flap: a replica's address goes away and comes back repeatedly (a
	// stand-in frontend closing and reopening its listener).
	Flap Kind = "flap"
	// Timeout: every replica stalls a share of requests past the gateway's
	// per-request timeout.
	Timeout Kind = "timeout"
	// Overload: no fault; the gateway's concurrency limit and bounded queue
	// meet 10× the load it admits.
	Overload Kind = "overload"
	// Truncate: a replica ends some streams cleanly after their first event,
	// without [DONE] (a stand-in frontend); the gateway must end them with
	// an SSE error event so the client can tell them from complete ones.
	Truncate Kind = "truncate"
)

// The client-side scenarios: healthy replicas, misbehaving clients. Their
// checks do not depend on timing, and no client may get a replica ejected.
const (
	// HangUp10 and HangUp50: 10 % and 50 % of the clients close their
	// stream at its first token.
	HangUp10 Kind = "hangup10"
	HangUp50 Kind = "hangup50"
	// SlowReader: a few clients stream a long answer and stop reading it at
	// its first token, with a small receive buffer, until everyone else's
	// requests are done; then they hang up.
	SlowReader Kind = "slowreader"
	// Overflow: every 20th request asks for max_tokens 2^63−1; it must get a
	// clear 400, and every ordinary request beside it must succeed.
	Overflow Kind = "overflow"
	// QueryOfDeath: one request's input crashes the replica that reads it.
	// It must not be retried on each replica in turn: at most one crashes.
	QueryOfDeath Kind = "querydeath"
	// Hetero: one replica of three also serves a LoRA adapter; every
	// request for the adapter must reach that replica, none answered 404.
	Hetero Kind = "hetero"
	// Defaults: clients hanging up (10 %), two slow readers and overflow
	// requests against a gateway on its default settings (timeouts,
	// cooldowns, retries), not the suite's tight ones.
	Defaults Kind = "defaults"
)

// Kinds lists every scenario the suite asserts on, in the order Report
// prints them: the replica faults, the client-side scenarios, then the
// hostile peers.
func Kinds() []Kind {
	return slices.Concat(ReplicaKinds(), ClientKinds(), HostileKinds())
}

// kindSets are the names ParseKinds takes for a whole set.
var kindSets = map[string]func() []Kind{"all": Kinds, "replica": ReplicaKinds, "client": ClientKinds, "hostile": HostileKinds}

// ReplicaKinds are the scenarios that inject a fault into the replicas.
func ReplicaKinds() []Kind {
	return []Kind{Refuse, Die, Stall, Error500, Fail503, Limit429, Flap, Timeout, Truncate, Overload}
}

// ClientKinds are the client-side scenarios.
func ClientKinds() []Kind {
	return []Kind{HangUp10, HangUp50, SlowReader, Overflow, QueryOfDeath, Hetero, Defaults}
}

// Options bound a run. The zero value of every field takes its default.
type Options struct {
	Kinds    []Kind  // scenarios to run, default Kinds()
	Requests int     // per scenario, default 120 (overload: 3× this at 10× load, after a baseline of half)
	Rate     float64 // open-loop arrivals per second, default 100
	Replicas int     // default 3 (overload: 2)
	// MaxTokens each request asks for (ignore_eos), default 24.
	MaxTokens int
	// Policy routes the requests, default round_robin, so that every replica,
	// the faulty one included, receives its share and the fault is met.
	Policy string
	Seed   uint64 // default 1
	// TimeScale of the simulated replicas, default 20 (overload: always 1,
	// so that service time dominates the gateway's own overhead).
	TimeScale float64
	// ClientTimeout bounds each request; an answer not complete by then is
	// lost. Default 15s.
	ClientTimeout time.Duration
	// ScenarioTimeout bounds one scenario in wall time, default 60 s plus
	// ten times the load's expected length (Requests / Rate).
	ScenarioTimeout time.Duration
	Logger          *slog.Logger // the gateway's logger, default discard
	// HostileFor is how long each hostile-peers scenario's attack and
	// ordinary load last (the load: Rate requests a second per gateway),
	// default Requests / Rate.
	HostileFor time.Duration
	// Redis is a redis-server's URL (redis://127.0.0.1:PORT/0) for the
	// forged-loads scenario, whose gateways share state through it; each
	// run uses a namespace of its own. "": the scenario is skipped.
	Redis string
}

func (o Options) withDefaults() Options {
	if len(o.Kinds) == 0 {
		o.Kinds = Kinds()
	}
	if o.Requests <= 0 {
		o.Requests = 120
	}
	if o.Rate <= 0 {
		o.Rate = 100
	}
	if o.Replicas <= 0 {
		o.Replicas = 3
	}
	if o.MaxTokens <= 0 {
		o.MaxTokens = 24
	}
	if o.Policy == "" {
		o.Policy = "round_robin"
	}
	if o.Seed == 0 {
		o.Seed = 1
	}
	if o.TimeScale <= 0 {
		o.TimeScale = 20
	}
	if o.ClientTimeout <= 0 {
		o.ClientTimeout = 15 * time.Second
	}
	if o.ScenarioTimeout <= 0 {
		o.ScenarioTimeout = time.Minute + time.Duration(10*float64(o.Requests)/o.Rate*float64(time.Second))
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.HostileFor <= 0 {
		o.HostileFor = time.Duration(float64(o.Requests) / o.Rate * float64(time.Second))
	}
	return o
}

// ErrUnknownKind is returned for a scenario name Kinds does not list.
var ErrUnknownKind = errors.New("chaos: unknown fault kind")

// ParseKinds parses a comma-separated list of kinds and sets of kinds
// ("replica", "client", "hostile"; "" or "all": every kind).
func ParseKinds(s string) ([]Kind, error) {
	if s == "" {
		return Kinds(), nil
	}
	var out []Kind
	for _, name := range strings.Split(s, ",") {
		name = strings.TrimSpace(name)
		if set, ok := kindSets[name]; ok {
			out = append(out, set()...)
			continue
		}
		if name == "" {
			continue
		}
		k := Kind(name)
		if !slices.Contains(Kinds(), k) {
			return nil, fmt.Errorf("%w %q (known: %v, or a set: all, replica, client, hostile)", ErrUnknownKind, name, Kinds())
		}
		out = append(out, k)
	}
	return out, nil
}

// Result is one scenario's account.
type Result struct {
	Kind Kind
	// ClientCaused: a client-side scenario whose replicas stay healthy, so
	// every ejection, and every ordinary request that failed, was caused
	// by the misbehaving clients.
	ClientCaused bool
	// Sent = Succeeded + FailedClear + HungUp + Lost.
	Sent, Succeeded, FailedClear, HungUp, Lost int
	// Retried requests reached more than one replica (any class).
	Retried int
	// StreamErrors: streams that ended with an SSE error event (part of FailedClear).
	StreamErrors int
	// Status counts the final HTTP status of every answered request.
	Status map[int]int
	// NoRetryAfter counts 429/503 answers without a Retry-After header.
	NoRetryAfter int

	// Attempts the gateway made upstream (recorded), the retries among them
	// (attempts after a request's first), and kvgate_retries_total's
	// increase (which also counts a retry that found no replica left).
	Attempts, RecordedRetries, RetriesMetric int
	// RuleViolations: requests whose attempts broke the retry rule.
	RuleViolations int
	// Generations the replicas' engines admitted (finished + aborted), the
	// attempts the gateway saw answered 200 (Seen) and the attempts that
	// broke after being sent (Ambiguous: the replica may have begun).
	Generations, Seen, Ambiguous int
	// Wasted = Generations − Seen: generations no client received a byte of
	// (a replica died with the work done, was cut mid-way, or generated a
	// request after a stall the gateway had given up on). Each is within
	// the retry rule; a nonzero figure is work done twice or thrown away.
	Wasted int
	// PreEngine: the fault answers before a replica's engine admits the
	// request (a 500, a 503, a 429, a shed), so Wasted must be 0.
	PreEngine bool
	// Mismatches: replicas whose engine count is outside [seen, seen+ambiguous],
	// answers whose X-Kvgate-Replica is not the replica last tried, and
	// answers no attempt upstream produced.
	Mismatches []string
	// Aborted: generations the engines cut short (a client or the gateway
	// went away mid-way).
	Aborted int

	// Ejections: kvgate_ejections_total's increase over all replicas.
	Ejections int
	// Back: every replica expected back in rotation was, by the end;
	// StayedOut: every permanently failed replica was out.
	Back, StayedOut bool
	// InFlightZero: the gateway's in-flight, admitted and queued counts
	// returned to zero after the load.
	InFlightZero bool
	FaultWindows int // flap: down windows

	// Latency of succeeded requests (wall time).
	P50, P99 time.Duration
	Wall     time.Duration // the load's wall time

	// Overload only: the baseline phase at the concurrency limit, and the
	// overload phase's offered rate, admitted answers and sheds.
	Baseline              *Result
	OfferedRate           float64
	Admitted, Shed, QTime int // 200s, 429s, 503 queue timeouts

	// The client-side scenarios' requests by what their client did:
	// Ordinary requests (and those of them that did not succeed),
	// Overflow requests (and those answered a clear 400), PoisonReplicas
	// (the replicas the query of death reached), Adapter requests (those
	// that reached a replica not serving the adapter, and those answered 404).
	Ordinary, OrdinaryFailed    int
	Overflow, Overflow400       int
	Poison, PoisonReplicas      int
	Adapter, AdapterElsewhere   int
	Adapter404                  int
	LostReasons, FailReasons    []string // samples of the first few of each
	OrdinaryReasons, OddReasons []string // ordinary requests that failed; overflow/adapter ones answered wrong

	// Peers: a hostile-peers scenario's account (nil for the others); its
	// ordinary requests are counted in the classes above.
	Peers *PeerAccount
}

// Clear reports whether the scenario kept the suite's invariants and met
// its fault: Invariants and FaultMet found nothing.
func (r *Result) Clear() bool {
	return len(r.Invariants()) == 0 && len(r.FaultMet()) == 0
}

// Run runs each scenario of opts in turn on a fresh fleet and gateway.
func Run(ctx context.Context, opts Options) ([]*Result, error) {
	opts = opts.withDefaults()
	var out []*Result
	for _, k := range opts.Kinds {
		res, err := runKind(ctx, k, opts)
		if err != nil {
			return out, fmt.Errorf("chaos: %s: %w", k, err)
		}
		out = append(out, res)
	}
	return out, nil
}

// runKind runs one scenario on a fresh system.
func runKind(ctx context.Context, k Kind, opts Options) (*Result, error) {
	if slices.Contains(HostileKinds(), k) {
		return runPeers(ctx, k, opts)
	}
	sc, err := scenarioFor(k, opts)
	if err != nil {
		return nil, err
	}
	return runScenario(ctx, sc, opts)
}
