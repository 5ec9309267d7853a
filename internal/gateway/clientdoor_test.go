package gateway

import (
	"io"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvgate/kvgate/internal/testutil"
)

// Headers only the gateway sets upstream never come from the client:
// X-Kvgate-* (any spelling), X-Data-Parallel-Rank and the headers llm-d's
// routing sidecar acts on (a prefill host, a pull source: an SSRF through
// the sidecar) are dropped, X-Request-Id and Authorization are the
// gateway's; the others pass.
func TestClientGatewayHeadersStripped(t *testing.T) {
	a := newFakeReplica(t)
	gw := startGateway(t, baseConfig(a.srv.URL))
	resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`,
		"X-Kvgate-Replica", "http://evil", "X-Kvgate-Prefill", "http://evil", "x-kvgate-rank", "3",
		"X-KVGATE-ROUTE", "1", "X-Data-Parallel-Rank", "5", "X-Request-Id", "client-id", "X-Custom", "kept",
		"x-prefiller-host-port", "10.0.0.1:80", "X-Kv-Cache-Source-Host-Port", "10.0.0.2:80",
		"x-llm-d-kv-cache-source-host-port", "10.0.0.3:80", "x-data-parallel-host-port", "10.0.0.4:80")
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	a.mu.Lock()
	h := a.headers[0]
	a.mu.Unlock()
	for k := range h {
		if strings.HasPrefix(strings.ToLower(k), "x-kvgate-") || strings.EqualFold(k, headerDataParallelRank) ||
			slices.Contains(sidecarHeaders, http.CanonicalHeaderKey(k)) {
			t.Errorf("the replica got the client's %s: %q", k, h[k])
		}
	}
	if h.Get("X-Custom") != "kept" || h.Get("X-Request-Id") != "client-id" {
		t.Errorf("the replica got X-Custom %q, X-Request-Id %q", h.Get("X-Custom"), h.Get("X-Request-Id"))
	}
	if resp.Header.Get("X-Kvgate-Replica") != a.srv.URL {
		t.Errorf("the client got X-Kvgate-Replica %q", resp.Header.Get("X-Kvgate-Replica"))
	}
	// Without gateway keys a client's key is the replicas': passed on,
	// its scheme spelt as vLLM compares it.
	if resp, body = post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "Authorization", "bearer sk-client"); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	a.mu.Lock()
	auth := a.headers[1].Get("Authorization")
	a.mu.Unlock()
	if auth != "Bearer sk-client" {
		t.Errorf("the replica got Authorization %q", auth)
	}
	waitIdle(t, gw)
}

// bearer takes the scheme in any case (RFC 9110 §11.1), at every door.
func TestBearer(t *testing.T) {
	for _, c := range []struct {
		header, tok string
		ok          bool
	}{
		{"Bearer k1", "k1", true}, {"bearer k1", "k1", true}, {"BEARER k1", "k1", true}, {"bEaReR k1", "k1", true},
		{"Bearer   k1", "k1", true}, {"Bearer k1 k2", "k1 k2", true},
		{"", "", false}, {"Bearer", "", false}, {"Bearer ", "", false}, {"Bearerk1", "", false},
		{"Basic azE=", "", false}, {"Token k1", "", false}, {" Bearer k1", "", false},
	} {
		h := http.Header{}
		if c.header != "" {
			h["Authorization"] = []string{c.header}
		}
		if tok, ok := bearer(h); ok != c.ok || tok != c.tok {
			t.Errorf("bearer(%q) = %q, %v; want %q, %v", c.header, tok, ok, c.tok, c.ok)
		}
	}
}

// Each door that takes a bearer token (API keys on the API, the admin
// token on /admin and /debug, and on /ui) takes "bearer" in any case, and
// still refuses a wrong token or another scheme.
func TestBearerAnyCaseAtEveryDoor(t *testing.T) {
	a := newFakeReplica(t)
	cfg := baseConfig(a.srv.URL)
	cfg.APIKeys, cfg.AdminToken = []string{"client-key"}, "admin-token"
	gw := startGateway(t, cfg)
	doors := []struct{ method, path, body, token string }{
		{"POST", "/v1/completions", `{"model":"m","prompt":"x"}`, "client-key"},
		{"GET", "/v1/models", "", "client-key"},
		{"GET", "/admin/replicas", "", "admin-token"},
		{"POST", "/debug/route", `{"model":"m","prompt":"x"}`, "admin-token"},
		{"GET", "/ui/state", "", "admin-token"},
		{"GET", "/ui", "", "admin-token"},
	}
	send := func(method, path, body, auth string) int {
		req, _ := http.NewRequest(method, gw.srv.URL+path, strings.NewReader(body))
		req.Header.Set("Authorization", auth)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		_, _ = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode
	}
	for _, d := range doors {
		for _, scheme := range []string{"Bearer", "bearer", "BEARER", "beaRer"} {
			if status := send(d.method, d.path, d.body, scheme+" "+d.token); status != 200 {
				t.Errorf("%s %s with %q: %d", d.method, d.path, scheme, status)
			}
		}
		for _, auth := range []string{"bearer wrong", "Basic " + d.token, "bearer", d.token} {
			if status := send(d.method, d.path, d.body, auth); status != 401 {
				t.Errorf("%s %s with %q: %d, want 401", d.method, d.path, auth, status)
			}
		}
	}
	waitIdle(t, gw)
}

// Finding 13: X-Forwarded-For is appended to, not passed verbatim; the
// gateway's request id goes upstream and is the one the client sees.
func TestForwardedForAndRequestID(t *testing.T) {
	var seen atomic.Pointer[http.Header]
	a := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		h := r.Header.Clone()
		seen.Store(&h)
		w.Header().Set("X-Request-Id", "replica-own-id")
		okStream(1)(w, r)
	})
	gw, _ := gwWithClock(t, baseConfig(a.srv.URL))
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`,
		"X-Forwarded-For", "203.0.113.7", "X-Request-Id", "client-id-1")
	h := *seen.Load()
	if xff := h.Get("X-Forwarded-For"); xff != "203.0.113.7, 127.0.0.1" {
		t.Fatalf("X-Forwarded-For upstream %q", xff)
	}
	if h.Get("X-Request-Id") != "client-id-1" || r.Header.Get("X-Request-Id") != "client-id-1" {
		t.Fatalf("request id upstream %q, to the client %q", h.Get("X-Request-Id"), r.Header.Get("X-Request-Id"))
	}
	r = testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
	if id := r.Header.Get("X-Request-Id"); id == "" || id == "replica-own-id" || (*seen.Load()).Get("X-Request-Id") != id {
		t.Fatalf("generated request id %q, upstream %q", id, (*seen.Load()).Get("X-Request-Id"))
	}
}

