// Package fleet keeps the gateway's knowledge of its replicas current: it
// scrapes each replica's /metrics (waiting, running, KV usage, cache size,
// running LoRA adapters), checks /health and lists /v1/models. Everything it
// learns goes into the replica's one home, router.Replica, which the
// policies read. (Each request's verdict reaches the replica's circuit
// breaker through its router.Ticket; the fleet logs the replica leaving and
// rejoining rotation, NoteEjection.) Time comes from an injected clock, so
// scrape backoff and staleness are tested exactly with a fake one.
package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/router"
)

// Config tunes the fleet's loops.
type Config struct {
	ScrapeInterval time.Duration // default 250ms
	HealthInterval time.Duration // default 1s
	// StaleAfter: metrics older than this are not used for routing (the
	// router's own bound) and the replica is logged as stale; default 8 ×
	// ScrapeInterval, at least 2 s.
	StaleAfter time.Duration
	Timeout    time.Duration // per probe; default 2s
	// MaxMetricsBytes bounds a /metrics page (default 4 MiB; vLLM's is a few
	// hundred KiB). A larger page is not parsed, and the replica's scrapes
	// back off like failed ones.
	MaxMetricsBytes int64
	Logger          *slog.Logger
	Clock           clock.Clock
}

// Fleet watches the router's replicas.
type Fleet struct {
	models atomic.Pointer[[]router.Model] // union of the replicas' models
	rt     *router.Router
	cfg    Config
	client *http.Client
	mu     sync.Mutex // serialises refreshModels
	// smu guards servers and the loops' bookkeeping: the membership
	// changes while the fleet runs (Sync).
	smu sync.Mutex
	// servers are the targets of each server (by URL), in slot order: the
	// ranks of a data-parallel server share its probes. Only servers with
	// a replica not removed are listed, and probed.
	servers map[string]*server
	runCtx  context.Context // Run's, nil before Run and once it ends
	loops   sync.WaitGroup
	// rejoins re-check each ejected replica at its breaker's cooldown's
	// end (NoteEjection); stopped when Run ends.
	rejoins map[clock.Timer]struct{}
	warned  sync.Map // server URL → engines count already warned about
	// loggedOut is, per slot, whether the last rotation change logged took
	// the replica out (absent: in rotation, as replicas start).
	loggedOut sync.Map
	// healthWhy is, per server URL, why its last health check failed
	// (absent: it passed); summarised: the first checks' outcome is logged.
	healthWhy  sync.Map
	summarised atomic.Bool
}

// server is one server's targets and its probe loops' cancel (nil while
// they do not run).
type server struct {
	slots  []int
	cancel context.CancelFunc
}

