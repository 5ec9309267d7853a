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
// in-flight counts stuck, a client-side scenario's rule) or its fault was
// not met (no ejection, a replica not back in rotation, …); the table and
// every problem are printed first.
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
	var bad []string
	for _, r := range results {
		if !r.Clear() {
			bad = append(bad, string(r.Kind))
		}
	}
	if len(bad) > 0 {
		return fmt.Errorf("%w: %s", ErrNotClear, strings.Join(bad, ", "))
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

// WriteTable prints results as Report does: a row per scenario, the
// overload comparison, then per scenario its counts and every problem.
func WriteTable(w io.Writer, results []*Result) error {
	var faults, peers []*Result
	for _, r := range results {
		if r.Peers != nil {
			peers = append(peers, r)
		} else {
			faults = append(faults, r)
		}
	}
	if len(faults) > 0 {
		if err := writeRows(w, faults); err != nil {
			return err
		}
	}
	if len(peers) > 0 {
		if err := writePeerRows(w, peers, len(faults) > 0); err != nil {
			return err
		}
	}
	var b strings.Builder
	for _, r := range results {
		writeOverload(&b, r)
	}
	for _, r := range results {
		if r.Peers != nil {
			writePeerDetails(&b, r)
		} else {
			writeDetails(&b, r)
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// writePeerRows prints the hostile-peers scenarios' table: their ordinary
// requests (every gateway's), the lowest success rate among the gateways,
// and the verdict.
func writePeerRows(w io.Writer, results []*Result, gap bool) error {
	if gap {
		fmt.Fprintln(w)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "hostile peers\tgateways\tordinary\tsucceeded\tafter retry\tfailed-clear\tlost\tempty replies\tcrashes\t"+
		"lowest success\tp50 ms\tp99 ms\tchecks\t")
	for _, r := range results {
		p := r.Peers
		if p.Skipped != "" {
			fmt.Fprintf(tw, "%s\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\t-\tskipped\t\n", r.Kind)
			continue
		}
		lowest := 1.0
		for _, g := range p.Gateways {
			lowest = min(lowest, g.SuccessRate())
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t\n", r.Kind, len(p.Gateways), r.Sent, r.Succeeded,
			p.Retried, r.FailedClear, r.Lost, p.EmptyReplies, len(p.Crashes), pct(lowest), ms(r.P50), ms(r.P99), checks(r))
	}
	return tw.Flush()
}

// writePeerDetails prints a hostile scenario's attack, each gateway's
// ordinary requests, the attack's figures and every problem.
func writePeerDetails(b *strings.Builder, r *Result) {
	p := r.Peers
	fmt.Fprintf(b, "\n%s: %s\n", r.Kind, p.Attack)
	if p.Skipped != "" {
		fmt.Fprintf(b, "  skipped: %s\n", p.Skipped)
		return
	}
	for _, g := range p.Gateways {
		fmt.Fprintf(b, "  %s: %d ordinary, %d succeeded (%s), p50 %s ms, p99 %s ms\n",
			g.Name, g.Sent, g.Succeeded, pct(g.SuccessRate()), ms(g.P50), ms(g.P99))
	}
	for _, f := range p.Figures {
		fmt.Fprintf(b, "  %s\n", f)
	}
	for _, x := range r.Invariants() {
		fmt.Fprintf(b, "  BROKEN %s\n", x)
	}
	for _, x := range r.FaultMet() {
		fmt.Fprintf(b, "  NOT MET %s\n", x)
	}
}

func writeRows(w io.Writer, results []*Result) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "kind\tsent\tsucceeded\tretried\tfailed-clear\t(stream err)\thung up\tlost\twasted gen\trule viol\t"+
		"ejections\tby clients\tback\tin-flight 0\tp50 ms\tp99 ms\tchecks\t")
	row := func(name string, r *Result, verdict string) {
		byClients := "-"
		if r.ClientCaused {
			byClients = fmt.Sprint(r.Ejections)
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t\n", name, r.Sent, r.Succeeded,
			r.Retried, r.FailedClear, r.StreamErrors, r.HungUp, r.Lost, r.Wasted, r.RuleViolations, r.Ejections, byClients,
			yesNo(r.Back && r.StayedOut), yesNo(r.InFlightZero), ms(r.P50), ms(r.P99), verdict)
	}
	for _, r := range results {
		if r.Baseline != nil {
			b := *r.Baseline
			b.Back, b.StayedOut, b.InFlightZero = r.Back, r.StayedOut, r.InFlightZero
			row(string(r.Kind)+" baseline", &b, "-")
		}
		row(string(r.Kind), r, checks(r))
	}
	return tw.Flush()
}

// writeOverload prints the overload scenario's comparison with its baseline.
func writeOverload(b *strings.Builder, r *Result) {
	if r.Baseline == nil {
		return
	}
	ratio := 0.0
	if r.Baseline.P99 > 0 {
		ratio = float64(r.P99) / float64(r.Baseline.P99)
	}
	fmt.Fprintf(b, "\n%s: baseline at the concurrency limit p50 %s ms p99 %s ms; offered %.0f req/s (10× the admitted capacity) for %s:"+
		" %d admitted (p50 %s ms, p99 %s ms = %.2f× baseline), %d shed with 429, %d queue timeouts (503), %d 429/503 without Retry-After\n",
		r.Kind, ms(r.Baseline.P50), ms(r.Baseline.P99), r.OfferedRate, r.Wall.Round(time.Millisecond), r.Admitted,
		ms(r.P50), ms(r.P99), ratio, r.Shed, r.QTime, r.NoRetryAfter)
}

// writeDetails prints a scenario's counts, its problems (broken invariants
// with their samples, missing fault evidence) and a sample of its clear
// failures.
func writeDetails(b *strings.Builder, r *Result) {
	fmt.Fprintf(b, "\n%s: attempts %d (retries %d), kvgate_retries_total +%d, engine generations %d (answered %d, broken after sending %d, aborted %d), windows %d, statuses %s\n",
		r.Kind, r.Attempts, r.RecordedRetries, r.RetriesMetric, r.Generations, r.Seen, r.Ambiguous, r.Aborted, r.FaultWindows, statuses(r.Status))
	writeClientLine(b, r)
	for _, p := range r.Invariants() {
		fmt.Fprintf(b, "  BROKEN %s\n", p)
	}
	for _, p := range r.FaultMet() {
		fmt.Fprintf(b, "  NOT MET %s\n", p)
	}
	for _, s := range r.FailReasons {
		fmt.Fprintf(b, "  failed: %s\n", s)
	}
}

// checks is a row's verdict: ok, or how many invariants it broke and
// how many pieces of its fault's evidence are missing.
func checks(r *Result) string {
	inv, met := len(r.Invariants()), len(r.FaultMet())
	switch {
	case inv == 0 && met == 0:
		return "ok"
	case met == 0:
		return fmt.Sprintf("BROKEN %d", inv)
	case inv == 0:
		return fmt.Sprintf("NOT MET %d", met)
	}
	return fmt.Sprintf("BROKEN %d, NOT MET %d", inv, met)
}

// writeClientLine prints what a client-side scenario's clients did and met.
func writeClientLine(b *strings.Builder, r *Result) {
	if !r.ClientCaused && r.Poison == 0 {
		return // a replica fault's scenario: every client ordinary
	}
	fmt.Fprintf(b, "  clients: %d ordinary (%d not succeeded), %d hung up, %d overflow (%d answered 400), "+
		"%d query of death (reached %d replicas), %d adapter (%d elsewhere, %d 404)\n",
		r.Ordinary, r.OrdinaryFailed, r.HungUp, r.Overflow, r.Overflow400, r.Poison, r.PoisonReplicas,
		r.Adapter, r.AdapterElsewhere, r.Adapter404)
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
