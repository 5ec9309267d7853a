package gateway

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// On a prefill/decode fleet /ready waits for a replica that answers: a
// healthy prefill replica alone serves no request (every one would get 503).
func TestReadyNeedsAnAnsweringReplica(t *testing.T) {
	pre := newFakeReplica(t)
	down := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(down.Close)
	cfg := baseConfig()
	cfg.Replicas = []ReplicaConfig{{URL: down.URL, Role: "decode"}, {URL: pre.srv.URL, Role: "prefill"}}
	gw := startGateway(t, cfg)
	eventually(t, "the prefill replica healthy", func() bool { return gw.g.rt.Replica(1).Ready() })
	resp, err := http.Get(gw.srv.URL + "/ready")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("/ready %d with only a prefill replica healthy, want 503", resp.StatusCode)
	}
}
