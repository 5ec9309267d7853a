package gateway

import (
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

// The live view's window: the fleet's figures over the last
// uiBuckets × uiBucketWidth (five minutes), one bucket per ten seconds.
const (
	uiBucketWidth = 10 * time.Second
	uiBuckets     = 30
	uiDecisions   = 25 // the last decisions kept
)

// uiStats are the live view's tallies, fed by noteUI on every settled
// attempt. They hold what the Prometheus registry cannot answer cheaply in
// a browser: a small ring of recent buckets and the last decisions. Replicas
// are keyed by name, so that a replica added or removed keeps its own.
type uiStats struct {
	mu        sync.Mutex
	replicas  map[string]*uiTally
	attempts  int64 // every attempt counted in a tally
	ring      [uiBuckets]uiBucket
	decisions [uiDecisions]uiDecision // a ring; next is the oldest
	next, n   int
}

// uiTally is one replica's (or the fleet's) counts since start.
type uiTally struct {
	attempts int64
	// usagePrompt is the prompt tokens of answers whose usage reported
	// cached_tokens, cached those tokens: the hit rate from usage.
	usagePrompt, cached int64
}

// uiBucket is the fleet's counts in one uiBucketWidth.
type uiBucket struct {
	slot     int64 // start / uiBucketWidth (0: unused)
	attempts int64
	tally    uiTally
	ttftSum  time.Duration
	ttftN    int64
	ttftMax  time.Duration
}

// uiDecision is one settled attempt as the view lists it: the decision as
// /debug/route shows it, and how it ended.
type uiDecision struct {
	At        time.Time `json:"at"`
	RequestID string    `json:"request_id"`
	Model     string    `json:"model"`
	Policy    string    `json:"policy"` // the policy that decided (a pool's own)
	Step      string    `json:"step,omitempty"`
	Branch    string    `json:"branch,omitempty"`
	routeDecision
	PrefillURL string   `json:"prefill_url,omitempty"`
	Verdict    string   `json:"verdict"`
	Status     int      `json:"status,omitempty"`
	TTFTMs     *float64 `json:"ttft_ms,omitempty"`
	Prompt     int      `json:"prompt_tokens,omitempty"`
	Cached     *int     `json:"cached_tokens,omitempty"`
}

func newUIStats() *uiStats { return &uiStats{replicas: map[string]*uiTally{}} }

// noteUI is the live view's sink: it counts every settled attempt that
// was sent.
func (g *Gateway) noteUI(st *settledAttempt) {
	if st.sent {
		g.ui.note(st, g.describe(st.a.tk.Decision))
	}
}

// note counts one settled attempt, its decision described as rd.
func (s *uiStats) note(st *settledAttempt, rd routeDecision) {
	x, a, ttft, end := st.x, st.a, st.ttft, st.end
	d := uiDecision{At: end, RequestID: x.id, Model: modelOf(x), Policy: st.policy, Step: a.step, Branch: st.branch,
		routeDecision: rd, Verdict: a.v.String(), Status: a.status, Prompt: a.prompt}
	if a.prefill != nil && a.step != stepPrefill {
		d.PrefillURL = a.prefill.URL()
	}
	if ttft >= 0 {
		ms := float64(ttft.Microseconds()) / 1000
		d.TTFTMs = &ms
	}
	var t uiTally
	t.attempts = 1
	if a.v == served && a.prompt > 0 && a.cached >= 0 {
		t.usagePrompt, t.cached = int64(a.prompt), int64(a.cached)
		c := a.cached
		d.Cached = &c
	}
	name := st.name
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.replicas[name]
	if r == nil {
		r = &uiTally{}
		s.replicas[name] = r
	}
	r.add(t)
	s.attempts++
	b := s.bucket(end)
	b.tally.add(t)
	if ttft >= 0 {
		b.ttftSum += ttft
		b.ttftN++
		b.ttftMax = max(b.ttftMax, ttft)
	}
	s.decisions[s.next] = d
	s.next = (s.next + 1) % uiDecisions
	s.n = min(s.n+1, uiDecisions)
}

func (t *uiTally) add(o uiTally) {
	t.attempts += o.attempts
	t.usagePrompt += o.usagePrompt
	t.cached += o.cached
}

// hitRate is cached / prompt tokens, nil when no usage reported any.
func (t uiTally) hitRate() *float64 {
	if t.usagePrompt == 0 {
		return nil
	}
	r := float64(t.cached) / float64(t.usagePrompt)
	return &r
}

// bucket is the ring's bucket of instant at, emptied when it last held an
// older one (s.mu held).
func (s *uiStats) bucket(at time.Time) *uiBucket {
	slot := at.UnixNano() / int64(uiBucketWidth)
	b := &s.ring[slot%uiBuckets]
	if b.slot != slot {
		*b = uiBucket{slot: slot}
	}
	return b
}

// uiPoint is one bucket of the fleet's series, as /ui/state serves it.
type uiPoint struct {
	Start     time.Time `json:"start"`
	Attempts  int64     `json:"attempts"`
	HitRate   *float64  `json:"hit_rate"`
	TTFTMeanM *float64  `json:"ttft_mean_ms"`
	TTFTMaxMs *float64  `json:"ttft_max_ms"`
}

// uiSnapshot is what the tallies say at now.
type uiSnapshot struct {
	replicas  map[string]uiTally
	attempts  int64
	fleet     uiTally
	series    []uiPoint
	decisions []uiDecision // newest first
}

func (s *uiStats) snapshot(now time.Time) uiSnapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := uiSnapshot{replicas: make(map[string]uiTally, len(s.replicas)), attempts: s.attempts}
	for name, t := range s.replicas {
		out.replicas[name] = *t
		out.fleet.add(*t)
	}
	last := now.UnixNano() / int64(uiBucketWidth)
	for slot := last - uiBuckets + 1; slot <= last; slot++ {
		p := uiPoint{Start: time.Unix(0, slot*int64(uiBucketWidth)).UTC()}
		if b := s.ring[slot%uiBuckets]; b.slot == slot {
			p.Attempts, p.HitRate = b.tally.attempts, b.tally.hitRate()
			if b.ttftN > 0 {
				mean := float64((b.ttftSum / time.Duration(b.ttftN)).Microseconds()) / 1000
				mx := float64(b.ttftMax.Microseconds()) / 1000
				p.TTFTMeanM, p.TTFTMaxMs = &mean, &mx
			}
		}
		out.series = append(out.series, p)
	}
	for k := 1; k <= s.n; k++ {
		out.decisions = append(out.decisions, s.decisions[(s.next-k+uiDecisions)%uiDecisions])
	}
	return out
}

