package report

import (
	"slices"
	"time"
)

// Makespans summarise a run's programs (an agent's session and its
// subagents, a conversation) or RL batches: what a program's user waits
// for is the whole program, from its first request's arrival to its last
// answer, and an RL trainer waits for the slowest sample of a batch.
//
//   - makespan_ms: the distribution (type 7 percentiles, as every figure
//     here) over the groups: the latest end (arrival + E2E; a failed
//     request's arrival) of its records less the earliest arrival;
//   - count: the groups; failed: those with a failed request (counted
//     in the distribution all the same, ended where they failed);
//   - prefill_tokens_mean: the mean over the groups of the prompt tokens
//     their successful requests computed (prompt − cached, as the replicas
//     report them): per batch, the prefill work co-locating identical
//     samples saves.
type Makespans struct {
	Count             int     `json:"count"`
	Failed            int     `json:"failed,omitempty"`
	Makespanms        Dist    `json:"makespan_ms"`
	PrefillTokensMean float64 `json:"prefill_tokens_mean"`
}

// span is one group's extent and work.
type span struct {
	first, last time.Duration
	prefill     int64
	failed, set bool
}

func (s *span) add(r Record) {
	end := r.Start + r.E2E
	if !s.set {
		s.first, s.last, s.set = r.Start, end, true
	}
	s.first, s.last = min(s.first, r.Start), max(s.last, end)
	if r.Err {
		s.failed = true
		return
	}
	s.prefill += int64(max(r.PromptTokens-r.CachedTokens, 0))
}

// makespans is the programs' and the batches' summaries (nil when no
// record names one).
func makespans(recs []Record) (programs, batches *Makespans) {
	var progs, bats map[int32]*span
	for _, r := range recs {
		if r.Program > 0 {
			progs = addSpan(progs, r.Program, r)
		}
		if r.Batch > 0 {
			bats = addSpan(bats, r.Batch, r)
		}
	}
	return summariseSpans(progs), summariseSpans(bats)
}

func addSpan(m map[int32]*span, k int32, r Record) map[int32]*span {
	if m == nil {
		m = map[int32]*span{}
	}
	s, ok := m[k]
	if !ok {
		s = &span{}
		m[k] = s
	}
	s.add(r)
	return m
}

func summariseSpans(m map[int32]*span) *Makespans {
	if len(m) == 0 {
		return nil
	}
	out := &Makespans{Count: len(m)}
	ms := make([]float64, 0, len(m))
	var prefill int64
	for _, s := range m {
		ms = append(ms, float64(s.last-s.first)/float64(time.Millisecond))
		prefill += s.prefill
		if s.failed {
			out.Failed++
		}
	}
	slices.Sort(ms)
	out.Makespanms = distOf(ms)
	out.PrefillTokensMean = float64(prefill) / float64(len(m))
	return out
}
