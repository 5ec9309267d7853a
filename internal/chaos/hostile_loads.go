package chaos

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sharedstate"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// forgedLoad is one kind of entry the forger writes: the loads and
// decisions of a batch, and whether the door must drop it (a value out of
// sharedstate's bounds) or may let it through.
type forgedLoad struct {
	what  string
	out   bool
	build func(urls []string) ([]sharedstate.ReplicaLoad, []sharedstate.Decision)
}

func everyLoad(urls []string, l router.Load) []sharedstate.ReplicaLoad {
	out := make([]sharedstate.ReplicaLoad, len(urls))
	for i, u := range urls {
		out[i] = sharedstate.ReplicaLoad{Replica: u, Load: l}
	}
	return out
}

func oneLoad(u string, l router.Load) []sharedstate.ReplicaLoad {
	return []sharedstate.ReplicaLoad{{Replica: u, Load: l}}
}

// forgedLoads are the forger's entries, written in turn: the red team's
// (finding 1), the other extremes of each field, a decision out of bounds,
// and two that are within the bounds — the largest load a peer may claim,
// and a load for a replica nobody serves.
var forgedLoads = []forgedLoad{
	{"−1,000,000 in flight on one replica (the red team's)", true, func(u []string) ([]sharedstate.ReplicaLoad, []sharedstate.Decision) {
		return oneLoad(u[1], router.Load{InFlight: -1_000_000}), nil
	}},
	{"−1,000,000 in every count of every replica", true, func(u []string) ([]sharedstate.ReplicaLoad, []sharedstate.Decision) {
		return everyLoad(u, router.Load{InFlight: -1_000_000, InFlightTokens: -1_000_000, PendingPrefill: -1_000_000, PendingCount: -1_000_000}), nil
	}},
	{"math.MinInt64 in every count", true, func(u []string) ([]sharedstate.ReplicaLoad, []sharedstate.Decision) {
		return everyLoad(u, router.Load{InFlight: math.MinInt64, InFlightTokens: math.MinInt64, PendingPrefill: math.MinInt64, PendingCount: math.MinInt64}), nil
	}},
	{"math.MaxInt64 in every count", true, func(u []string) ([]sharedstate.ReplicaLoad, []sharedstate.Decision) {
		return everyLoad(u, router.Load{InFlight: math.MaxInt64, InFlightTokens: math.MaxInt64, PendingPrefill: math.MaxInt64, PendingCount: math.MaxInt64}), nil
	}},
	// The encoder writes a negative offset or token count as 0: the
	// forger's decision is out of bounds the other way.
	{"a decision at block 2^40 of 2^40 tokens", true, func(u []string) ([]sharedstate.ReplicaLoad, []sharedstate.Decision) {
		return nil, []sharedstate.Decision{{Replica: u[2], Model: sim.DefaultModel, Offset: 1 << 40, Tokens: 1 << 40, Blocks: []uint64{1, 2, 3}}}
	}},
	{"the bounds exactly on one replica (2^20 requests, 2^44 tokens)", false, func(u []string) ([]sharedstate.ReplicaLoad, []sharedstate.Decision) {
		return oneLoad(u[0], router.Load{InFlight: sharedstate.MaxLoadCount, InFlightTokens: sharedstate.MaxLoadTokens,
			PendingPrefill: sharedstate.MaxLoadTokens, PendingCount: sharedstate.MaxLoadCount}), nil
	}},
	{"a load for a replica nobody serves", false, func([]string) ([]sharedstate.ReplicaLoad, []sharedstate.Decision) {
		return oneLoad("http://127.0.0.1:1", router.Load{InFlight: 7}), nil
	}},
}

// loadForger writes forgedLoads in turn into a namespace's stream, each
// kind under a gateway name of its own with its own batch numbers.
type loadForger struct {
	rc     *redis.Client
	stream string
	urls   []string
	seq    []uint64
	// written[k]: entries of forgedLoads[k] written; err: the first failed write.
	written []int
	err     error
}

// write writes the forger's n-th entry: each kind of forgedLoads for
// `slice` entries in turn, so that each meets the gateways alone, as the
// red team's did (written together, a MaxInt64 load and a −1,000,000 one
// would add up to a plausible one: a peer's load stands for its TTL).
func (f *loadForger) write(ctx context.Context, n, slice int) {
	k := n / slice % len(forgedLoads)
	loads, decisions := forgedLoads[k].build(f.urls)
	f.seq[k]++
	b := sharedstate.Batch{Gateway: fmt.Sprintf("chaos-forger-%d", k), Seq: f.seq[k], At: time.Now(), Loads: loads, Decisions: decisions}
	// "b" is the field every gateway reads a batch from.
	err := f.rc.XAdd(ctx, &redis.XAddArgs{Stream: f.stream, Values: []any{"b", sharedstate.AppendBatch(nil, &b)}}).Err()
	switch {
	case err == nil:
		f.written[k]++
	case f.err == nil && ctx.Err() == nil:
		f.err = err
	}
}

// out is the number of entries written that the door must drop.
func (f *loadForger) out() int {
	n := 0
	for k, c := range f.written {
		if forgedLoads[k].out {
			n += c
		}
	}
	return n
}

