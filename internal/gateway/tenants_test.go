package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/sim"
)

// tenantsConfig has tenants gold (default band 1, may ask for 0, weight 2,
// its own cache) and bulk (band 2), and a key of no tenant.
func tenantsConfig(urls ...string) Config {
	cfg := baseConfig(urls...)
	zero := 0
	cfg.APIKeys = []string{"k-none"}
	cfg.Tenants = []TenantConfig{
		{Name: "gold", APIKeys: []string{"k-gold"}, Priority: 1, MaxPriority: &zero, Weight: 2, IsolateCache: true},
		{Name: "bulk", APIKeys: []string{"k-bulk", "k-bulk2"}, Priority: 2},
	}
	return cfg
}

func bearerHdr(key string) []string { return []string{"Authorization", "Bearer " + key} }

// A request's tenant comes from its key: a tenant's keys and the
// top-level api_keys let it in, any other key (or none) is refused; the
// replica never sees the client's key; the access log names the tenant.
func TestTenantKeys(t *testing.T) {
	f := newFakeReplica(t)
	cfg := tenantsConfig(f.srv.URL)
	cfg.AccessLog = true
	logs := &lockedBuffer{}
	gw := startGatewayWith(t, cfg, Options{Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	body := `{"model":"m","prompt":"hello world","max_tokens":3}`
	for key, want := range map[string]int{"k-gold": 200, "k-bulk2": 200, "k-none": 200, "k-other": 401, "": 401} {
		var hdr []string
		if key != "" {
			hdr = bearerHdr(key)
		}
		if resp, b := post(t, gw.srv.URL+"/v1/completions", body, hdr...); resp.StatusCode != want {
			t.Errorf("key %q: %d %s, want %d", key, resp.StatusCode, b, want)
		}
	}
	f.mu.Lock()
	for _, h := range f.headers {
		if h.Get("Authorization") != "" {
			t.Errorf("the replica got the client's key: %q", h.Get("Authorization"))
		}
	}
	f.mu.Unlock()
	if !strings.Contains(logs.String(), `"tenant":"gold"`) || !strings.Contains(logs.String(), `"tenant":"bulk"`) {
		t.Errorf("the access log does not name the tenants:\n%s", logs.String())
	}
	if resp, _ := testGet(t, gw.srv.URL+"/v1/models", "k-bulk"); resp != 200 {
		t.Errorf("/v1/models with a tenant's key: %d", resp)
	}
	waitIdle(t, gw)
}

func testGet(t *testing.T, url, key string) (int, string) {
	t.Helper()
	return callWithKey(t, http.MethodGet, url, key, "")
}

// callWithKey sends a request with a bearer key (and a JSON body, when
// not empty) and returns its status and body.
func callWithKey(t *testing.T, method, url, key, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// What the replica gets: an isolated tenant's cache_salt (its client's
// own salt after it), any other client's salt namespaced so that it can
// never be an isolated tenant's, and the priority field only as the
// gateway sets it: removed, or (engine_priority) the request's band, its
// priority clamped to its tenant's range.
func TestTenantBody(t *testing.T) {
	cases := []struct {
		name, key, body string
		engine          bool
		salt            string // "" absent
		priority        string // "" absent
	}{
		{"isolated, no salt", "k-gold", `{"model":"m","prompt":"p"}`, false, "kvgate-tenant:gold:", ""},
		{"isolated, own salt", "k-gold", `{"model":"m","prompt":"p","cache_salt":"s1"}`, false, "kvgate-tenant:gold:s1", ""},
		{"forged salt", "k-bulk", `{"model":"m","prompt":"p","cache_salt":"kvgate-tenant:gold:"}`, false, "kvgate-client:kvgate-tenant:gold:", ""},
		{"no salt, not isolated", "k-none", `{"model":"m","prompt":"p"}`, false, "", ""},
		{"priority removed", "k-bulk", `{"model":"m","prompt":"p","priority":-5}`, false, "", ""},
		{"band sent", "k-bulk", `{"model":"m","prompt":"p"}`, true, "", "2"},
		{"priority clamped", "k-gold", `{"model":"m","prompt":"p","priority":-7}`, true, "kvgate-tenant:gold:", "0"},
		{"chat", "k-gold", `{"model":"m","messages":[{"role":"user","content":"hi"}],"priority":1}`, true, "kvgate-tenant:gold:", "1"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeReplica(t)
			cfg := tenantsConfig(f.srv.URL)
			cfg.FlowControl.EnginePriority = tc.engine
			gw := startGateway(t, cfg)
			path := "/v1/completions"
			if tc.name == "chat" {
				path = "/v1/chat/completions"
			}
			if resp, b := post(t, gw.srv.URL+path, tc.body, bearerHdr(tc.key)...); resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			f.mu.Lock()
			sent := f.bodies[0]
			f.mu.Unlock()
			checkSent(t, sent, tc.salt, tc.priority)
			waitIdle(t, gw)
		})
	}
}

// checkSent checks the cache_salt and priority (each "" for absent) of a
// body a replica got, and that its model came along.
func checkSent(t *testing.T, sent []byte, salt, priority string) {
	t.Helper()
	var got map[string]json.RawMessage
	if err := json.Unmarshal(sent, &got); err != nil {
		t.Fatalf("%s: %v", sent, err)
	}
	var s string
	_ = json.Unmarshal(got["cache_salt"], &s)
	if s != salt || string(got["priority"]) != priority || got["model"] == nil {
		t.Fatalf("sent %s: want cache_salt %q, priority %q", sent, salt, priority)
	}
}

// X-Kvgate-Deadline-Ms: a bad value is a 400; the header never reaches
// the replica.
func TestTenantDeadlineHeader(t *testing.T) {
	f := newFakeReplica(t)
	gw := startGateway(t, tenantsConfig(f.srv.URL))
	body := `{"model":"m","prompt":"p"}`
	for _, v := range []string{"0", "-3", "x", "3600001"} {
		if resp, b := post(t, gw.srv.URL+"/v1/completions", body, append(bearerHdr("k-bulk"), headerDeadline, v)...); resp.StatusCode != 400 ||
			!strings.Contains(b, "invalid_deadline") {
			t.Errorf("deadline %q: %d %s", v, resp.StatusCode, b)
		}
	}
	if resp, b := post(t, gw.srv.URL+"/v1/completions", body, append(bearerHdr("k-bulk"), headerDeadline, "5000")...); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	f.mu.Lock()
	if h := f.headers[0].Get(headerDeadline); h != "" {
		t.Errorf("the replica got %s: %s", headerDeadline, h)
	}
	f.mu.Unlock()
	waitIdle(t, gw)
}

// heldStub is a replica whose streamed answers wait for the test: each
// request's first byte comes when release has a token for it.
func heldStub(t *testing.T) (*stub, chan struct{}) {
	release := make(chan struct{}, 16)
	s := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		<-release
		okStream(2)(w, r)
	})
	return s, release
}

