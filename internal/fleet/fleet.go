// Package fleet keeps the gateway's knowledge of its replicas current: it
// scrapes each replica's /metrics (waiting, running, KV usage, cache size),
// checks /health, lists /v1/models, and ejects a replica after consecutive
// failures (passive health) for a cooldown. It writes what it learns into
// the router, which the policies read.
package fleet

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/router"
)

// Config tunes the fleet's loops.
type Config struct {
	ScrapeInterval time.Duration // default 250ms
	HealthInterval time.Duration // default 1s
	EjectAfter     int           // consecutive failures; default 3
	EjectCooldown  time.Duration // default 10s
	Timeout        time.Duration // per probe; default 2s
	// APIKeys per replica (optional), sent as bearer tokens.
	APIKeys []string
	Logger  *slog.Logger
	Now     func() time.Time
	// OnEject is called when a replica is ejected (metrics).
	OnEject func(replica int)
}

// Fleet watches the router's replicas.
type Fleet struct {
	models atomic.Pointer[[]string] // union of the replicas' models
	rt     *router.Router
	cfg    Config
	client *http.Client
	mem    []*member
}

type member struct {
	url string
	mu  sync.Mutex
	// healthOK: the last active health check passed (true until one fails).
	healthOK     bool
	consecFail   int
	ejectedUntil time.Time
	// The circuit breaker: open while ejectedUntil is ahead; after it,
	// half-open (opens > 0) until a probe request succeeds.
	opens       int  // consecutive openings without a success in between
	probe       bool // half-open: a trial request is in flight
	models      []string
	cacheBlocks int
}

// New watches every replica of rt.
func New(rt *router.Router, client *http.Client, cfg Config) *Fleet {
	if cfg.ScrapeInterval <= 0 {
		cfg.ScrapeInterval = 250 * time.Millisecond
	}
	if cfg.HealthInterval <= 0 {
		cfg.HealthInterval = time.Second
	}
	if cfg.EjectAfter <= 0 {
		cfg.EjectAfter = 3
	}
	if cfg.EjectCooldown <= 0 {
		cfg.EjectCooldown = 10 * time.Second
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	f := &Fleet{rt: rt, cfg: cfg, client: client}
	for i := range rt.Replicas() {
		f.mem = append(f.mem, &member{url: rt.URL(i), healthOK: true})
	}
	return f
}

// Run probes every replica until ctx ends; it returns when all its
// goroutines have.
func (f *Fleet) Run(ctx context.Context) {
	var wg sync.WaitGroup
	for i := range f.mem {
		wg.Add(2)
		go func() { defer wg.Done(); f.loop(ctx, f.cfg.ScrapeInterval, func() { f.scrape(ctx, i) }) }()
		go func() { defer wg.Done(); f.loop(ctx, f.cfg.HealthInterval, func() { f.health(ctx, i) }) }()
	}
	wg.Wait()
}

func (f *Fleet) loop(ctx context.Context, every time.Duration, probe func()) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		probe()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (f *Fleet) get(ctx context.Context, i int, path string) (*http.Response, error) {
	ctx, cancel := context.WithTimeout(ctx, f.cfg.Timeout)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, f.mem[i].url+path, nil)
	if err != nil {
		cancel()
		return nil, err
	}
	if i < len(f.cfg.APIKeys) && f.cfg.APIKeys[i] != "" {
		req.Header.Set("Authorization", "Bearer "+f.cfg.APIKeys[i])
	}
	resp, err := f.client.Do(req)
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = &cancelBody{ReadCloser: resp.Body, cancel: cancel}
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		return nil, fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	return resp, nil
}

type cancelBody struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (b *cancelBody) Close() error { err := b.ReadCloser.Close(); b.cancel(); return err }

// ScrapeOnce scrapes replica i now (tests, and the first scrape at start).
func (f *Fleet) scrape(ctx context.Context, i int) {
	resp, err := f.get(ctx, i, "/metrics")
	if err != nil {
		return // the health loop judges reachability
	}
	m, err := ParseMetrics(io.LimitReader(resp.Body, 8<<20))
	resp.Body.Close()
	if err != nil {
		f.cfg.Logger.Debug("scrape", "replica", f.mem[i].url, "err", err)
		return
	}
	m = f.rt.SetMetrics(i, m, f.cfg.Now())
	mem := f.mem[i]
	mem.mu.Lock()
	changed := m.NumBlocks > 0 && m.NumBlocks != mem.cacheBlocks
	mem.cacheBlocks = m.NumBlocks
	mem.mu.Unlock()
	if changed {
		// The index forgets about when the replica's cache does.
		_ = f.rt.Index().SetCapacity(i, m.NumBlocks)
	}
}

