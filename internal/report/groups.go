package report

import (
	"slices"
	"strconv"
	"time"
)

// Group summarises the requests of one tenant or one priority band of a
// run: what each got, and why the failed ones failed (ErrKind, e.g.
// "http_429", "shed_ttl"), so that a noisy neighbour's flood and a
// well-behaved tenant's latency are read apart.
type Group struct {
	Requests int            `json:"requests"`
	Errors   int            `json:"errors"`
	ErrKinds map[string]int `json:"error_kinds,omitempty"`
	TTFTms   Dist           `json:"ttft_ms"`
	E2Ems    Dist           `json:"e2e_ms"`
	// Tokens of its successful requests, and its share of the run's
	// output rate.
	PromptTokens     int64   `json:"prompt_tokens"`
	CachedTokens     int64   `json:"cached_tokens"`
	OutputTokens     int64   `json:"output_tokens"`
	OutputTokensPerS float64 `json:"output_tokens_per_s"`
	HitRate          float64 `json:"hit_rate"`
}

// groups are recs' summaries per tenant and per priority (nil when no
// record names a tenant or a priority other than 0).
func groups(recs []Record, wall time.Duration) (tenants, priorities map[string]Group) {
	named := slices.ContainsFunc(recs, func(r Record) bool { return r.Tenant != "" || r.Priority != 0 })
	if !named {
		return nil, nil
	}
	if wall <= 0 {
		wall = span(recs)
	}
	by := func(key func(Record) string) map[string]Group {
		parts := map[string][]Record{}
		for _, r := range recs {
			k := key(r)
			parts[k] = append(parts[k], r)
		}
		out := make(map[string]Group, len(parts))
		for k, rs := range parts {
			out[k] = groupOf(rs, wall)
		}
		return out
	}
	return by(func(r Record) string { return r.Tenant }), by(func(r Record) string { return strconv.Itoa(r.Priority) })
}

// groupOf summarises one group's records over the run's wall.
func groupOf(recs []Record, wall time.Duration) Group {
	g := Group{Requests: len(recs)}
	var ttft, e2e []float64
	for _, r := range recs {
		if r.Err {
			g.Errors++
			if g.ErrKinds == nil {
				g.ErrKinds = map[string]int{}
			}
			g.ErrKinds[r.ErrKind]++
			continue
		}
		ttft, e2e = append(ttft, ms(r.TTFT)), append(e2e, ms(r.E2E))
		g.PromptTokens += int64(r.PromptTokens)
		g.CachedTokens += int64(r.CachedTokens)
		g.OutputTokens += int64(r.OutputTokens)
	}
	slices.Sort(ttft)
	slices.Sort(e2e)
	g.TTFTms, g.E2Ems = distOf(ttft), distOf(e2e)
	if wall > 0 {
		g.OutputTokensPerS = float64(g.OutputTokens) / wall.Seconds()
	}
	if g.PromptTokens > 0 {
		g.HitRate = float64(g.CachedTokens) / float64(g.PromptTokens)
	}
	return g
}

// span is the time from the first arrival to the last completion.
func span(recs []Record) time.Duration {
	var first, last time.Duration
	for i, r := range recs {
		if i == 0 || r.Start < first {
			first = r.Start
		}
		last = max(last, r.Start+r.E2E)
	}
	return last - first
}
