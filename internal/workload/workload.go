// Package workload makes the request sequences that `kvgate bench` sends
// through a gateway and `kvgate replay` runs in virtual time: seeded
// generators with realistic prefix sharing (multi-turn chat, groups sharing a
// system prompt, repeated prefixes, Zipf-popular prefixes, no sharing) and
// the Mooncake traces, whose prompts are synthesised from their hash ids.
//
// Every byte is a function of the Spec: the same Spec (seed included) gives
// the same requests, byte for byte, in every run and Go release, because all
// randomness comes from PCG-DXSM (see rng) and text from a fixed vocabulary.
// Nothing is mutable at package level: every function, and Request.Text on
// requests nobody writes, is safe for concurrent use.
package workload

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
)

// Request is one request of a workload. Messages and HashIDs may share
// backing arrays with other requests of the same workload: treat them as
// read-only.
type Request struct {
	Index int
	// At is the arrival offset for open-loop runs: the trace timestamp divided
	// by the speed-up, or a Poisson arrival set by Arrivals; 0 in closed loop.
	At time.Duration
	// Prev is the index of the request that must complete before this one is
	// sent (the conversation's previous turn), -1 if none. The runner sends
	// it at max(At, Prev's completion + Think).
	Prev  int
	Think time.Duration
	// Session is the conversation, group or prefix id, or the agent
	// program (X-Session-Id: a program id, router.ProgramOf); "" when the
	// workload has none.
	Session string
	// Program numbers the request's program for the makespan measures
	// (report.Record.Program): a conversation, an agent program with its
	// subagent (whose Session is its own); 0 for none.
	Program int
	// Batch numbers an RL rollout's batch (1, 2, …; 0: none). A request
	// of batch b > 1 without a Prev is sent once every request of batch
	// b − 1 has ended, Think after the last of them (At still bounds it
	// below).
	Batch int
	// Chat selects /v1/chat/completions with Messages; otherwise
	// /v1/completions with the text (see Text).
	Chat     bool
	Messages []Message
	Prompt   string
	// MaxTokens is the number of output tokens; the runner sends it with
	// ignore_eos so that replicas produce exactly this many.
	MaxTokens int
	// InputTokens is the prompt's token count under prompt.Approx of Text():
	// exact, since every generated text is ASCII of a known length.
	InputTokens int
	// HashIDs are the Mooncake hash ids of a trace request (nil otherwise);
	// its text is synthesised from them on demand (see Text).
	HashIDs []int
	// BlockIDs are the hash ids of a recorded trace (kvgate serve --record)
	// whose blocks are BlockTokens tokens rather than Mooncake's 512; its
	// text is synthesised from them as from HashIDs. They are kept apart
	// from HashIDs, which always mean 512-token blocks to their readers.
	BlockIDs    []int
	BlockTokens int
	// Timed: At is the request's own arrival time from a trace or a request
	// log, or the workload's own (an agent program's start; 0 for a
	// request that waits for its Prev or its Batch), which Arrivals keeps.
	Timed bool
	// Tenant is the tenant the request is sent for ("" none): a trace's or
	// a multi-tenant workload's (Mix); Priority its priority (vLLM's:
	// lower is earlier); Deadline its time-to-first-token deadline (0:
	// none).
	Tenant   string
	Priority int
	Deadline time.Duration
}

// Text returns the routing text: the Prompt, the chat rendered as the
// gateway renders it (prompt.RenderChat, each message's content made on
// demand when it is not held), or for a trace request
// TraceText(HashIDs, InputTokens) (AppendTraceTextN of BlockIDs for a
// recorded one), synthesised on each call (about 25 µs for
// 12,000 tokens) rather than held, so that a whole trace costs no text memory.
func (r *Request) Text() string {
	switch {
	case r.Chat:
		return bytesToString(appendChat(nil, r.Messages))
	case r.HashIDs != nil && r.Prompt == "":
		return TraceText(r.HashIDs, r.InputTokens)
	case r.BlockIDs != nil && r.Prompt == "":
		return bytesToString(AppendTraceTextN(nil, r.BlockIDs, r.InputTokens, r.BlockTokens))
	}
	return r.Prompt
}

