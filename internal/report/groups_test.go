package report

import (
	"strings"
	"testing"
	"time"
)

// A run whose records name tenants or priorities is summarised per tenant
// and per band, its failures by kind; one that names none has no groups.
func TestGroups(t *testing.T) {
	ms := time.Millisecond
	recs := []Record{
		{Start: 0, TTFT: 10 * ms, E2E: 100 * ms, PromptTokens: 100, CachedTokens: 50, OutputTokens: 10, Tenant: "A"},
		{Start: 0, TTFT: 30 * ms, E2E: 300 * ms, PromptTokens: 100, OutputTokens: 10, Tenant: "A", Priority: 1},
		{Start: 0, Err: true, ErrKind: "shed_ttl", Tenant: "B", Priority: 1},
	}
	run := Summarize("p", recs, 1, time.Second)
	a, b := run.Tenants["A"], run.Tenants["B"]
	if a.Requests != 2 || a.Errors != 0 || a.TTFTms.P50 != 20 || a.HitRate != 0.25 || a.OutputTokensPerS != 20 {
		t.Fatalf("A: %+v", a)
	}
	if b.Requests != 1 || b.ErrKinds["shed_ttl"] != 1 {
		t.Fatalf("B: %+v", b)
	}
	if run.Priorities["0"].Requests != 1 || run.Priorities["1"].Requests != 2 {
		t.Fatalf("priorities %+v", run.Priorities)
	}
	if plain := Summarize("p", []Record{{TTFT: ms, E2E: ms}}, 1, 0); plain.Tenants != nil || plain.Priorities != nil {
		t.Fatal("groups without tenants")
	}
	var out strings.Builder
	WriteTable(&out, Result{Runs: []Run{run}})
	for _, want := range []string{"p tenant A: 2 requests, ttft p50 20.0", "p tenant B: 1 requests", "errors 1 (shed_ttl 1)",
		"p priority 0: 1 requests", "p priority 1: 2 requests"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the table lacks %q:\n%s", want, out.String())
		}
	}
}
