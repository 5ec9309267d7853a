package router

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// pdFlowRig is a flowRig over replicas of the given roles ("p", "d", "b"),
// whose requests go to prefill/decode pairs (SubmitPD).
type pdFlowRig struct {
	*flowRig
	pairs map[string]PD
}

func newPDFlowRig(t *testing.T, roles string, fc FlowConfig) *pdFlowRig {
	t.Helper()
	fr := newFlowRigWith(t, len(roles), fc, func(c *Config) {
		c.Replicas = nil
		for i, r := range roles {
			role := map[rune]policy.Role{'p': policy.RolePrefill, 'd': policy.RoleDecode, 'b': policy.RoleBoth}[r]
			c.Specs = append(c.Specs, Spec{URL: "http://r" + string(rune('a'+i)), Role: role})
		}
	})
	return &pdFlowRig{flowRig: fr, pairs: map[string]PD{}}
}

// submitPD sends a prefill/decode request as submit does: routed now (nil
// Waiting) or waiting; released pairs are recorded in pairs.
func (fr *pdFlowRig) submitPD(name, tenant string, prio, tokens int, mod ...func(*policy.Request)) (*Waiting, error) {
	fr.t.Helper()
	text := name + " " + strings.Repeat("abcd", tokens)
	req := fr.rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, Prompts: 1, MaxTokens: 10}, "", "")
	req.Tenant, req.Priority, req.Now = tenant, prio, fr.now
	for _, m := range mod {
		m(req)
	}
	pd, w, err := fr.rt.SubmitPD(req)
	if err != nil {
		return nil, err
	}
	if w == nil {
		fr.pairs[name] = pd
		fr.released = append(fr.released, name)
		return nil, nil
	}
	w.OnRouted = func(_ *Ticket, err error) {
		if fr.shedOut(name, err) {
			return
		}
		pd, err := w.PD()
		if err != nil || pd.Decode == nil {
			fr.t.Errorf("%s routed without its pair: %+v, %v", name, pd, err)
			return
		}
		fr.pairs[name] = pd
		fr.released = append(fr.released, name)
	}
	return w, nil
}

func (fr *pdFlowRig) mustPD(name, tenant string, prio, tokens int) *Waiting {
	fr.t.Helper()
	w, err := fr.submitPD(name, tenant, prio, tokens)
	if err != nil {
		fr.t.Fatalf("%s: %v", name, err)
	}
	return w
}

// prefilled ends name's prefill step (its answer came back), as the
// gateway does before sending the decode step.
func (fr *pdFlowRig) prefilled(name string) {
	fr.t.Helper()
	pd, ok := fr.pairs[name]
	if !ok || pd.Prefill == nil {
		fr.t.Fatalf("%s has no prefill step: %+v", name, pd)
	}
	pd.Prefill.Done(fr.now, Outcome{CachedTokens: -1, OutputTokens: 1})
}

// finish ends name's decode step with out tokens.
func (fr *pdFlowRig) finish(name string, out int) {
	fr.t.Helper()
	pd := fr.pairs[name]
	if pd.Prefill != nil {
		pd.Prefill.Done(fr.now, Outcome{CachedTokens: -1, OutputTokens: 1})
	}
	pd.Decode.FirstToken(fr.now)
	pd.Decode.Done(fr.now, Outcome{CachedTokens: -1, OutputTokens: out})
}

