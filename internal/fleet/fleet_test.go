package fleet

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
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

// newFleet is a fleet of n replicas whose breakers open after ejectAfter
// failures for 10 s, on a fake clock; the router's ejections reach the
// fleet's log as the gateway wires them (router.Config.OnEject).
func newFleet(t *testing.T, n int, ejectAfter int, client *http.Client, cfg Config) (*router.Router, *Fleet, *clock.Fake) {
	t.Helper()
	pol, _ := policy.New("least_load", policy.Options{})
	urls := []string{"http://a", "http://b", "http://c"}[:n]
	clk := clock.NewFake(time.Unix(100, 0))
	var f *Fleet
	rt, err := router.New(router.Config{Replicas: urls, Policy: pol, Now: clk.Now,
		OnEject: func(e router.Ejection) { f.NoteEjection(e.Slot, e.Cooldown) },
		Breaker: router.BreakerConfig{EjectAfter: ejectAfter, Cooldown: 10 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Clock = clk
	f = New(rt, client, cfg)
	return rt, f, clk
}

// fail sends replica i one request that fails, as the gateway does:
// routed to it (the others excluded), admitted by its breaker, ended with
// a failure. An ejected replica is no candidate: nothing is sent.
func fail(rt *router.Router, i int) {
	var others []int
	for k := range rt.Replicas() {
		if k != i {
			others = append(others, k)
		}
	}
	tk, err := rt.Route(rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: "x", Prompts: 1}, "", ""), others...)
	if err != nil {
		return
	}
	tk.Allow()
	tk.Done(rt.Now(), router.Outcome{CachedTokens: -1, Health: router.HealthFailed})
}
