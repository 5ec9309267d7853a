package gateway

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/prompt"
)

// settle reads one table: for every verdict, what the replica's breaker
// hears (eject_after 1: one failure opens it), whether the prefix index
// keeps the request the replica took, and whether the attempt is counted.
// A client's 4xx, a client gone, the gateway's limit, a 429 and a loop
// (508: rejected) never count against the replica.
func TestSettleOutcomeOfEveryVerdict(t *testing.T) {
	type want struct {
		breaker string // after settling, with eject_after 1
		kept    bool   // the index holds the request's blocks for the replica
		counted bool   // kvgate_attempts_total{verdict}
	}
	cases := []struct {
		v       verdict
		started bool
		want    want
	}{
		{served, true, want{"closed", true, true}},
		{skipped, false, want{"closed", true, false}},
		{refused, false, want{"open", false, true}},
		{busy, false, want{"closed", true, true}},
		{failed, false, want{"open", false, true}},
		{failed, true, want{"open", true, true}}, // a stream broken midway: the replica took it
		{rejected, false, want{"closed", false, true}},
		{rejected, true, want{"closed", false, true}},
		{clientGone, true, want{"closed", true, true}},
		{gatewayLimit, false, want{"closed", true, true}},
	}
	seen := map[verdict]bool{}
	for _, c := range cases {
		seen[c.v] = true
		t.Run(c.v.String(), func(t *testing.T) {
			cfg := baseConfig("http://127.0.0.1:1")
			cfg.EjectAfter = 1
			g, err := New(cfg, Options{})
			if err != nil {
				t.Fatal(err)
			}
			req := g.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: strings.Repeat("a prompt. ", 40), Prompts: 1}, "", "")
			tk, err := g.rt.Route(req)
			if err != nil {
				t.Fatal(err)
			}
			x := &exchange{w: httptest.NewRecorder(), r: httptest.NewRequest(http.MethodPost, "/v1/completions", nil),
				log: slog.New(slog.DiscardHandler), start: g.clock.Now(), req: req}
			a := &attempt{tk: tk, cached: -1, v: c.v, started: c.started}
			if c.v != skipped && !g.allow(a) {
				t.Fatal("a closed breaker refused")
			}
			a.v = c.v
			tk.Accept() // the replica's first byte: learnt, unless settle forgets it
			g.settle(x, a)
			got := want{breaker: g.fleet.State(0), kept: g.rt.Index().Holds(0, req.Blocks[len(req.Blocks)-1]),
				counted: counterValue(t, g.reg, "kvgate_attempts_total", map[string]string{"verdict": c.v.String()}) == 1}
			if got != c.want {
				t.Fatalf("settled %s (started %v): %+v, want %+v", c.v, c.started, got, c.want)
			}
			if g.rt.InFlight(0) != 0 {
				t.Fatal("the ticket is still in flight")
			}
		})
	}
	if len(seen) != len(outcomes) {
		t.Fatalf("the table covers %d verdicts of %d", len(seen), len(outcomes))
	}
}
