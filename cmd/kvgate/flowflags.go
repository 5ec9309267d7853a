package main

import (
	"flag"
	"fmt"
	"strconv"
	"time"

	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/workload"
)

// flowFlags are the multi-tenant flags of `kvgate replay`: the tenants of
// a generated multi-tenant workload (--tenant) and the flow control the
// replayed gateway runs (--flow and its settings), the router's own.
type flowFlags struct {
	tenants        listFlag
	sheddable      listFlag
	flow           bool
	enginePriority bool
	queueMs        float64
	waiting        int
	kvUsage        float64
	ttl            time.Duration
	maxQueued      int
}

func (f *flowFlags) register(fs *flag.FlagSet) {
	fs.Var(&f.tenants, "tenant", "a tenant of a multi-tenant workload (repeatable), instead of --trace or --workload: "+
		"name=A,rate=R (requests/s),workload=NAME (default random),requests=N,priority=P,weight=W,deadline=D,seed=S and its "+
		"workload's parameters, e.g. --tenant name=A,rate=20,input_len=2000 --tenant name=B,rate=2")
	fs.BoolVar(&f.flow, "flow", false, "run the gateway's flow controller: tenants weighed by GPU work within priority "+
		"bands, requests held in the router while the fleet is saturated, shed past their TTL or deadline (docs/tenants.md)")
	fs.Float64Var(&f.queueMs, "flow-queue-ms", router.DefaultQueueMs, "with --flow: a replica is saturated when its "+
		"queued prefill would take longer than this (ms, by the cost model)")
	fs.IntVar(&f.waiting, "flow-waiting", router.DefaultSatWaiting, "with --flow: ... or more requests than this wait there")
	fs.Float64Var(&f.kvUsage, "flow-kv-usage", router.DefaultSatKVUsage, "with --flow: ... or its KV cache is fuller than this")
	fs.DurationVar(&f.ttl, "flow-ttl", router.DefaultFlowTTL, "with --flow: the longest wait in the router's queue")
	fs.IntVar(&f.maxQueued, "flow-max-queued", router.DefaultBandMaxQueued, "with --flow: the requests a band may hold waiting")
	fs.Var(&f.sheddable, "flow-sheddable", "with --flow: a priority whose requests are refused at once while the fleet is saturated (repeatable)")
	fs.BoolVar(&f.enginePriority, "engine-priority", false, "the engines schedule by each request's band "+
		"(vLLM's --scheduling-policy priority; kvgate sim's flag of that name)")
}

// tenantSpecs are --tenant's specs.
func (f *flowFlags) tenantSpecs() ([]workload.TenantSpec, error) {
	var out []workload.TenantSpec
	for _, s := range f.tenants {
		t, err := workload.ParseTenant(s)
		if err != nil {
			return nil, fmt.Errorf("%w: --tenant: %v", errUsage, err)
		}
		out = append(out, t)
	}
	return out, nil
}

// config is the router's flow configuration: off without --flow; each
// tenant's weight, and its priority as its only band.
func (f *flowFlags) config(tenants []workload.TenantSpec) (router.FlowConfig, error) {
	if !f.flow {
		return router.FlowConfig{}, nil
	}
	if !(f.queueMs > 0) || f.waiting < 1 || !(f.kvUsage > 0) || f.ttl <= 0 || f.maxQueued < 1 {
		return router.FlowConfig{}, fmt.Errorf("%w: --flow-queue-ms, --flow-kv-usage and --flow-ttl must be positive, "+
			"--flow-waiting and --flow-max-queued at least 1", errUsage)
	}
	fc := router.FlowConfig{Enabled: true, Tenants: map[string]router.FlowTenant{},
		Saturation: router.SaturationRule{QueueMs: f.queueMs, Waiting: f.waiting, KVUsage: f.kvUsage},
		Band:       router.Band{TTL: f.ttl, MaxQueued: f.maxQueued}}
	for _, t := range tenants {
		fc.Tenants[t.Name] = router.FlowTenant{Weight: t.Weight, Priority: t.Priority, MaxPriority: t.Priority}
	}
	for _, p := range f.sheddable {
		n, err := strconv.Atoi(p)
		if err != nil {
			return fc, fmt.Errorf("%w: --flow-sheddable %q: want a priority (an integer)", errUsage, p)
		}
		fc.Bands = append(fc.Bands, router.Band{Priority: n, TTL: f.ttl, MaxQueued: f.maxQueued, Sheddable: true})
	}
	return fc, nil
}

// meta records the flow settings in a result's meta.
func (f *flowFlags) meta(m map[string]any) {
	if len(f.tenants) > 0 {
		m["tenants"] = []string(f.tenants)
	}
	if !f.flow {
		return
	}
	m["flow"] = map[string]any{"queue_ms": f.queueMs, "waiting": f.waiting, "kv_usage": f.kvUsage, "ttl": f.ttl.String(),
		"max_queued": f.maxQueued, "sheddable": []string(f.sheddable)}
	if f.enginePriority {
		m["engine_priority"] = true
	}
}
