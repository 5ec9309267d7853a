package gateway

import (
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/sim"
)

// A deliberately wrong index raises the wrong-route metric: the index is
// told that replica 1 holds a long prompt it never saw, the policy follows
// the index there, and the replica reports no cached tokens — a wrong
// route, counted, and marked in the receipt. The same prompt again is
// held for real: its route is right.
func TestWrongIndexRaisesWrongRoutes(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 2})
	cfg := simConfig("ttft", fl.URLs()...)
	cfg.RouteReceipts = true
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	rt := gw.g.Router()
	text := strings.Repeat("a long shared document that nobody sent before. ", 60)
	body := `{"model":"` + sim.DefaultModel + `","prompt":` + strconv.Quote(text) + `,"max_tokens":2}`
	p, err := prompt.Parse(prompt.Completion, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	req := rt.Prepare(p, "", "")
	if err := rt.Index().Insert(1, req.Blocks); err != nil { // the lie
		t.Fatal(err)
	}
	wrong := func() float64 { return testutil.ToFloat64(gw.g.met.wrongRoutes.WithLabelValues("ttft", rt.Name(1))) }
	checks := func() float64 { return testutil.ToFloat64(gw.g.met.routeChecks.WithLabelValues("ttft", rt.Name(1))) }
	r, _ := post(t, gw.srv.URL+"/v1/completions", body)
	if r.StatusCode != 200 || r.Header.Get("X-Kvgate-Replica") != fl.URLs()[1] {
		t.Fatalf("the index's holder was not chosen: %d %q", r.StatusCode, r.Header.Get("X-Kvgate-Replica"))
	}
	if rc := r.Header.Get(headerRoute); !strings.Contains(rc, "branch=held") || strings.Contains(rc, "matched_tokens=0;") {
		t.Fatalf("receipt %q: want the match the index claimed", rc)
	}
	if wrong() != 1 || checks() != 1 {
		t.Fatalf("wrong routes %v of %v checks, want 1 of 1", wrong(), checks())
	}
	r, _ = post(t, gw.srv.URL+"/v1/completions", body)
	if r.StatusCode != 200 || r.Header.Get("X-Kvgate-Replica") != fl.URLs()[1] {
		t.Fatalf("second time: %d %q", r.StatusCode, r.Header.Get("X-Kvgate-Replica"))
	}
	if wrong() != 1 || checks() != 2 {
		t.Fatalf("after a true hit: wrong routes %v of %v checks, want 1 of 2", wrong(), checks())
	}
}

// Receipts are opt-in: no X-Kvgate-Route without route_receipts.
func TestReceiptHeaderOptIn(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 1})
	gw := startGateway(t, simConfig("ttft", fl.URLs()...))
	waitHealthy(t, gw)
	r, _ := post(t, gw.srv.URL+"/v1/completions", `{"model":"`+sim.DefaultModel+`","prompt":"hi","max_tokens":1}`)
	if r.StatusCode != 200 || r.Header.Get(headerRoute) != "" {
		t.Fatalf("%d, receipt %q without route_receipts", r.StatusCode, r.Header.Get(headerRoute))
	}
}

// The receipt's queue_ms reads back as String wrote it; a value no
// receipt carries (negative, not a number, past the bound) reads as none.
func TestReceiptQueueWaitReadsBack(t *testing.T) {
	h := http.Header{}
	h.Set(headerRoute, receipt{policy: "ttft", queue: 40500 * time.Microsecond}.String())
	if d, ok := ReceiptQueueWait(h); !ok || d != 40500*time.Microsecond {
		t.Fatalf("%q: %v %v", h.Get(headerRoute), d, ok)
	}
	for _, v := range []string{"", "policy=ttft", "queue_ms=-1", "queue_ms=NaN", "queue_ms=+Inf", "queue_ms=2e9", "queue_ms=x"} {
		if d, ok := ReceiptQueueWait(http.Header{headerRoute: {v}}); ok {
			t.Errorf("%q: %v", v, d)
		}
	}
	// A decode step's prefill_cached_tokens likewise; none without one.
	h.Set(headerRoute, receipt{policy: "ttft", prefillCached: 4096}.String())
	if n, ok := ReceiptPrefillCached(h); !ok || n != 4096 {
		t.Fatalf("%q: %v %v", h.Get(headerRoute), n, ok)
	}
	h.Set(headerRoute, receipt{policy: "ttft", prefillCached: -1}.String())
	if n, ok := ReceiptPrefillCached(h); ok {
		t.Fatalf("%q: %v", h.Get(headerRoute), n)
	}
	for _, v := range []string{"prefill_cached_tokens=-1", "prefill_cached_tokens=x", "prefill_cached_tokens=99999999999"} {
		if n, ok := ReceiptPrefillCached(http.Header{headerRoute: {v}}); ok {
			t.Errorf("%q: %v", v, n)
		}
	}
}