// New watches every replica of rt.
func New(rt *router.Router, client *http.Client, cfg Config) *Fleet {
	if cfg.ScrapeInterval <= 0 {
		cfg.ScrapeInterval = 250 * time.Millisecond
	}
	if cfg.HealthInterval <= 0 {
		cfg.HealthInterval = time.Second
	}
	if cfg.StaleAfter <= 0 {
		cfg.StaleAfter = max(8*cfg.ScrapeInterval, 2*time.Second)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 2 * time.Second
	}
	if cfg.MaxMetricsBytes <= 0 {
		cfg.MaxMetricsBytes = defaultMaxMetricsBytes
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	cfg.Clock = clock.OrReal(cfg.Clock)
	f := &Fleet{rt: rt, cfg: cfg, client: client, servers: map[string]*server{}, rejoins: map[clock.Timer]struct{}{}}
	f.Sync()
	return f
}

// Sync follows the router's membership: a server with a replica added or
// revived starts being probed at once (while Run runs), one whose replicas
// were all removed stops; the union of the models served is recomputed.
func (f *Fleet) Sync() {
	want := map[string][]int{}
	for i := range f.rt.Replicas() {
		if r := f.rt.Replica(i); !r.Removed() {
			want[r.URL()] = append(want[r.URL()], i)
		}
	}
	f.smu.Lock()
	for u, s := range f.servers {
		if _, ok := want[u]; !ok {
			if s.cancel != nil {
				s.cancel()
			}
			delete(f.servers, u)
		}
	}
	for u, slots := range want {
		s := f.servers[u]
		if s == nil {
			s = &server{}
			f.servers[u] = s
		}
		s.slots = slots
		if f.runCtx != nil && s.cancel == nil {
			f.startLocked(s)
		}
	}
	f.smu.Unlock()
	f.refreshModels()
}

// Forget drops what the fleet keeps of a replica the router forgot
// (router.Forget): the rotation last logged for its slot, which the slot's
// next replica must not inherit, and the engine count warned about and the
// last health check's failure for its server, once no replica of that
// server is left. Its probes stopped when it was removed (Sync).
func (f *Fleet) Forget(slot int, url string) {
	f.loggedOut.Delete(slot)
	for i := range f.rt.Replicas() {
		if r := f.rt.Replica(i); !r.Vacant() && r.URL() == url {
			return // another rank of the server, or the server listed again
		}
	}
	f.warned.Delete(url)
	f.healthWhy.Delete(url)
}

// startLocked starts server s's probe loops; smu is held.
func (f *Fleet) startLocked(s *server) {
	ctx, cancel := context.WithCancel(f.runCtx)
	s.cancel = cancel
	i := s.slots[0]
	f.loops.Add(2)
	go func() {
		defer f.loops.Done()
		f.loop(ctx, f.cfg.ScrapeInterval, func() bool { return f.Scrape(ctx, i) })
	}()
	go func() {
		defer f.loops.Done()
		f.loop(ctx, f.cfg.HealthInterval, func() bool { return f.Health(ctx, i) })
	}()
}

// Servers are the URLs of the servers probed, sorted.
func (f *Fleet) Servers() []string {
	f.smu.Lock()
	defer f.smu.Unlock()
	out := make([]string, 0, len(f.servers))
	for u := range f.servers {
		out = append(out, u)
	}
	sort.Strings(out)
	return out
}

// slotsOf is the targets of replica i's server (i alone when its server
// is no longer probed).
func (f *Fleet) slotsOf(i int) []int {
	f.smu.Lock()
	defer f.smu.Unlock()
	if s := f.servers[f.rt.URL(i)]; s != nil {
		return s.slots
	}
	return []int{i}
}

// StaleAfter is the age past which a replica's metrics are not used.
func (f *Fleet) StaleAfter() time.Duration { return f.cfg.StaleAfter }

// Run probes every replica until ctx ends; it returns when all its
// goroutines have.
func (f *Fleet) Run(ctx context.Context) {
	f.smu.Lock()
	f.runCtx = ctx
	for _, s := range f.servers {
		f.startLocked(s)
	}
	f.smu.Unlock()
	<-ctx.Done()
	f.smu.Lock()
	f.runCtx = nil // Sync starts no loop from now on, NoteEjection no re-check
	for _, s := range f.servers {
		if s.cancel != nil {
			s.cancel()
			s.cancel = nil
		}
	}
	for t := range f.rejoins {
		t.Stop()
	}
	clear(f.rejoins)
	f.smu.Unlock()
	f.loops.Wait()
}

// maxBackoff bounds the wait between probes of a replica that keeps failing.
const maxBackoff = 30 * time.Second

// loop probes every interval; after failures in a row it waits longer
// (doubling, at most maxBackoff), so a broken replica costs little.
func (f *Fleet) loop(ctx context.Context, every time.Duration, probe func() bool) {
	fails := 0
	for {
		if probe() {
			fails = 0
		} else {
			fails++
		}
		wait := every
		if fails > 1 {
			wait = min(every<<min(fails-1, 16), max(maxBackoff, every))
		}
		if !clock.Sleep(f.cfg.Clock, wait, ctx.Done()) {
			return
		}
	}
}

func (f *Fleet) get(ctx context.Context, i int, path string) (*http.Response, error) {
	ctx, cancel := context.WithTimeout(ctx, f.cfg.Timeout)
	r := f.rt.Replica(i)
	resp, err := getPage(ctx, f.client, r.URL(), r.APIKey(), path)
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = &cancelBody{ReadCloser: resp.Body, cancel: cancel}
	return resp, nil
}

// getPage GETs base+path with the replica's bearer key; anything but a 200
// is an error (its body drained and closed).
func getPage(ctx context.Context, client *http.Client, base, apiKey, path string) (*http.Response, error) {
	req, err := NewRequest(ctx, http.MethodGet, base, apiKey, path, nil, nil)
	if err != nil {
		return nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		return nil, &statusError{path: path, status: resp.Status}
	}
	return resp, nil
}

// statusError is a probe answered with another status than 200.
type statusError struct{ path, status string }

func (e *statusError) Error() string { return "GET " + e.path + ": " + e.status }

// healthReason says in a few words why a health check failed: the status
// the server answered, or what kept it from answering.
func (f *Fleet) healthReason(err error) string {
	var se *statusError
	var dns *net.DNSError
	var ne net.Error
	switch {
	case errors.As(err, &se):
		return se.path + " answered " + se.status
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused"
	case errors.Is(err, syscall.ECONNRESET):
		return "connection reset"
	case errors.As(err, &dns) && dns.IsNotFound:
		return "host " + dns.Name + " not found"
	case errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()):
		return fmt.Sprintf("no answer within %v", f.cfg.Timeout)
	}
	return err.Error()
}

