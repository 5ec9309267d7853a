package fleet

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/testutil"
)

// healthServers are replicas whose /health passes, answers 503, refuses
// the connection, and never answers; their URLs in that order.
func healthServers(t *testing.T) []string {
	t.Helper()
	ok := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" {
			http.NotFound(w, r)
		}
	}))
	t.Cleanup(ok.Close)
	busy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(busy.Close)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := "http://" + l.Addr().String()
	l.Close()
	silent := httptest.NewServer(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	t.Cleanup(silent.Close)
	return []string{ok.URL, busy.URL, refused, silent.URL}
}

func healthFleet(t *testing.T, urls []string, log *slog.Logger) *Fleet {
	t.Helper()
	pol, _ := policy.New("least_load", policy.Options{})
	clk := clock.NewFake(time.Unix(100, 0))
	rt, err := router.New(router.Config{Replicas: urls, Policy: pol, Now: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return New(rt, &http.Client{Transport: tr}, Config{Logger: log, Clock: clk, Timeout: 100 * time.Millisecond})
}

// A replica out of rotation says why (the status it answered, a refused
// connection, no answer in time); once every replica's first check has
// ended, one line says how many are healthy and why the others are not,
// and no later check says it again.
func TestHealthSaysWhy(t *testing.T) {
	urls := healthServers(t)
	sink := &testutil.SyncBuffer{}
	f := healthFleet(t, urls, slog.New(slog.NewTextHandler(sink, nil)))
	ctx := context.Background()
	for i := range urls {
		if strings.Contains(sink.String(), "replicas healthy") {
			t.Fatalf("summary before replica %d's first check:\n%s", i, sink.String())
		}
		f.Health(ctx, i)
	}
	reasons := []string{"/health answered 503 Service Unavailable", "connection refused", "no answer within 100ms"}
	for i, why := range reasons {
		want := `msg="replica unhealthy: out of rotation until its /health passes" replica=` + urls[i+1] + ` reason="` + why + `"`
		if !strings.Contains(sink.String(), want) {
			t.Errorf("no line %s in:\n%s", want, sink.String())
		}
	}
	for i := range urls {
		f.Health(ctx, i)
	}
	var summaries []string
	for _, l := range strings.Split(sink.String(), "\n") {
		if strings.Contains(l, "replicas healthy") {
			summaries = append(summaries, l)
		}
	}
	if len(summaries) != 1 || !strings.Contains(summaries[0], "level=WARN") ||
		!strings.Contains(summaries[0], `msg="1 of 4 replicas healthy; unhealthy: `) {
		t.Fatalf("summaries: %q", summaries)
	}
	for i, why := range reasons {
		if !strings.Contains(summaries[0], urls[i+1]+" ("+why+")") {
			t.Errorf("summary lacks %s (%s): %s", urls[i+1], why, summaries[0])
		}
	}

	sink = &testutil.SyncBuffer{}
	f = healthFleet(t, urls[:1], slog.New(slog.NewTextHandler(sink, nil)))
	f.Health(ctx, 0)
	if !strings.Contains(sink.String(), `level=INFO msg="1 of 1 replica healthy" healthy=1 replicas=1`) {
		t.Fatalf("all healthy: %s", sink.String())
	}
}
