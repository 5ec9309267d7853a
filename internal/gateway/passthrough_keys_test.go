package gateway

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/testutil"
)

// Replicas started with --api-key get their key on every call the gateway
// makes (inference, the other paths, the remote tokenizer's /tokenize,
// /health, /metrics, /v1/models), never the client's; the key is never in
// the logs (debug level), /debug/route or /admin/replicas.
func TestReplicaKeysOnEveryCall(t *testing.T) {
	a := newAPIReplica(t, "a", "m", "sk-replica-a-secret")
	b := newAPIReplica(t, "b", "m", "sk-replica-b-secret")
	cfg := baseConfig()
	for _, f := range []*apiReplica{a, b} {
		cfg.Replicas = append(cfg.Replicas, ReplicaConfig{URL: f.srv.URL, APIKey: f.key})
	}
	cfg.Tokenizer = "remote"
	cfg.APIKeys = []string{"client-key"}
	cfg.AdminToken = "admin-token"
	var logs testutil.SyncBuffer
	g, err := New(cfg, Options{Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	srv := httptest.NewServer(g.Handler())
	done := make(chan struct{})
	go func() { defer close(done); g.Run(ctx) }()
	t.Cleanup(func() { srv.Close(); cancel(); <-done })
	eventually(t, "both replicas probed with their keys", func() bool {
		for _, f := range []*apiReplica{a, b} {
			for _, p := range []string{"/health", "/metrics", "/v1/models"} {
				if _, ok := f.probes.Load(p); !ok {
					return false
				}
			}
		}
		return g.rt.Replica(0).Served() != nil && g.rt.Replica(1).Served() != nil
	})
	send := func(method, path, body string) (int, string) {
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer client-key")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(out)
	}
	for k := range 4 { // embeddings take the remote tokenizer's /tokenize first
		for _, c := range []struct{ method, path, body string }{
			{"POST", "/v1/embeddings", fmt.Sprintf(`{"model":"m","input":"text %d to embed"}`, k)},
			{"POST", "/v1/score", `{"model":"m","text_1":"a","text_2":"b"}`},
			{"POST", "/v1/responses", `{"model":"m","input":"hi"}`},
			{"POST", "/v1/rerank", `{"model":"m","query":"q","documents":["a"]}`},
		} {
			if status, body := send(c.method, c.path, c.body); status != 200 {
				t.Fatalf("%s %s: %d %s", c.method, c.path, status, body)
			}
		}
	}
	if got := len(a.requests()) + len(b.requests()); got < 16+4 {
		t.Fatalf("%d requests reached the replicas (want the 16 sent and the tokenizer's)", got)
	}
	tokenized := strings.Contains(strings.Join(append(a.requests(), b.requests()...), " "), "POST /tokenize")
	if !tokenized {
		t.Fatal("the remote tokenizer never called /tokenize")
	}
	if n := a.unauthorized.Load() + b.unauthorized.Load(); n != 0 {
		t.Fatalf("%d calls reached a replica without its key", n)
	}
	for _, path := range []string{"/debug/route", "/admin/replicas"} {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+path, strings.NewReader(`{"model":"m","prompt":"x"}`))
		if path == "/admin/replicas" {
			req.Method = http.MethodGet
		}
		req.Header.Set("Authorization", "Bearer admin-token")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		out, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || strings.Contains(string(out), "secret") {
			t.Fatalf("%s: %d, shows a key: %s", path, resp.StatusCode, out)
		}
	}
	// Without the client's key nothing reaches a replica.
	before := len(a.requests()) + len(b.requests())
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/v1/score", strings.NewReader(`{"model":"m"}`))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 || len(a.requests())+len(b.requests()) != before {
		t.Fatalf("no client key: %d", resp.StatusCode)
	}
	eventually(t, "idle", func() bool { return g.rt.InFlight(0) == 0 && g.rt.InFlight(1) == 0 })
	if l := logs.String(); strings.Contains(l, "secret") || strings.Contains(l, "client-key") || l == "" {
		t.Fatalf("the logs show a key (or are empty): %s", l)
	}
}
