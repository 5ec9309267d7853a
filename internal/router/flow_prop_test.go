package router

import (
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/kvgate/kvgate/internal/policy"
)

// flowCase is one request of the property test and what became of it.
type flowCase struct {
	prio   int
	w      *Waiting
	tk     *Ticket
	first  bool
	done   bool
	ends   int    // times it left the queue or was answered: exactly one at the end
	state  string // waiting, routed, shed, cancelled
	queued bool   // it waited in the queue
}

// TestFlowNothingLost drives a flow-controlled router with any sequence of
// arrivals (tenants, bands, deadlines), first tokens, ends, cancellations,
// scrapes and time, and checks: every request ends exactly once — routed,
// shed with a *ShedError, or cancelled — the queue's count is the requests
// waiting, the replicas' counts are the requests in flight, a request
// leaves the queue routed only when no more urgent one is left waiting,
// and at the end nothing waits and no tenant is active.
func TestFlowNothingLost(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		fc := FlowConfig{
			Saturation: SaturationRule{QueueMs: rapid.SampledFrom([]float64{1, 40, 1000}).Draw(rt, "queue_ms")},
			MaxQueued:  rapid.IntRange(1, 8).Draw(rt, "max_queued"),
			Band:       Band{TTL: time.Duration(rapid.IntRange(1, 10).Draw(rt, "ttl_s")) * time.Second, MaxQueued: rapid.IntRange(1, 5).Draw(rt, "band_max")},
			Bands:      []Band{{Priority: 3, Sheddable: true}},
			Tenants:    map[string]FlowTenant{"B": {Weight: 2}},
		}
		fr := newFlowRig(t, rapid.IntRange(1, 3).Draw(rt, "replicas"), fc)
		var cases []*flowCase
		for step := range rapid.IntRange(1, 120).Draw(rt, "steps") {
			routedFromQueue := map[*flowCase]bool{}
			hookFlow(rt, cases, routedFromQueue)
			flowAction(rt, fr, &cases, step)
			checkFlow(rt, fr, cases, routedFromQueue)
		}
		// Drain: every ticket ends, time passes every expiry.
		hookFlow(rt, cases, map[*flowCase]bool{})
		for ended := true; ended; { // an end may release a waiting request
			ended = false
			for _, c := range cases {
				if c.state == "routed" && !c.done {
					c.tk.Done(fr.now, Outcome{CachedTokens: -1, OutputTokens: 3})
					c.done, ended = true, true
				}
			}
		}
		fr.now = fr.now.Add(time.Hour)
		expireDue(fr, cases)
		for i, c := range cases {
			if c.ends != 1 || c.state == "waiting" {
				rt.Fatalf("request %d: %s, ended %d times", i, c.state, c.ends)
			}
		}
		if fr.rt.Queued() != 0 {
			rt.Fatalf("%d still queued", fr.rt.Queued())
		}
		for _, tf := range fr.rt.FlowTenants() {
			if tf.Active != 0 || tf.Queued != 0 {
				rt.Fatalf("tenant %s still active: %+v", tf.Tenant, tf)
			}
		}
	})
}

// hookFlow has every waiting request record how it leaves the queue.
func hookFlow(rt *rapid.T, cases []*flowCase, routedFromQueue map[*flowCase]bool) {
	for _, c := range cases {
		if c.state != "waiting" {
			continue
		}
		c.w.OnRouted = func(tk *Ticket, err error) {
			c.ends++
			switch {
			case err == nil:
				c.tk, c.state = tk, "routed"
				routedFromQueue[c] = true
			case errors.Is(err, ErrShed):
				c.state = "shed"
			default:
				rt.Fatalf("left the queue with %v", err)
			}
		}
	}
}

// flowAction takes one random action on the rig.
func flowAction(rt *rapid.T, fr *flowRig, cases *[]*flowCase, step int) {
	pick := func(state string, label string) *flowCase {
		var in []*flowCase
		for _, c := range *cases {
			if c.state == state && !c.done {
				in = append(in, c)
			}
		}
		if len(in) == 0 {
			return nil
		}
		return in[rapid.IntRange(0, len(in)-1).Draw(rt, label)]
	}
	switch rapid.IntRange(0, 5).Draw(rt, "action") {
	case 0, 1:
		*cases = append(*cases, flowSubmit(rt, fr, step))
	case 2:
		if c := pick("routed", "first"); c != nil {
			c.tk.FirstToken(fr.now)
			c.first = true
		}
	case 3:
		if c := pick("routed", "done"); c != nil {
			c.tk.Done(fr.now, Outcome{CachedTokens: -1, OutputTokens: rapid.IntRange(0, 50).Draw(rt, "out")})
			c.done = true
		}
	case 4:
		if c := pick("waiting", "cancel"); c != nil && fr.rt.Cancel(c.w) {
			c.state = "cancelled"
			c.ends++
		}
	case 5:
		fr.now = fr.now.Add(time.Duration(rapid.IntRange(0, 3000).Draw(rt, "ms")) * time.Millisecond)
		if rapid.Bool().Draw(rt, "scrape") {
			fr.rt.SetMetrics(0, Metrics{Waiting: rapid.IntRange(0, 8).Draw(rt, "waiting")}, fr.now)
		}
		expireDue(fr, *cases)
	}
}

