package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
)

// heldPrefillStub is a prefill replica whose answers (vLLM's, with the
// kv_transfer_params naming the held KV) wait for release, but for a
// prompt saying "at once" (a request that should never have been sent:
// the test fails instead of hanging).
func heldPrefillStub(t *testing.T) (*stub, chan struct{}) {
	t.Helper()
	release := make(chan struct{}, 16)
	s := newStub(t, "", func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if !strings.Contains(string(b), "at once") {
			select {
			case <-release:
			case <-r.Context().Done():
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}],`+
			`"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13},`+
			`"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[1]}}`)
	})
	return s, release
}

// heldPDConfig is the tenants' configuration on prefill replica pre and
// decode replica dec, flow control saturated by one pending prefill step,
// every request with a prefill step.
func heldPDConfig(t *testing.T, pre, dec *stub) Config {
	t.Helper()
	cfg := tenantsConfig()
	rs, err := ParseReplicaList(dec.srv.URL, ReplicaLists{Prefill: pre.srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Replicas = rs
	cfg.NonCachedTokens = 0 // every request has a prefill step
	cfg.FlowControl.QueueMs = 1
	return cfg
}

// Flow control on a prefill/decode fleet: while the prefill replica
// computes a prompt (saturated), a sheddable tenant's request is refused
// 429 shed_saturated before anything is sent, and a gold request waits in
// the router's queue (kvgate_queue_depth) and is served, pair and all, once
// the prefill step ahead of it ends; a request whose client leaves while it
// waits leaves nothing behind.
func TestPDFlowShedsAndHolds(t *testing.T) {
	pre, release := heldPrefillStub(t)
	dec := newStub(t, "", okStream(2))
	cfg := heldPDConfig(t, pre, dec)
	cfg.FlowControl.Bands = []BandFlowConfig{{Priority: 2, Sheddable: true}}
	reg := prometheus.NewRegistry()
	gw := startGatewayWith(t, cfg, Options{Clock: clock.NewFake(time.Unix(1000, 0)), Registry: reg})
	t.Cleanup(func() { // before the gateway's server closes: a failed test leaves no request held
		for range cap(release) - len(release) {
			release <- struct{}{}
		}
	})
	rt := gw.g.Router()
	eventually(t, "both replicas listed", func() bool { return rt.Replica(0).Served() != nil && rt.Replica(1).Served() != nil })
	stream := `{"model":"m","prompt":"a long enough prompt for a pending prefill","max_tokens":2,"stream":true}`
	type result struct {
		code          int
		replica, pref string
	}
	results := make(chan result, 2)
	send := func(ctx context.Context, key string) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw.srv.URL+"/v1/completions", strings.NewReader(stream))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			results <- result{code: -1}
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		results <- result{resp.StatusCode, resp.Header.Get("X-Kvgate-Replica"), resp.Header.Get(headerPrefill)}
	}
	var wg sync.WaitGroup
	wg.Go(func() { send(context.Background(), "k-gold") })
	eventually(t, "the first prefill step at the prefill replica", func() bool { return pre.calls.Load() == 1 })
	bulk := strings.Replace(stream, "a long", "at once a long", 1)
	if resp, b := post(t, gw.srv.URL+"/v1/completions", bulk, bearerHdr("k-bulk")...); resp.StatusCode != 429 ||
		!strings.Contains(b, "shed_saturated") || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("sheddable while the prefill side is saturated: %d %s", resp.StatusCode, b)
	}
	gone, leave := context.WithCancel(context.Background())
	wg.Go(func() { send(gone, "k-none") })
	wg.Go(func() { send(context.Background(), "k-gold") })
	depth := func(tenant string) float64 {
		return counterValue(t, reg, "kvgate_queue_depth", map[string]string{"tenant": tenant})
	}
	eventually(t, "two requests waiting", func() bool { return depth("gold") == 1 && depth("") == 1 })
	leave()
	if r := <-results; r.code != -1 {
		t.Fatalf("the request whose client left: %d", r.code)
	}
	eventually(t, "the request whose client left out of the queue", func() bool { return rt.Queued() == 1 })
	if n, m := pre.calls.Load(), dec.calls.Load(); n != 1 || m != 0 {
		t.Fatalf("%d prefill and %d decode steps sent while one prefill step was pending", n, m)
	}
	release <- struct{}{}
	eventually(t, "the gold request's prefill step sent", func() bool { return pre.calls.Load() == 2 })
	release <- struct{}{}
	wg.Wait()
	close(results)
	for r := range results {
		if r.code != 200 || r.replica != dec.srv.URL || r.pref != pre.srv.URL {
			t.Errorf("gold: %d, replica %q, prefill %q; want 200 through %s and %s", r.code, r.replica, r.pref, pre.srv.URL, dec.srv.URL)
		}
	}
	if n := counterValue(t, reg, "kvgate_shed_total", map[string]string{"reason": "saturated", "tenant": "bulk"}); n != 1 {
		t.Errorf("kvgate_shed_total{reason=saturated,tenant=bulk} = %v, want 1", n)
	}
	if n := dec.calls.Load(); n != 2 {
		t.Errorf("%d decode steps, want 2", n)
	}
	waitIdle(t, gw)
	for _, tf := range rt.FlowTenants() {
		if tf.Queued != 0 || tf.Active != 0 {
			t.Errorf("tenant %q still counted: %+v", tf.Tenant, tf)
		}
	}
}