// AppendText appends Text() to dst, for callers that reuse one buffer.
func (r *Request) AppendText(dst []byte) []byte {
	switch {
	case r.Chat:
		return appendChat(dst, r.Messages)
	case r.HashIDs != nil && r.Prompt == "":
		return AppendTraceText(dst, r.HashIDs, r.InputTokens)
	case r.BlockIDs != nil && r.Prompt == "":
		return AppendTraceTextN(dst, r.BlockIDs, r.InputTokens, r.BlockTokens)
	}
	return append(dst, r.Prompt...)
}

// Bounds on what Generate makes, so that a typo in a parameter is an error
// and not an out-of-memory kill.
const (
	MaxRequests  = 10_000_000
	MaxTextBytes = 8 << 30 // Σ len(Text()) over the workload
)

var (
	// ErrUnknownWorkload: the workload name is not one of Names().
	ErrUnknownWorkload = errors.New("unknown workload")
	// ErrUnknownParam: a parameter the workload does not have.
	ErrUnknownParam = errors.New("unknown workload parameter")
	// ErrBadParam: a parameter (or the request count) out of its range.
	ErrBadParam = errors.New("bad workload parameter")
	// ErrTooLarge: the workload would exceed MaxRequests or MaxTextBytes.
	ErrTooLarge = errors.New("workload too large")
)

// Param describes one parameter of a workload.
type Param struct {
	Name     string
	Default  float64
	Min, Max float64 // inclusive
	Integer  bool
	Doc      string
}

// Spec names a workload. Parse fills Name (and Path); the caller sets the rest.
type Spec struct {
	Name string // multiturn, shared_prefix, prefix_repetition, zipf, random or trace
	Path string // the trace file, for Name == "trace"
	// Requests, when > 0, is the exact number of requests to make: grouped
	// workloads derive their group count from it unless that is set too (then
	// the groups must hold at least Requests); a trace keeps its first
	// Requests records. 0 means the workload's default size.
	Requests int
	Seed     uint64
	// Params overrides the workload's parameters by name (see ParamsOf).
	Params map[string]float64
}

// generator is one workload. plan checks the parameters and sizes the work
// before anything is allocated.
type generator struct {
	name   string
	doc    string
	domain uint64 // rng stream of this workload
	params []Param
	plan   func(p params, requests int) (plan, error)
	// timed: the workload times its own arrivals (Request.Timed: programs
	// and batches start on their own clocks, later requests follow what
	// they wait for), so --rate does not apply and a load generator must
	// send each request when it is due: an open loop (Spec.Timed).
	timed bool
}

type plan struct {
	n         int     // requests
	made      float64 // requests generated before a cut to n
	textBytes float64 // upper bound of Σ len(Text())
	gen       func(r *rng, n int) []Request
}

// TraceName is the workload name of a trace; the spec string is "trace:FILE".
const TraceName = "trace"

// Names lists the workload names, "trace" last (spelled trace:FILE in specs).
func Names() []string {
	out := make([]string, 0, len(generators)+1)
	for i := range generators {
		out = append(out, generators[i].name)
	}
	return append(out, TraceName)
}

// Timed reports whether the workload times its own arrivals: a trace (its
// timestamps), agents (programs at program_rate, turns after tool pauses)
// and rl (the next batch when the last one ends). A load generator runs
// such a workload as an open loop: a closed loop of N clients would hold
// a request that is due until one of them is free, which lengthens the
// programs' makespans and thins the load the replay models.
func (s Spec) Timed() bool {
	if s.Name == TraceName {
		return true
	}
	g := lookup(s.Name)
	return g != nil && g.timed
}

func lookup(name string) *generator {
	for i := range generators {
		if generators[i].name == name {
			return &generators[i]
		}
	}
	return nil
}

