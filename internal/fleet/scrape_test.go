package fleet

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
)

// stubReplica serves /metrics, /health and /v1/models from swappable pages.
type stubReplica struct {
	srv     *httptest.Server
	metrics atomic.Pointer[string] // nil: 500
	models  atomic.Pointer[string]
	hits    atomic.Int64
}

func newStub(t *testing.T) *stubReplica {
	s := &stubReplica{}
	s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.hits.Add(1)
		switch r.URL.Path {
		case "/metrics":
			if p := s.metrics.Load(); p != nil {
				_, _ = w.Write([]byte(*p))
				return
			}
			http.Error(w, "broken", http.StatusInternalServerError)
		case "/v1/models":
			if p := s.models.Load(); p != nil {
				_, _ = w.Write([]byte(*p))
				return
			}
			http.NotFound(w, r)
		case "/health":
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *stubReplica) setMetrics(page string) { s.metrics.Store(&page) }

func fleetOn(t *testing.T, urls []string, cfg Config) (*router.Router, *Fleet, *clock.Fake) {
	t.Helper()
	pol, _ := policy.New("least_load", policy.Options{})
	clk := clock.NewFake(time.Unix(100, 0))
	rt, err := router.New(router.Config{Replicas: urls, Policy: pol, Now: clk.Now, StaleAfter: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Clock = clk
	cfg.StaleAfter = 2 * time.Second
	return rt, New(rt, &http.Client{}, cfg), clk
}

func page(waiting int) string {
	return fmt.Sprintf("vllm:num_requests_waiting %d\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.5\n", waiting)
}

// Finding 9: an idle replica's old "900 waiting" must not be used forever.
// Once its scrapes fail for longer than StaleAfter, the policies see no
// scraped values for it (the gateway's own counts decide) and it gets work.
func TestStaleMetricsAreNotUsed(t *testing.T) {
	a, b := newStub(t), newStub(t)
	a.setMetrics(page(900))
	b.setMetrics(page(5))
	rt, f, clk := fleetOn(t, []string{a.srv.URL, b.srv.URL}, Config{})
	ctx := context.Background()
	if !f.Scrape(ctx, 0) || !f.Scrape(ctx, 1) {
		t.Fatal("first scrapes failed")
	}
	a.metrics.Store(nil) // replica a's /metrics breaks; its last page said 900 waiting
	clk.Advance(time.Second)
	if f.Scrape(ctx, 0) {
		t.Fatal("a failing scrape reported success")
	}
	views := rt.Views(&policy.Request{Now: clk.Now()})
	if !views[0].HaveMetrics || views[0].Waiting != 900 {
		t.Fatalf("within StaleAfter the last values stand: %+v", views[0])
	}
	clk.Advance(1500 * time.Millisecond)
	f.Scrape(ctx, 1)
	f.Scrape(ctx, 0)
	views = rt.Views(&policy.Request{Now: clk.Now()})
	if views[0].HaveMetrics || views[0].Waiting != 0 || views[0].MetricsAge != 2500*time.Millisecond {
		t.Fatalf("stale metrics still used: %+v", views[0])
	}
	if !views[1].HaveMetrics || views[1].Waiting != 5 {
		t.Fatalf("fresh replica lost its metrics: %+v", views[1])
	}
	a.setMetrics(page(0))
	if !f.Scrape(ctx, 0) || !rt.Views(&policy.Request{Now: clk.Now()})[0].HaveMetrics {
		t.Fatal("a good scrape did not make the replica fresh again")
	}
}

// Finding 9: a /metrics page over the bound is not read whole nor parsed.
func TestOversizedMetricsPageRejected(t *testing.T) {
	a := newStub(t)
	a.setMetrics(page(1) + "# " + strings.Repeat("x", 5000) + "\n")
	rt, f, _ := fleetOn(t, []string{a.srv.URL}, Config{MaxMetricsBytes: 4096})
	if f.Scrape(context.Background(), 0) {
		t.Fatal("a page over the bound was accepted")
	}
	if _, _, have := rt.ReplicaMetrics(0); have {
		t.Fatal("values from an oversized page were stored")
	}
}

// A replica that keeps failing is probed less and less often: the wait
// doubles from the interval up to maxBackoff, and returns to the interval
// after a success.
func TestProbeBackoff(t *testing.T) {
	_, f, clk := fleetOn(t, []string{"http://unused"}, Config{})
	answers := make(chan bool)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.loop(ctx, 250*time.Millisecond, func() bool {
			select {
			case ok := <-answers:
				return ok
			case <-ctx.Done():
				return false
			}
		})
	}()
	var waits []time.Duration
	for i := range 10 {
		answers <- i >= 8 // eight failures, then successes
		if !clk.WaitTimers(1, 10*time.Second) {
			t.Fatal("the loop did not wait")
		}
		p := clk.Pending()
		waits = append(waits, p[0])
		clk.Advance(p[0])
	}
	cancel()
	<-done
	want := []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second,
		4 * time.Second, 8 * time.Second, 16 * time.Second, 30 * time.Second, 250 * time.Millisecond, 250 * time.Millisecond}
	for i := range want {
		if waits[i] != want[i] {
			t.Fatalf("waits %v, want %v", waits, want)
		}
	}
}

// /v1/models keeps each model's root, parent and context length, and the
// adapters a scrape reports running count as served.
func TestModelsAndRunningAdapters(t *testing.T) {
	a := newStub(t)
	models := `{"object":"list","data":[{"id":"base","root":"/models/base","parent":null,"max_model_len":4096},` +
		`{"id":"sql-lora","root":"/adapters/sql","parent":"base","max_model_len":4096}]}`
	a.models.Store(&models)
	a.setMetrics(page(0) + `vllm:lora_requests_info{max_lora="4",running_lora_adapters="late-lora,sql-lora",waiting_lora_adapters=""} 1.7e9` + "\n")
	rt, f, _ := fleetOn(t, []string{a.srv.URL}, Config{})
	ctx := context.Background()
	if !f.Health(ctx, 0) || !f.Scrape(ctx, 0) {
		t.Fatal("probes failed")
	}
	s := rt.Replica(0).Served()
	if s == nil || !s.Has("base") || !s.Has("sql-lora") || !s.Has("late-lora") || s.Has("other") {
		t.Fatalf("served %+v", s)
	}
	a.setMetrics(page(0)) // the replica restarted: no adapter running any more
	if !f.Scrape(ctx, 0) || rt.Replica(0).Served().Has("late-lora") || !rt.Replica(0).Served().Has("sql-lora") {
		t.Fatalf("after a restart: %+v", rt.Replica(0).Served())
	}
	got := f.Models()
	// Each card is kept as the replica sent it, for the gateway's /v1/models.
	if len(got) != 2 || got[0] != (router.Model{ID: "base", Root: "/models/base", MaxModelLen: 4096,
		Card: `{"id":"base","root":"/models/base","parent":null,"max_model_len":4096}`}) ||
		got[1] != (router.Model{ID: "sql-lora", Root: "/adapters/sql", Parent: "base", MaxModelLen: 4096,
			Card: `{"id":"sql-lora","root":"/adapters/sql","parent":"base","max_model_len":4096}`}) {
		t.Fatalf("models %+v", got)
	}
}

// A data-parallel server's ranks are targets sharing one scrape: each gets
// its own engine's series; a server with more engines than targets is
// warned about.
func TestDataParallelRanksShareOneScrape(t *testing.T) {
	s := newStub(t)
	s.setMetrics(`vllm:num_requests_waiting{engine="0",model_name="m"} 3
vllm:num_requests_waiting{engine="1",model_name="m"} 7
vllm:num_requests_running{engine="0",model_name="m"} 1
vllm:num_requests_running{engine="1",model_name="m"} 2
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="2000"} 1
`)
	pol, _ := policy.New("least_load", policy.Options{})
	clk := clock.NewFake(time.Unix(100, 0))
	specs := []router.Spec{{URL: s.srv.URL, Ranked: true, Rank: 0}, {URL: s.srv.URL, Ranked: true, Rank: 1}}
	rt, err := router.New(router.Config{Specs: specs, Policy: pol, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	var logs strings.Builder
	f := New(rt, s.srv.Client(), Config{Clock: clk, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if !f.Scrape(context.Background(), 1) {
		t.Fatal("scrape failed")
	}
	if n := s.hits.Load(); n != 1 {
		t.Fatalf("%d requests for two ranks of one server, want 1", n)
	}
	for k, want := range []router.Metrics{{Waiting: 3, Running: 1, KVUsage: 0.25, NumBlocks: 1000, BlockSize: 16, EngineBlockSize: 16},
		{Waiting: 7, Running: 2, KVUsage: 0.5, NumBlocks: 2000, BlockSize: 16, EngineBlockSize: 16}} {
		got, _, ok := rt.ReplicaMetrics(k)
		if !ok || got != want {
			t.Fatalf("rank %d: %+v, want %+v", k, got, want)
		}
	}
	if rt.Name(1) != s.srv.URL+"#1" {
		t.Fatalf("name %q", rt.Name(1))
	}
	if strings.Contains(logs.String(), "data-parallel") {
		t.Fatalf("warned with as many targets as engines: %s", logs.String())
	}
	// The server grows to 3 engines: warned once.
	s.setMetrics(strings.Replace(*s.metrics.Load(), `vllm:num_requests_running{engine="1",model_name="m"} 2`,
		"vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 2\nvllm:num_requests_running{engine=\"2\",model_name=\"m\"} 0", 1))
	f.Scrape(context.Background(), 0)
	f.Scrape(context.Background(), 0)
	if n := strings.Count(logs.String(), "data_parallel_size"); n != 1 {
		t.Fatalf("warned %d times about 3 engines as 2 targets, want 1:\n%s", n, logs.String())
	}
}