func (f *Fleet) health(ctx context.Context, i int) {
	ok := false
	if resp, err := f.get(ctx, i, "/health"); err == nil {
		resp.Body.Close()
		ok = true
	}
	if ctx.Err() != nil {
		return
	}
	mem := f.mem[i]
	mem.mu.Lock()
	// A passing /health does not reset the passive failure count: a replica
	// can answer /health and fail every inference request.
	mem.healthOK = ok
	mem.mu.Unlock()
	if ok {
		f.fetchModels(ctx, i)
	}
	f.update(i)
}

func (f *Fleet) fetchModels(ctx context.Context, i int) {
	resp, err := f.get(ctx, i, "/v1/models")
	if err != nil {
		return
	}
	defer resp.Body.Close()
	var body struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&body); err != nil {
		return
	}
	ids := make([]string, 0, len(body.Data))
	for _, d := range body.Data {
		ids = append(ids, d.ID)
	}
	f.mem[i].mu.Lock()
	changed := !slices.Equal(f.mem[i].models, ids)
	f.mem[i].models = ids
	f.mem[i].mu.Unlock()
	if changed {
		f.refreshModels()
	}
}

// refreshModels recomputes the union of the replicas' models, which the
// gateway reads on every request.
func (f *Fleet) refreshModels() {
	set := map[string]bool{}
	for _, m := range f.mem {
		m.mu.Lock()
		for _, id := range m.models {
			set[id] = true
		}
		m.mu.Unlock()
	}
	out := make([]string, 0, len(set))
	for id := range set {
		out = append(out, id)
	}
	sort.Strings(out)
	f.models.Store(&out)
}

// update sets the router's health flag from the checks and ejection.
func (f *Fleet) update(i int) {
	mem := f.mem[i]
	mem.mu.Lock()
	ok := mem.healthOK && !f.cfg.Now().Before(mem.ejectedUntil)
	mem.mu.Unlock()
	f.rt.SetHealthy(i, ok)
}

// Allow asks to send a request to replica i: always while its breaker is
// closed; while half-open (after an ejection's cooldown) only one trial
// request at a time. The caller then reports the outcome with exactly one
// of Success, Failure or Neutral.
func (f *Fleet) Allow(i int) bool {
	mem := f.mem[i]
	mem.mu.Lock()
	defer mem.mu.Unlock()
	if mem.opens == 0 {
		return true
	}
	if f.cfg.Now().Before(mem.ejectedUntil) || mem.probe {
		return false
	}
	mem.probe = true
	return true
}

// Success records a good response from replica i: the failure count
// restarts and a half-open breaker closes.
func (f *Fleet) Success(i int) {
	mem := f.mem[i]
	mem.mu.Lock()
	mem.consecFail, mem.opens, mem.probe = 0, 0, false
	mem.mu.Unlock()
}

// Neutral ends a request that says nothing of the replica's health (the
// client went away, a 4xx): it only frees a half-open breaker's trial.
func (f *Fleet) Neutral(i int) {
	mem := f.mem[i]
	mem.mu.Lock()
	mem.probe = false
	mem.mu.Unlock()
}

// Failure records a failed request to replica i (connection refused or
// reset, 5xx, timeout). The breaker opens after EjectAfter consecutive
// failures, or at once when a half-open trial fails, for a cooldown that
// doubles with each opening in a row (at most 32× EjectCooldown); the
// replica leaves rotation. After the cooldown the replica returns half-open
// (if its /health passes) and closes on a trial's success.
func (f *Fleet) Failure(i int) {
	mem := f.mem[i]
	mem.mu.Lock()
	mem.consecFail++
	trial := mem.probe
	mem.probe = false
	now := f.cfg.Now()
	eject := !now.Before(mem.ejectedUntil) && (trial || mem.consecFail >= f.cfg.EjectAfter)
	var cooldown time.Duration
	if eject {
		mem.opens++
		cooldown = f.cfg.EjectCooldown << min(mem.opens-1, 5)
		mem.ejectedUntil = now.Add(cooldown)
		mem.consecFail = 0
	}
	mem.mu.Unlock()
	if eject {
		f.cfg.Logger.Warn("replica ejected", "replica", mem.url, "cooldown", cooldown)
		if f.cfg.OnEject != nil {
			f.cfg.OnEject(i)
		}
		f.rt.SetHealthy(i, false)
	}
}

// State is replica i's breaker state: "closed", "open" or "half-open".
func (f *Fleet) State(i int) string {
	mem := f.mem[i]
	mem.mu.Lock()
	defer mem.mu.Unlock()
	switch {
	case mem.opens == 0:
		return "closed"
	case f.cfg.Now().Before(mem.ejectedUntil):
		return "open"
	}
	return "half-open"
}

// Ejected reports whether replica i is in its ejection cooldown.
func (f *Fleet) Ejected(i int) bool {
	mem := f.mem[i]
	mem.mu.Lock()
	defer mem.mu.Unlock()
	return f.cfg.Now().Before(mem.ejectedUntil)
}

// Models is the union of the replicas' served models, sorted (shared: do
// not modify).
func (f *Fleet) Models() []string {
	if p := f.models.Load(); p != nil {
		return *p
	}
	return nil
}