func namesList() string {
	ns := Names()
	ns[len(ns)-1] = TraceName + ":FILE"
	return strings.Join(ns, ", ")
}

// ParamsOf returns the parameters of a workload with their defaults and ranges.
func ParamsOf(name string) ([]Param, error) {
	if name == TraceName {
		return slices.Clone(traceParams), nil
	}
	g := lookup(name)
	if g == nil {
		return nil, fmt.Errorf("%w %q: want one of %s", ErrUnknownWorkload, name, namesList())
	}
	return slices.Clone(g.params), nil
}

// Parse reads a workload spec: a name ("multiturn", "shared_prefix",
// "prefix_repetition", "zipf", "random") or "trace:PATH".
func Parse(spec string) (Spec, error) {
	spec = strings.TrimSpace(spec)
	if path, ok := strings.CutPrefix(spec, TraceName+":"); ok {
		if strings.TrimSpace(path) == "" {
			return Spec{}, fmt.Errorf("%w: trace: needs a file, as in trace:PATH", ErrUnknownWorkload)
		}
		return Spec{Name: TraceName, Path: path}, nil
	}
	if spec == TraceName {
		return Spec{}, fmt.Errorf("%w: a trace is given as trace:PATH", ErrUnknownWorkload)
	}
	if lookup(spec) == nil {
		return Spec{}, fmt.Errorf("%w %q: want one of %s", ErrUnknownWorkload, spec, namesList())
	}
	return Spec{Name: spec}, nil
}

// SetParam sets one parameter from "name=value" (the --workload-param
// form), checking the name against the workload and the value's range.
func (s *Spec) SetParam(kv string) error {
	name, val, ok := strings.Cut(kv, "=")
	name, val = strings.TrimSpace(name), strings.TrimSpace(val)
	if !ok || name == "" {
		return fmt.Errorf("%w: %q is not name=value", ErrBadParam, kv)
	}
	v, err := strconv.ParseFloat(val, 64)
	if err != nil {
		return fmt.Errorf("%w: %s=%q is not a number", ErrBadParam, name, val)
	}
	ps, err := ParamsOf(s.Name)
	if err != nil {
		return err
	}
	if err := checkParam(s.Name, ps, name, v); err != nil {
		return err
	}
	if s.Params == nil {
		s.Params = map[string]float64{}
	}
	s.Params[name] = v
	return nil
}

// String is the spec in the command line's words, for reports:
// "multiturn conversations=64 seed=1".
func (s Spec) String() string {
	var b strings.Builder
	b.WriteString(s.Name)
	if s.Name == TraceName {
		b.WriteString(":" + s.Path)
	}
	keys := make([]string, 0, len(s.Params))
	for k := range s.Params {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, " %s=%s", k, strconv.FormatFloat(s.Params[k], 'g', -1, 64))
	}
	if s.Requests > 0 {
		fmt.Fprintf(&b, " requests=%d", s.Requests)
	}
	fmt.Fprintf(&b, " seed=%d", s.Seed)
	return b.String()
}

func checkParam(workload string, ps []Param, name string, v float64) error {
	for _, p := range ps {
		if p.Name != name {
			continue
		}
		switch {
		case !(v >= p.Min && v <= p.Max): // also NaN
			return fmt.Errorf("%w: %s %s=%g is outside [%g, %g]", ErrBadParam, workload, name, v, p.Min, p.Max)
		case p.Integer && v != math.Trunc(v):
			return fmt.Errorf("%w: %s %s=%g must be an integer", ErrBadParam, workload, name, v)
		}
		return nil
	}
	names := make([]string, len(ps))
	for i, p := range ps {
		names[i] = p.Name
	}
	return fmt.Errorf("%w %q for %s: it has %s", ErrUnknownParam, name, workload, strings.Join(names, ", "))
}

// params are a workload's parameters resolved against their defaults.
type params struct {
	vals map[string]float64
	set  map[string]bool // given by the user
}