type cancelBody struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (b *cancelBody) Close() error { err := b.ReadCloser.Close(); b.cancel(); return err }

// defaultMaxMetricsBytes is Config.MaxMetricsBytes's default.
const defaultMaxMetricsBytes = 4 << 20

// errTooLarge: a /metrics page over MaxMetricsBytes.
var errTooLarge = errors.New("metrics page larger than the bound")

// Scrape scrapes the /metrics of replica i's server once (every rank of a
// data-parallel server from one page) and reports whether it worked. A
// failure keeps the last values, whose age then grows until the router
// stops using them; the transition to stale (and back) is logged once.
func (f *Fleet) Scrape(ctx context.Context, i int) bool {
	page, err := f.readMetrics(ctx, i)
	if ctx.Err() != nil {
		return true
	}
	slots := f.slotsOf(i)
	if err == nil {
		f.checkEngines(i, Engines(page))
	}
	ok := true
	for _, s := range slots {
		ok = f.scrapeResult(s, page, err) && ok
	}
	return ok
}

// scrapeResult applies one scrape (page, or err) to target i.
func (f *Fleet) scrapeResult(i int, page map[string]*metricFamily, err error) bool {
	r := f.rt.Replica(i)
	now := f.cfg.Clock.Now()
	var m router.Metrics
	if err == nil {
		engine := allEngines
		if k, ranked := r.Rank(); ranked {
			engine = k
		}
		m, err = metricsOf(page, engine)
	}
	if err == nil {
		m = f.rt.SetMetrics(i, m, now)
		if m.NumBlocks > 0 && r.SetCapacityBlocks(m.NumBlocks) {
			// The index forgets about when the replica's cache does.
			_ = f.rt.Index().SetCapacity(i, m.NumBlocks)
		}
		f.noteAdapters(i, ParseAdapters(page))
	}
	changed, stale, fails := r.ScrapeResult(now, err, f.cfg.StaleAfter)
	switch {
	case changed && stale:
		f.cfg.Logger.Warn("replica metrics are stale: routing on the gateway's own counts for it",
			"replica", r.Name(), "failed_scrapes", fails, "err", err)
	case changed:
		f.cfg.Logger.Info("replica metrics fresh again", "replica", r.Name())
	case err != nil && fails == 1:
		f.cfg.Logger.Debug("scrape failed", "replica", r.Name(), "err", err)
	}
	return err == nil
}

// checkEngines warns once (per count) when replica i's server runs more
// data-parallel engines than kvgate routes it as: the ranks beyond are
// never chosen by the cache, only by the server.
func (f *Fleet) checkEngines(i, engines int) {
	targets := len(f.slotsOf(i))
	if engines <= 1 || engines == targets {
		return
	}
	if old, loaded := f.warned.Swap(f.rt.URL(i), engines); loaded && old.(int) == engines {
		return
	}
	f.cfg.Logger.Warn("replica runs data-parallel engines kvgate does not route to one by one: set data_parallel_size "+
		"(or restart kvgate, which counts them at start)",
		"replica", f.rt.URL(i), "engines", engines, "routed_as", targets)
}

func (f *Fleet) readMetrics(ctx context.Context, i int) (map[string]*metricFamily, error) {
	resp, err := f.get(ctx, i, "/metrics")
	if err != nil {
		return nil, err
	}
	return readPage(resp, f.cfg.MaxMetricsBytes)
}

// readPage reads and parses a /metrics page of at most limit bytes, and
// closes it.
func readPage(resp *http.Response, limit int64) (map[string]*metricFamily, error) {
	defer resp.Body.Close()
	if resp.ContentLength > limit {
		return nil, errTooLarge
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(data)) > limit {
		return nil, errTooLarge
	}
	return parseBytes(data)
}

