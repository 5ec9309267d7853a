package report

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestMakespans(t *testing.T) {
	s := time.Second
	recs := []Record{
		// program 1: from 0 to 9 s; program 2: from 2 s to 4 s, one request failed.
		{Start: 0, TTFT: s / 10, E2E: s, PromptTokens: 1000, CachedTokens: 0, OutputTokens: 5, Program: 1, Replica: 0},
		{Start: 5 * s, TTFT: s / 10, E2E: 4 * s, PromptTokens: 2000, CachedTokens: 1500, OutputTokens: 5, Program: 1, Replica: 0},
		{Start: 2 * s, TTFT: s / 10, E2E: 2 * s, PromptTokens: 500, CachedTokens: 100, OutputTokens: 5, Program: 2, Replica: 1},
		{Start: 3 * s, Err: true, Program: 2, Replica: 1},
		// batch 1: 0 to 3 s, prefill 300 + 0; batch 2: 3 to 4 s.
		{Start: 0, TTFT: s / 10, E2E: 3 * s, PromptTokens: 300, OutputTokens: 5, Batch: 1, Replica: 0},
		{Start: 0, TTFT: s / 10, E2E: s, PromptTokens: 300, CachedTokens: 300, OutputTokens: 5, Batch: 1, Replica: 0},
		{Start: 3 * s, TTFT: s / 10, E2E: s, PromptTokens: 300, CachedTokens: 200, OutputTokens: 5, Batch: 2, Replica: 1},
	}
	run := Summarize("p", recs, 2, 0)
	p, b := run.Programs, run.Batches
	if p == nil || p.Count != 2 || p.Failed != 1 || p.Makespanms.P50 != 5500 || p.Makespanms.Mean != 5500 ||
		p.PrefillTokensMean != (1000+500+400)/2.0 {
		t.Fatalf("programs %+v", p)
	}
	if b == nil || b.Count != 2 || b.Failed != 0 || b.Makespanms.Mean != 2000 || b.PrefillTokensMean != (300+100)/2.0 {
		t.Fatalf("batches %+v", b)
	}
	if none := Summarize("q", recs[:0], 1, 0); none.Programs != nil || none.Batches != nil {
		t.Fatal("no program, no batch: no makespans")
	}
	var out bytes.Buffer
	WriteTable(&out, Result{Runs: []Run{run}})
	for _, want := range []string{"program p90 s", "batch p50 s", "prefill/batch", "5.5", "8.3", "2.0", "200"} {
		if !strings.Contains(out.String(), want) {
			t.Fatalf("table lacks %q:\n%s", want, out.String())
		}
	}
}