// /debug/route on a prefill/decode fleet says whether flow control would
// hold the pair now: not while the prefill replica is idle, held
// (saturated) while it computes a prompt, and (queued_behind) while
// another request waits in the pool's queue; nothing is sent. Before, it
// showed the pair alone.
func TestPDDebugRouteSaysHeld(t *testing.T) {
	pre, release := heldPrefillStub(t)
	dec := newStub(t, "", okStream(2))
	cfg := heldPDConfig(t, pre, dec)
	cfg.AdminToken = "s3cret"
	gw := startGatewayWith(t, cfg, Options{Clock: clock.NewFake(time.Unix(1000, 0)), Registry: prometheus.NewRegistry()})
	t.Cleanup(func() {
		for range cap(release) - len(release) {
			release <- struct{}{}
		}
	})
	rt := gw.g.Router()
	eventually(t, "both replicas listed", func() bool { return rt.Replica(0).Served() != nil && rt.Replica(1).Served() != nil })
	stream := `{"model":"m","prompt":"a long enough prompt for a pending prefill","max_tokens":2,"stream":true}`
	flow := func() map[string]any {
		t.Helper()
		resp, body := post(t, gw.srv.URL+"/debug/route", stream, "Authorization", "Bearer s3cret")
		var got struct {
			Flow       map[string]any `json:"flow"`
			PrefillURL string         `json:"prefill_url"`
		}
		if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &got) != nil || got.PrefillURL != pre.srv.URL {
			t.Fatalf("/debug/route: %d %s", resp.StatusCode, body)
		}
		return got.Flow
	}
	if f := flow(); f["held"] != false {
		t.Fatalf("idle fleet: flow %v, want not held", f)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { post(t, gw.srv.URL+"/v1/completions", stream, bearerHdr("k-gold")...) })
	eventually(t, "the first prefill step at the prefill replica", func() bool { return pre.calls.Load() == 1 })
	if f := flow(); f["held"] != true || f["reason"] != "saturated" {
		t.Fatalf("the prefill replica computing a prompt: flow %v, want held (saturated)", f)
	}
	wg.Go(func() { post(t, gw.srv.URL+"/v1/completions", stream, bearerHdr("k-gold")...) })
	eventually(t, "a request waiting", func() bool { return rt.Queued() == 1 })
	if f := flow(); f["held"] != true || f["reason"] != "queued_behind" {
		t.Fatalf("a request waiting: flow %v, want held (queued_behind)", f)
	}
	if n := pre.calls.Load(); n != 1 {
		t.Fatalf("%d prefill steps sent, want 1", n)
	}
	release <- struct{}{}
	release <- struct{}{}
	wg.Wait()
	waitIdle(t, gw)
}

// On an aggregated fleet too: /debug/route says the request would be held
// while its one replica computes a prompt (saturated), not before.
func TestDebugRouteSaysHeld(t *testing.T) {
	s, release := heldStub(t)
	cfg := tenantsConfig(s.srv.URL)
	cfg.FlowControl.QueueMs, cfg.AdminToken = 1, "s3cret"
	gw := startGatewayWith(t, cfg, Options{Clock: clock.NewFake(time.Unix(1000, 0)), Registry: prometheus.NewRegistry()})
	eventually(t, "models listed", func() bool { return len(gw.g.Fleet().Models()) > 0 })
	stream := `{"model":"m","prompt":"a long enough prompt for a pending prefill","max_tokens":2,"stream":true}`
	flow := func() any {
		t.Helper()
		resp, body := post(t, gw.srv.URL+"/debug/route", stream, "Authorization", "Bearer s3cret")
		var got struct {
			Flow map[string]any `json:"flow"`
		}
		if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &got) != nil {
			t.Fatalf("/debug/route: %d %s", resp.StatusCode, body)
		}
		return fmt.Sprint(got.Flow)
	}
	if f := flow(); f != "map[held:false]" {
		t.Fatalf("idle: flow %v", f)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { post(t, gw.srv.URL+"/v1/completions", stream, bearerHdr("k-gold")...) })
	eventually(t, "the first request at the replica", func() bool { return s.calls.Load() == 1 })
	if f := flow(); f != "map[held:true reason:saturated]" {
		t.Fatalf("the replica computing a prompt: flow %v", f)
	}
	release <- struct{}{}
	wg.Wait()
	waitIdle(t, gw)
}
