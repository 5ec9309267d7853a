package gateway

import (
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// dynamo's router queue, end to end: with router_queue_threshold 0 a
// request arriving while another's prefill is pending waits in the router
// (kvgate_router_queue_depth 1), and is sent once that prefill ends.
func TestRouterQueueHoldsUntilPrefillEnds(t *testing.T) {
	release := make(chan struct{})
	var first sync.Once
	s := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		held := false
		first.Do(func() { held = true })
		if held {
			<-release // the first request's prefill: no first byte until the test says
		}
		okStream(2)(w, r)
	})
	cfg := baseConfig(s.srv.URL)
	cfg.Policy = "dynamo"
	cfg.PolicyParams = map[string]any{"router_queue_threshold": 0}
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	body := `{"model":"m","prompt":"a prompt of a few words","max_tokens":2,"stream":true}`
	codes := make(chan int, 2)
	send := func() {
		resp, err := http.Post(gw.srv.URL+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			codes <- -1
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		codes <- resp.StatusCode
	}
	go send()
	eventually(t, "the first request at the replica", func() bool { return s.calls.Load() == 1 })
	go send()
	eventually(t, "the second request waiting in the router", func() bool {
		return counterValue(t, gw.g.reg, "kvgate_router_queue_depth", nil) == 1
	})
	if n := s.calls.Load(); n != 1 {
		t.Fatalf("%d requests reached the replica while one waited in the router", n)
	}
	close(release)
	for range 2 {
		if c := <-codes; c != 200 {
			t.Fatalf("status %d", c)
		}
	}
	if n := s.calls.Load(); n != 2 || gw.g.rt.Queued() != 0 {
		t.Fatalf("%d calls, %d still queued", n, gw.g.rt.Queued())
	}
	waitIdle(t, gw)
}
