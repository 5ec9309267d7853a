package fleet

import (
	"context"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/testutil"
)

// probed is an httptest replica that reports each /health on a channel.
func probed(t *testing.T, model string) (*httptest.Server, chan struct{}) {
	hits := make(chan struct{}, 64)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			select {
			case hits <- struct{}{}:
			default:
			}
		case "/v1/models":
			_, _ = w.Write([]byte(`{"data":[{"id":"` + model + `"}]}`))
		default:
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(srv.Close)
	return srv, hits
}

func waitHit(t *testing.T, hits chan struct{}, what string) {
	t.Helper()
	select {
	case <-hits:
	case <-time.After(testutil.Bound(10 * time.Second)): // a deadline for a broken test, not a wait for the event
		t.Fatalf("%s: no health check", what)
	}
}

// TestSyncProbesAddedServersAndStopsRemovedOnes: a replica added while
// the fleet runs is probed at once (no interval passes on the fake clock);
// one removed is no longer probed, and its models leave the union.
func TestSyncProbesAddedServersAndStopsRemovedOnes(t *testing.T) {
	a, aHits := probed(t, "ma")
	b, bHits := probed(t, "mb")
	pol, _ := policy.New("least_load", policy.Options{})
	clk := clock.NewFake(time.Unix(100, 0))
	rt, err := router.New(router.Config{Replicas: []string{a.URL}, Policy: pol, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	f := New(rt, a.Client(), Config{Clock: clk, HealthInterval: time.Hour, ScrapeInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { f.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()
	waitHit(t, aHits, "the first replica")
	if _, err := rt.SetReplicas([]router.Spec{{URL: a.URL}, {URL: b.URL}}); err != nil {
		t.Fatal(err)
	}
	f.Sync()
	waitHit(t, bHits, "the added replica")
	if got := f.Servers(); !slices.Equal(got, sortedURLs(a.URL, b.URL)) {
		t.Fatalf("probing %v", got)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(f.Models()) != 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond) // polling with a deadline: the health loop lists the models
	}
	if len(f.Models()) != 2 {
		t.Fatalf("models %v, want ma and mb", f.Models())
	}
	if _, err := rt.SetReplicas([]router.Spec{{URL: b.URL}}); err != nil {
		t.Fatal(err)
	}
	f.Sync()
	if got := f.Servers(); !slices.Equal(got, []string{b.URL}) {
		t.Fatalf("probing %v after the removal", got)
	}
	if ms := f.Models(); len(ms) != 1 || ms[0].ID != "mb" {
		t.Fatalf("models %v after the removal, want mb only", ms)
	}
}

func sortedURLs(u ...string) []string { slices.Sort(u); return u }