// A P/D request waits in its pool's queue while the prefill side is
// saturated (the decode side is not: it computes one token a request),
// and the waiting pairs leave in band order as the prefill steps end.
func TestPDFlowHoldsWhilePrefillSaturated(t *testing.T) {
	fr := newPDFlowRig(t, "pd", tightFlow())
	fr.mustPD("x", "A", 0, 100)
	if pd := fr.pairs["x"]; pd.Prefill == nil || pd.Prefill.Replica != 0 || pd.Decode.Replica != 1 {
		t.Fatalf("x: want prefill on 0, decode on 1; got %+v", pd)
	}
	for _, r := range []struct {
		name, tenant string
		prio         int
	}{{"low", "A", 2}, {"mid", "B", 1}, {"top", "B", 0}} {
		if w := fr.mustPD(r.name, r.tenant, r.prio, 100); w == nil {
			t.Fatalf("%s routed while the prefill replica is saturated", r.name)
		}
	}
	if got := fr.rt.Queued(); got != 3 {
		t.Fatalf("%d waiting, want 3", got)
	}
	for _, n := range []string{"x", "top", "mid"} {
		fr.prefilled(n)
	}
	if got, want := fr.order(), "x top mid low"; got != want {
		t.Fatalf("order %q, want %q", got, want)
	}
	for _, n := range []string{"x", "top", "mid", "low"} {
		fr.finish(n, 16)
	}
	assertIdle(t, fr.rt)
	for _, tf := range fr.rt.FlowTenants() {
		if tf.Queued != 0 || tf.Active != 0 {
			t.Fatalf("tenant %s still counted: %+v", tf.Tenant, tf)
		}
	}
}

// A pair is charged to its tenant like an aggregated request: the prompt
// its prefill replica computes plus the output expected, corrected by the
// output the decode step produced.
func TestPDFlowChargesThePrefillWork(t *testing.T) {
	fr := newPDFlowRig(t, "pd", FlowConfig{})
	fr.mustPD("x", "A", 0, 100)
	pd := fr.pairs["x"]
	served := func() float64 {
		for _, tf := range fr.rt.FlowTenants() {
			if tf.Tenant == "A" {
				return tf.Served
			}
		}
		return -1
	}
	want := float64(pd.Prefill.UncachedTokens()) + 10 // max_tokens 10: the output expected
	if pd.Prefill.UncachedTokens() < 100 || served() != want {
		t.Fatalf("served %g, want %g (prefill's %d uncached + 10)", served(), want, pd.Prefill.UncachedTokens())
	}
	fr.finish("x", 4)
	if got := served(); got != want-6 {
		t.Fatalf("after 4 output tokens: served %g, want %g", got, want-6)
	}
	assertIdle(t, fr.rt)
}

// A sheddable band's pair is refused at once while the prefill side is
// saturated; a pair whose estimate passes its deadline is shed; the decode
// step of a request already prefilled is never held.
func TestPDFlowShedsAndNeverHoldsADecodeStep(t *testing.T) {
	fc := tightFlow()
	fc.Bands = []Band{{Priority: 3, Sheddable: true}}
	fr := newPDFlowRig(t, "pdd", fc)
	fr.mustPD("x", "A", 0, 100)
	var se *ShedError
	if _, err := fr.submitPD("flood", "S", 3, 100); !errors.As(err, &se) || se.Reason != ShedSaturated {
		t.Fatalf("sheddable pair while saturated: %v, want shed %q", err, ShedSaturated)
	}
	w := fr.mustPD("gold", "G", 0, 100)
	if w == nil {
		t.Fatal("gold routed while the prefill replica is saturated")
	}
	tk, err := fr.rt.RouteDecode(fr.pairs["x"].Decode.Request(), 0, fr.pairs["x"].Decode.Replica)
	if err != nil || tk.Replica != 2 {
		t.Fatalf("decode step again while the queue holds gold: %v, replica %v", err, tk)
	}
	tk.Done(fr.now, Outcome{CachedTokens: -1})
	fr.prefilled("x")
	if got := fr.order(); got != "x gold" {
		t.Fatalf("order %q, want x gold", got)
	}
	fr.est = time.Second
	late := func(r *policy.Request) { r.Deadline = fr.now.Add(100 * time.Millisecond) }
	fr.prefilled("gold")
	if _, err := fr.submitPD("late", "G", 0, 100, late); !errors.As(err, &se) || se.Reason != ShedDeadline {
		t.Fatalf("a pair estimated past its deadline: %v, want shed %q", err, ShedDeadline)
	}
	fr.finish("x", 1)
	fr.finish("gold", 1)
	assertIdle(t, fr.rt)
}

