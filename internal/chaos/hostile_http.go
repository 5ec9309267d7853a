package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// The HTTP doors: the passthrough paths and the replica list.

// pathCounter counts the requests replicas receive by path, as sent (the
// escaped form), behind a frontend of each replica.
type pathCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *pathCounter) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c.mu.Lock()
		c.n[r.URL.EscapedPath()]++
		c.mu.Unlock()
		h.ServeHTTP(w, r)
	})
}

// ordinaryPaths are the paths the ordinary load and the gateway's probes
// and scrapes reach a replica on.
var ordinaryPaths = []string{"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}

// others are the counts of the paths not in ordinaryPaths, sorted.
func (c *pathCounter) others() (total int, paths []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for p, n := range c.n {
		if !slices.Contains(ordinaryPaths, p) {
			total += n
			paths = append(paths, fmt.Sprintf("%s×%d", p, n))
		}
	}
	sort.Strings(paths)
	return total, paths
}

// countPaths puts every replica behind a frontend counting its requests'
// paths; the gateways are then given the frontends' URLs.
func (e *peerEnv) countPaths() (*pathCounter, error) {
	c := &pathCounter{n: map[string]int{}}
	for i, r := range e.sims {
		f, err := startFrontend(c.wrap(r.Handler()))
		if err != nil {
			return nil, err
		}
		e.stops = append(e.stops, f.close)
		e.urls[i] = f.URL()
	}
	return c, nil
}

// adminCall is one request of the admin-paths attack.
type adminCall struct {
	path, body string
}

// adminCalls are vLLM's admin endpoints and ways around an allow-list:
// encoded dot segments, doubled slashes, a trailing slash, an encoded
// letter, an encoded '?', another case.
var adminCalls = []adminCall{
	{"/v1/load_lora_adapter", `{"lora_name":"chaos-evil","lora_path":"/tmp/chaos-evil"}`},
	{"/v1/unload_lora_adapter", `{"lora_name":"` + sim.DefaultModel + `"}`},
	{"/v1/%2e%2e/reset_prefix_cache", `{}`},
	{"/v1/%2E%2E/reset_prefix_cache", `{}`},
	{"/v1/../reset_prefix_cache", `{}`},
	{"/reset_prefix_cache", `{}`},
	{"//v1/load_lora_adapter", `{"lora_name":"chaos-evil","lora_path":"/tmp/chaos-evil"}`},
	{"/v1/load_lora_adapter/", `{"lora_name":"chaos-evil","lora_path":"/tmp/chaos-evil"}`},
	{"/v1/%6coad_lora_adapter", `{"lora_name":"chaos-evil","lora_path":"/tmp/chaos-evil"}`},
	{"/v1/load_lora_adapter%3F", `{"lora_name":"chaos-evil","lora_path":"/tmp/chaos-evil"}`},
	{"/v1/LOAD_LORA_ADAPTER", `{"lora_name":"chaos-evil","lora_path":"/tmp/chaos-evil"}`},
	{"/v1/completions/../load_lora_adapter", `{"lora_name":"chaos-evil","lora_path":"/tmp/chaos-evil"}`},
	{"/v1/completions%2f..%2fload_lora_adapter", `{"lora_name":"chaos-evil","lora_path":"/tmp/chaos-evil"}`},
	{"/sleep", `{}`},
	{"/wake_up", `{}`},
	{"/collective_rpc", `{"method":"chaos"}`},
	{"/start_profile", `{}`},
}

const (
	chaosClientKey  = "chaos-client-key"
	chaosReplicaKey = "chaos-replica-key"
)

// adminTally counts the admin-paths answers by caller, path and status.
type adminTally struct {
	mu      sync.Mutex
	status  map[string]map[int]int // "caller path" → status → count
	sent    int
	unclear []string // answers other than a clear 400/404 (401 without a key)
}

func (t *adminTally) note(caller, path string, status int, clear bool, keyless bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.sent++
	k := caller + " " + path
	if t.status[k] == nil {
		t.status[k] = map[int]int{}
	}
	t.status[k][status]++
	ok := clear && (status == http.StatusNotFound || status == http.StatusBadRequest || (keyless && status == http.StatusUnauthorized))
	if !ok {
		t.unclear = sample(t.unclear, fmt.Sprintf("%s POST %s: %d (clear %v)", caller, path, status, clear))
	}
}

// call sends one admin call to base and notes its answer.
func (t *adminTally) call(hc *http.Client, caller, base, key string, c adminCall) {
	req, err := http.NewRequest(http.MethodPost, base+c.path, strings.NewReader(c.body))
	if err != nil {
		t.note(caller, c.path, 0, false, key == "")
		return
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := hc.Do(req)
	if err != nil {
		t.note(caller, c.path, 0, false, key == "")
		return
	}
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	resp.Body.Close()
	_, clear := clearError(data)
	t.note(caller, c.path, resp.StatusCode, clear, key == "")
}

// callers are the admin-paths attack's callers, in the order it calls.
var callers = []string{"open", "keys+key", "keys-nokey"}

// summary is each caller's answers to path: "open 404×n, keys+key …".
func (t *adminTally) summary(path string) string {
	t.mu.Lock()
	defer t.mu.Unlock()
	parts := make([]string, len(callers))
	for i, c := range callers {
		parts[i] = c + " " + statuses(t.status[c+" "+path])
	}
	return strings.Join(parts, ", ")
}

// all is every answer's status, all paths and callers together.
func (t *adminTally) all() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	sum := map[int]int{}
	for _, st := range t.status {
		for s, n := range st {
			sum[s] += n
		}
	}
	return statuses(sum)
}

// runAdminPaths: three replicas (each with an api_key of its own) behind
// frontends that count the paths they receive; one gateway without API
// keys and one with. While ordinary clients use both, an attacker calls
// vLLM's admin paths through each, with and without a key.
func runAdminPaths(ctx context.Context, e *peerEnv, res *Result) error {
	p := res.Peers
	p.Attack = fmt.Sprintf("%d admin paths (load/unload_lora_adapter, reset_prefix_cache behind an encoded \"..\", //, a trailing /, "+
		"an encoded letter or '?', sleep, wake_up, collective_rpc, …) POSTed every 100 ms through a gateway without API keys "+
		"and one with them, with its key and without", len(adminCalls))
	if _, err := e.startSims(ctx, sim.Config{Replicas: 3}); err != nil {
		return err
	}
	counter, err := e.countPaths()
	if err != nil {
		return err
	}
	gws, cls, err := e.openAndKeyed(ctx, func(cfg *gateway.Config) {
		for i := range cfg.Replicas {
			cfg.Replicas[i].APIKey = chaosReplicaKey
		}
	})
	if err != nil {
		return err
	}
	t := &adminTally{status: map[string]map[int]int{}}
	hc := &http.Client{Transport: e.tr, Timeout: 10 * time.Second}
	results := e.attack(ctx, cls, func(actx context.Context) {
		every(actx, 100*time.Millisecond, e.attackRounds(100*time.Millisecond), func() bool {
			for _, c := range adminCalls {
				t.call(hc, callers[0], gws[0].base, "", c)
				t.call(hc, callers[1], gws[1].base, chaosClientKey, c)
				t.call(hc, callers[2], gws[1].base, "", c)
			}
			return true
		})
	}, nil)
	e.account(res, names(gws...), results)
	hits, paths := counter.others()
	p.figure("%d admin calls (gateway without keys: open; with keys: keys+key, keys-nokey) answered %s", t.sent, t.all())
	for _, c := range []string{"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/%2e%2e/reset_prefix_cache"} {
		p.figure("POST %s: %s", c, t.summary(c))
	}
	p.figure("requests the replicas received on a path other than %v: %d %v", ordinaryPaths, hits, paths)
	p.check(t.sent > 0 && len(t.unclear) == 0, "admin calls not answered a clear 404 or 400 (401 without a key): %v", t.unclear)
	p.check(hits == 0, "the replicas received %d requests on admin paths: %v", hits, paths)
	return nil
}

// runSelfLoop: a gateway whose replica is its own listen address is
// refused at start. Two gateways each other's only replica are sent
// requests for the paths every gateway passes through (tokenize,
// detokenize, score): each must end in 508 at its second visit. First
// alone, while the process's file descriptors and goroutines are watched
// (one request made 8,189 fds before); then for HostileFor beside the
// ordinary load, which a legitimate chain — a gateway whose replica is a
// gateway in front of the replicas — serves through both its gateways.
func runSelfLoop(ctx context.Context, e *peerEnv, res *Result) error {
	p := res.Peers
	p.Attack = fmt.Sprintf("a gateway configured with its own address as a replica; two gateways configured as each other's replica, "+
		"sent /tokenize, /detokenize and /v1/score requests (%d alone, 8 at a time, then at %.0f/s beside the ordinary load)", loopAlone, e.o.Rate)
	refusedAtStart(p)
	if _, err := e.startSims(ctx, sim.Config{Replicas: 3}); err != nil {
		return err
	}
	back, err := e.serve("back", e.config(e.urls), nil)
	if err != nil {
		return err
	}
	front, err := e.serve("front", e.config([]string{back.base}), nil)
	if err != nil {
		return err
	}
	if err := e.waitReady(ctx, back); err != nil {
		return err
	}
	// The front's replica is a gateway: no engine metrics to scrape, so it
	// is ready once it lists the back's models and sees it healthy.
	if err := testutil.Poll(ctx, 10*time.Second, func() bool {
		return len(front.g.Fleet().Models()) > 0 && front.g.Router().Healthy(0)
	}); err != nil {
		return fmt.Errorf("the front gateway did not see the back one ready: %w", err)
	}
	loopA, loopB, err := e.loopPair(ctx)
	if err != nil {
		return err
	}
	e.markEjections()
	hc := &http.Client{Transport: e.tr, Timeout: e.o.ClientTimeout}
	bases := []string{loopA.base, loopB.base}
	loopBounded(ctx, p, hc, bases)
	lt := &loopTally{status: map[int]int{}}
	results := e.attack(ctx, e.clients(front, back), func(actx context.Context) {
		lt.run(actx, hc, bases, loadSpec{n: e.ordinaryCount(), rate: e.o.Rate, maxInFlight: 8, seed: 0x508})
	}, nil)
	e.account(res, names(front, back), results)
	p.figure("beside the ordinary load: %d looping requests, answered %s (%d with code loop_detected); %d lost",
		lt.sent, statuses(lt.status), lt.loop, len(lt.lost))
	p.check(lt.sent > 0 && lt.loop == lt.sent, "%d of %d looping requests answered 508 loop_detected: %v", lt.loop, lt.sent, lt.lost)
	return nil
}

// loopAlone is the looping requests sent before the ordinary load, with
// the process's gauges watched; loopFDs and loopGoroutines bound what they
// may take (8 at a time: a few connections and goroutines each).
const (
	loopAlone      = 200
	loopFDs        = 512
	loopGoroutines = 2048
)

// loopBounded sends loopAlone looping requests, 8 at a time, watching the
// process's file descriptors and goroutines, then waits for them to come
// back.
func loopBounded(ctx context.Context, p *PeerAccount, hc *http.Client, bases []string) {
	base := readGauges()
	gctx, stop := context.WithCancel(ctx)
	peakOf := peak(gctx, 5*time.Millisecond)
	lt := &loopTally{status: map[int]int{}}
	lt.run(ctx, hc, bases, loadSpec{n: loopAlone, concurrency: 8})
	stop()
	top := peakOf()
	after := settledGauges(ctx, base)
	p.figure("alone: %d looping requests answered %s (%d loop_detected); fds %d before, at most %d, %d after; goroutines %d, at most %d, %d after",
		lt.sent, statuses(lt.status), lt.loop, base.fds, top.fds, after.fds, base.goroutines, top.goroutines, after.goroutines)
	p.check(lt.sent == loopAlone && lt.loop == lt.sent, "%d of %d looping requests answered 508 loop_detected: %v", lt.loop, lt.sent, lt.lost)
	p.check(top.fds-base.fds < loopFDs, "%d looping requests took %d file descriptors", loopAlone, top.fds-base.fds)
	p.check(top.goroutines-base.goroutines < loopGoroutines, "%d looping requests took %d goroutines", loopAlone, top.goroutines-base.goroutines)
}

// refusedAtStart checks that a gateway whose replica is its own listen
// address is refused by gateway.New, for each spelling of the address.
func refusedAtStart(p *PeerAccount) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		p.broken("no free port: %v", err)
		return
	}
	port := ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	cases := []struct{ listen, replica string }{
		{fmt.Sprintf("127.0.0.1:%d", port), fmt.Sprintf("http://127.0.0.1:%d", port)},
		{fmt.Sprintf("127.0.0.1:%d", port), fmt.Sprintf("http://localhost:%d/", port)},
		{fmt.Sprintf("0.0.0.0:%d", port), fmt.Sprintf("http://127.0.0.1:%d", port)},
		{fmt.Sprintf(":%d", port), fmt.Sprintf("http://localhost:%d", port)},
	}
	refused := 0
	var why []string
	for _, c := range cases {
		cfg := gateway.Defaults()
		cfg.Listen, cfg.Replicas = c.listen, []gateway.ReplicaConfig{{URL: c.replica}}
		_, err := gateway.New(cfg, gateway.Options{Registry: prometheus.NewRegistry()})
		if err != nil && strings.Contains(err.Error(), "loop") {
			refused++
		} else {
			why = append(why, fmt.Sprintf("listen %s, replica %s: %v", c.listen, c.replica, err))
		}
	}
	p.figure("a replica that is the gateway's own listen address: %d of %d spellings refused at start", refused, len(cases))
	p.check(refused == len(cases), "a gateway started with its own address as a replica: %v", why)
}