// Health checks the /health of replica i's server (and lists its models
// when it passes) for every target of the server; it reports whether the
// check passed.
func (f *Fleet) Health(ctx context.Context, i int) bool {
	resp, err := f.get(ctx, i, "/health")
	ok := err == nil
	if ok {
		resp.Body.Close()
	}
	if ctx.Err() != nil {
		return true
	}
	var why string
	if ok {
		f.healthWhy.Delete(f.rt.URL(i))
		// Listed before it is in rotation: a replica passing its first
		// check is routable (a candidate for its models) once it is Ready.
		f.fetchModels(ctx, i)
	} else {
		why = f.healthReason(err)
		f.healthWhy.Store(f.rt.URL(i), why) // before the check counts as ended (SetHealthOK): summarise reads it
	}
	for _, s := range f.slotsOf(i) {
		r := f.rt.Replica(s)
		was := r.Healthy()
		// A passing /health does not close the breaker: a replica can answer
		// /health and fail every inference request.
		now := r.SetHealthOK(ok, f.cfg.Clock.Now())
		switch {
		case was == now:
		case now:
			f.logRotation(s, true, "replica back in rotation", "breaker", r.Breaker.State(f.cfg.Clock.Now()))
		case !ok:
			f.logRotation(s, false, "replica unhealthy: out of rotation until its /health passes", "reason", why)
		}
	}
	f.summarise()
	return ok
}

// summarise logs, once, when every replica's first health check has ended
// (what /ready waits for), how many servers passed it and why each other
// did not: "2 of 3 replicas healthy; unhealthy: URL (connection refused)",
// at info when all passed, else at warn.
func (f *Fleet) summarise() {
	if f.summarised.Load() {
		return
	}
	for i := range f.rt.Replicas() {
		if r := f.rt.Replica(i); !r.Removed() && !r.Probed() {
			return
		}
	}
	if !f.summarised.CompareAndSwap(false, true) {
		return
	}
	servers := f.Servers()
	var down []string
	for _, u := range servers {
		if why, failed := f.healthWhy.Load(u); failed {
			down = append(down, fmt.Sprintf("%s (%v)", u, why))
		}
	}
	noun := "replicas"
	if len(servers) == 1 {
		noun = "replica"
	}
	msg := fmt.Sprintf("%d of %d %s healthy", len(servers)-len(down), len(servers), noun)
	if len(down) == 0 {
		f.cfg.Logger.Info(msg, "healthy", len(servers), "replicas", len(servers))
		return
	}
	f.cfg.Logger.Warn(msg+"; unhealthy: "+strings.Join(down, ", "), "healthy", len(servers)-len(down), "replicas", len(servers))
}

