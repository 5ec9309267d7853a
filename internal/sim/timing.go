package sim

import (
	"encoding/json"
	"math"
	"time"

	"github.com/kvgate/kvgate/internal/openai"
)

// The sim's account of a request's engine-side times (issue 30).
//
// A replica run faster than real time (Config.TimeScale) knows each
// request's times in model time — what the simulated GPU took — while
// everything around it (the gateway, HTTP, the load generator) runs in real
// time. A client that multiplies the wall latency it measures by the scale
// multiplies that real time too. So the sim tells the client its own part,
// per request, in the answer's usage object, under a key of its own that
// unchanged OpenAI clients ignore (vLLM's usage carries prompt_tokens,
// completion_tokens, total_tokens and prompt_tokens_details only):
//
//	"usage": {"prompt_tokens": 812, ..., "kvgate_sim": {"ttft_ms": 31.2, "e2e_ms": 1450.8, "max_itl_ms": 14.1, "time_scale": 20}}
//
// bench then counts the engine's part once in model time and the rest once
// in real time (bench.Run). The usage object is where a client already
// looks for the replica's own account of a request (cached_tokens), it is
// relayed untouched by kvgate's gateway (streamed and not), and it comes in
// the last chunk, when every time is known.
//
// A disaggregated request's prefill step is another replica's engine time:
// the prefill replica adds it to the kv_transfer_params of its answer
// (PrefillKey), which the gateway passes to the decode replica with the
// rest, and the decode replica counts it in ttft_ms and e2e_ms; likewise
// its span in real time in wall_ttft_ms and wall_e2e_ms.

// TimingKey is the usage object's key of the sim's Timing.
const TimingKey = "kvgate_sim"

// PrefillKey and PrefillWallKey are the kv_transfer_params keys by which
// a prefill replica passes its engine time (ms, model time) and its own
// span in real time (ms; Timing.WallE2Ems) to the decode replica.
const (
	PrefillKey     = "kvgate_sim_prefill_ms"
	PrefillWallKey = "kvgate_sim_prefill_wall_ms"
)

// MaxTimingMs bounds every time in a Timing and PrefillKey: a day, far
// beyond any request's timeout.
const MaxTimingMs = 24 * 60 * 60 * 1000

// Timing is one request's engine-side times, in model time (ms).
type Timing struct {
	// TTFTms is the time from the request's arrival at the engine to its
	// first token (the earliest choice's), plus the prefill step's engine
	// time for a remote prefill.
	TTFTms float64 `json:"ttft_ms"`
	// E2Ems is from the arrival to the last token of the last choice.
	E2Ems float64 `json:"e2e_ms"`
	// MaxITLms is the longest gap between two tokens of one choice.
	MaxITLms float64 `json:"max_itl_ms"`
	// TimeScale is the replica's time scale: its engine ran this many
	// times faster than real time.
	TimeScale float64 `json:"time_scale"`
	// WallTTFTms and WallE2Ems are the replica's own span in real time
	// (ms): from handing the request to its engine to writing its first
	// token (streams only; 0 otherwise), and to writing its answer's end.
	// What a client measured beyond them was spent outside the replica.
	// They contain the engine's time / TimeScale and what simulating it
	// cost on this host (a driver woken late, a handler waiting for the
	// CPU), which is neither the engine's nor the router's.
	WallTTFTms float64 `json:"wall_ttft_ms"`
	WallE2Ems  float64 `json:"wall_e2e_ms"`
}

// Valid reports whether every field of t is a time a replica can report:
// finite, 0 < ttft ≤ e2e ≤ MaxTimingMs, 0 ≤ max_itl ≤ e2e, and a time scale
// in (0, MaxTimeScale]. A client reads t from the network: it uses nothing
// that fails this.
func (t Timing) Valid() bool {
	for _, v := range []float64{t.TTFTms, t.E2Ems, t.MaxITLms, t.TimeScale, t.WallTTFTms, t.WallE2Ems} {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return false
		}
	}
	return t.TTFTms > 0 && t.TTFTms <= t.E2Ems && t.E2Ems <= MaxTimingMs && t.MaxITLms >= 0 && t.MaxITLms <= t.E2Ems &&
		t.TimeScale > 0 && t.TimeScale <= MaxTimeScale && t.WallTTFTms >= 0 && t.WallTTFTms <= t.WallE2Ems &&
		t.WallE2Ems <= MaxTimingMs
}

// ParseTiming reads the Timing of an answer's usage from a streamed
// chunk's data or a whole non-streamed answer; false when there is none or
// it is not Valid.
func ParseTiming(data []byte) (Timing, bool) {
	var a struct {
		Usage *struct {
			Timing *Timing `json:"kvgate_sim"`
		} `json:"usage"`
	}
	if json.Unmarshal(data, &a) != nil || a.Usage == nil || a.Usage.Timing == nil || !a.Usage.Timing.Valid() {
		return Timing{}, false
	}
	return *a.Usage.Timing, true
}

// usageOut is the usage object the sim writes: vLLM's fields and, once
// the call is finished, the sim's Timing.
type usageOut struct {
	openai.Usage
	Timing *Timing `json:"kvgate_sim,omitempty"`
}

// chunkOut is a streamed chunk with the sim's usage object (the outer
// Usage field hides openai.Chunk's in encoding/json).
type chunkOut struct {
	openai.Chunk
	Usage *usageOut `json:"usage,omitempty"`
}

// timing is the engine-side times of a finished call (see Timing). The
// handler calls it once every choice has finished: the driver wrote their
// times under call.mu before it woke the handler, which took call.mu since.
func (r *Replica) timing(j *job, cl *call) *Timing {
	var first, last, gap time.Duration = -1, 0, 0
	for _, c := range cl.choices {
		if c.total == 0 {
			continue
		}
		if first < 0 || c.firstAt-c.arrival < first {
			first = c.firstAt - c.arrival
		}
		last, gap = max(last, c.lastAt-c.arrival), max(gap, c.maxGap)
	}
	if first < 0 {
		return nil
	}
	pre, preWall := j.kv.prefillMs, j.kv.prefillWallMs
	t := &Timing{TTFTms: pre + ms(first), E2Ems: pre + ms(last), MaxITLms: ms(gap), TimeScale: r.scale}
	if !j.submitted.IsZero() {
		t.WallE2Ems = preWall + ms(r.clock.Now().Sub(j.submitted))
		if !j.firstOut.IsZero() {
			t.WallTTFTms = preWall + ms(j.firstOut.Sub(j.submitted))
		}
	}
	return t
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