// flowSubmit submits a random request, at times a retry excluding a
// replica (held for its own candidates alone: errHeldAlone).
func flowSubmit(rt *rapid.T, fr *flowRig, step int) *flowCase {
	c := &flowCase{prio: rapid.IntRange(0, 3).Draw(rt, "prio")}
	fr.exclude = nil
	if n := fr.rt.Replicas(); n > 1 && rapid.IntRange(0, 3).Draw(rt, "retry") == 0 {
		fr.exclude = []int{rapid.IntRange(0, n-1).Draw(rt, "excluded")}
	}
	tenant := rapid.SampledFrom([]string{"A", "B", "C"}).Draw(rt, "tenant")
	deadline := rapid.IntRange(0, 5000).Draw(rt, "deadline_ms")
	w, err := fr.submit(fmt.Sprint("req", step), tenant, c.prio, rapid.IntRange(1, 3000).Draw(rt, "tokens"), func(r *policy.Request) {
		if deadline > 0 {
			r.Deadline = fr.now.Add(time.Duration(deadline) * time.Millisecond)
		}
		r.MaxTokens = rapid.IntRange(0, 64).Draw(rt, "max_tokens")
	})
	switch {
	case errors.Is(err, ErrShed):
		c.state, c.ends = "shed", 1
	case err != nil:
		rt.Fatalf("submit: %v", err)
	case w == nil:
		c.tk, c.state, c.ends = fr.tickets[fmt.Sprint("req", step)], "routed", 1
	default:
		c.w, c.state, c.queued = w, "waiting", true
	}
	return c
}

// expireDue expires every waiting request whose expiry came, as the
// gateway's timer does.
func expireDue(fr *flowRig, cases []*flowCase) {
	for _, c := range cases {
		if c.state != "waiting" || c.w.Expires().After(fr.now) {
			continue
		}
		if err := fr.rt.Expire(c.w); err != nil {
			if !errors.Is(err, ErrShed) {
				panic(err)
			}
			c.state = "shed"
			c.ends++
		}
	}
}

// checkFlow checks the invariants after one action.
func checkFlow(rt *rapid.T, fr *flowRig, cases []*flowCase, routedFromQueue map[*flowCase]bool) {
	waiting, inFlight := 0, 0
	minWaiting := 1 << 30
	for i, c := range cases {
		if c.ends > 1 {
			rt.Fatalf("request %d ended %d times", i, c.ends)
		}
		switch c.state {
		case "waiting":
			waiting++
			if !c.w.alone { // held for its own replicas: the others may pass it
				minWaiting = min(minWaiting, c.prio)
			}
		case "routed":
			if !c.done {
				inFlight++
			}
		}
	}
	for c := range routedFromQueue {
		if c.prio > minWaiting {
			rt.Fatalf("a band-%d request left the queue while a band-%d one waits", c.prio, minWaiting)
		}
	}
	if got := fr.rt.Queued(); got != waiting {
		rt.Fatalf("queue holds %d, %d waiting", got, waiting)
	}
	if q := fr.rt.pools[0].q; q.alone < 0 || q.alone > q.n {
		rt.Fatalf("%d of %d waiting counted as held alone", q.alone, q.n)
	}
	checkAloneWork(rt, fr.rt.pools[0].q)
	n := 0
	for i := range fr.rt.Replicas() {
		n += fr.rt.InFlight(i)
	}
	if n != inFlight {
		rt.Fatalf("replicas count %d in flight, %d routed and not done", n, inFlight)
	}
}

// checkAloneWork checks each band's and tenant's work held alone (what the
// estimate leaves out: queue.ahead) against the requests waiting there.
func checkAloneWork(rt *rapid.T, q *queue) {
	q.mu.Lock()
	defer q.mu.Unlock()
	near := func(a, b float64) bool { return math.Abs(a-b) <= 1e-3+1e-9*math.Abs(b) }
	for _, b := range q.bands {
		inBand := 0.0
		for _, tq := range b.tenants {
			s := 0.0
			for _, w := range tq.h {
				if w.alone {
					s += w.work
				}
			}
			if !near(tq.alone, s) {
				rt.Fatalf("band %d, tenant %s: %g of work counted held alone, %g waiting so", b.prio, tq.t.name, tq.alone, s)
			}
			inBand += s
		}
		if !near(b.alone, inBand) {
			rt.Fatalf("band %d: %g of work counted held alone, %g waiting so", b.prio, b.alone, inBand)
		}
	}
}