func (f *Fleet) fetchModels(ctx context.Context, i int) {
	resp, err := f.get(ctx, i, "/v1/models")
	if err != nil {
		return
	}
	defer resp.Body.Close()
	var body struct {
		Data []json.RawMessage `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&body); err != nil || len(body.Data) == 0 {
		return
	}
	ms := make([]router.Model, 0, len(body.Data))
	for _, raw := range body.Data {
		var d struct {
			ID          string  `json:"id"`
			Root        string  `json:"root"`
			Parent      *string `json:"parent"`
			MaxModelLen int     `json:"max_model_len"`
		}
		if json.Unmarshal(raw, &d) != nil || d.ID == "" {
			continue
		}
		m := router.Model{ID: d.ID, Root: d.Root, MaxModelLen: max(d.MaxModelLen, 0), Card: string(raw)}
		if d.Parent != nil {
			m.Parent = *d.Parent
		}
		ms = append(ms, m)
	}
	if len(ms) == 0 {
		return // a listing without one readable model says nothing: keep the last
	}
	for _, s := range f.slotsOf(i) {
		var running []string
		if old := f.rt.Replica(s).Served(); old != nil {
			running = old.Running
		}
		f.setServed(s, router.NewServed(ms, running))
	}
}

// noteAdapters records the adapters a scrape saw running or waiting as
// served by replica i (vLLM loads adapters on demand; /v1/models may lag).
// The page itself is the history (vLLM keeps every label set it exported
// while the process lives), so a restarted replica forgets them.
func (f *Fleet) noteAdapters(i int, running []string) {
	old := f.rt.Replica(i).Served()
	if old == nil {
		return
	}
	f.setServed(i, router.NewServed(old.Models, running))
}

func (f *Fleet) setServed(i int, s *router.Served) {
	r := f.rt.Replica(i)
	if s.Equal(r.Served()) {
		return
	}
	r.SetServed(s)
	f.refreshModels()
}

// refreshModels recomputes the union of the replicas' models, which the
// gateway reads on every request.
func (f *Fleet) refreshModels() {
	f.mu.Lock()
	defer f.mu.Unlock()
	set := map[string]router.Model{}
	for i := range f.rt.Replicas() {
		s := f.rt.Replica(i).Served()
		if s == nil || f.rt.Replica(i).Removed() {
			continue // a removed replica's models are no longer served
		}
		for _, m := range s.Models {
			if _, ok := set[m.ID]; !ok {
				set[m.ID] = m
			}
		}
	}
	out := make([]router.Model, 0, len(set))
	for _, m := range set {
		out = append(out, m)
	}
	sort.Slice(out, func(a, b int) bool { return out[a].ID < out[b].ID })
	f.models.Store(&out)
}

// Models is the union of the replicas' listed models, sorted by ID (shared:
// do not modify).
func (f *Fleet) Models() []router.Model {
	if p := f.models.Load(); p != nil {
		return *p
	}
	return nil
}

// NoteEjection logs that replica i's breaker opened (router.Config.OnEject):
// out of rotation for cooldown, back half-open after it if its last /health
// passed. Logged with the health loop's own rotation changes, once per
// departure. The replica is re-checked when the cooldown ends (rejoin):
// the health loop would bring it back only at its next check, up to
// health_interval later (more while its checks back off), and nothing
// else would (the router's queue waits for it meanwhile).
func (f *Fleet) NoteEjection(i int, cooldown time.Duration) {
	f.logRotation(i, false, "replica ejected after consecutive failures: out of rotation for the cooldown", "cooldown", cooldown)
	r := f.rt.Replica(i)
	f.smu.Lock()
	defer f.smu.Unlock()
	if f.runCtx == nil {
		return // not running: nor is the health loop
	}
	var t clock.Timer
	t = f.cfg.Clock.AfterFunc(cooldown, func() {
		f.smu.Lock()
		_, live := f.rejoins[t]
		delete(f.rejoins, t)
		f.smu.Unlock()
		if live {
			f.rejoin(i, r)
		}
	})
	f.rejoins[t] = struct{}{}
}

// rejoin puts replica r (of slot i, which discovery may have given to
// another since) back in rotation, half-open, if its breaker's cooldown
// has ended and its last /health passed (router.Replica.UpdateHealthy,
// which moves the router's queue).
func (f *Fleet) rejoin(i int, r *router.Replica) {
	if i >= f.rt.Replicas() || f.rt.Replica(i) != r || r.Removed() || r.Healthy() {
		return
	}
	now := f.cfg.Clock.Now()
	if r.UpdateHealthy(now) {
		f.logRotation(i, true, "replica back in rotation: its breaker's cooldown ended", "breaker", r.Breaker.State(now))
	}
}

// logRotation logs, at info, a replica leaving rotation (in false) or
// coming back, once per transition: the health loop and the request path
// (an ejection) both report, and may race, and an ejected replica whose
// /health also fails is still one departure.
func (f *Fleet) logRotation(slot int, in bool, msg string, args ...any) {
	prev, _ := f.loggedOut.LoadOrStore(slot, false)
	if prev.(bool) == !in || !f.loggedOut.CompareAndSwap(slot, prev, !in) {
		return // logged already, by this reporter or the other
	}
	f.cfg.Logger.Info(msg, append([]any{"replica", f.rt.Name(slot)}, args...)...)
}

// State is replica i's breaker state: "closed", "open" or "half-open".
func (f *Fleet) State(i int) string { return f.rt.Replica(i).Breaker.State(f.cfg.Clock.Now()) }

// Ejected reports whether replica i is in its ejection cooldown.
func (f *Fleet) Ejected(i int) bool { return f.rt.Replica(i).Breaker.Open(f.cfg.Clock.Now()) }

// CountEngines reads a server's /metrics once and returns how many
// data-parallel engines it runs (distinct engine labels; 1 when none are
// labelled): how the gateway learns, at start, how many targets a server is.
func CountEngines(ctx context.Context, client *http.Client, url, apiKey string) (int, error) {
	resp, err := getPage(ctx, client, url, apiKey, "/metrics")
	if err != nil {
		return 0, err
	}
	fams, err := readPage(resp, defaultMaxMetricsBytes)
	if err != nil {
		return 0, err
	}
	return max(Engines(fams), 1), nil
}
