package chaos

import (
	"context"
	"fmt"
	"io"
	"maps"
	"net"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// The hostile-peers scenarios (issue 22): an outsider at one of the
// gateway's doors — the shared-state stream in Redis, the KV-event
// listening socket, the request body, the passthrough paths, the replica
// list — while ordinary clients go on using the gateway(s). Each runs its
// attack for Options.HostileFor beside a bounded ordinary load, and its
// verdict is:
//
//   - no crash: every gateway's Serve and Run still running when the
//     scenario stops them, and /health answering 200 afterwards;
//   - no ordinary request lost. An ordinary request counts as answered when
//     it ends in a complete generation, at once or after its client's
//     retries of a clear retryable refusal (429 or 503 with an OpenAI
//     error body: at most ordinaryRetries retries, each after its
//     Retry-After, capped at a second). Anything else is lost: a
//     connection closed or reset without an answer (an empty reply, the
//     mark of a crash), no answer by the client's deadline, a truncated
//     answer, or an error the client cannot retry;
//   - no healthy replica ejected, in-flight counts back to zero;
//   - the attack's own check (see each Kind).
const (
	// ForgedLoads: two gateways share state through a real redis-server;
	// a forger writes peer loads of −1,000,000 and other extremes (and a
	// decision out of bounds) into the stream with sharedstate's encoder,
	// each kind alone for a while. Every out-of-bounds entry is dropped at
	// each gateway's door, what passes is never negative at the router,
	// and both gateways answer every ordinary request.
	ForgedLoads Kind = "forgedloads"
	// ForgedEvents: replicas A, B on 127.0.0.1 and C on 127.0.0.2 publish
	// their KV events to the gateway's listening socket. A forger at
	// 127.0.0.2 (C's address) publishes replica A's topic restarted with
	// B's and C's prompts and B's restarted empty; another at 127.0.0.3 (no
	// replica's) tries too. No prompt's replica changes, during or after
	// the attack; the forged batches are dropped (peer_address).
	ForgedEvents Kind = "forgedevents"
	// HugeFrames: 24 peers at the replicas' own address (more than its
	// per-address cap) announce 64 MiB frames, round after round, and
	// 1,024 idle peers connect from another address: every huge frame is
	// cut, no idle peer is kept, the heap stays bounded and every real
	// publisher is heard during the attack.
	HugeFrames Kind = "hugeframes"
	// Trickle: 40 uploads per gateway declare 8 MiB and trickle 100 bytes
	// every 2 s (timings scaled to HostileFor), on a gateway without API
	// keys and on one with them: the body memory held stays near what
	// arrived, and ordinary 1 KB requests keep a p99 ≤ 1 s.
	Trickle Kind = "trickle"
	// AdminPaths: vLLM's admin paths (load/unload a LoRA adapter, reset the
	// prefix cache through an encoded "..", sleep, …) with and without an
	// API key: each answered 404 or 400, and the replicas receive none.
	AdminPaths Kind = "adminpaths"
	// SelfLoop: a gateway whose replica is its own address is refused at
	// start; two gateways in front of each other answer 508, with the
	// process's file descriptors and goroutines bounded, while a
	// legitimate two-tier chain (a gateway in front of a gateway) serves
	// every ordinary request.
	SelfLoop Kind = "selfloop"
)

// HostileKinds are the hostile-peers scenarios.
func HostileKinds() []Kind {
	return []Kind{ForgedLoads, ForgedEvents, HugeFrames, Trickle, AdminPaths, SelfLoop}
}

// ordinaryRetries bounds an ordinary client's retries of a 429 or 503.
const ordinaryRetries = 3

// PeerAccount is a hostile-peers scenario's account, beside Result's
// classes of its ordinary requests (every gateway's together).
type PeerAccount struct {
	Attack   string           // what the attacker did
	Gateways []GatewayAccount // the ordinary requests, per gateway
	// Retried: ordinary requests that succeeded after their client retried
	// a 429 or 503. EmptyReplies: ordinary requests whose connection closed
	// without an answer (part of Result.Lost).
	Retried, EmptyReplies int
	Crashes               []string // a gateway's Serve or Run ended, or /health failed
	Figures               []string // the attack's figures
	Broken                []string // the attack's checks no timing excuses (make test)
	Slow                  []string // its checks that depend on the machine's speed (make chaos)
	Skipped               string   // why the scenario did not run; "" when it ran
}

// GatewayAccount is one gateway's ordinary requests.
type GatewayAccount struct {
	Name            string
	Sent, Succeeded int
	P50, P99        time.Duration
}

// SuccessRate is the share of the gateway's ordinary requests that succeeded.
func (g GatewayAccount) SuccessRate() float64 {
	if g.Sent == 0 {
		return 0
	}
	return float64(g.Succeeded) / float64(g.Sent)
}

func (p *PeerAccount) figure(format string, args ...any) {
	p.Figures = append(p.Figures, fmt.Sprintf(format, args...))
}

func (p *PeerAccount) broken(format string, args ...any) {
	p.Broken = append(p.Broken, fmt.Sprintf(format, args...))
}

func (p *PeerAccount) slow(format string, args ...any) {
	p.Slow = append(p.Slow, fmt.Sprintf(format, args...))
}

// check notes a broken invariant unless ok.
func (p *PeerAccount) check(ok bool, format string, args ...any) {
	if !ok {
		p.broken(format, args...)
	}
}

// peerInvariants are the hostile verdict's parts no timing can excuse.
func (r *Result) peerInvariants() []string {
	p := r.Peers
	var out []string
	if p.Skipped != "" {
		return nil
	}
	if r.Sent == 0 || r.Sent != r.Succeeded+r.FailedClear+r.HungUp+r.Lost {
		out = append(out, fmt.Sprintf("ordinary sent %d ≠ succeeded %d + failed %d + lost %d", r.Sent, r.Succeeded, r.FailedClear, r.Lost))
	}
	if lost := r.Sent - r.Succeeded; lost != 0 {
		out = append(out, fmt.Sprintf("%d ordinary requests lost (%d empty replies, %d errors the client cannot retry): %v %v",
			lost, p.EmptyReplies, r.FailedClear, r.LostReasons, r.FailReasons))
	}
	for _, c := range p.Crashes {
		out = append(out, "crash: "+c)
	}
	if !r.InFlightZero {
		out = append(out, "a gateway's in-flight counts did not return to zero")
	}
	return append(out, p.Broken...)
}

// runPeers runs one hostile-peers scenario.
func runPeers(ctx context.Context, k Kind, o Options) (*Result, error) {
	ctx, cancel := context.WithTimeout(ctx, o.ScenarioTimeout+3*o.HostileFor)
	defer cancel()
	e := &peerEnv{o: o, kind: k}
	defer e.stop()
	e.tr = &http.Transport{Proxy: nil, MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024, DisableCompression: true}
	e.stops = append(e.stops, e.tr.CloseIdleConnections)
	res := &Result{Kind: k, Status: map[int]int{}, Back: true, StayedOut: true, InFlightZero: true, Peers: &PeerAccount{}}
	var err error
	switch k {
	case ForgedLoads:
		err = runForgedLoads(ctx, e, res)
	case ForgedEvents:
		err = runForgedEvents(ctx, e, res)
	case HugeFrames:
		err = runHugeFrames(ctx, e, res)
	case Trickle:
		err = runTrickle(ctx, e, res)
	case AdminPaths:
		err = runAdminPaths(ctx, e, res)
	case SelfLoop:
		err = runSelfLoop(ctx, e, res)
	default:
		return nil, fmt.Errorf("%w %q", ErrUnknownKind, k)
	}
	if err != nil {
		return nil, err
	}
	if res.Peers.Skipped == "" {
		e.survived(ctx, res)
	}
	return res, nil
}

// peerEnv is a hostile scenario's running system: simulated replicas
// (possibly behind counting frontends), gateways, the clients' transport.
type peerEnv struct {
	o     Options
	kind  Kind
	sims  []*sim.Replica
	urls  []string // the replicas' URLs as the gateways are given them
	gws   []*peerGateway
	tr    *http.Transport
	stops []func()
	// ejections0: each gateway's kvgate_ejections_total before the load.
	ejections0 map[*peerGateway]float64
}

func (e *peerEnv) stop() {
	for i := len(e.stops) - 1; i >= 0; i-- {
		e.stops[i]()
	}
	e.stops = nil
}

// startSims starts a fleet and appends its replicas (and their URLs).
func (e *peerEnv) startSims(ctx context.Context, cfg sim.Config) ([]*sim.Replica, error) {
	if cfg.Seed == 0 {
		cfg.Seed = e.o.Seed
	}
	if cfg.TimeScale == 0 {
		cfg.TimeScale = e.o.TimeScale
	}
	if cfg.KVBlocks == 0 {
		cfg.KVBlocks = 4096
	}
	fl, err := sim.Start(ctx, cfg)
	if err != nil {
		return nil, err
	}
	e.stops = append(e.stops, func() { _ = fl.Close() })
	rs := fl.Replicas()
	for _, r := range rs {
		e.sims = append(e.sims, r)
		e.urls = append(e.urls, r.URL())
	}
	return rs, nil
}

// config is the suite's gateway configuration for urls (gatewayConfig's
// tight probes and cooldowns), draining within a second when stopped.
func (e *peerEnv) config(urls []string) gateway.Config {
	cfg := gatewayConfig(scenario{}, e.o, urls)
	cfg.DrainTimeout = gateway.Duration(time.Second)
	return cfg
}

// peerGateway is one gateway of a hostile scenario, served as kvgate serve
// serves it (Gateway.Serve: the connection cap, the drain) on loopback.
type peerGateway struct {
	name string
	g    *gateway.Gateway
	cfg  gateway.Config
	reg  *prometheus.Registry
	base string // http://host:port

	cancel   context.CancelFunc
	wg       sync.WaitGroup
	stopping atomic.Bool
	mu       sync.Mutex
	ended    []string // Serve or Run returning before the scenario stopped them
}

// serve starts a gateway for cfg on ln (nil: a new loopback port, which
// becomes cfg.Listen).
func (e *peerEnv) serve(name string, cfg gateway.Config, ln net.Listener) (*peerGateway, error) {
	if ln == nil {
		var err error
		if ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			return nil, err
		}
	}
	cfg.Listen = ln.Addr().String()
	pg := &peerGateway{name: name, cfg: cfg, reg: prometheus.NewRegistry(), base: "http://" + ln.Addr().String()}
	g, err := gateway.New(cfg, gateway.Options{Registry: pg.reg, Logger: e.o.Logger})
	if err != nil {
		_ = ln.Close()
		return nil, err
	}
	pg.g = g
	ctx, cancel := context.WithCancel(context.Background())
	pg.cancel = cancel
	pg.wg.Go(func() {
		g.Run(ctx)
		pg.end("Run returned")
	})
	pg.wg.Go(func() {
		err := g.Serve(ctx, ln)
		pg.end(fmt.Sprintf("Serve returned (%v)", err))
	})
	e.gws = append(e.gws, pg)
	e.stops = append(e.stops, pg.stop)
	return pg, nil
}

