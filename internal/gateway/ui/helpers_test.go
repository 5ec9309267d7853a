package ui_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// The view's tests run it where it is served: behind a gateway, whose
// exported API starts it.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// newFakeReplica is a minimal vLLM-shaped replica serving model m: it
// answers completions (streamed or not) with three tokens and usage of 10
// prompt tokens, 8 of them cached.
func newFakeReplica(t *testing.T) *httptest.Server {
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") })
	mux.HandleFunc("/v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"m","object":"model"}]}`)
	})
	mux.HandleFunc("/v1/completions", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Stream bool `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&req)
		usage := `{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":8}}`
		if !req.Stream {
			w.Header().Set("Content-Type", "application/json")
			fmt.Fprintf(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"a b c","finish_reason":"length"}],"usage":%s}`, usage)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"t%d\",\"finish_reason\":null}]}\n\n", i)
			w.(http.Flusher).Flush()
		}
		fmt.Fprintf(w, "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[],\"usage\":%s}\n\ndata: [DONE]\n\n", usage)
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

type testGW struct {
	g   *gateway.Gateway
	srv *httptest.Server
}

// startGateway runs a gateway on an httptest server until the test ends.
func startGateway(t *testing.T, cfg gateway.Config) *testGW {
	t.Helper()
	g, err := gateway.New(cfg, gateway.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	tg := &testGW{g: g, srv: httptest.NewServer(g.Handler())}
	done := make(chan struct{})
	go func() { defer close(done); g.Run(ctx) }()
	t.Cleanup(func() {
		tg.srv.Close()
		cancel()
		<-done
	})
	return tg
}

func baseConfig(urls ...string) gateway.Config {
	cfg := gateway.Defaults()
	for _, u := range urls {
		cfg.Replicas = append(cfg.Replicas, gateway.ReplicaConfig{URL: u})
	}
	cfg.ScrapeInterval = gateway.Duration(20 * time.Millisecond)
	cfg.HealthInterval = gateway.Duration(20 * time.Millisecond)
	return cfg
}

// get sends a GET with optional headers through a client that does not
// follow redirects.
func get(t *testing.T, url string, hdr ...string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(body)
}

func post(t *testing.T, url, body string, hdr ...string) (*http.Response, string) {
	t.Helper()
	r := testutil.Post(t, nil, url, body, hdr...)
	return &http.Response{StatusCode: r.Status, Header: r.Header}, r.Body
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	testutil.Eventually(t, 5*time.Second, what, cond)
}

// waitListed waits until every replica has listed its models.
func waitListed(t *testing.T, gw *testGW) {
	t.Helper()
	rt := gw.g.Router()
	eventually(t, "every replica's models listed", func() bool {
		for i := range rt.Replicas() {
			if rt.Replica(i).Served() == nil {
				return false
			}
		}
		return true
	})
}

// waitIdle waits until no request is in flight.
func waitIdle(t *testing.T, gw *testGW) {
	t.Helper()
	rt := gw.g.Router()
	eventually(t, "in-flight counts back to zero", func() bool {
		for i := range rt.Replicas() {
			if rt.InFlight(i) != 0 {
				return false
			}
		}
		return true
	})
}

// startSim starts simulated replicas for a test.
func startSim(t *testing.T, cfg sim.Config) *sim.Fleet {
	t.Helper()
	cfg.Port = 0
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 50
	}
	fl, err := sim.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fl.Close() })
	return fl
}

// waitHealthy waits until every replica is a candidate: checked, its
// models listed (an unlisted replica is not one while another is) and
// scraped.
func waitHealthy(t *testing.T, gw *testGW) {
	t.Helper()
	eventually(t, "replicas checked, scraped and their models listed", func() bool {
		if len(gw.g.Fleet().Models()) == 0 {
			return false
		}
		rt := gw.g.Router()
		for i := range rt.Replicas() {
			if r := rt.Replica(i); !r.Ready() || r.Served() == nil {
				return false
			}
			if _, _, ok := rt.ReplicaMetrics(i); !ok {
				return false
			}
		}
		return true
	})
}
