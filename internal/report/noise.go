package report

import (
	"cmp"
	"math"
	"slices"
	"sort"
)

// QuantileInterval returns the central interval of the given level (0.90:
// from the 5th to the 95th percentile) of the bootstrap distribution of the
// p-quantile of ascending samples: how far the quantile would move if the
// run's requests were drawn again. 0..0 for no samples.
//
// The percentile bootstrap of a quantile needs no resampling: the quantile
// of a resample is an order statistic X*(r) of it, and X*(r) ≤ x(j) exactly
// when at least r of the n draws fall on x(1)…x(j), a Binomial(n, j/n)
// event. So P(X*(r) ≤ x(j)) = P(Bin(n, j/n) ≥ r), and the interval's ends
// are the order statistics where that probability crosses (1−level)/2 and
// (1+level)/2 (Efron 1979, §3; the "exact bootstrap" of an L-statistic). It
// is the same interval a resampling bootstrap converges to, deterministic,
// and cheap for a million requests. Quantile (type 7) interpolates between
// ranks r and r+1: the lower end is taken from X*(r) and the upper from
// X*(r+1), which can only widen the interval.
//
// It treats the requests as independent draws. A live run's are not quite
// (a queue that builds up delays the requests behind it together), so the
// interval is, if anything, too narrow: differences inside it are noise,
// some just outside it may be too.
func QuantileInterval(sorted []float64, p, level float64) Interval {
	n := len(sorted)
	if n == 0 {
		return Interval{}
	}
	p = min(max(p, 0), 1)
	tail := (1 - min(max(level, 0), 1)) / 2
	h := float64(n-1) * p
	r1 := int(math.Floor(h)) + 1 // 1-based ranks around the type-7 quantile
	r2 := r1
	if float64(r1-1) < h && r1 < n {
		r2 = r1 + 1
	}
	return Interval{Lo: sorted[bootstrapRank(n, r1, tail)-1], Hi: sorted[bootstrapRank(n, r2, 1-tail)-1]}
}

// bootstrapRank is the smallest j in 1..n with P(X*(r) ≤ x(j)) ≥ prob, the
// prob-quantile of the bootstrap distribution of order statistic r.
func bootstrapRank(n, r int, prob float64) int {
	return 1 + sort.Search(n, func(i int) bool { return binomialTail(n, r, float64(i+1)/float64(n)) >= prob })
}

// binomialTail is P(Bin(n, q) ≥ r), summed over the terms within 12
// standard deviations (and 12 terms) of the mean: the rest add less than
// 1e-30.
func binomialTail(n, r int, q float64) float64 {
	switch {
	case r <= 0 || q >= 1:
		return 1
	case r > n || q <= 0:
		return 0
	}
	mean := float64(n) * q
	sd := math.Sqrt(mean * (1 - q))
	lo := max(r, int(mean-12*sd)-12)
	hi := min(n, int(mean+12*sd)+12)
	lnQ, ln1Q := math.Log(q), math.Log1p(-q)
	lgN, _ := math.Lgamma(float64(n + 1))
	sum := 0.0
	for k := lo; k <= hi; k++ {
		lgK, _ := math.Lgamma(float64(k + 1))
		lgNK, _ := math.Lgamma(float64(n - k + 1))
		sum += math.Exp(lgN - lgK - lgNK + float64(k)*lnQ + float64(n-k)*ln1Q)
	}
	return min(sum, 1)
}

// sections and sectionT are the sectioning interval's k and Student's t quantile t(0.95, k−1):
// ten sections, the most that leave each a few dozen requests in a short run.
const (
	sections = 10
	sectionT = 1.8331 // t(0.95, 9)
)

// SectionedP90Interval is a 90 % interval of the p90 TTFT of recs' successful requests that
// counts requests that are slow together: the run cut into ten sections of consecutive
// arrivals, each section's p90, and the whole run's p90 ± t(0.95, 9) · s/√10, s the sections'
// standard deviation (sectioning, the batch-means interval centred on the whole run's estimate;
// Asmussen & Glynn, Stochastic Simulation, 2007, §III.5). In a live run a stall (the machine,
// the network, a queue building up) delays consecutive requests together, which the bootstrap
// of independent requests (QuantileInterval) does not see; sections do, when the stalls are
// shorter than a section. False when there are fewer than 100 successful requests (ten per
// section). The lower end is at least 0.
func SectionedP90Interval(recs []Record) (Interval, bool) {
	ok := make([]Record, 0, len(recs))
	for _, r := range recs {
		if !r.Err {
			ok = append(ok, r)
		}
	}
	n := len(ok)
	if n < 10*sections {
		return Interval{}, false
	}
	slices.SortStableFunc(ok, func(a, b Record) int { return cmp.Compare(a.Start, b.Start) })
	all := make([]float64, n)
	for i, r := range ok {
		all[i] = ms(r.TTFT)
	}
	var sum, sumSq float64
	for k := range sections {
		sec := slices.Clone(all[k*n/sections : (k+1)*n/sections])
		slices.Sort(sec)
		q := Percentile(sec, 0.90)
		sum, sumSq = sum+q, sumSq+q*q
	}
	mean := sum / sections
	sd := math.Sqrt(max(sumSq-sections*mean*mean, 0) / (sections - 1))
	slices.Sort(all)
	p90, half := Percentile(all, 0.90), sectionT*sd/math.Sqrt(sections)
	return Interval{Lo: max(p90-half, 0), Hi: p90 + half}, true
}

// Union is the smallest interval holding both.
func (i Interval) Union(j Interval) Interval {
	return Interval{Lo: min(i.Lo, j.Lo), Hi: max(i.Hi, j.Hi)}
}