func resolve(workload string, ps []Param, given map[string]float64) (params, error) {
	p := params{vals: make(map[string]float64, len(ps)), set: map[string]bool{}}
	for _, d := range ps {
		p.vals[d.Name] = d.Default
	}
	keys := make([]string, 0, len(given))
	for k := range given {
		keys = append(keys, k)
	}
	sort.Strings(keys) // report the first bad name in a stable order
	for _, k := range keys {
		if err := checkParam(workload, ps, k, given[k]); err != nil {
			return params{}, err
		}
		p.vals[k], p.set[k] = given[k], true
	}
	return p, nil
}

func (p params) f(name string) float64 {
	v, ok := p.vals[name]
	if !ok {
		panic("workload: undeclared parameter " + name) // a bug in this package, not input
	}
	return v
}

func (p params) int(name string) int { return int(p.f(name)) }

// Generate makes the workload's requests. It sizes the workload first and
// fails with ErrTooLarge beyond MaxRequests requests or MaxTextBytes of text.
func Generate(s Spec) ([]Request, error) {
	if s.Requests < 0 {
		return nil, fmt.Errorf("%w: requests %d is negative", ErrBadParam, s.Requests)
	}
	if s.Requests > MaxRequests {
		return nil, fmt.Errorf("%w: %d requests, at most %d", ErrTooLarge, s.Requests, MaxRequests)
	}
	if s.Name == TraceName {
		return generateTrace(s)
	}
	g := lookup(s.Name)
	if g == nil {
		return nil, fmt.Errorf("%w %q: want one of %s", ErrUnknownWorkload, s.Name, namesList())
	}
	p, err := resolve(g.name, g.params, s.Params)
	if err != nil {
		return nil, err
	}
	pl, err := g.plan(p, s.Requests)
	if err != nil {
		return nil, err
	}
	if err := checkSize(g.name, max(float64(pl.n), pl.made), pl.textBytes); err != nil {
		return nil, err
	}
	reqs := pl.gen(newRNG(s.Seed, g.domain), pl.n)
	text := 0.0 // what was made, for the workloads sized by expectation
	for i := range reqs {
		text += float64(reqs[i].InputTokens) * prompt.TokenBytesPer
	}
	if err := checkSize(g.name, float64(len(reqs)), text); err != nil {
		return nil, err
	}
	return reqs, nil
}

func checkSize(name string, n, textBytes float64) error {
	if n > MaxRequests {
		return fmt.Errorf("%w: %s would make %.0f requests, at most %d", ErrTooLarge, name, n, MaxRequests)
	}
	if textBytes > MaxTextBytes {
		return fmt.Errorf("%w: %s would make %.1f GiB of prompt text, at most %d GiB",
			ErrTooLarge, name, textBytes/(1<<30), MaxTextBytes>>30)
	}
	return nil
}

// domainArrivals is the rng stream of Arrivals.
const domainArrivals uint64 = 0x617272697661 // "arriva"

// Arrivals sets At to Poisson arrivals at rate requests per second, in index
// order: the first at 0, then exponential gaps of mean 1/rate drawn from a
// generator seeded by seed. Trace requests (Timed, or HashIDs set) keep
// their timestamps and are skipped. rate ≤ 0 (or NaN) sets At = 0: closed loop.
func Arrivals(reqs []Request, rate float64, seed uint64) {
	open := rate > 0
	r := newRNG(seed, domainArrivals)
	t, first := 0.0, true
	for i := range reqs {
		if reqs[i].Timed || reqs[i].HashIDs != nil {
			continue
		}
		if !open {
			reqs[i].At = 0
			continue
		}
		if !first {
			t += r.exp() / rate
		}
		first = false
		reqs[i].At = seconds(t)
	}
}

// seconds converts to a Duration, saturating instead of overflowing.
func seconds(s float64) time.Duration {
	ns := s * float64(time.Second)
	if ns >= math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(ns)
}
