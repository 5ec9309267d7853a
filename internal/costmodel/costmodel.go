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
//
// A profile also prices the KV-cache transfer of prefill/decode
// disaggregation (vLLM's NixlConnector: the decode instance reads the prompt's
// KV blocks from the prefill instance over RDMA): a fixed latency per transfer
// plus the bytes of the tokens moved over the link's bandwidth,
//
//	transfer = latency + tokens × kv_bytes_per_token / bandwidth
//
// and the load of KV from the engine's host (CPU) tier, an offloading
// connector's cache in host memory (vLLM's OffloadingConnector, LMCache):
// the same form over the GPU's PCIe link,
//
//	host load = host_latency + tokens × kv_bytes_per_token / host_bandwidth
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

	// KVBytesPerToken is the size of one token's KV cache, all layers:
	// 2 (K and V) × layers × KV heads × head dim × bytes per element.
	KVBytesPerToken float64 `json:"kv_bytes_per_token"`
	// TransferGBps is the bandwidth of a KV transfer between two instances,
	// in GB/s (10^9 bytes per second); 0 only with KVBytesPerToken 0.
	TransferGBps float64 `json:"transfer_gb_per_s"`
	// TransferLatencyMs is the fixed cost of one transfer (handshake,
	// posting the reads, the completion notification), ms.
	TransferLatencyMs float64 `json:"transfer_latency_ms"`
	// TransferSource says where the transfer figures come from.
	TransferSource string `json:"transfer_source,omitempty"`

	// HostGBps is the bandwidth of loading KV from the host tier into GPU
	// memory, GB/s; 0 only with KVBytesPerToken 0.
	HostGBps float64 `json:"host_gb_per_s"`
	// HostLatencyMs is the fixed cost of one load from the host tier
	// (posting the copies, their completion, the scheduler step that
	// notices it), ms.
	HostLatencyMs float64 `json:"host_latency_ms"`
	// HostSource says where the host-tier figures come from.
	HostSource string `json:"host_source,omitempty"`
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

// TransferWireMs is the time the bytes of tokens' KV take on the link:
// tokens × KVBytesPerToken / bandwidth, in ms (0 for no tokens or no bytes).
func (p Profile) TransferWireMs(tokens int) float64 {
	return p.wireMs(tokens, p.TransferGBps)
}

// wireMs is the time tokens' KV bytes take at gbps, in ms.
func (p Profile) wireMs(tokens int, gbps float64) float64 {
	if tokens <= 0 || p.KVBytesPerToken == 0 {
		return 0
	}
	return float64(tokens) * p.KVBytesPerToken / (gbps * 1e9) * 1e3
}

// HostWireMs is the time tokens' KV take on the host tier's PCIe link, ms.
func (p Profile) HostWireMs(tokens int) float64 { return p.wireMs(tokens, p.HostGBps) }

// HostLoadMs is the time of one load of tokens' KV from the host tier
// alone on its link: the per-load latency plus the wire time, ms (0 for no
// tokens).
func (p Profile) HostLoadMs(tokens int) float64 {
	if tokens <= 0 {
		return 0
	}
	return p.HostLatencyMs + p.HostWireMs(tokens)
}

// HostLatency is HostLatencyMs as a duration.
func (p Profile) HostLatency() time.Duration { return msToDuration(p.HostLatencyMs) }

// HostWireTime is HostWireMs as a duration.
func (p Profile) HostWireTime(tokens int) time.Duration { return msToDuration(p.HostWireMs(tokens)) }

// TransferMs is the time of one transfer of tokens' KV alone on the link:
// the per-transfer latency plus the wire time, ms (0 for no tokens).
func (p Profile) TransferMs(tokens int) float64 {
	if tokens <= 0 {
		return 0
	}
	return p.TransferLatencyMs + p.TransferWireMs(tokens)
}

// TransferLatency is TransferLatencyMs as a duration.
func (p Profile) TransferLatency() time.Duration { return msToDuration(p.TransferLatencyMs) }

// TransferWireTime is TransferWireMs as a duration.
func (p Profile) TransferWireTime(tokens int) time.Duration {
	return msToDuration(p.TransferWireMs(tokens))
}

// TransferTime is the duration of one transfer of tokens' KV alone on the
// link: TransferLatency + TransferWireTime (each rounded down to the
// nanosecond, as the engine adds them), 0 for no tokens.
func (p Profile) TransferTime(tokens int) time.Duration {
	if tokens <= 0 {
		return 0
	}
	return p.TransferLatency() + p.TransferWireTime(tokens)
}

