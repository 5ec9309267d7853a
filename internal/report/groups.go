package report

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
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
		wall = recordsSpan(recs)
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

// recordsSpan is the time from the first arrival to the last completion.
func recordsSpan(recs []Record) time.Duration {
	var first, last time.Duration
	for i, r := range recs {
		if i == 0 || r.Start < first {
			first = r.Start
		}
		last = max(last, r.Start+r.E2E)
	}
	return last - first
}

// groupLines are the table's lines per tenant and per priority of each
// run that has them ("" for none): the figures a noisy neighbour's flood
// and a well-behaved tenant's latency are read apart by.
func groupLines(res Result) string {
	var b strings.Builder
	for _, r := range res.Runs {
		for _, g := range []struct {
			what string
			m    map[string]Group
		}{{"tenant", r.Tenants}, {"priority", r.Priorities}} {
			if len(g.m) == 0 || (g.what == "priority" && len(g.m) < 2) {
				continue
			}
			for _, k := range slices.Sorted(maps.Keys(g.m)) {
				v := g.m[k]
				fmt.Fprintf(&b, "%s %s %s: %d requests, ttft p50 %s p90 %s p99 %s ms, out tok/s %s, hit %s%%, errors %d",
					r.Policy, g.what, cmp.Or(k, `""`), v.Requests, fmtMs(v.TTFTms.P50), fmtMs(v.TTFTms.P90), fmtMs(v.TTFTms.P99),
					fmtTokRate(v.OutputTokensPerS), fmtPercent(v.HitRate), v.Errors)
				if len(v.ErrKinds) > 0 {
					var kinds []string
					for _, kind := range slices.Sorted(maps.Keys(v.ErrKinds)) {
						kinds = append(kinds, fmt.Sprintf("%s %d", kind, v.ErrKinds[kind]))
					}
					b.WriteString(" (" + strings.Join(kinds, ", ") + ")")
				}
				b.WriteByte('\n')
			}
		}
	}
	return strings.TrimSuffix(b.String(), "\n")
}
