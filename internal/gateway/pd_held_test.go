package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/sim"
)

// countingProxy is a reverse proxy to target counting the inference
// requests it forwards: a prefill replica's requests, counted (the KV it
// holds is pulled from target itself, whose address its answers name).
func countingProxy(t *testing.T, target string) (string, *atomic.Int64) {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	var n atomic.Int64
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1/completions") || strings.HasPrefix(r.URL.Path, "/v1/chat/") {
			n.Add(1)
		}
		rp.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, &n
}

// A decode step refused before it started (503) does not run the
// completed prefill again (finding 12): the next decode replica pulls the
// KV the prefill replica holds, with the same kv_transfer_params, and the
// prefill replica gets exactly one request per client request. When no
// decode replica can take the KV it is released, and the client gets the
// refusal.
func TestPDDecodeRefusedReusesTheHeldKV(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 2, Roles: []engine.Role{engine.RolePrefill, engine.RoleDecode}})
	good := fl.URLs()[1]
	tests := []struct {
		name     string
		good     bool // a decode replica that takes the request besides the refusing one
		requests int
		status   int
		released float64
	}{
		{"next decode replica pulls it", true, 4, http.StatusOK, 0},
		{"no decode replica takes it", false, 1, http.StatusServiceUnavailable, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pre, prefills := countingProxy(t, fl.URLs()[0])
			bad := newPDFake(t, http.StatusServiceUnavailable)
			dec := []string{bad.srv.URL}
			if tc.good {
				dec = append(dec, good)
			}
			cfg := pdConfig(t, "round_robin", []string{pre}, dec)
			cfg.EjectAfter = 1000 // keep it in rotation: only the retry saves the requests
			gw := startGateway(t, cfg)
			waitPD(t, gw)
			for i := range tc.requests {
				resp, body := post(t, gw.srv.URL+"/v1/completions", longPrompt(i, `,"stream":true`))
				if resp.StatusCode != tc.status {
					t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
				}
				if tc.good {
					pdHeaders(t, fmt.Sprintf("request %d", i), resp.Header, []string{pre}, []string{good})
				}
				if n := prefills.Load(); n != int64(i+1) {
					t.Fatalf("after %d requests the prefill replica got %d prefill steps", i+1, n)
				}
			}
			got := bad.got()
			if len(got) == 0 {
				t.Fatal("round robin never picked the refusing decode replica")
			}
			var req struct {
				KV struct {
					DoRemotePrefill bool    `json:"do_remote_prefill"`
					RemoteBlockIDs  []int64 `json:"remote_block_ids"`
				} `json:"kv_transfer_params"`
			}
			if err := json.Unmarshal([]byte(got[0]), &req); err != nil || !req.KV.DoRemotePrefill || len(req.KV.RemoteBlockIDs) == 0 {
				t.Fatalf("the refused decode step's body: %v %s", err, got[0])
			}
			waitIdle(t, gw)
			reused := counterValue(t, gw.g.reg, "kvgate_prefill_held_kv_total", map[string]string{"outcome": "reused"})
			released := counterValue(t, gw.g.reg, "kvgate_prefill_held_kv_total", map[string]string{"outcome": "released"})
			if tc.good && int(reused) != len(got) || released != tc.released {
				t.Fatalf("held KV reused %v times (%d refusals), released %v (want %v)", reused, len(got), released, tc.released)
			}
		})
	}
}
