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

// At start /ready waits until every replica's first health check has ended
// (passed or failed), so that the first requests are routed over the whole
// fleet; a replica failing its check does not hold it back.
func TestReadyWaitsForTheFirstHealthChecks(t *testing.T) {
	a := newFakeReplica(t)
	release := make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			select {
			case <-release:
			case <-r.Context().Done():
			}
		}
		w.WriteHeader(http.StatusServiceUnavailable)
	}))
	t.Cleanup(slow.Close)
	cfg := baseConfig(a.srv.URL, slow.URL)
	gw := startGateway(t, cfg)
	eventually(t, "the fast replica healthy", func() bool { return gw.g.rt.Replica(0).Ready() })
	status := func() int {
		resp, err := http.Get(gw.srv.URL + "/ready")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	// The slow replica's check ends only when released, or at the probe
	// timeout (2 s of wall clock): on a machine so busy that it passed,
	// there is nothing left to observe before the release.
	if s := status(); s != http.StatusServiceUnavailable && !gw.g.rt.Replica(1).Probed() {
		t.Fatalf("/ready %d while a replica's first check is under way, want 503", s)
	}
	close(release) // its check ends, failed
	eventually(t, "/ready 200", func() bool { return status() == http.StatusOK })
}