// loopPair starts two gateways, each the other's only replica, and waits
// until each sees the other healthy.
func (e *peerEnv) loopPair(ctx context.Context) (*peerGateway, *peerGateway, error) {
	lnA, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, nil, err
	}
	lnB, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = lnA.Close()
		return nil, nil, err
	}
	a, err := e.serve("loop-a", e.config([]string{"http://" + lnB.Addr().String()}), lnA)
	if err != nil {
		_ = lnB.Close()
		return nil, nil, err
	}
	b, err := e.serve("loop-b", e.config([]string{"http://" + lnA.Addr().String()}), lnB)
	if err != nil {
		return nil, nil, err
	}
	if err := testutil.Poll(ctx, 10*time.Second, func() bool {
		return a.g.Router().Healthy(0) && b.g.Router().Healthy(0)
	}); err != nil {
		return nil, nil, fmt.Errorf("the looping gateways did not see each other healthy: %w", err)
	}
	return a, b, nil
}

// loopTally counts the looping requests' answers.
type loopTally struct {
	mu     sync.Mutex
	sent   int
	loop   int // 508 with code loop_detected
	status map[int]int
	lost   []string
}

// loopCalls are requests a gateway passes through without a model.
var loopCalls = []adminCall{
	{"/tokenize", `{"prompt":"hello"}`},
	{"/detokenize", `{"tokens":[1,2]}`},
	{"/v1/score", `{"text_1":"a","text_2":"b"}`},
}

