package epp

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/epp/standin"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// recorder is a proxy in front of one sim that keeps each inference
// request's body as the replica got it.
type recorder struct {
	mu     sync.Mutex
	bodies []string
}

func (rc *recorder) start(t *testing.T, simURL string) string {
	t.Helper()
	target, err := url.Parse(simURL)
	if err != nil {
		t.Fatal(err)
	}
	rp := httputil.NewSingleHostReverseProxy(target)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			b, _ := io.ReadAll(r.Body)
			rc.mu.Lock()
			rc.bodies = append(rc.bodies, string(b))
			rc.mu.Unlock()
			r.Body = io.NopCloser(strings.NewReader(string(b)))
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// Behind the endpoint picker the replica gets the body kvgate serve would
// send, not the client's: an isolated tenant's cache_salt, no priority of
// the client's, no kv_transfer_params of the client's, with its length,
// in both body modes. Before, the picker answered the client's body back
// (full duplex) or left it (buffered): an isolate_cache tenant's KV was
// shared with every client, and a client's kv_transfer_params reached the
// replica.
func TestTenantBodyThroughThePicker(t *testing.T) {
	fl := startSims(t, 1)
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			rc := &recorder{}
			cfg := gatewayConfig(fl, "ttft")
			cfg.Replicas = []gateway.ReplicaConfig{{URL: rc.start(t, fl.URLs()[0])}}
			cfg.Tenants = []gateway.TenantConfig{{Name: "gold", APIKeys: []string{"k-gold"}, IsolateCache: true}}
			r := startRig(t, cfg, fl, standin.Config{RequestMode: m.mode, ResponseMode: m.mode, MessageTimeout: time.Minute})
			body := `{"model":"` + sim.DefaultModel + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2,` +
				`"priority":-5,"kv_transfer_params":{"remote_host":"10.9.9.9","remote_port":1}}`
			resp := testutil.Post(t, http.DefaultClient, r.front.URL+"/v1/chat/completions", body, "Authorization", "Bearer k-gold")
			if resp.Status != http.StatusOK {
				t.Fatalf("%d %s", resp.Status, resp.Body)
			}
			rc.mu.Lock()
			sent := rc.bodies[len(rc.bodies)-1]
			rc.mu.Unlock()
			var got map[string]json.RawMessage
			if err := json.Unmarshal([]byte(sent), &got); err != nil {
				t.Fatalf("%s: %v", sent, err)
			}
			if string(got["cache_salt"]) != `"kvgate-tenant:gold:"` || got["priority"] != nil || got["kv_transfer_params"] != nil {
				t.Fatalf("the replica got %s", sent)
			}
		})
	}
}
