package main

import (
	"fmt"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/workload"
)

// Several tenants in `kvgate bench` (--tenant, as replay takes it): their
// workloads merged by arrival (open loop: each tenant at its own rate),
// each request sent with its tenant's key= (Authorization: Bearer), its
// priority and deadline, and the result summarised per tenant and per
// priority. With --embedded and --flow the in-process gateway has the
// tenants configured (keys, weights, priorities; flow_control from the
// --flow-* flags); without --flow it has none, the same load's baseline.
// A --target gateway has its own tenants: give each --tenant its key=.

// benchTenantKey is the key of a tenant that names none (--embedded).
func benchTenantKey(name string) string { return "kvgate-bench-" + name }

// flowOnly are the flags that configure the --embedded gateway's flow control.
var flowOnly = []string{"flow", "flow-queue-ms", "flow-waiting", "flow-kv-usage", "flow-ttl", "flow-max-queued",
	"flow-sheddable", "engine-priority"}

// tenantRequests is the merged workload of --tenant (nil without), and
// the tenants' keys; --workload, --workload-param, --rate, --requests and
// --concurrency describe a single workload and are refused beside it.
func (f *benchFlags) tenantRequests() ([]workload.Request, map[string]string, error) {
	specs, err := f.tenancy.tenantSpecs()
	if err != nil || len(specs) == 0 {
		return nil, nil, err
	}
	for _, name := range []string{"workload", "workload-param", "rate", "requests", "concurrency"} {
		if f.set[name] {
			return nil, nil, fmt.Errorf("%w: --tenant makes the workload: drop --%s (give it in the tenant's spec)", errUsage, name)
		}
	}
	reqs, err := workload.Mix(specs, f.seed)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: --tenant: %v", errUsage, err)
	}
	keys := map[string]string{}
	for _, t := range specs {
		switch {
		case t.Key != "":
			keys[t.Name] = t.Key
		case f.embedded:
			keys[t.Name] = benchTenantKey(t.Name)
		}
	}
	return reqs, keys, nil
}

// tenantGateway configures the --embedded gateway's tenants and flow
// control (--flow), and the replicas' priority scheduling
// (--engine-priority).
func (f *benchFlags) tenantGateway(g *gateway.Config, s *sim.Config, keys map[string]string) error {
	if !f.embedded || !f.tenancy.flow {
		return nil
	}
	specs, err := f.tenancy.tenantSpecs()
	if err != nil {
		return err
	}
	rc, err := f.tenancy.config(specs) // the flags' own checks, and the sheddable bands
	if err != nil {
		return err
	}
	fc := &g.FlowControl
	fc.Enabled = true
	fc.QueueMs, fc.Waiting, fc.KVUsage = f.tenancy.queueMs, f.tenancy.waiting, f.tenancy.kvUsage
	fc.TTL, fc.MaxQueued, fc.EnginePriority = gateway.Duration(f.tenancy.ttl), f.tenancy.maxQueued, f.tenancy.enginePriority
	for _, b := range rc.Bands {
		fc.Bands = append(fc.Bands, gateway.BandFlowConfig{Priority: b.Priority, Sheddable: b.Sheddable})
	}
	for _, t := range specs {
		p := t.Priority
		g.Tenants = append(g.Tenants, gateway.TenantConfig{Name: t.Name, APIKeys: []string{keys[t.Name]}, Priority: p,
			MaxPriority: &p, Weight: t.Weight})
	}
	if f.tenancy.enginePriority {
		s.SchedulingPolicy = sim.SchedulingPriority
	}
	return nil
}
