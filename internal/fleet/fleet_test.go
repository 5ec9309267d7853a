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
	for _, bad := range []string{"", "garbage{", "# TYPE x gauge\nx 1\n", "vllm:kv_cache_usage_perc NaN\n", "vllm:num_requests_waiting -1\n"} {
		if _, err := ParseMetrics(strings.NewReader(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}

func FuzzParseMetrics(f *testing.F) {
	f.Add("vllm:num_requests_waiting 3\nvllm:kv_cache_usage_perc 0.5\n")
	f.Add("vllm:cache_config_info{num_gpu_blocks=\"x\"} 1\nvllm:num_requests_running 1\n")
	f.Fuzz(func(t *testing.T, page string) {
		m, err := ParseMetrics(strings.NewReader(page))
		if err == nil && (m.KVUsage < 0 || m.KVUsage > 1.0001 || m.Waiting < 0 || m.Running < 0) {
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
