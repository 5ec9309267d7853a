// Package costmodel holds the latency profiles of an LLM engine: how long one
// scheduler iteration (a "step") takes for the tokens it processes, and from
// that how long a prefill of n new tokens on top of a cached context takes.
//
// The model is the usual additive one used by serving simulators (Vidur,
// DistServe's, Splitwise's): a fixed per-step overhead, a linear term in the
// tokens processed (the matmuls), a quadratic-ish attention term for prefill
// (each new token attends to the whole context), and a linear attention term
// for decodes (each decode token reads its whole KV cache):
//
//	step = c0 + c1·tokens_in_step + c2·Σ(prefill_chunk × context) + c3·Σ decode_context
//
// Both the engine model (sim, replay) and the ttft routing policy use it, so a
// policy's estimate and the simulated replica agree by construction; against a
// real engine the ttft policy corrects the estimate online.
package costmodel

import (
	"fmt"
	"sort"
	"strings"
	"time"
)

// Profile is one latency profile. Costs are in milliseconds.
type Profile struct {
	Name string `json:"name"`
	// C0 is the fixed cost of one step (scheduling, kernel launches, sampling), ms.
	C0 float64 `json:"c0_ms"`
	// C1 is the cost per token processed in a step (prefill or decode), ms/token.
	C1 float64 `json:"c1_ms_per_token"`
	// C2 is the attention cost of prefill: per (chunk token × context token), ms.
	C2 float64 `json:"c2_ms_per_token2"`
	// C3 is the attention cost of decode: per context token read by a decode, ms.
	C3 float64 `json:"c3_ms_per_ctx_token"`
	// Source says where the figures come from.
	Source string `json:"source"`
}

// Step describes the work of one scheduler iteration.
type Step struct {
	// Tokens is the number of tokens processed: prefill chunk tokens + one per decode.
	Tokens int
	// PrefillCtx is Σ over prefill chunks of chunk_tokens × context_after_chunk.
	PrefillCtx float64
	// DecodeCtx is Σ over decoding sequences of their context length.
	DecodeCtx float64
}

// StepMs is the duration of a step in milliseconds.
func (p Profile) StepMs(s Step) float64 {
	return p.C0 + p.C1*float64(s.Tokens) + p.C2*s.PrefillCtx + p.C3*s.DecodeCtx
}

// StepTime is the duration of a step.
func (p Profile) StepTime(s Step) time.Duration {
	return msToDuration(p.StepMs(s))
}

// PrefillMs estimates, in milliseconds, the time to prefill newTokens on top of
// cachedTokens already in the KV cache, alone on the replica, chunked by
// budget tokens per step (budget ≤ 0 means one chunk). The last chunk's step
// also samples the first output token, so this is the time to first token of
// a request that does not wait.
func (p Profile) PrefillMs(newTokens, cachedTokens, budget int) float64 {
	if newTokens <= 0 {
		// vLLM always recomputes at least one token (the last prompt token).
		newTokens = 1
	}
	if budget <= 0 {
		budget = newTokens
	}
	total := 0.0
	ctx := cachedTokens
	for left := newTokens; left > 0; {
		chunk := min(left, budget)
		ctx += chunk
		total += p.StepMs(Step{Tokens: chunk, PrefillCtx: float64(chunk) * float64(ctx)})
		left -= chunk
	}
	return total
}

// PrefillTime is PrefillMs as a duration.
func (p Profile) PrefillTime(newTokens, cachedTokens, budget int) time.Duration {
	return msToDuration(p.PrefillMs(newTokens, cachedTokens, budget))
}

// DecodeStepMs is the time of one decode step of a batch of n sequences with
// the given mean context length, with no prefill in the step.
func (p Profile) DecodeStepMs(n int, meanContext float64) float64 {
	return p.StepMs(Step{Tokens: n, DecodeCtx: float64(n) * meanContext})
}

// Validate reports a profile whose costs cannot describe an engine.
func (p Profile) Validate() error {
	if p.C0 < 0 || p.C1 <= 0 || p.C2 < 0 || p.C3 < 0 {
		return fmt.Errorf("costmodel: profile %q: c1 must be > 0 and c0, c2, c3 ≥ 0", p.Name)
	}
	return nil
}

func msToDuration(ms float64) time.Duration {
	return time.Duration(ms * float64(time.Millisecond))
}

// Default is the name of the default profile.
const Default = "llama3-8b-h100"

var profiles = map[string]Profile{
	"llama3-8b-h100": {
		Name: "llama3-8b-h100",
		C0:   10, C1: 0.04, C2: 1e-7, C3: 3e-6,
		Source: "Llama-3-8B, bf16, one H100 80GB: ≈25k prefill tokens/s (c1) and ≈10 ms per decode " +
			"step at batch 1 (c0), orders of magnitude as reported by vLLM's and SGLang's published " +
			"serving benchmarks; c2 and c3 are small attention terms: ≈2% of an 8k-token prefill " +
			"(6.7 ms of 344 ms) and ≈13% of a decode step of 256 sequences at 4k context (3.1 ms of 23.3 ms).",
	},
	"llama3-70b-h100-tp2": {
		Name: "llama3-70b-h100-tp2",
		C0:   20, C1: 0.08, C2: 2e-7, C3: 6e-6,
		Source: "Llama-3-70B, fp8, two H100 with tensor parallelism 2: about twice the per-token " +
			"and per-step costs of the 8B profile (≈12.5k prefill tokens/s, ≈20 ms per decode step).",
	},
}

// Lookup returns the named profile.
func Lookup(name string) (Profile, error) {
	if name == "" {
		name = Default
	}
	p, ok := profiles[name]
	if !ok {
		return Profile{}, fmt.Errorf("costmodel: unknown profile %q (known: %s)", name, strings.Join(Names(), ", "))
	}
	return p, nil
}

// MustLookup is Lookup for names known at compile time.
func MustLookup(name string) Profile {
	p, err := Lookup(name)
	if err != nil {
		panic(err)
	}
	return p
}

// Names lists the built-in profiles, sorted.
func Names() []string {
	out := make([]string, 0, len(profiles))
	for n := range profiles {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}