// Under flow control a request that finds the fleet saturated waits in
// the gateway; past its band's TTL it is answered 429 with Retry-After,
// counted in kvgate_shed_total{reason="ttl"}; a sheddable band's request
// is refused at once (saturated); kvgate_queue_depth shows what waits, by
// band and tenant; nothing is lost: the held request completes.
func TestFlowShedsWith429(t *testing.T) {
	s, release := heldStub(t)
	cfg := tenantsConfig(s.srv.URL)
	cfg.FlowControl.QueueMs = 1
	cfg.FlowControl.TTL = Duration(10 * time.Second)
	cfg.FlowControl.Bands = []BandFlowConfig{{Priority: 2, Sheddable: true}}
	reg := prometheus.NewRegistry()
	clk := clock.NewFake(time.Unix(1000, 0))
	gw := startGatewayWith(t, cfg, Options{Clock: clk, Registry: reg})
	eventually(t, "models listed", func() bool { return len(gw.g.Fleet().Models()) > 0 })
	stream := `{"model":"m","prompt":"a long enough prompt for a pending prefill","max_tokens":2,"stream":true}`
	type result struct {
		code  int
		retry string
		body  string
	}
	results := make(chan result, 2)
	send := func(key string) {
		req, _ := http.NewRequest(http.MethodPost, gw.srv.URL+"/v1/completions", strings.NewReader(stream))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			results <- result{code: -1, body: err.Error()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		results <- result{resp.StatusCode, resp.Header.Get("Retry-After"), string(b)}
	}
	var wg sync.WaitGroup
	wg.Go(func() { send("k-gold") })
	eventually(t, "the first request at the replica", func() bool { return s.calls.Load() == 1 })
	// bulk's band 2 is sheddable: refused at once.
	if resp, b := post(t, gw.srv.URL+"/v1/completions", stream, bearerHdr("k-bulk")...); resp.StatusCode != 429 ||
		!strings.Contains(b, "shed_saturated") || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("sheddable: %d %s", resp.StatusCode, b)
	}
	wg.Go(func() { send("k-none") })
	eventually(t, "the second request waiting", func() bool {
		return counterValue(t, reg, "kvgate_queue_depth", map[string]string{"band": "0", "tenant": ""}) == 1
	})
	clk.Advance(11 * time.Second) // past the TTL
	r := <-results
	if r.code != 429 || !strings.Contains(r.body, "shed_ttl") {
		t.Fatalf("waited past its TTL: %d %s", r.code, r.body)
	}
	if n, err := strconv.Atoi(r.retry); err != nil || n < 1 {
		t.Fatalf("Retry-After %q", r.retry)
	}
	release <- struct{}{}
	if r := <-results; r.code != 200 {
		t.Fatalf("the held request: %d %s", r.code, r.body)
	}
	wg.Wait()
	for reason, tenant := range map[string]string{"ttl": "", "saturated": "bulk"} {
		if n := counterValue(t, reg, "kvgate_shed_total", map[string]string{"reason": reason, "tenant": tenant}); n != 1 {
			t.Errorf("kvgate_shed_total{reason=%s,tenant=%s} = %v, want 1", reason, tenant, n)
		}
	}
	if n := counterValue(t, reg, "kvgate_tenant_tokens_total", map[string]string{"tenant": "gold"}); n != 0 {
		t.Logf("gold's tokens %v (the stub reports no usage in streams)", n)
	}
	waitIdle(t, gw)
}