func (pg *peerGateway) end(why string) {
	if pg.stopping.Load() {
		return
	}
	pg.mu.Lock()
	pg.ended = append(pg.ended, pg.name+": "+why+" while the scenario ran")
	pg.mu.Unlock()
}

func (pg *peerGateway) stop() {
	pg.stopping.Store(true)
	pg.cancel()
	pg.wg.Wait()
}

// waitReady waits until every gateway lists a model and sees each of its
// replicas scraped and healthy, then notes the ejection counters.
// openAndKeyed serves two gateways on e's replicas, each configured by
// tune: gw-open, without API keys, and gw-keys, whose clients must send
// chaosClientKey; it returns them ready, with a client of each (the
// second sending the key).
func (e *peerEnv) openAndKeyed(ctx context.Context, tune func(*gateway.Config)) ([]*peerGateway, []*client, error) {
	var gws []*peerGateway
	for _, keyed := range []bool{false, true} {
		cfg := e.config(e.urls)
		tune(&cfg)
		name := "gw-open"
		if keyed {
			cfg.APIKeys, name = []string{chaosClientKey}, "gw-keys"
		}
		pg, err := e.serve(name, cfg, nil)
		if err != nil {
			return nil, nil, err
		}
		gws = append(gws, pg)
	}
	if err := e.waitReady(ctx, gws...); err != nil {
		return nil, nil, err
	}
	cls := e.clients(gws...)
	cls[1].apiKey = chaosClientKey
	return gws, cls, nil
}

