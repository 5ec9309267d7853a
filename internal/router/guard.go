package router

import (
	"runtime/debug"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

// A policy's Pick is total (every registered policy is checked over any
// view: policy.TestEveryPolicyIsTotal), but a policy is code that reads
// numbers from outside the process: should one still panic, it costs the
// request its policy, never the connection or the process, and never
// every request while the input that broke it lasts. Every call into a
// policy's Pick, PickPair or Observe goes through guard: a panic is recovered,
// reported (Config.OnPolicyPanic, with its stack at most once per
// PanicReportEvery and policy), and the request is routed by least load
// among the same candidates (the least_load policy, itself total).

// PanicReportEvery is how often a panicking policy's stack is reported:
// once a minute per policy, on the router's clock, so that an input that
// makes every request panic logs a line a minute, not one a request.
const PanicReportEvery = time.Minute

// PolicyPanic is a panic recovered from a policy's Pick or PickPair.
type PolicyPanic struct {
	// Policy is the name of the policy that panicked (a pool's own
	// included).
	Policy string
	// Value is what the policy panicked with.
	Value any
	// Stack is the panicking goroutine's stack, set on the policy's first
	// panic and then at most once per PanicReportEvery (nil otherwise:
	// count the panic, log only those with a stack).
	Stack []byte
	// Suppressed is the number of the policy's panics reported without a
	// stack since the last one with a stack.
	Suppressed int
}

// panicReports throttles the stacks of panicking policies, per policy.
type panicReports struct {
	mu         sync.Mutex
	last       map[string]time.Time // policy → when its stack was last reported
	suppressed map[string]int       // policy → panics since, reported without a stack
}

// guard runs f, a call into the policy named name, and reports whether it
// returned: a panic in it is recovered and reported (false).
func (rt *Router) guard(name string, f func()) (ok bool) {
	defer func() {
		if v := recover(); v != nil {
			ok = false
			rt.panicked(name, v)
		}
	}()
	f()
	return true
}

// panicked reports a panic of the policy named name with value v, with
// its stack when none was reported in the last PanicReportEvery. It runs
// in guard's deferred call, so debug.Stack still holds the panic's frames.
func (rt *Router) panicked(name string, v any) {
	p := PolicyPanic{Policy: name, Value: v}
	now := rt.cfg.Now()
	r := &rt.panics
	r.mu.Lock()
	if last, ok := r.last[name]; ok && now.Sub(last) < PanicReportEvery {
		r.suppressed[name]++
	} else {
		if r.last == nil {
			r.last, r.suppressed = map[string]time.Time{}, map[string]int{}
		}
		r.last[name] = now
		p.Suppressed, r.suppressed[name] = r.suppressed[name], 0
		p.Stack = debug.Stack()
	}
	r.mu.Unlock()
	if f := rt.cfg.OnPolicyPanic; f != nil {
		f(p)
	}
}

// pick is pol's Pick among views, guarded: after a panic, least load's.
func (rt *Router) pick(pol policy.Policy, req *policy.Request, views []policy.ReplicaView) (policy.Decision, error) {
	var d policy.Decision
	var err error
	if rt.guard(pol.Name(), func() { d, err = pol.Pick(req, views) }) {
		return d, err
	}
	return rt.leastLoad.Pick(req, views)
}

// pickPairBy is pp's PickPair (pp is pol's), guarded: after a panic, least
// load's pair, each side by its Pick (the router's per-side rule).
func (rt *Router) pickPairBy(pol policy.Policy, pp policy.PairPicker, req *policy.Request, pre, dec []policy.ReplicaView) (policy.PairDecision, error) {
	var pd policy.PairDecision
	var err error
	if rt.guard(pol.Name(), func() { pd, err = pp.PickPair(req, pre, dec) }) {
		return pd, err
	}
	return rt.pickPerSide(rt.leastLoad, req, pre, dec)
}

// observe tells the policy that routed t the event ev, guarded: a panic in
// Observe costs the policy what it would have learnt, never the request
// (Observe runs on the request's goroutine, after its bytes may have gone).
func (t *Ticket) observe(ev policy.Event) {
	if t.obs == nil {
		return
	}
	name := "" // an Observer is a policy: name it as Pick's panics are named
	if p, ok := t.obs.(policy.Policy); ok {
		name = p.Name()
	}
	t.rt.guard(name, func() { t.obs.Observe(ev) })
}
