package fleet

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestParseMetrics(t *testing.T) {
	page := `# HELP vllm:num_requests_waiting x
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="a"} 3
vllm:num_requests_waiting{model_name="b"} 2
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="a"} 7
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="a"} 0.5
vllm:kv_cache_usage_perc{model_name="b"} 0.75
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="30000",enable_prefix_caching="True"} 1
`
	m, err := ParseMetrics(strings.NewReader(page))
	if err != nil {
		t.Fatal(err)
	}
	want := router.Metrics{Waiting: 5, Running: 7, KVUsage: 0.75, NumBlocks: 30000, BlockSize: 16}
	if m != want {
		t.Fatalf("%+v want %+v", m, want)
	}
	old := "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.25\n"
	if m, err := ParseMetrics(strings.NewReader(old)); err != nil || m.KVUsage != 0.25 {
		t.Fatalf("old name: %+v %v", m, err)
	}
	for _, bad := range []string{"", "garbage{", "# TYPE x gauge\nx 1\n", "vllm:kv_cache_usage_perc NaN\n"} {
		if _, err := ParseMetrics(strings.NewReader(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

// TestParseMetricsBounds: what a replica's page says is bounded where it
// is parsed (#22): a NaN or infinite sample refuses the scrape, a negative
// one is 0 (one series' negative count takes nothing from another's),
// counts are at most maxCount and the KV usage within [0, 1].
func TestParseMetricsBounds(t *testing.T) {
	const kv = "vllm:kv_cache_usage_perc 0.5\n"
	cases := []struct {
		name, page string
		want       router.Metrics // with err false
		err        bool
	}{
		{"negative waiting", "vllm:num_requests_waiting -1\n" + kv, router.Metrics{KVUsage: 0.5}, false},
		{"negative running", "vllm:num_requests_running -7\n" + kv, router.Metrics{KVUsage: 0.5}, false},
		{"negative series among others", "vllm:num_requests_waiting{model_name=\"a\"} -1000000\n" +
			"vllm:num_requests_waiting{model_name=\"b\"} 3\n" + kv, router.Metrics{Waiting: 3, KVUsage: 0.5}, false},
		{"huge waiting", "vllm:num_requests_waiting 1e300\n" + kv, router.Metrics{Waiting: maxCount, KVUsage: 0.5}, false},
		{"huge running summed", "vllm:num_requests_running{engine=\"0\"} 2e9\nvllm:num_requests_running{engine=\"1\"} 2e9\n" + kv,
			router.Metrics{Running: maxCount, KVUsage: 0.5}, false},
		{"NaN waiting", "vllm:num_requests_waiting NaN\n" + kv, router.Metrics{}, true},
		{"+Inf running", "vllm:num_requests_running +Inf\n" + kv, router.Metrics{}, true},
		{"-Inf waiting", "vllm:num_requests_waiting -Inf\n" + kv, router.Metrics{}, true},
		{"NaN KV usage", "vllm:num_requests_waiting 1\nvllm:kv_cache_usage_perc NaN\n", router.Metrics{}, true},
		{"+Inf KV usage", "vllm:kv_cache_usage_perc +Inf\n", router.Metrics{}, true},
		{"-Inf KV usage (old name)", "vllm:gpu_cache_usage_perc -Inf\n", router.Metrics{}, true},
		{"KV usage over 1", "vllm:kv_cache_usage_perc 1.5\n", router.Metrics{KVUsage: 1}, false},
		{"KV usage barely over 1", "vllm:kv_cache_usage_perc 1.00005\n", router.Metrics{KVUsage: 1}, false},
		{"negative KV usage", "vllm:kv_cache_usage_perc -0.5\n", router.Metrics{}, false},
		{"negative num_gpu_blocks", "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"-5\"} 1\n" + kv,
			router.Metrics{KVUsage: 0.5, BlockSize: 16}, false},
		{"huge num_gpu_blocks", "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"99999999999\"} 1\n" + kv,
			router.Metrics{KVUsage: 0.5, NumBlocks: maxCount, BlockSize: 16}, false},
		{"block_size out of range", "vllm:cache_config_info{block_size=\"999999999\",num_gpu_blocks=\"10\"} 1\n" + kv,
			router.Metrics{}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m, err := ParseMetrics(strings.NewReader(c.page))
			if (err != nil) != c.err || (!c.err && m != c.want) {
				t.Fatalf("%+v, %v; want %+v, error %v", m, err, c.want, c.err)
			}
		})
	}
}

func FuzzParseMetrics(f *testing.F) {
	f.Add("vllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.5\n")
	f.Add("vllm:cache_config_info{num_gpu_blocks=\"x\"} 1\nvllm:num_requests_running 1\n")
	f.Fuzz(func(t *testing.T, page string) {
		m, err := ParseMetrics(strings.NewReader(page))
		if err == nil && (!(m.KVUsage >= 0 && m.KVUsage <= 1) || m.Waiting < 0 || m.Running < 0 || m.Waiting > maxCount ||
			m.Running > maxCount || m.NumBlocks < 0 || m.NumBlocks > maxCount || m.BlockSize < 0 || m.BlockSize > maxBlockSize) {
			t.Fatalf("out of range accepted: %+v", m)
		}
	})
}

func newFleet(t *testing.T, n int, ejectAfter int, client *http.Client, cfg Config) (*router.Router, *Fleet, *clock.Fake) {
	t.Helper()
	pol, _ := policy.New("least_load", policy.Options{})
	urls := []string{"http://a", "http://b", "http://c"}[:n]
	clk := clock.NewFake(time.Unix(100, 0))
	rt, err := router.New(router.Config{Replicas: urls, Policy: pol, Now: clk.Now,
		Breaker: router.BreakerConfig{EjectAfter: ejectAfter, Cooldown: 10 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Clock = clk
	return rt, New(rt, client, cfg), clk
}

// healthCheck is what the health loop does with a check's result.
func healthCheck(rt *router.Router, clk *clock.Fake, i int, ok bool) {
	rt.Replica(i).SetHealthOK(ok, clk.Now())
}

// fail and succeed admit one request to replica i and report it.
func fail(f *Fleet, i int)    { _, p := f.Allow(i); f.Failure(i, p) }
func succeed(f *Fleet, i int) { _, p := f.Allow(i); f.Success(i, p) }

func TestEjectionAndReturn(t *testing.T) {
	var ejected []int
	rt, f, clk := newFleet(t, 2, 3, nil, Config{OnEject: func(i int) { ejected = append(ejected, i) }})
	fail(f, 1)
	fail(f, 1)
	succeed(f, 1) // a success resets the count
	fail(f, 1)
	fail(f, 1)
	if !rt.Healthy(1) || f.Ejected(1) {
		t.Fatal("ejected before 3 consecutive failures")
	}
	fail(f, 1)
	if rt.Healthy(1) || !f.Ejected(1) || len(ejected) != 1 {
		t.Fatalf("not ejected after 3: healthy %v ejections %v", rt.Healthy(1), ejected)
	}
	healthCheck(rt, clk, 1, true) // a health check during the cooldown keeps it out
	if rt.Healthy(1) {
		t.Fatal("back during cooldown")
	}
	clk.Advance(11 * time.Second)
	healthCheck(rt, clk, 1, true) // the health check after the cooldown brings it back
	if !rt.Healthy(1) || f.Ejected(1) {
		t.Fatal("not back after cooldown")
	}
	healthCheck(rt, clk, 1, false)
	if rt.Healthy(1) {
		t.Fatal("failing health check kept it in")
	}
}

// The breaker: closed → open after EjectAfter failures → half-open after
// the cooldown (one trial at a time) → closed on the trial's success, or
// open again, for twice as long, on its failure.
func TestBreakerStates(t *testing.T) {
	rt, f, clk := newFleet(t, 1, 2, nil, Config{})
	step := func(what, want string) {
		t.Helper()
		if got := f.State(0); got != want {
			t.Fatalf("%s: state %s, want %s", what, got, want)
		}
	}
	allow := func() (bool, router.Pass) { return f.Allow(0) }
	step("start", "closed")
	if ok, _ := allow(); !ok {
		t.Fatal("closed breaker refused")
	}
	fail(f, 0)
	fail(f, 0)
	step("2 failures", "open")
	if ok, _ := allow(); ok || rt.Healthy(0) {
		t.Fatal("open breaker let a request through")
	}
	clk.Advance(10 * time.Second)
	healthCheck(rt, clk, 0, true) // the health check after the cooldown
	step("cooldown over", "half-open")
	ok, trial := allow()
	if !rt.Healthy(0) || !ok || !trial.Trial {
		t.Fatal("half-open breaker refused its trial")
	}
	if ok, _ := allow(); ok {
		t.Fatal("half-open breaker let a second request through beside the trial")
	}
	f.Failure(0, trial) // the trial fails: open again, for 20 s
	step("trial failed", "open")
	clk.Advance(15 * time.Second)
	step("15 s into a doubled cooldown", "open")
	clk.Advance(5 * time.Second)
	healthCheck(rt, clk, 0, true)
	step("doubled cooldown over", "half-open")
	ok, trial = allow()
	if !ok {
		t.Fatal("no trial")
	}
	f.Neutral(0, trial) // the client left: the trial slot is free again, still half-open
	step("neutral trial", "half-open")
	ok, trial = allow()
	if !ok {
		t.Fatal("no second trial")
	}
	f.Success(0, trial)
	step("trial succeeded", "closed")
	if ok, _ := allow(); !ok {
		t.Fatal("closed breaker refused")
	}
	// A passing /health does not reset the passive failure count.
	fail(f, 0)
	healthCheck(rt, clk, 0, true)
	fail(f, 0)
	step("failures around a health check", "open")
}

// Reports from requests admitted before an opening are stale: they cannot
// release or use up the trial, reopen, or close the breaker early.
func TestBreakerIgnoresStalePasses(t *testing.T) {
	rt, f, clk := newFleet(t, 1, 2, nil, Config{})
	_, long := f.Allow(0) // a long stream admitted while closed
	_, long2 := f.Allow(0)
	fail(f, 0)
	fail(f, 0) // opens
	f.Success(0, long2)
	if f.State(0) != "open" {
		t.Fatal("a success admitted before the opening closed the breaker in its cooldown")
	}
	clk.Advance(10 * time.Second)
	healthCheck(rt, clk, 0, true)
	ok, trial := f.Allow(0)
	if !ok || !trial.Trial {
		t.Fatal("no trial")
	}
	f.Neutral(0, long) // the long stream's client hangs up
	if ok, _ := f.Allow(0); ok {
		t.Fatal("a stale neutral freed the trial slot: two trials at once")
	}
	f.Failure(0, long) // or it fails
	if f.State(0) != "half-open" {
		t.Fatalf("a stale failure reopened the breaker: %s", f.State(0))
	}
	f.Success(0, trial)
	if f.State(0) != "closed" {
		t.Fatalf("the trial's success did not close it: %s", f.State(0))
	}
}