func (e *peerEnv) waitReady(ctx context.Context, gws ...*peerGateway) error {
	for _, pg := range gws {
		if err := gatewayReady(ctx, pg.g, pg.g.Router().Replicas()); err != nil {
			return fmt.Errorf("%s did not see its replicas ready: %w", pg.name, err)
		}
	}
	e.markEjections()
	return nil
}

func (e *peerEnv) markEjections() {
	e.ejections0 = map[*peerGateway]float64{}
	for _, pg := range e.gws {
		e.ejections0[pg] = metricSum(pg.reg, "kvgate_ejections_total")
	}
}

// client is an ordinary client of pg.
func (e *peerEnv) client(pg *peerGateway) *client {
	return &client{http: &http.Client{Transport: e.tr}, base: pg.base, model: sim.DefaultModel,
		maxTokens: e.o.MaxTokens, timeout: e.o.ClientTimeout, seed: e.o.Seed,
		prefix: fmt.Sprintf("chaos-%s-%s-%d-", e.kind, pg.name, e.o.Seed)}
}

// ordinaryCount is how many ordinary requests each gateway gets: the
// suite's rate for HostileFor.
func (e *peerEnv) ordinaryCount() int {
	return max(int(e.o.Rate*e.o.HostileFor.Seconds()+0.5), 1)
}

