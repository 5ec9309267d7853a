package costmodel

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestStepAndPrefill(t *testing.T) {
	p := MustLookup(Default)
	// One step of 1,000 prefill tokens on an empty context.
	if got, want := p.StepMs(Step{Tokens: 1000, PrefillCtx: 1000 * 1000}), 10+0.04*1000+1e-7*1e6; math.Abs(got-want) > 1e-9 {
		t.Fatalf("step %v want %v", got, want)
	}
	// Prefill is chunked by the budget: 10,000 tokens in chunks of 4,096, 4,096 and 1,808.
	want := 0.0
	ctx := 500
	for _, c := range []int{4096, 4096, 1808} {
		ctx += c
		want += p.StepMs(Step{Tokens: c, PrefillCtx: float64(c) * float64(ctx)})
	}
	if got := p.PrefillMs(10000, 500, 4096); math.Abs(got-want) > 1e-9 {
		t.Fatalf("chunked prefill %v want %v", got, want)
	}
	// A cached prompt still computes one token; no budget means one chunk.
	if p.PrefillMs(0, 100, 0) != p.PrefillMs(1, 100, 0) {
		t.Fatal("zero new tokens is not one token")
	}
	if d := p.PrefillTime(1000, 0, 0); d != time.Duration(p.PrefillMs(1000, 0, 0)*float64(time.Millisecond)) {
		t.Fatalf("PrefillTime %v", d)
	}
	// Cached tokens make the prefill cheaper, more context makes it dearer.
	if p.PrefillMs(100, 0, 0) >= p.PrefillMs(4000, 0, 0) || p.PrefillMs(100, 8000, 0) <= p.PrefillMs(100, 0, 0) {
		t.Fatal("prefill time does not follow new tokens and context")
	}
	if got := p.DecodeStepMs(8, 1000); math.Abs(got-(10+0.04*8+3e-6*8000)) > 1e-9 {
		t.Fatalf("decode step %v", got)
	}
}

func TestProfiles(t *testing.T) {
	if len(Names()) != 3 || Names()[0] != "llama3-70b-h100-tp2" || Names()[2] != Seed004 {
		t.Fatalf("names %v", Names())
	}
	big, small := MustLookup("llama3-70b-h100-tp2"), MustLookup("llama3-8b-h100")
	if big.PrefillMs(8000, 0, 8192) < 1.9*small.PrefillMs(8000, 0, 8192) {
		t.Fatal("the 70B profile is not about twice the 8B's cost")
	}
	for _, n := range Names() {
		p := MustLookup(n)
		if err := p.Validate(); err != nil || p.Source == "" {
			t.Fatalf("%s: %v, source %q", n, err, p.Source)
		}
	}
	if p, err := Lookup(""); err != nil || p.Name != Default {
		t.Fatalf("default: %v %v", p.Name, err)
	}
	if _, err := Lookup("gpt-5"); err == nil || !strings.Contains(err.Error(), "llama3-8b-h100") {
		t.Fatalf("unknown profile: %v", err)
	}
	if (Profile{Name: "x", C1: 0}).Validate() == nil {
		t.Fatal("c1 = 0 accepted")
	}
}

// The transfer's cost: latency + tokens × bytes per token / bandwidth, with
// the KV sizes of the models' configs.
func TestTransfer(t *testing.T) {
	small, big := MustLookup("llama3-8b-h100"), MustLookup("llama3-70b-h100-tp2")
	if small.KVBytesPerToken != 131072 || big.KVBytesPerToken != 327680 {
		t.Fatalf("KV bytes per token %v, %v", small.KVBytesPerToken, big.KVBytesPerToken)
	}
	tests := []struct {
		p      Profile
		tokens int
		wantMs float64
	}{
		{small, 2000, 2 + 2000*131072/50e9*1e3}, // 7.24288 ms
		{small, 8000, 2 + 8000*131072/50e9*1e3}, // 22.97152 ms
		{big, 2000, 2 + 2000*327680/100e9*1e3},  // 8.5536 ms
		{big, 8000, 2 + 8000*327680/100e9*1e3},  // 28.2144 ms
		{small, 0, 0},
		{MustLookup(Seed004), 8000, 2},
	}
	for _, tc := range tests {
		got := tc.p.TransferMs(tc.tokens)
		if math.Abs(got-tc.wantMs) > 1e-9 {
			t.Errorf("%s, %d tokens: %v ms, want %v", tc.p.Name, tc.tokens, got, tc.wantMs)
		}
		if d := tc.p.TransferTime(tc.tokens); d != tc.p.TransferLatency()*time.Duration(min(tc.tokens, 1))+tc.p.TransferWireTime(tc.tokens) {
			t.Errorf("%s: TransferTime %v is not latency + wire", tc.p.Name, d)
		}
		t.Logf("%s: %d tokens, %.0f bytes: %.5f ms", tc.p.Name, tc.tokens, tc.p.TransferBytes(tc.tokens), got)
	}
	if got := small.TransferTime(8000); got != 22971520*time.Nanosecond {
		t.Errorf("8000 tokens take %v", got)
	}
	bad := []Profile{
		{Name: "no bandwidth", C1: 1, KVBytesPerToken: 1},
		{Name: "negative latency", C1: 1, TransferLatencyMs: -1},
		{Name: "negative bytes", C1: 1, KVBytesPerToken: -1, TransferGBps: 1},
	}
	for _, p := range bad {
		if p.Validate() == nil {
			t.Errorf("%s accepted", p.Name)
		}
	}
}

// Seed 004's profile: every step 50 ms whatever its tokens.
func TestSeed004(t *testing.T) {
	p := MustLookup(Seed004)
	for _, n := range []int{1, 100, 4000} {
		if got := p.PrefillMs(n, 0, 8192); math.Abs(got-50) > 0.01 {
			t.Errorf("prefill of %d tokens: %v ms, want 50", n, got)
		}
	}
	if got := p.DecodeStepMs(1, 4000); got != 50+1e-6 {
		t.Errorf("decode step %v ms", got)
	}
}

func TestHostLoad(t *testing.T) {
	p := MustLookup(Default)
	// 1,000 tokens of 128 KiB at 25 GB/s: 5.24288 ms, plus 1 ms.
	if got, want := p.HostLoadMs(1000), 1+1000*131072/25e9*1e3; math.Abs(got-want) > 1e-9 {
		t.Fatalf("host load %v want %v", got, want)
	}
	if p.HostLoadMs(0) != 0 || p.HostWireMs(-5) != 0 {
		t.Fatal("no tokens cost something")
	}
	if d := p.HostLatency() + p.HostWireTime(1000); d != time.Duration(p.HostLatencyMs*1e6)+time.Duration(p.HostWireMs(1000)*1e6) {
		t.Fatalf("durations %v", d)
	}
	// A host hit costs less than computing the same tokens, on every
	// built-in profile that has KV bytes, from one block to a long prompt.
	for _, n := range Names() {
		q := MustLookup(n)
		for _, tokens := range []int{16, 1000, 32000} {
			if load, pre := q.HostLoadMs(tokens), q.PrefillMs(tokens, 0, 8192); load >= pre {
				t.Errorf("%s: loading %d tokens takes %v ms, computing them %v", n, tokens, load, pre)
			}
		}
	}
	bad := p
	bad.HostGBps = 0
	if bad.Validate() == nil {
		t.Fatal("bytes per token without a host bandwidth validated")
	}
	bad.HostGBps, bad.HostLatencyMs = 25, -1
	if bad.Validate() == nil {
		t.Fatal("a negative host latency validated")
	}
}