// Requests the gateway does not route by the pool's policy (a stored
// response named in the path or by previous_response_id, pinned to its
// replica; a body without a prompt, by load) go through the flow
// controller too: a sheddable band's is refused while the fleet is
// saturated, and none reaches the replica ahead of its turn. (With
// tenants, a response id whose owner the gateway does not know is not
// looked up at all: 404, passthrough_responses.go.)
func TestFlowHoldsPinnedAndByLoadRequests(t *testing.T) {
	s, release := heldStub(t)
	cfg := tenantsConfig(responsesFront(t, s.srv.URL, "resp_bulk"))
	cfg.FlowControl.QueueMs = 1
	cfg.FlowControl.Bands = []BandFlowConfig{{Priority: 2, Sheddable: true}}
	reg := prometheus.NewRegistry()
	gw := startGatewayWith(t, cfg, Options{Clock: clock.NewFake(time.Unix(1000, 0)), Registry: reg})
	eventually(t, "models listed", func() bool { return len(gw.g.Fleet().Models()) > 0 })
	if code, b := callWithKey(t, http.MethodPost, gw.srv.URL+"/v1/responses", "k-bulk", `{"model":"m","input":"x"}`); code != 200 {
		t.Fatalf("bulk's response: %d %s", code, b)
	}
	if code, b := callWithKey(t, http.MethodGet, gw.srv.URL+"/v1/responses/resp_unknown", "k-bulk", ""); code != 404 {
		t.Fatalf("an id of unknown owner: %d %s", code, b)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		resp, b := post(t, gw.srv.URL+"/v1/completions",
			`{"model":"m","prompt":"a long enough prompt for a pending prefill","max_tokens":2,"stream":true}`, bearerHdr("k-gold")...)
		if resp.StatusCode != 200 {
			t.Errorf("the held request: %d %s", resp.StatusCode, b)
		}
	})
	eventually(t, "the first request at the replica", func() bool { return s.calls.Load() == 1 })
	for _, c := range []struct{ method, path, body string }{
		{http.MethodGet, "/v1/responses/resp_bulk", ""},                                                    // pinned
		{http.MethodPost, "/v1/responses", `{"model":"m","input":"x","previous_response_id":"resp_bulk"}`}, // pinned
		{http.MethodPost, "/v1/score", `{"model":"m","text_1":"a","text_2":"b"}`},                          // no prompt: by load
	} {
		req, _ := http.NewRequest(c.method, gw.srv.URL+c.path, strings.NewReader(c.body))
		req.Header.Set("Authorization", "Bearer k-bulk")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 429 || !strings.Contains(string(b), "shed_saturated") {
			t.Errorf("%s %s from a sheddable band on a saturated fleet: %d %s", c.method, c.path, resp.StatusCode, b)
		}
	}
	if n := counterValue(t, reg, "kvgate_shed_total", map[string]string{"reason": "saturated", "tenant": "bulk"}); n != 3 {
		t.Errorf("kvgate_shed_total{reason=saturated,tenant=bulk} = %v, want 3", n)
	}
	release <- struct{}{}
	wg.Wait()
	waitIdle(t, gw)
}

