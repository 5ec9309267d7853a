package replay

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/report"
)

// OracleName is the run name of the oracle bound in progress reports.
const OracleName = "oracle"

// The oracle bound: how fast the fleet could serve the sequence if routing
// had no trade-off to make. It runs the same engines, in the same virtual
// time, with a router that
//
//   - gives every request the hit it would get from one LRU cache of the
//     whole fleet's capacity (merged_lru, kept in routing order): the
//     engine that serves it treats that prefix as cached (engine
//     Request.AssumedCached) whether or not it holds it, so that no
//     request pays for where its prefix happens to be;
//   - places it where its first token comes soonest by the engines' exact
//     queues (engine.Backlog, not the stale scraped gauges or the
//     gateway's counts), priced by the one TTFT estimate every policy of
//     kvgate uses (policy.TTFT.Estimate).
//
// It is not a proof that no policy can do better (the placement is greedy,
// the estimate a model), but no policy has its information: a policy beats
// it only by luck of eviction order or timing. Its capacity (the largest
// speed-up meeting the SLO) is report.Bound.OracleCapacity, and each run's
// capacity_vs_bound is its capacity over it.
type oracle struct {
	vr  *virtualRun
	est *policy.TTFT
	lru *blockLRU
	bs  int
}

var (
	_ policy.Policy   = (*oracle)(nil)
	_ policy.Observer = (*oracle)(nil)
)

// oracleSpec is the oracle's run: a policy of the replay's own, attached
// to its virtual run's engines when built (engineAware).
func oracleSpec() PolicySpec {
	return PolicySpec{Name: OracleName, New: func(o policy.Options) (policy.Policy, error) {
		p, err := policy.New("ttft", policy.Options{BlockSize: o.BlockSize, Profile: o.Profile, MaxBatchTokens: o.MaxBatchTokens})
		if err != nil {
			return nil, err
		}
		return &oracle{est: p.(*policy.TTFT), bs: o.BlockSize}, nil
	}}
}

// engineAware is implemented by the replay's own routers that read the
// engines (the oracle); attach is called once the run's engines exist.
type engineAware interface{ attach(vr *virtualRun) }

func (o *oracle) attach(vr *virtualRun) {
	o.vr = vr
	o.lru = newBlockLRU(vr.cfg.engines() * vr.cfg.KVBlocks)
}

func (*oracle) Name() string { return OracleName }

// hit is the blocks of req the fleet-wide LRU holds now (engine rule:
// leading blocks, never the last prompt token).
func (o *oracle) hit(req *policy.Request) int {
	limit := hitLimit(len(req.Blocks), req.Tokens, o.bs)
	n := 0
	for n < limit && o.lru.has(req.Blocks[n]) {
		n++
	}
	return n
}

// Pick sends req to the healthy replica whose exact backlog gives it the
// earliest estimated first token (the lowest slot on ties).
func (o *oracle) Pick(req *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
	hit := o.hit(req)
	best, bestMs := -1, math.Inf(1)
	for i := range rs {
		if !rs[i].Healthy {
			continue
		}
		b := o.vr.replicas[rs[i].Index].engine.Backlog()
		v := policy.ReplicaView{Index: rs[i].Index, Healthy: true, InFlight: b.Live, InFlightTokens: b.Footprint, InFlightKV: b.KV,
			PendingPrefill: b.Prefill, PendingCount: b.Pending, NumBlocks: o.vr.cfg.KVBlocks, Match: hit}
		if ms, _ := o.est.Estimate(req, &v, 0); ms < bestMs {
			best, bestMs = i, ms
		}
	}
	if best < 0 {
		return policy.Decision{}, policy.ErrNoReplica
	}
	return policy.Decision{Replica: rs[best].Index, Reason: "oracle: earliest first token by the exact queues",
		Matched: hit, EstTTFT: time.Duration(bestMs * float64(time.Millisecond))}, nil
}

// Observe puts a routed request's blocks in the fleet-wide LRU, its head
// most recent (as the bound's merged_lru does).
func (o *oracle) Observe(ev policy.Event) {
	if ev.Kind != policy.Routed || ev.Req == nil {
		return
	}
	for j := len(ev.Req.Blocks) - 1; j >= 0; j-- {
		o.lru.touch(ev.Req.Blocks[j])
	}
	o.lru.trim()
}

// oracleBound runs the oracle at cfg's speed-up (its TTFT and hit rate in
// the bound) and, with slo, searches its capacity.
func oracleBound(ctx context.Context, cfg Config, pl *plan, slo *SLO, b *report.Bound) error {
	if cfg.disaggregated() || cfg.Gateways > 1 {
		return fmt.Errorf("%w: the oracle bound is computed for one gateway and an aggregated fleet", ErrConfig)
	}
	run, err := runPlan(ctx, cfg, pl, oracleSpec())
	if err != nil {
		return err
	}
	ttft := run.TTFTms
	b.OracleTTFTms, b.OracleHitRate = &ttft, &run.HitRate
	if slo == nil {
		return nil
	}
	rg, err := capacityPlan(ctx, cfg, pl, oracleSpec(), *slo)
	if err != nil {
		return err
	}
	c := rg.Pass
	b.OracleCapacity, b.OracleCapacityCeiling = &c, rg.Ceiling()
	return nil
}
