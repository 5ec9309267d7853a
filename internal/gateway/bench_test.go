package gateway

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
)

// BenchmarkProxy compares, in one run, a small non-streamed completion
// sent straight to a replica, through kvgate (ttft policy: parse, hash,
// route, proxy, usage read), and through Go's plain httputil.ReverseProxy.
// The difference per request is the latency kvgate adds; ops/s under
// RunParallel is the throughput on small responses.
func BenchmarkProxy(b *testing.B) {
	const resp = `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"ok","finish_reason":"length"}],` +
		`"usage":{"prompt_tokens":300,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":256}}}`
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("/v1/completions", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, resp)
	})
	up := httptest.NewServer(mux)
	defer up.Close()

	gw := benchGateway(b, baseConfig(up.URL))
	// The same gateway with a tenant: its key, the flow controller on, its
	// queue empty (the done-when: no measurable cost).
	tcfg := baseConfig(up.URL)
	tcfg.Tenants = []TenantConfig{{Name: "t", APIKeys: []string{"k"}}}
	gwt := benchGateway(b, tcfg)
	u, _ := url.Parse(up.URL)
	rp := httptest.NewServer(httputil.NewSingleHostReverseProxy(u))
	defer rp.Close()

	body := []byte(`{"model":"m","max_tokens":1,"prompt":"` + strings.Repeat("The quick brown fox jumps. ", 45) + `"}`)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256}}
	post := func(b *testing.B, url string) bool {
		req, _ := http.NewRequest(http.MethodPost, url+"/v1/completions", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer k")
		r, err := client.Do(req)
		if err != nil {
			b.Error(err)
			return false
		}
		_, _ = io.Copy(io.Discard, r.Body)
		r.Body.Close()
		if r.StatusCode != 200 {
			b.Errorf("status %d", r.StatusCode)
			return false
		}
		return true
	}
	targets := []struct{ name, url string }{{"direct", up.URL}, {"kvgate", gw.URL}, {"kvgate-tenant", gwt.URL}, {"httputil", rp.URL}}
	for _, tc := range targets {
		b.Run("latency/"+tc.name, func(b *testing.B) {
			for b.Loop() {
				if !post(b, tc.url) {
					return
				}
			}
		})
	}
	for _, tc := range targets {
		b.Run("parallel/"+tc.name, func(b *testing.B) {
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if !post(b, tc.url) {
						return
					}
				}
			})
		})
	}
}

// benchGateway starts a gateway of cfg for a benchmark, stopped at its end.
func benchGateway(b *testing.B, cfg Config) *httptest.Server {
	g, err := New(cfg, Options{})
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); g.Run(ctx) }()
	gw := httptest.NewServer(g.Handler())
	b.Cleanup(func() { gw.Close(); cancel(); <-done })
	return gw
}
