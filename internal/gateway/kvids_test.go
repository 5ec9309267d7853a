package gateway

import (
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/sim"
)

// idProxy is a reverse proxy to target that keeps the X-Request-Id of each
// inference request it forwards.
func idProxy(t *testing.T, target string) (string, func() []string) {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var ids []string
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1/completions") {
			mu.Lock()
			ids = append(ids, r.Header.Get("X-Request-Id"))
			mu.Unlock()
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), ids...)
	}
}

// Two clients sending one X-Request-Id get two KV transfers of their own:
// each prefill/decode pair's steps carry one id (vLLM's request id, which
// the decode step's pull names), the client's id and a suffix unique to
// the attempt, so the prefill replica never holds two requests of one id;
// the client's id stays the answer's. Before, both pairs were "dup".
func TestPDKVTransferIDs(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 2, Roles: []engine.Role{engine.RolePrefill, engine.RoleDecode}})
	pre, preIDs := idProxy(t, fl.URLs()[0])
	dec, decIDs := idProxy(t, fl.URLs()[1])
	gw := startGateway(t, pdConfig(t, "round_robin", []string{pre}, []string{dec}))
	waitPD(t, gw)
	for i := range 2 {
		resp, body := post(t, gw.srv.URL+"/v1/completions", longPrompt(i, ""), "X-Request-Id", "dup")
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Request-Id") != "dup" {
			t.Fatalf("request %d: %d %s, X-Request-Id %q", i, resp.StatusCode, body, resp.Header.Get("X-Request-Id"))
		}
	}
	p, d := preIDs(), decIDs()
	if len(p) != 2 || len(d) != 2 {
		t.Fatalf("prefill steps %v, decode steps %v", p, d)
	}
	for i := range p {
		if !strings.HasPrefix(p[i], "dup-kv") || p[i] != d[i] {
			t.Errorf("pair %d: prefill step's id %q, decode step's %q: want one id, the client's and a suffix", i, p[i], d[i])
		}
	}
	if p[0] == p[1] {
		t.Errorf("two pairs share the KV transfer id %q", p[0])
	}
	waitIdle(t, gw)
}