// A held pair whose client leaves (Cancel) or whose wait ends (Expire)
// leaves nothing behind; with no prefill replica the decode side computes
// the prompt and is the side gated.
func TestPDFlowCancelExpireAndDecodeOnly(t *testing.T) {
	fr := newPDFlowRig(t, "d", tightFlow())
	fr.mustPD("x", "A", 0, 100)
	if pd := fr.pairs["x"]; pd.Prefill != nil || SkipReason(pd.Decision) != SkipNoPrefill {
		t.Fatalf("x: want the decode replica alone, got %+v", pd.Decision)
	}
	a := fr.mustPD("a", "A", 0, 100)
	b := fr.mustPD("b", "B", 0, 100)
	if a == nil || b == nil {
		t.Fatal("routed while the only replica computing prompts is saturated")
	}
	if !fr.rt.Cancel(a) {
		t.Fatal("a was not waiting")
	}
	if err := fr.rt.Expire(b); !errors.Is(err, ErrShed) {
		t.Fatalf("expired b: %v", err)
	}
	fr.finish("x", 1)
	if fr.rt.Queued() != 0 || fr.order() != "x" {
		t.Fatalf("%d waiting, released %q", fr.rt.Queued(), fr.order())
	}
	assertIdle(t, fr.rt)
	for _, tf := range fr.rt.FlowTenants() {
		if tf.Queued != 0 || tf.Active != 0 {
			t.Fatalf("tenant %s still counted: %+v", tf.Tenant, tf)
		}
	}
}

// A pair that skips its prefill step by the threshold has its decode
// replica compute what it lacks: it waits while that replica is saturated,
// though the prefill replica is idle.
func TestPDFlowThresholdSkipWaitsForItsDecodeReplica(t *testing.T) {
	fr := newFlowRigWith(t, 2, tightFlow(), func(c *Config) {
		c.Replicas, c.NonCachedTokens = nil, 1000
		c.Specs = []Spec{{URL: "http://p", Role: policy.RolePrefill}, {URL: "http://d", Role: policy.RoleDecode}}
	})
	pr := &pdFlowRig{flowRig: fr, pairs: map[string]PD{}}
	pr.mustPD("x", "A", 0, 100)
	if pd := pr.pairs["x"]; pd.Prefill != nil || SkipReason(pd.Decision) != SkipThreshold {
		t.Fatalf("x: want a threshold skip, got %+v", pd.Decision)
	}
	if w := pr.mustPD("y", "A", 0, 100); w == nil {
		t.Fatal("y routed while its decode replica computes x's prompt")
	}
	pr.pairs["x"].Decode.FirstToken(fr.now)
	if got := fr.order(); got != "x y" {
		t.Fatalf("order %q, want x y", got)
	}
	pr.finish("x", 1)
	pr.finish("y", 1)
	assertIdle(t, fr.rt)
}

// BenchmarkSubmitPD times a pair's decision as the gateway asks for it
// (SubmitPD, then both tickets' end) with flow control off (RoutePD) and
// on (the queue, the gate on the prefill side, the tenant's charge), in
// one run, over BenchmarkDecisionPD's 2P6D fleet and prompt.
func BenchmarkSubmitPD(b *testing.B) {
	for _, on := range []bool{false, true} {
		b.Run(map[bool]string{false: "off", true: "on"}[on], func(b *testing.B) {
			rt := newPDRouter(b, mustPolicy(b, "ttft"), "ppdddddd", Config{Flow: FlowConfig{Enabled: on}})
			text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 32000/45+1)[:32000]
			req := rt.Prepare(parse(b, text), "", "")
			_ = rt.Index().Insert(0, req.Blocks[:300])
			_ = rt.Index().Insert(2, req.Blocks[:100])
			req.Tenant = "t"
			at := time.Unix(0, 0)
			for b.Loop() {
				pd, w, err := rt.SubmitPD(req)
				if err != nil || w != nil {
					b.Fatal(err, w)
				}
				endPD(pd, at)
			}
		})
	}
}
