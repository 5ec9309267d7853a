package ui

import (
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
)

// The view's window: the fleet's figures over the last Buckets ×
// BucketWidth (five minutes), one bucket per ten seconds.
const (
	BucketWidth = 10 * time.Second
	Buckets     = 30
	decisions   = 25 // the last decisions kept
)

// Tallies are the view's counts, fed by the gateway on every settled
// attempt (Note). They hold what the Prometheus registry cannot answer
// cheaply in a browser: a small ring of recent buckets and the last
// decisions. Replicas are keyed by name, so that a replica added or
// removed keeps its own.
type Tallies struct {
	mu        sync.Mutex
	replicas  map[string]*Tally
	attempts  int64 // every attempt counted in a tally
	ring      [Buckets]bucket
	decisions [decisions]Decision // a ring; next is the oldest
	next, n   int
}

// Tally is one replica's (or the fleet's) counts since start.
type Tally struct {
	Attempts int64
	// usagePrompt is the prompt tokens of answers whose usage reported
	// cached_tokens, cached those tokens: the hit rate from usage.
	usagePrompt, cached int64
}

// bucket is the fleet's counts in one BucketWidth.
type bucket struct {
	slot    int64 // start / BucketWidth (0: unused)
	tally   Tally
	ttftSum time.Duration
	ttftN   int64
	ttftMax time.Duration
}

// Route is a decision as /debug/route and the view show it: the policy's
// reason, matched blocks, load and estimate, and the replica it names.
type Route struct {
	Decision    policy.Decision `json:"decision"`
	ReplicaURL  string          `json:"replica_url"`
	ReplicaRank *int            `json:"replica_rank,omitempty"`
	EstTTFTMs   float64         `json:"est_ttft_ms"`
}

// Attempt is one settled attempt, as the gateway notes it.
type Attempt struct {
	At time.Time
	// Replica is the name of the replica tried (the tally's key).
	Replica   string
	RequestID string
	Model     string
	Policy    string // the policy that decided (a pool's own)
	Step      string // a disaggregated request's step ("": whole)
	Branch    string // what the decision did with the prompt's prefix
	Route     Route
	// PrefillURL is the prefill replica a decode step pulled from.
	PrefillURL string
	Verdict    string
	Served     bool
	Status     int           // the replica's HTTP status (0: none)
	TTFT       time.Duration // from the request's arrival (-1: no first token seen)
	Prompt     int           // the usage's prompt tokens (0: none seen)
	Cached     int           // its cached tokens (-1: not reported)
}

// Decision is one settled attempt as the view lists it: the decision as
// /debug/route shows it, and how it ended.
type Decision struct {
	At        time.Time `json:"at"`
	RequestID string    `json:"request_id"`
	Model     string    `json:"model"`
	Policy    string    `json:"policy"`
	Step      string    `json:"step,omitempty"`
	Branch    string    `json:"branch,omitempty"`
	Route
	PrefillURL string   `json:"prefill_url,omitempty"`
	Verdict    string   `json:"verdict"`
	Status     int      `json:"status,omitempty"`
	TTFTMs     *float64 `json:"ttft_ms,omitempty"`
	Prompt     int      `json:"prompt_tokens,omitempty"`
	Cached     *int     `json:"cached_tokens,omitempty"`
}

// NewTallies makes empty tallies.
func NewTallies() *Tallies { return &Tallies{replicas: map[string]*Tally{}} }

// Note counts one settled attempt.
func (s *Tallies) Note(a Attempt) {
	d := Decision{At: a.At, RequestID: a.RequestID, Model: a.Model, Policy: a.Policy, Step: a.Step, Branch: a.Branch,
		Route: a.Route, PrefillURL: a.PrefillURL, Verdict: a.Verdict, Status: a.Status, Prompt: a.Prompt}
	if a.TTFT >= 0 {
		ms := millis(a.TTFT)
		d.TTFTMs = &ms
	}
	t := Tally{Attempts: 1}
	if a.Served && a.Prompt > 0 && a.Cached >= 0 {
		t.usagePrompt, t.cached = int64(a.Prompt), int64(a.Cached)
		c := a.Cached
		d.Cached = &c
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.replicas[a.Replica]
	if r == nil {
		r = &Tally{}
		s.replicas[a.Replica] = r
	}
	r.add(t)
	s.attempts++
	b := s.bucket(a.At)
	b.tally.add(t)
	if a.TTFT >= 0 {
		b.ttftSum += a.TTFT
		b.ttftN++
		b.ttftMax = max(b.ttftMax, a.TTFT)
	}
	s.decisions[s.next] = d
	s.next = (s.next + 1) % decisions
	s.n = min(s.n+1, decisions)
}

// Forget drops the tally of the replica named name (the router forgot it).
func (s *Tallies) Forget(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.replicas, name)
}

// Replicas is the number of replicas tallied.
func (s *Tallies) Replicas() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.replicas)
}

func (t *Tally) add(o Tally) {
	t.Attempts += o.Attempts
	t.usagePrompt += o.usagePrompt
	t.cached += o.cached
}

// HitRate is cached / prompt tokens, nil when no usage reported any.
func (t Tally) HitRate() *float64 {
	if t.usagePrompt == 0 {
		return nil
	}
	r := float64(t.cached) / float64(t.usagePrompt)
	return &r
}

// bucket is the ring's bucket of instant at, emptied when it last held an
// older one (s.mu held).
func (s *Tallies) bucket(at time.Time) *bucket {
	slot := at.UnixNano() / int64(BucketWidth)
	b := &s.ring[slot%Buckets]
	if b.slot != slot {
		*b = bucket{slot: slot}
	}
	return b
}

// Point is one bucket of the fleet's series, as /ui/state serves it.
type Point struct {
	Start     time.Time `json:"start"`
	Attempts  int64     `json:"attempts"`
	HitRate   *float64  `json:"hit_rate"`
	TTFTMeanM *float64  `json:"ttft_mean_ms"`
	TTFTMaxMs *float64  `json:"ttft_max_ms"`
}

// Snapshot is what the tallies say at an instant.
type Snapshot struct {
	Replicas  map[string]Tally
	Attempts  int64
	Fleet     Tally
	Series    []Point
	Decisions []Decision // newest first
}

// Snapshot is what the tallies say at now.
func (s *Tallies) Snapshot(now time.Time) Snapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := Snapshot{Replicas: make(map[string]Tally, len(s.replicas)), Attempts: s.attempts}
	for name, t := range s.replicas {
		out.Replicas[name] = *t
		out.Fleet.add(*t)
	}
	last := now.UnixNano() / int64(BucketWidth)
	for slot := last - Buckets + 1; slot <= last; slot++ {
		p := Point{Start: time.Unix(0, slot*int64(BucketWidth)).UTC()}
		if b := s.ring[slot%Buckets]; b.slot == slot {
			p.Attempts, p.HitRate = b.tally.Attempts, b.tally.HitRate()
			if b.ttftN > 0 {
				mean, mx := millis(b.ttftSum/time.Duration(b.ttftN)), millis(b.ttftMax)
				p.TTFTMeanM, p.TTFTMaxMs = &mean, &mx
			}
		}
		out.Series = append(out.Series, p)
	}
	for k := 1; k <= s.n; k++ {
		out.Decisions = append(out.Decisions, s.decisions[(s.next-k+decisions)%decisions])
	}
	return out
}

// millis is d in milliseconds, to the microsecond.
func millis(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