// Cache isolation on a simulated replica: two isolated tenants sending
// the same long prompt get cached_tokens 0 from each other's first
// requests and > 0 from their own repeats, and /debug/route shows the
// index crediting a tenant's prefix to it only. Without isolate_cache the
// second tenant's first request hits the first's prefix (the control:
// the sim and the index share prefixes across clients by default).
func TestTenantCacheIsolation(t *testing.T) {
	for _, isolate := range []bool{true, false} {
		t.Run(fmt.Sprintf("isolate=%v", isolate), func(t *testing.T) {
			fl := startSim(t, sim.Config{Replicas: 1})
			cfg := simConfig("ttft", fl.URLs()...)
			cfg.AdminToken = "adm"
			cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}, IsolateCache: isolate},
				{Name: "b", APIKeys: []string{"kb"}, IsolateCache: isolate}}
			gw := startGateway(t, cfg)
			waitHealthy(t, gw)
			body := `{"model":"` + sim.DefaultModel + `","max_tokens":2,"prompt":"` + strings.Repeat("the same long prompt ", 40) + `"}`
			cached := func(key string) int {
				resp, b := post(t, gw.srv.URL+"/v1/completions", body, bearerHdr(key)...)
				if resp.StatusCode != 200 {
					t.Fatalf("%s: %d %s", key, resp.StatusCode, b)
				}
				var out struct {
					Usage struct {
						Details struct {
							Cached int `json:"cached_tokens"`
						} `json:"prompt_tokens_details"`
					} `json:"usage"`
				}
				if err := json.Unmarshal([]byte(b), &out); err != nil {
					t.Fatal(err)
				}
				return out.Usage.Details.Cached
			}
			match := func(tenant string) int {
				resp, b := post(t, gw.srv.URL+"/debug/route?tenant="+tenant, body, bearerHdr("adm")...)
				if resp.StatusCode != 200 {
					t.Fatalf("/debug/route: %d %s", resp.StatusCode, b)
				}
				var out struct {
					Replicas []struct {
						Match int `json:"match_blocks"`
					} `json:"replicas"`
				}
				if err := json.Unmarshal([]byte(b), &out); err != nil || len(out.Replicas) != 1 {
					t.Fatalf("/debug/route: %v %s", err, b)
				}
				return out.Replicas[0].Match
			}
			if n := cached("ka"); n != 0 {
				t.Fatalf("a's first request: %d cached tokens", n)
			}
			if ma, mb := match("a"), match("b"); ma == 0 || (mb == 0) != isolate {
				t.Fatalf("index after a's request: a matches %d blocks, b %d (isolate %v)", ma, mb, isolate)
			}
			if n := cached("kb"); (n == 0) != isolate {
				t.Fatalf("b's first request: %d cached tokens (isolate %v)", n, isolate)
			}
			if na, nb := cached("ka"), cached("kb"); na == 0 || nb == 0 {
				t.Fatalf("repeats: a %d, b %d cached tokens", na, nb)
			}
			// The live view lists the tenants and the GPU work each was served.
			code, st := testGet(t, gw.srv.URL+"/ui/state", "adm")
			var state struct {
				Tenants []struct {
					Name   string  `json:"name"`
					Served float64 `json:"served_tokens"`
				} `json:"tenants"`
			}
			if err := json.Unmarshal([]byte(st), &state); code != 200 || err != nil || len(state.Tenants) != 2 ||
				state.Tenants[0].Name != "a" || state.Tenants[1].Served <= 0 {
				t.Fatalf("/ui/state: %d %v %s", code, err, st)
			}
		})
	}
}

// responsesFront is a replica in front of stub: it creates stored
// responses (each answered with id) and sends the rest to the stub.
func responsesFront(t *testing.T, stub, id string) string {
	t.Helper()
	u, err := url.Parse(stub)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/responses" {
			rp.ServeHTTP(w, r)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":%q,"object":"response","status":"completed","output":[]}`, id)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}