// TransferBytes is the size of tokens' KV, in bytes.
func (p Profile) TransferBytes(tokens int) float64 {
	return float64(max(tokens, 0)) * p.KVBytesPerToken
}

// Validate reports a profile whose costs cannot describe an engine.
func (p Profile) Validate() error {
	if p.C0 < 0 || p.C1 <= 0 || p.C2 < 0 || p.C3 < 0 {
		return fmt.Errorf("costmodel: profile %q: c1 must be > 0 and c0, c2, c3 ≥ 0", p.Name)
	}
	if p.KVBytesPerToken < 0 || p.TransferGBps < 0 || p.TransferLatencyMs < 0 ||
		(p.KVBytesPerToken > 0 && p.TransferGBps == 0) {
		return fmt.Errorf("costmodel: profile %q: transfer costs must be ≥ 0, and bytes per token need a bandwidth > 0", p.Name)
	}
	if !(p.HostGBps >= 0 && p.HostLatencyMs >= 0) || (p.KVBytesPerToken > 0 && p.HostGBps == 0) {
		return fmt.Errorf("costmodel: profile %q: host-tier costs must be ≥ 0, and bytes per token need a host bandwidth > 0", p.Name)
	}
	return nil
}

func msToDuration(ms float64) time.Duration {
	return time.Duration(ms * float64(time.Millisecond))
}

// Default is the name of the default profile.
const Default = "llama3-8b-h100"

// Transfer defaults shared by the profiles.
const (
	// DefaultTransferGBps is one 400 Gb/s RDMA NIC (ConnectX-7, InfiniBand
	// NDR or RoCE) at line rate, 50 GB/s: a DGX/HGX H100 has one such NIC
	// per GPU for its compute fabric, and NIXL over UCX reads the KV blocks
	// one-sided from GPU memory to GPU memory (GPUDirect RDMA), close to
	// line rate for the MB-sized reads of a prompt's blocks.
	DefaultTransferGBps = 50
	// DefaultTransferLatencyMs is seed 004's "RDMA transfer 2 ms": the
	// fixed part of a transfer (NIXL's handshake is cached per remote
	// engine; this covers posting the reads, their completion and the
	// notification that frees the prefill side's blocks).
	DefaultTransferLatencyMs = 2

	// llama3KVHeads, llama3HeadDim: Llama 3's grouped-query attention, the
	// same in the 8B and 70B models (config.json: num_key_value_heads 8,
	// hidden_size / num_attention_heads = 4096/32 = 8192/64 = 128).
	llama3KVHeads = 8
	llama3HeadDim = 128
	// bf16Bytes: vLLM's default --kv-cache-dtype auto stores KV in the
	// model's activation dtype, bf16 (also for fp8-weight checkpoints
	// without fp8 KV scales).
	bf16Bytes = 2

	// DefaultHostGBps is one H100's host link as a KV offloading connector
	// uses it: PCIe Gen5 x16 carries 64 GB/s per direction in theory and
	// about 50 GB/s in pinned-memory copies; vLLM's OffloadingConnector
	// moves blocks by DMA (cudaMemcpyAsync) in 0.5–2 MB physical blocks
	// since vLLM 0.12's contiguous layout (blog.vllm.ai, 2026-01-08, "Inside
	// vLLM's new KV offloading connector"), well below the link's peak with
	// compute running beside it. 25 GB/s is the figure (#28): half
	// the copy rate, for the interference.
	DefaultHostGBps = 25
	// DefaultHostLatencyMs is the fixed part of a host load: the scheduler
	// posts it in one step (the request waits for remote KVs, as with NIXL)
	// and sees it done in a later one; about one decode step at batch 1 on
	// the 8B profile would be 10 ms, but the copy is polled every step of
	// any size, so a millisecond is taken, not measured.
	DefaultHostLatencyMs = 1
)

const hostSource = "host tier: PCIe Gen5 x16 per GPU, 25 GB/s for DMA copies of 0.5–2 MB KV blocks with compute " +
	"beside them (half the ≈50 GB/s of pinned copies; vLLM's OffloadingConnector since 0.12), 1 ms per load."

const transferSource = "per-transfer latency 2 ms (seed 004's RDMA transfer); bandwidth: one 400 Gb/s " +
	"RDMA NIC per GPU (ConnectX-7 on DGX/HGX H100) at line rate, 50 GB/s, as NIXL over UCX reads the " +
	"blocks GPU to GPU; "

