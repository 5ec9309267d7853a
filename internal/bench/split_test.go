package bench

import (
	"context"
	"net/http"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/sim"
)

// A gateway made slower by a fixed delay per request (a handler that
// sleeps before routing) at time scale 1000: bench counts the delay once,
// in real time, as time outside the engine. Multiplied by the scale, as
// bench did before, the delay alone would be 20 s of TTFT. The bounds hold
// on any machine: the client's wall time to the first token contains the
// sleep and the replica's own span, so outside ≥ the delay; and the TTFT is
// the engine's (tens of ms of model time for these prompts) plus outside,
// which would have to reach about 20 s of real time per request to break
// the upper bound.
func TestSlowGatewayCountedOnce(t *testing.T) {
	const (
		delay = 20 * time.Millisecond
		scale = 1000
	)
	reqs := generate(t, "multiturn", map[string]float64{"conversations": 3, "turns": 3, "system_prompt_len": 64,
		"user_len_min": 32, "user_len_max": 32, "output_len": 4, "think_ms": 0})
	e := embedded(2)
	e.Sim.TimeScale = scale
	e.Load.RequestTimeout = 24 * time.Hour // model time: 86 s of wall at the scale
	e.wrapGateway = func(h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost {
				time.Sleep(delay) // the gateway's own cost, in real time
			}
			h.ServeHTTP(w, r)
		})
	}
	res, err := RunEmbedded(context.Background(), e, "round_robin", reqs)
	if err != nil {
		t.Fatal(err)
	}
	for i, rec := range res.Records {
		if rec.Err || rec.EngineTTFT <= 0 {
			t.Fatalf("record %d: %+v: no engine time", i, rec)
		}
		if out := rec.TTFT - rec.EngineTTFT; out < delay {
			t.Errorf("record %d: outside the engine %v, want ≥ the gateway's delay %v", i, out, delay)
		}
		if rec.TTFT >= scale*delay {
			t.Errorf("record %d: TTFT %v: the gateway's %v counted × %d", i, rec.TTFT, delay, scale)
		}
		if rec.E2E-rec.EngineE2E < delay {
			t.Errorf("record %d: E2E %v outside the engine's %v by less than the delay", i, rec.E2E, rec.EngineE2E)
		}
	}
	// Model time ran no faster than the scale, held back while each
	// request was in the slow gateway.
	if eff := res.Run.Extra[ExtraTimeScale]; !(eff > 0 && eff <= scale*1.01) {
		t.Errorf("effective time scale %v, want in (0, %d]", eff, scale)
	}
	sp := res.Run.Split
	if sp == nil || sp.Source != report.SplitPerRequest || sp.Requests != len(reqs) || sp.OutsideTTFTms == nil ||
		sp.OutsideTTFTms.P50 < float64(delay.Milliseconds()) {
		t.Fatalf("split %+v, want every request's, outside ≥ %v", sp, delay)
	}
}

// splitRecord: the engine's part as the replica says (model time), the
// client's wall time beyond the replica's own span once (real time), never
// a negative part; without a span, the engine's time / its scale stands in;
// a wait in the gateway's queue in model time, its real time off the
// outside part.
func TestSplitRecord(t *testing.T) {
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	tests := []struct {
		name                 string
		first, gap, e2e      time.Duration // the client's wall times
		t                    sim.Timing
		ttft, wantE2E, maxIT time.Duration
		q                    queueWait
	}{
		{"span", ms(12), ms(2), ms(60), sim.Timing{TTFTms: 100, E2Ems: 900, MaxITLms: 30, TimeScale: 20, WallTTFTms: 7, WallE2Ems: 50},
			ms(105), ms(910), ms(30 + 0.5), queueWait{}},
		{"client faster than the span: no negative part", ms(6), ms(1), ms(40), sim.Timing{TTFTms: 100, E2Ems: 900, MaxITLms: 30,
			TimeScale: 20, WallTTFTms: 7, WallE2Ems: 50}, ms(100), ms(900), ms(30), queueWait{}},
		{"no span", ms(12), ms(2), ms(60), sim.Timing{TTFTms: 100, E2Ems: 900, MaxITLms: 30, TimeScale: 20},
			ms(107), ms(915), ms(30.5), queueWait{}},
		// 40 ms of model time waited in the gateway, 80 ms of real time
		// (a host at half the scale): 100 + 40 + (92 - 7 - 80) = 145.
		{"queued", ms(92), ms(2), ms(140), sim.Timing{TTFTms: 100, E2Ems: 900, MaxITLms: 30, TimeScale: 1, WallTTFTms: 7, WallE2Ems: 50},
			ms(145), ms(950), ms(30), queueWait{model: ms(40), wall: ms(80)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var rec report.Record
			splitRecord(&rec, streamed{first: tc.first, maxGap: tc.gap}, tc.e2e, tc.t, tc.q)
			if rec.TTFT != tc.ttft || rec.E2E != tc.wantE2E || rec.MaxITL != tc.maxIT ||
				rec.EngineTTFT != ms(tc.t.TTFTms) || rec.EngineE2E != ms(tc.t.E2Ems) {
				t.Errorf("got TTFT %v E2E %v max ITL %v engine %v/%v; want %v %v %v", rec.TTFT, rec.E2E, rec.MaxITL,
					rec.EngineTTFT, rec.EngineE2E, tc.ttft, tc.wantE2E, tc.maxIT)
			}
		})
	}
}

