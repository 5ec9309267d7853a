package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvgate/kvgate/internal/fleet"
)

// replicaHealthy is the gateway's series with one sample per routing
// target, labelled replica: its URL, or URL#k for data-parallel rank k.
const replicaHealthy = "kvgate_replica_healthy"

// Targets reads the routing targets of the kvgate gateway at target from
// its /metrics, before a run: every target, named as targetName names the
// one that answers (so that Config.Replicas can count the ones that get no
// request), sorted, and those out of rotation at the time. Without the
// series (not a kvgate gateway: vLLM itself, another router) it returns
// nil and no error: the run then knows only the targets that answer.
func Targets(ctx context.Context, c *http.Client, target string, header http.Header) (all, down []string, err error) {
	fams, err := targetMetrics(ctx, c, target, header)
	if err != nil {
		return nil, nil, fmt.Errorf("bench: the target's replicas: %w", err)
	}
	f, ok := fams[replicaHealthy]
	if !ok {
		return nil, nil, nil
	}
	for _, m := range f.GetMetric() {
		name := ""
		for _, l := range m.GetLabel() {
			if l.GetName() == "replica" {
				name = l.GetValue()
			}
		}
		if name == "" || slices.Contains(all, name) {
			continue
		}
		all = append(all, name)
		if m.GetGauge().GetValue() == 0 {
			down = append(down, name)
		}
	}
	slices.Sort(all)
	slices.Sort(down)
	return all, down, nil
}

// targetMetrics reads target's /metrics page; nil, and no error, when it
// has none in Prometheus's text format (not something that exports them).
func targetMetrics(ctx context.Context, c *http.Client, target string, header http.Header) (map[string]*dto.MetricFamily, error) {
	if c == nil {
		c = http.DefaultClient
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(target, "/")+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	for k, vs := range header {
		req.Header[k] = vs
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		return nil, nil
	}
	fams, err := fleet.ParseText(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, nil
	}
	return fams, nil
}

// requestsTotal is the gateway's count of requests answered, labelled
// policy (the one that routed them: a pool's own with pools), replica
// and code.
const requestsTotal = "kvgate_requests_total"

// PolicyCounts reads how many requests the kvgate gateway at target has
// answered so far, by routing policy (requestsTotal, summed over replicas
// and codes); nil without the series (not a kvgate gateway, or nothing
// answered yet).
func PolicyCounts(ctx context.Context, c *http.Client, target string, header http.Header) (map[string]float64, error) {
	fams, err := targetMetrics(ctx, c, target, header)
	if err != nil || fams[requestsTotal] == nil {
		return nil, err
	}
	out := map[string]float64{}
	for _, m := range fams[requestsTotal].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "policy" && l.GetValue() != "" {
				out[l.GetValue()] += m.GetCounter().GetValue() + m.GetUntyped().GetValue() // typed or not
			}
		}
	}
	return out, nil
}

// RoutedBy names the policies that answered requests between two
// PolicyCounts readings (a run's: its own requests, and whatever else the
// gateway served meanwhile), sorted and joined by "+" (a gateway with
// pools routes each pool by its own); "" when none is known to have.
func RoutedBy(before, after map[string]float64) string {
	var names []string
	for p, n := range after {
		if n > before[p] {
			names = append(names, p)
		}
	}
	slices.Sort(names)
	return strings.Join(names, "+")
}