var profiles = map[string]Profile{
	"llama3-8b-h100": {
		Name: "llama3-8b-h100",
		C0:   10, C1: 0.04, C2: 1e-7, C3: 3e-6,
		Source: "Llama-3-8B, bf16, one H100 80GB: ≈25k prefill tokens/s (c1) and ≈10 ms per decode " +
			"step at batch 1 (c0), orders of magnitude as reported by vLLM's and SGLang's published " +
			"serving benchmarks; c2 and c3 are small attention terms: ≈2% of an 8k-token prefill " +
			"(6.7 ms of 344 ms) and ≈13% of a decode step of 256 sequences at 4k context (3.1 ms of 23.3 ms).",
		// Meta-Llama-3-8B config.json: 32 layers, 8 KV heads of 128, bf16:
		// 2 × 32 × 8 × 128 × 2 = 131,072 B = 128 KiB per token.
		KVBytesPerToken:   2 * 32 * llama3KVHeads * llama3HeadDim * bf16Bytes,
		TransferGBps:      DefaultTransferGBps,
		TransferLatencyMs: DefaultTransferLatencyMs,
		TransferSource: transferSource + "KV: Llama-3-8B config.json, 2 (K, V) × 32 layers × 8 KV heads × " +
			"128 head dim × 2 bytes (bf16) = 131,072 B per token.",
		HostGBps:      DefaultHostGBps,
		HostLatencyMs: DefaultHostLatencyMs,
		HostSource:    hostSource,
	},
	"llama3-70b-h100-tp2": {
		Name: "llama3-70b-h100-tp2",
		C0:   20, C1: 0.08, C2: 2e-7, C3: 6e-6,
		Source: "Llama-3-70B, fp8, two H100 with tensor parallelism 2: about twice the per-token " +
			"and per-step costs of the 8B profile (≈12.5k prefill tokens/s, ≈20 ms per decode step).",
		// Meta-Llama-3-70B config.json: 80 layers, 8 KV heads of 128; KV in
		// bf16: 2 × 80 × 8 × 128 × 2 = 327,680 B = 320 KiB per token. With
		// TP 2 each GPU holds 4 of the KV heads and its worker reads its
		// half over its own NIC, in parallel: twice one NIC's bandwidth.
		KVBytesPerToken:   2 * 80 * llama3KVHeads * llama3HeadDim * bf16Bytes,
		TransferGBps:      2 * DefaultTransferGBps,
		TransferLatencyMs: DefaultTransferLatencyMs,
		TransferSource: transferSource + "two GPUs, each reading its tensor-parallel half of the KV heads " +
			"over its own NIC: 100 GB/s together. KV: Llama-3-70B config.json, 2 (K, V) × 80 layers × 8 KV " +
			"heads × 128 head dim × 2 bytes (bf16 KV; --kv-cache-dtype auto) = 327,680 B per token.",
		// Each GPU loads its tensor-parallel half over its own PCIe link.
		HostGBps:      2 * DefaultHostGBps,
		HostLatencyMs: DefaultHostLatencyMs,
		HostSource:    hostSource + " Two GPUs, each loading its half of the KV heads: 50 GB/s together.",
	},
	Seed004: {
		Name: Seed004,
		// A fixed 50 ms per step, whatever its tokens: c1 is the smallest
		// positive cost (1 ns per token: 10k tokens add 10 µs), c2 = c3 = 0.
		C0: 50, C1: 1e-6,
		Source: "seed 004's fixed costs: prefill 50 ms, RDMA transfer 2 ms, decode 100 ms per request. " +
			"Every step costs 50 ms whatever it computes (c0; c1 is 1 ns per token so that the profile " +
			"is valid), so a request alone on its replica, with max_tokens 2 and a prompt within one " +
			"step's token budget, takes 50 ms to prefill (its first token) on a prefill replica, and on " +
			"a decode replica the 2 ms transfer and then 100 ms: a step for the last prompt token (its " +
			"first token) and one decode step; a decode replica that holds the prompt's prefix skips " +
			"prefill and transfer and takes the same 100 ms. Requests that overlap share steps (continuous batching), which the seed does " +
			"not model; run one sequence per step (max_seqs 1) to keep them apart.",
		TransferLatencyMs: 2,
		TransferSource:    "seed 004: RDMA transfer 2 ms per request, whatever its size (no bytes per token).",
		HostLatencyMs:     DefaultHostLatencyMs,
		HostSource:        "seed 004 has no host tier; a host load costs the default 1 ms, whatever its size.",
	},
}

// Seed004 is the name of the profile with seed 004's fixed costs.
const Seed004 = "seed004"

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