// uiReplica is one replica's row: its state as /admin/replicas shows it,
// and what the view adds.
type uiReplica struct {
	replicaDebug
	// State: healthy (in rotation), unhealthy (its /health fails),
	// ejected (its breaker is open), half-open (back on trial) or draining
	// (removed by discovery, its requests in flight finishing; once they
	// have, the row goes).
	State       string   `json:"state"`
	ScrapeAgeMs *float64 `json:"scrape_age_ms"` // nil: never scraped
	Attempts    int64    `json:"attempts"`
	Share       float64  `json:"share"`
	HitRate     *float64 `json:"hit_rate"`
	KVSynced    *bool    `json:"kv_synced,omitempty"` // precise mode only
}

// uiState is GET /ui/state's answer.
type uiState struct {
	Policy        string       `json:"policy"`
	Now           time.Time    `json:"now"`
	BucketSeconds float64      `json:"bucket_seconds"`
	InFlight      int64        `json:"in_flight"`
	Attempts      int64        `json:"attempts"`
	HitRate       *float64     `json:"hit_rate"`
	Replicas      []uiReplica  `json:"replicas"`
	Series        []uiPoint    `json:"series"`
	Decisions     []uiDecision `json:"decisions"`
}

// liveState gathers the view's state: the replicas from the router's own
// views (as /admin/replicas), the rest from the tallies.
func (g *Gateway) liveState() uiState {
	now := g.clock.Now()
	snap := g.ui.snapshot(now)
	views := g.rt.Views(&policy.Request{Now: now})
	st := uiState{Policy: g.cfg.Policy, Now: now.UTC(), BucketSeconds: uiBucketWidth.Seconds(), InFlight: g.inFlight.Load(),
		Attempts: snap.attempts, HitRate: snap.fleet.hitRate(), Series: snap.series, Decisions: snap.decisions}
	if st.Decisions == nil {
		st.Decisions = []uiDecision{}
	}
	for _, rd := range replicaDebugs(g, views, nil) {
		r := g.rt.Replica(rd.slot)
		if r.Removed() && !r.Draining() {
			continue // a discovery source removed it and its last request ended: gone
		}
		t := snap.replicas[g.rt.Name(rd.slot)]
		row := uiReplica{replicaDebug: rd, State: g.replicaState(rd.slot), Attempts: t.attempts, HitRate: t.hitRate()}
		if snap.attempts > 0 {
			row.Share = float64(t.attempts) / float64(snap.attempts)
		}
		if age := r.MetricsAge(now); age >= 0 {
			ms := float64(age.Microseconds()) / 1000
			row.ScrapeAgeMs = &ms
		}
		if g.rt.Precise() != nil {
			synced := r.PreciseSynced()
			row.KVSynced = &synced
		}
		st.Replicas = append(st.Replicas, row)
	}
	return st
}

// replicaState names replica i's rotation state for the view.
func (g *Gateway) replicaState(i int) string {
	if g.rt.Replica(i).Removed() {
		return "draining" // removed by discovery, its requests in flight finishing
	}
	switch g.fleet.State(i) {
	case "open":
		return "ejected"
	case "half-open":
		if g.rt.Healthy(i) {
			return "half-open"
		}
	}
	if !g.rt.Healthy(i) {
		return "unhealthy"
	}
	return "healthy"
}