// queueWaitOf: the receipt's queue_ms in model time, its real time by the
// rate model time ran at before the answer's header; a receipt missing,
// unparsable, negative or longer than the span counts as no wait.
func TestQueueWaitOf(t *testing.T) {
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	hdr := func(v string) http.Header { return http.Header{"X-Kvgate-Route": {v}} }
	for _, tc := range []struct {
		h             http.Header
		pre, preModel time.Duration
		want          queueWait
	}{
		{hdr("policy=ttft; matched_tokens=0; est_ttft_ms=90; queue_ms=40"), ms(100), ms(50), queueWait{model: ms(40), wall: ms(80)}},
		{hdr("policy=ttft; queue_ms=0"), ms(100), ms(50), queueWait{}},
		{hdr("policy=ttft; queue_ms=60"), ms(100), ms(50), queueWait{}},
		{hdr("policy=ttft; queue_ms=NaN"), ms(100), ms(50), queueWait{}},
		{hdr("policy=ttft; queue_ms=-3"), ms(100), ms(50), queueWait{}},
		{hdr("policy=ttft; queue_ms=+Inf"), ms(100), ms(50), queueWait{}},
		{hdr("policy=ttft; queue_ms=1e300"), ms(100), ms(50), queueWait{}},
		{hdr("policy=ttft; queue_ms=10"), ms(100), 0, queueWait{}},
		{http.Header{}, ms(100), ms(50), queueWait{}},
	} {
		if got := queueWaitOf(tc.h, tc.pre, tc.preModel); got != tc.want {
			t.Errorf("%v (%v real, %v model): %+v, want %+v", tc.h, tc.pre, tc.preModel, got, tc.want)
		}
	}
}

// On a disaggregated fleet a request's hit is its prefill step's (the
// route receipt's), not the decode replica's usage, which counts the
// prompt it pulled as cached, nor the replicas' counters summed, which
// count the prompt on both steps. One system prompt shared by every
// request: the first one's prefill computes it whole (no hit), the others'
// find it.
func TestEmbeddedPDHitIsThePrefillSteps(t *testing.T) {
	reqs := generate(t, "shared_prefix", map[string]float64{"groups": 1, "prompts_per_group": 5,
		"system_prompt_len": 1024, "question_len": 64, "output_len": 4})
	e := embedded(3)
	e.Sim.Roles = []engine.Role{engine.RolePrefill, engine.RoleDecode, engine.RoleDecode}
	e.Load.Concurrency = 1 // the first request first
	res, err := RunEmbedded(context.Background(), e, "ttft", reqs)
	if err != nil {
		t.Fatal(err)
	}
	if res.Run.Errors != 0 || len(res.Records) != len(reqs) {
		t.Fatalf("%d errors, %d records of %d", res.Run.Errors, len(res.Records), len(reqs))
	}
	var cached, prompt int
	for i, rec := range res.Records {
		if rec.CachedTokens < 0 || rec.CachedTokens > rec.PromptTokens {
			t.Fatalf("record %d: %d cached of %d", i, rec.CachedTokens, rec.PromptTokens)
		}
		cached += rec.CachedTokens
		prompt += rec.PromptTokens
	}
	if first := res.Records[0]; first.CachedTokens != 0 {
		t.Errorf("the first request's prefill found %d of %d tokens cached, want none (the decode replica's usage?)",
			first.CachedTokens, first.PromptTokens)
	}
	if cached == 0 {
		t.Errorf("no request found the shared system prompt")
	}
	if want := float64(cached) / float64(prompt); res.HitRate != want || res.Run.HitRate != want {
		t.Errorf("hit rate %v (run %v), want the records' %v", res.HitRate, res.Run.HitRate, want)
	}
}
