package gateway

import (
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/costmodel"
)

// The replicas are scraped as often as the fastest policy that routes asks
// (llm-d's rules read metrics every 50 ms, as its scheduler does), a pool's
// included, and never faster than minScrapeInterval nor slower than
// scrape_interval.
func TestScrapeIntervalFollowsTheFastestPolicy(t *testing.T) {
	for _, tc := range []struct {
		name       string
		policy     string
		pools      []PoolConfig
		configured time.Duration
		want       time.Duration
	}{
		{"ttft keeps scrape_interval", "ttft", nil, 250 * time.Millisecond, 250 * time.Millisecond},
		{"llmd refreshes at 50 ms", "llmd", nil, 250 * time.Millisecond, 50 * time.Millisecond},
		{"precise too", "precise", nil, time.Second, 50 * time.Millisecond},
		{"a faster scrape_interval stays", "llmd", nil, 20 * time.Millisecond, 20 * time.Millisecond},
		{"a pool's llmd", "ttft", []PoolConfig{{Name: "p", Models: []string{"*"}, Policy: "llmd"}}, 250 * time.Millisecond, 50 * time.Millisecond},
		{"never below the floor", "ttft", nil, time.Millisecond, time.Millisecond},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Defaults()
			cfg.Policy, cfg.Pools = tc.policy, tc.pools
			cfg.Replicas = []ReplicaConfig{{URL: "http://127.0.0.1:1"}}
			specs := targets(cfg.Replicas, []int{1})
			if len(tc.pools) > 0 {
				specs = poolTargets(cfg.Replicas, []int{1}, []string{"p"})
			}
			rt, err := newRouter(cfg, specs, costmodel.MustLookup(cfg.Profile), clock.Real(), nil, nil, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			if got := scrapeInterval(tc.configured, rt); got != tc.want {
				t.Errorf("scrape interval %v, want %v", got, tc.want)
			}
		})
	}
}
