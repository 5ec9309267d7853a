package bench

import (
	"time"

	"github.com/kvgate/kvgate/internal/report"
)

// Summarize is report.Summarize for a live run, with a wider p90 interval
// (ttft_p90_ci_ms): the union of the bootstrap of independent requests and
// report.SectionedP90Interval. A live run's slow requests come in bursts
// (a stall of the machine or the network delays the requests in flight
// together), which only the second sees; and the verdict calls two runs a
// tie when these intervals overlap.
func Summarize(policy string, recs []report.Record, replicas int, wall time.Duration) report.Run {
	run := report.Summarize(policy, recs, replicas, wall)
	if sec, ok := report.SectionedP90Interval(recs); ok && run.TTFTP90CI != nil {
		ci := run.TTFTP90CI.Union(sec)
		run.TTFTP90CI = &ci
	}
	return run
}