// ordinary sends the ordinary load through each client at once, each
// ordinaryCount requests at the suite's rate (Poisson arrivals), retrying
// clear refusals as a client library does; it returns each one's results.
func (e *peerEnv) ordinary(ctx context.Context, cls []*client) [][]result {
	out := make([][]result, len(cls))
	var wg sync.WaitGroup
	for k, cl := range cls {
		var mu sync.Mutex
		wg.Go(func() {
			runLoad(ctx, loadSpec{n: e.ordinaryCount(), rate: e.o.Rate, maxInFlight: 128, seed: e.o.Seed + uint64(k)},
				func(ctx context.Context, i int) {
					r := cl.doRetrying(ctx, i)
					mu.Lock()
					out[k] = append(out[k], r)
					mu.Unlock()
				})
		})
	}
	wg.Wait()
	return out
}

// account counts each gateway's ordinary results into res.
func (e *peerEnv) account(res *Result, gwNames []string, results [][]result) {
	p := res.Peers
	var all []time.Duration
	for k, rs := range results {
		ga := GatewayAccount{Name: gwNames[k]}
		var lat []time.Duration
		for _, r := range rs {
			res.Sent++
			ga.Sent++
			if r.status != 0 {
				res.Status[r.status]++
			}
			if count(res, r.id, r.verdict) {
				ga.Succeeded++
				lat = append(lat, r.latency)
				if r.retries > 0 {
					p.Retried++
				}
			} else if r.verdict.empty {
				p.EmptyReplies++
			}
		}
		ga.P50, ga.P99 = quantile(lat, 0.50), quantile(lat, 0.99)
		p.Gateways = append(p.Gateways, ga)
		all = append(all, lat...)
	}
	res.P50, res.P99 = quantile(all, 0.50), quantile(all, 0.99)
}

// survived checks what every hostile scenario must keep: no crash, no
// healthy replica ejected, in-flight counts back to zero.
func (e *peerEnv) survived(ctx context.Context, res *Result) {
	hc := &http.Client{Transport: e.tr, Timeout: 5 * time.Second}
	for _, pg := range e.gws {
		pg.mu.Lock()
		res.Peers.Crashes = append(res.Peers.Crashes, pg.ended...)
		pg.mu.Unlock()
		if why := health(hc, pg.base); why != "" {
			res.Peers.Crashes = append(res.Peers.Crashes, pg.name+": "+why)
		}
		res.Ejections += int(metricSum(pg.reg, "kvgate_ejections_total") - e.ejections0[pg])
		rt := pg.g.Router()
		res.InFlightZero = res.InFlightZero && testutil.Poll(ctx, 5*time.Second, func() bool {
			for i := range rt.Replicas() {
				if rt.InFlight(i) != 0 {
					return false
				}
			}
			return true
		}) == nil
	}
}

