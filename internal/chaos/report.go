package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
)

// ErrNotClear is returned by Report when a scenario broke an invariant
// (a lost request, a retry-rule violation, counts that do not reconcile,
// in-flight counts stuck, a replica not back in rotation); the table is
// printed first.
var ErrNotClear = errors.New("chaos: a scenario broke the suite's invariants")

// Report runs the scenarios of opts and prints one table row per fault
// kind, then the overload comparison and any lost or failed requests'
// reasons (a sample).
func Report(ctx context.Context, w io.Writer, opts Options) error {
	opts = opts.withDefaults()
	results, err := Run(ctx, opts)
	if len(results) > 0 {
		if werr := WriteTable(w, results); werr != nil && err == nil {
			err = werr
		}
	}
	if err != nil {
		return err
	}
	for _, r := range results {
		if !r.Clear() {
			return fmt.Errorf("%w: %s", ErrNotClear, r.Kind)
		}
	}
	return nil
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond)) }

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "NO"
}

// WriteTable prints results as Report does.
func WriteTable(w io.Writer, results []*Result) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "kind\tsent\tsucceeded\tretried\tfailed-clear\t(stream err)\tlost\twasted gen\trule viol\tejections\tback\tin-flight 0\tp50 ms\tp99 ms\t")
	row := func(name string, r *Result) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t\n", name, r.Sent, r.Succeeded, r.Retried,
			r.FailedClear, r.StreamErrors, r.Lost, r.Wasted, r.RuleViolations, r.Ejections,
			yesNo(r.Back && r.StayedOut), yesNo(r.InFlightZero), ms(r.P50), ms(r.P99))
	}
	for _, r := range results {
		if r.Baseline != nil {
			b := *r.Baseline
			b.Back, b.StayedOut, b.InFlightZero = r.Back, r.StayedOut, r.InFlightZero
			row(string(r.Kind)+" baseline", &b)
		}
		row(string(r.Kind), r)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	var b strings.Builder
	for _, r := range results {
		if r.Baseline != nil {
			ratio := 0.0
			if r.Baseline.P99 > 0 {
				ratio = float64(r.P99) / float64(r.Baseline.P99)
			}
			fmt.Fprintf(&b, "\n%s: baseline at the concurrency limit p50 %s ms p99 %s ms; offered %.0f req/s (10× the admitted capacity) for %s:"+
				" %d admitted (p50 %s ms, p99 %s ms = %.2f× baseline), %d shed with 429, %d queue timeouts (503), %d 429/503 without Retry-After\n",
				r.Kind, ms(r.Baseline.P50), ms(r.Baseline.P99), r.OfferedRate, r.Wall.Round(time.Millisecond), r.Admitted,
				ms(r.P50), ms(r.P99), ratio, r.Shed, r.QTime, r.NoRetryAfter)
		}
	}
	for _, r := range results {
		fmt.Fprintf(&b, "\n%s: attempts %d (retries %d), kvgate_retries_total +%d, engine generations %d (answered %d, broken after sending %d), windows %d, statuses %s\n",
			r.Kind, r.Attempts, r.RecordedRetries, r.RetriesMetric, r.Generations, r.Seen, r.Ambiguous, r.FaultWindows, statuses(r.Status))
		for _, m := range r.Mismatches {
			fmt.Fprintf(&b, "  MISMATCH %s\n", m)
		}
		for _, s := range r.LostReasons {
			fmt.Fprintf(&b, "  lost: %s\n", s)
		}
		for _, s := range r.FailReasons {
			fmt.Fprintf(&b, "  failed: %s\n", s)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func statuses(m map[int]int) string {
	codes := make([]int, 0, len(m))
	for c := range m {
		codes = append(codes, c)
	}
	sort.Ints(codes)
	parts := make([]string, 0, len(codes))
	for _, c := range codes {
		parts = append(parts, fmt.Sprintf("%d×%d", m[c], c))
	}
	return strings.Join(parts, " ")
}
