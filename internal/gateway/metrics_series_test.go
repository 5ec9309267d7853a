package gateway

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The cache hands out one policy's and replica's series, makes each child
// once, on first use, and after forget (the replica's series deleted from
// their vectors) makes them anew, so that counting goes on in a series
// the registry exports.
func TestSeriesCache(t *testing.T) {
	vec := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c"}, []string{"replica"})
	var c seriesCache
	a, b := c.of("p", "r1"), c.of("p", "r2")
	if a != c.of("p", "r1") || a == b || a == c.of("q", "r1") {
		t.Fatal("one entry per policy and replica")
	}
	made := 0
	mk := func(name string) func() prometheus.Counter {
		return func() prometheus.Counter { made++; return vec.WithLabelValues(name) }
	}
	if testutil.CollectAndCount(vec) != 0 {
		t.Fatal("a series before its first count")
	}
	for range 3 {
		a.served.get(mk("r1")).Inc()
	}
	b.served.get(mk("r2")).Inc()
	if made != 2 || testutil.ToFloat64(vec.WithLabelValues("r1")) != 3 {
		t.Fatalf("made %d children, r1 counts %v", made, testutil.ToFloat64(vec.WithLabelValues("r1")))
	}
	vec.DeletePartialMatch(prometheus.Labels{"replica": "r1"})
	c.forget("r1")
	if c.of("p", "r2") != b {
		t.Fatal("forget dropped another replica's series")
	}
	c.of("p", "r1").served.get(mk("r1")).Inc()
	if got := testutil.ToFloat64(vec.WithLabelValues("r1")); got != 1 || made != 3 {
		t.Fatalf("after forget: r1 counts %v, made %d", got, made)
	}
}