// health is "" when base answers GET /health with 200, else what it did.
func health(hc *http.Client, base string) string {
	resp, err := hc.Get(base + "/health")
	if err != nil {
		return "/health: " + err.Error()
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<10))
	if resp.StatusCode != http.StatusOK {
		return fmt.Sprintf("/health answered %d", resp.StatusCode)
	}
	return ""
}

// attack runs fn (the attacker) while the ordinary load through cls runs
// and then, when given, while then checks what it must see under attack;
// it returns the load's results once the attacker has returned.
func (e *peerEnv) attack(ctx context.Context, cls []*client, fn func(ctx context.Context), then func()) [][]result {
	actx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { fn(actx) })
	out := e.ordinary(ctx, cls)
	if then != nil {
		then()
	}
	stop()
	wg.Wait()
	return out
}

// every calls fn every d until ctx ends or fn returns false, at most n times.
func every(ctx context.Context, d time.Duration, n int, fn func() bool) {
	t := time.NewTicker(d)
	defer t.Stop()
	for range n {
		if !fn() {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// attackRounds bounds an attacker's loop of period d over HostileFor (and
// what the ordinary load may overrun it by).
func (e *peerEnv) attackRounds(d time.Duration) int {
	return int(4*e.o.HostileFor/d) + 100
}

// gauges samples the process's file descriptors, goroutines and heap.
type gauges struct {
	fds, goroutines int
	heap            uint64 // HeapInuse
}

func readGauges() gauges {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return gauges{fds: openFDs(), goroutines: runtime.NumGoroutine(), heap: ms.HeapInuse}
}

// openFDs counts the process's open file descriptors (Linux; −1 elsewhere).
func openFDs() int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return -1
	}
	return len(ents)
}

// peak samples gauges every d until ctx ends and returns the largest of each.
func peak(ctx context.Context, d time.Duration) func() gauges {
	var mu sync.Mutex
	top := readGauges()
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(d)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			g := readGauges()
			mu.Lock()
			top = gauges{fds: max(top.fds, g.fds), goroutines: max(top.goroutines, g.goroutines), heap: max(top.heap, g.heap)}
			mu.Unlock()
		}
	}()
	return func() gauges {
		<-done
		mu.Lock()
		defer mu.Unlock()
		return top
	}
}

// metricWith sums the series of a counter or gauge family of reg whose
// labels include every pair of want.
func metricWith(reg *prometheus.Registry, name string, want map[string]string) float64 {
	fams, err := reg.Gather()
	if err != nil {
		return 0
	}
	t := 0.0
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			if !matches(have, want) {
				continue
			}
			switch {
			case m.GetCounter() != nil:
				t += m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				t += m.GetGauge().GetValue()
			}
		}
	}
	return t
}

// byLabel sums a family's series of reg by the value of one label, as
// "value n, value n" in the values' order.
func byLabel(reg *prometheus.Registry, name, label string) string {
	fams, err := reg.Gather()
	if err != nil {
		return err.Error()
	}
	sums := map[string]float64{}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label {
					sums[l.GetValue()] += m.GetCounter().GetValue() + m.GetGauge().GetValue()
				}
			}
		}
	}
	keys := slices.Sorted(maps.Keys(sums))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %v", k, sums[k])
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

func matches(have, want map[string]string) bool {
	for k, v := range want {
		if have[k] != v {
			return false
		}
	}
	return true
}

// names are the gateways' names, in order.
func names(gws ...*peerGateway) []string {
	out := make([]string, len(gws))
	for i, pg := range gws {
		out[i] = pg.name
	}
	return out
}

// clients are ordinary clients of each gateway.
func (e *peerEnv) clients(gws ...*peerGateway) []*client {
	out := make([]*client, len(gws))
	for i, pg := range gws {
		out[i] = e.client(pg)
	}
	return out
}

// pct formats a share as a percentage.
func pct(x float64) string { return fmt.Sprintf("%.2f %%", 100*x) }