// run sends the looping requests of s to the gateways in turn. A request
// sent is answered whatever ctx does (hc's timeout bounds it): ctx only
// stops the sending.
func (t *loopTally) run(ctx context.Context, hc *http.Client, bases []string, s loadSpec) {
	runLoad(ctx, s, func(ctx context.Context, i int) {
		c := loopCalls[i%len(loopCalls)]
		req, err := http.NewRequestWithContext(context.WithoutCancel(ctx), http.MethodPost, bases[i%len(bases)]+c.path, strings.NewReader(c.body))
		if err != nil {
			return
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		t.mu.Lock()
		defer t.mu.Unlock()
		t.sent++
		if err != nil {
			t.lost = sample(t.lost, c.path+": "+err.Error())
			return
		}
		defer resp.Body.Close()
		t.status[resp.StatusCode]++
		var body struct {
			Error struct {
				Code string `json:"code"`
			} `json:"error"`
		}
		if json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&body) == nil && resp.StatusCode == http.StatusLoopDetected &&
			body.Error.Code == "loop_detected" {
			t.loop++
			return
		}
		t.lost = sample(t.lost, fmt.Sprintf("%s: %d %q", c.path, resp.StatusCode, body.Error.Code))
	})
}

// settledGauges waits (up to 10 s: the gateways close idle upstream
// connections after 4 s) for the file descriptors and goroutines to come
// back within a little of base, and returns them as they are then.
func settledGauges(ctx context.Context, base gauges) gauges {
	var g gauges
	_ = testutil.Poll(ctx, 10*time.Second, func() bool {
		g = readGauges()
		return g.fds <= base.fds+64 && g.goroutines <= base.goroutines+128
	})
	return g
}
