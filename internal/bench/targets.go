package bench

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

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
	if c == nil {
		c = http.DefaultClient
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(target, "/")+"/metrics", nil)
	if err != nil {
		return nil, nil, err
	}
	for k, vs := range header {
		req.Header[k] = vs
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, nil, fmt.Errorf("bench: the target's replicas: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		return nil, nil, nil // no metrics page: not something that lists its replicas
	}
	fams, err := fleet.ParseText(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return nil, nil, nil // a page in another format: likewise
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