// runForgedLoads: two gateways (the default policy, ttft) on three replicas
// share state through a real redis-server while a forger writes peer
// loads into the stream with the project's own encoder.
func runForgedLoads(ctx context.Context, e *peerEnv, res *Result) error {
	p := res.Peers
	p.Attack = "a forger writes into the shared-state stream every 10 ms (sharedstate.AppendBatch), each for a seventh of the time: " +
		"the red team's −1,000,000 in flight on one replica, −1,000,000, MinInt64 and MaxInt64 in every count, an out-of-bounds " +
		"decision, and two entries within the bounds; two gateways (ttft) share state through redis-server"
	if e.o.Redis == "" {
		p.Skipped = "no redis-server: Options.Redis is empty (the tests start one when redis-server is installed)"
		return nil
	}
	if _, err := e.startSims(ctx, sim.Config{Replicas: 3}); err != nil {
		return err
	}
	ns := fmt.Sprintf("chaos-%d-%d", e.o.Seed, time.Now().UnixNano())
	var gws []*peerGateway
	for _, name := range []string{"gw1", "gw2"} {
		cfg := e.config(e.urls)
		cfg.Policy, cfg.SharedState, cfg.SharedStateNamespace = policy.Default, e.o.Redis, ns
		pg, err := e.serve(name, cfg, nil)
		if err != nil {
			return err
		}
		gws = append(gws, pg)
	}
	if err := e.waitReady(ctx, gws...); err != nil {
		return err
	}
	if err := testutil.Poll(ctx, 10*time.Second, func() bool {
		return metricSum(gws[0].reg, "kvgate_shared_state_peers") >= 1 && metricSum(gws[1].reg, "kvgate_shared_state_peers") >= 1
	}); err != nil {
		return fmt.Errorf("the gateways did not see each other through Redis: %w", err)
	}
	opt, err := sharedstate.ParseURL(e.o.Redis)
	if err != nil {
		return err
	}
	rc := redis.NewClient(opt)
	defer rc.Close()
	f := &loadForger{rc: rc, stream: ns + ":batches", urls: e.urls, seq: make([]uint64, len(forgedLoads)), written: make([]int, len(forgedLoads))}
	var low lowest
	results := e.attack(ctx, e.clients(gws...), func(actx context.Context) {
		var wg sync.WaitGroup
		wg.Go(func() { low.watch(actx, gws, e.attackRounds(5*time.Millisecond)) })
		n, slice := 0, max(int(e.o.HostileFor/time.Duration(len(forgedLoads))/(10*time.Millisecond)), 1)
		every(actx, 10*time.Millisecond, e.attackRounds(10*time.Millisecond), func() bool {
			f.write(actx, n, slice)
			n++
			return true
		})
		wg.Wait()
	}, nil)
	e.account(res, names(gws...), results)
	for k, pg := range gws {
		p.figure("%s: ordinary requests by replica %s (a load within the bounds steers as a peer's real load would)", pg.name, split(results[k], e.urls))
	}
	return forgedLoadsVerdict(ctx, p, gws, f, &low)
}

// forgedLoadsVerdict checks that each gateway dropped every entry out of
// bounds (and nothing else), that no load the router holds went negative,
// and notes the figures.
func forgedLoadsVerdict(ctx context.Context, p *PeerAccount, gws []*peerGateway, f *loadForger, low *lowest) error {
	if f.err != nil {
		return fmt.Errorf("the forger could not write to Redis: %w", f.err)
	}
	total := 0
	for _, c := range f.written {
		total += c
	}
	p.figure("forged entries written: %d (%d out of bounds, %d within)", total, f.out(), total-f.out())
	p.check(f.out() > 0, "the forger wrote no entry out of bounds")
	for _, pg := range gws {
		// Every gateway reads every entry: the drops reach the count of the
		// entries out of bounds once it has read the last one.
		_ = testutil.Poll(ctx, 10*time.Second, func() bool {
			return metricSum(pg.reg, "kvgate_shared_state_dropped_total") >= float64(f.out())
		})
		dropped := metricSum(pg.reg, "kvgate_shared_state_dropped_total")
		panics := metricSum(pg.reg, "kvgate_policy_panics_total")
		p.figure("%s: dropped at the door %v (%s), policy panics recovered %v, kvgate_shared_state_up %v",
			pg.name, dropped, byLabel(pg.reg, "kvgate_shared_state_dropped_total", "reason"),
			panics, metricSum(pg.reg, "kvgate_shared_state_up"))
		p.check(dropped == float64(f.out()), "%s dropped %v entries, want the %d out of bounds", pg.name, dropped, f.out())
	}
	p.figure("the lowest peer load any router held during the attack: %s", low)
	p.check(low.min >= 0, "a negative peer load reached a router: %s", low)
	return nil
}

// lowest watches the peer loads the routers hold: the lowest count seen
// in any field, where, and the highest in-flight.
type lowest struct {
	mu       sync.Mutex
	min, max int64
	where    string
	samples  int
}

func (l *lowest) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return fmt.Sprintf("%d (%s; highest in flight %d; %d samples)", l.min, l.where, l.max, l.samples)
}

// watch samples every gateway's router every 5 ms until ctx ends, at
// most rounds times.
func (l *lowest) watch(ctx context.Context, gws []*peerGateway, rounds int) {
	every(ctx, 5*time.Millisecond, rounds, func() bool {
		for _, pg := range gws {
			rt := pg.g.Router()
			for i := range rt.Replicas() {
				ld := rt.RemoteLoad(i)
				l.mu.Lock()
				for _, v := range []int64{ld.InFlight, ld.InFlightTokens, ld.PendingPrefill, ld.PendingCount} {
					if v < l.min || l.where == "" {
						l.min, l.where = min(v, l.min), fmt.Sprintf("%s, replica %d", pg.name, i)
					}
				}
				l.max = max(l.max, ld.InFlight)
				l.samples++
				l.mu.Unlock()
			}
		}
		return true
	})
}

// split counts answered requests by the replica that answered them, in
// urls' order.
func split(rs []result, urls []string) string {
	n := map[string]int{}
	for _, r := range rs {
		n[r.replica]++
	}
	parts := make([]string, len(urls))
	for i, u := range urls {
		parts[i] = fmt.Sprint(n[u])
	}
	return strings.Join(parts, "/")
}