// Finding 14: keys match exactly, as vLLM's do.
func TestKeysAreCaseSensitive(t *testing.T) {
	a := newStub(t, "", okStream(1))
	gw, _ := gwWithClock(t, baseConfig(a.srv.URL))
	r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"MODEL":"m","prompt":"x"}`)
	if r.Status != 400 || !strings.Contains(r.Body, `"param":"model"`) || a.calls.Load() != 0 {
		t.Fatalf("MODEL: %d %s", r.Status, r.Body)
	}
}

// Only the gateway names the route: X-Kvgate-* headers a replica answers
// with (a compromised replica, or a gateway behind this one) never reach
// the client, on a relayed answer or a refusal passed on.
func TestReplicaGatewayHeadersStripped(t *testing.T) {
	a := newFakeReplica(t)
	gw := startGateway(t, baseConfig(a.srv.URL))
	for _, status := range []int64{0, http.StatusServiceUnavailable} {
		a.status.Store(status)
		resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`,
			"X-Test-Replica-Sets", "X-Kvgate-Replica=http://evil;X-Kvgate-Pull-From=http://evil;X-Other=kept")
		if want := map[int64]int{0: 200, 503: 503}[status]; resp.StatusCode != want {
			t.Fatalf("status %d: %d %s", status, resp.StatusCode, body)
		}
		for k, v := range resp.Header {
			if strings.HasPrefix(k, "X-Kvgate-") && strings.Contains(strings.Join(v, ","), "evil") {
				t.Errorf("replica status %d: the client got the replica's %s: %q", status, k, v)
			}
		}
		if got := resp.Header.Get("X-Kvgate-Replica"); got != a.srv.URL {
			t.Errorf("replica status %d: X-Kvgate-Replica %q, want %q", status, got, a.srv.URL)
		}
		if resp.Header.Get("X-Other") != "kept" {
			t.Errorf("replica status %d: the replica's other headers were dropped: %v", status, resp.Header)
		}
	}
	a.status.Store(0)
	waitIdle(t, gw)
}
