package sim

import (
	"encoding/json"
	"maps"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/testutil"
)

// The usage of a finished request carries the engine's own times in model
// time (kvgate_sim): to its first token, to its last, the longest gap
// between two tokens, and the time scale; streamed (in the usage chunk)
// and not. With a fake clock the steps take exactly what their timers
// say, at time scale 2 half of it in wall time: the times reported are the
// steps' virtual durations. vLLM's inter-token histogram has a sample per
// token after the first.
func TestUsageTiming(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(map[bool]string{false: "non-streamed", true: "streamed"}[stream], func(t *testing.T) {
			clk := newFakeClock()
			f := startFleet(t, Config{Clock: clk, TimeScale: 2, Seed: 1})
			c := testClient(t)
			url := f.URLs()[0]
			body := `{"model":"sim-llama-8b","prompt":` + jsonString(words("tim", 500)) + `,"max_tokens":4,"ignore_eos":true`
			if stream {
				body += `,"stream":true,"stream_options":{"include_usage":true}`
			}
			done := make(chan testutil.Response, 1)
			go func() { done <- testutil.Post(t, c, url+"/v1/completions", body+"}") }()
			var steps []time.Duration // wall
			for range 4 {
				d := waitTimer(t, clk)
				steps = append(steps, d)
				clk.Advance(d)
			}
			r := <-done
			data := []byte(r.Body)
			if stream {
				evs := sseEvents(t, r.Body)
				data = []byte(evs[len(evs)-2]) // the usage chunk, before [DONE]
			}
			got, ok := ParseTiming(data)
			if !ok {
				t.Fatalf("no valid kvgate_sim in %s", data)
			}
			v := func(d time.Duration) float64 { return ms(2 * d) } // wall → model ms
			all := steps[0] + steps[1] + steps[2] + steps[3]
			want := Timing{TTFTms: v(steps[0]), E2Ems: v(all), MaxITLms: v(max(steps[1], steps[2], steps[3])), TimeScale: 2,
				WallE2Ems: ms(all)} // the fake clock stands still but for the steps
			if stream {
				want.WallTTFTms = ms(steps[0]) // written when the first step ended
			}
			if !closeTiming(got, want) {
				t.Errorf("timing %+v, want %+v", got, want)
			}
			fams := scrape(t, c, url)
			if n := histCount(fams, MetricITL); n != 3 {
				t.Errorf("%s counts %d samples, want 3 (one per token after the first)", MetricITL, n)
			}
			if sum, _ := metricValue(fams, MetricITL, nil); math.Abs(sum*1000-(want.E2Ems-want.TTFTms)) > 1e-5 {
				t.Errorf("%s sums %vs, want %vms", MetricITL, sum, want.E2Ems-want.TTFTms)
			}
		})
	}
}

func closeTiming(a, b Timing) bool {
	near := func(x, y float64) bool { return math.Abs(x-y) < 1e-5 } // ms: a few ns of halving
	return near(a.TTFTms, b.TTFTms) && near(a.E2Ems, b.E2Ems) && near(a.MaxITLms, b.MaxITLms) && a.TimeScale == b.TimeScale &&
		near(a.WallTTFTms, b.WallTTFTms) && near(a.WallE2Ems, b.WallE2Ems)
}

// A disaggregated request's times count the prefill step's: the prefill
// replica passes its engine time in kv_transfer_params, the decode replica
// adds it to its own; a value out of range is refused.
func TestUsageTimingCountsPrefill(t *testing.T) {
	f := pdFleet(t, fast())
	c := testClient(t)
	pre, dec := f.Replicas()[0], f.Replicas()[1]
	text := words("ptm", 800)
	_, raw := prefill(t, c, pre.URL(), text)
	var kv map[string]json.RawMessage
	if err := json.Unmarshal(raw, &kv); err != nil {
		t.Fatal(err)
	}
	var preMs, preWall float64
	if err := json.Unmarshal(kv[PrefillKey], &preMs); err != nil || preMs <= 0 {
		t.Fatalf("prefill answer's %s = %s, want a positive number", PrefillKey, kv[PrefillKey])
	}
	if err := json.Unmarshal(kv[PrefillWallKey], &preWall); err != nil || preWall <= 0 {
		t.Fatalf("prefill answer's %s = %s, want a positive number", PrefillWallKey, kv[PrefillWallKey])
	}
	r := testutil.Post(t, c, dec.URL()+"/v1/completions", pdDecodeBody(text, 3, false, raw))
	got, ok := ParseTiming([]byte(r.Body))
	if !ok {
		t.Fatalf("decode answer without kvgate_sim: %s", r.Body)
	}
	if !(got.TTFTms > preMs && got.E2Ems > got.TTFTms && got.WallE2Ems > preWall) {
		t.Errorf("decode timing %+v does not count the prefill step's %v ms (%v ms wall)", got, preMs, preWall)
	}
	for _, key := range []string{PrefillKey, PrefillWallKey} {
		for _, bad := range []string{`-1`, `1e300`, `"5"`} {
			kv := maps.Clone(kv)
			kv[key] = json.RawMessage(bad)
			b, _ := json.Marshal(kv)
			r := testutil.Post(t, c, dec.URL()+"/v1/completions", pdDecodeBody(text, 3, false, b))
			if r.Status != 400 || !strings.Contains(r.Body, key) {
				t.Errorf("%s = %s: status %d %s, want 400 naming it", key, bad, r.Status, r.Body)
			}
		}
	}
}

// ParseTiming takes only times a replica can report.
func TestParseTimingBounds(t *testing.T) {
	tests := []struct {
		name, data string
		ok         bool
	}{
		{"valid", `{"usage":{"kvgate_sim":{"ttft_ms":10,"e2e_ms":50,"max_itl_ms":12,"time_scale":20,"wall_ttft_ms":1,"wall_e2e_ms":3}}}`, true},
		{"wall ttft after wall e2e", `{"usage":{"kvgate_sim":{"ttft_ms":10,"e2e_ms":50,"max_itl_ms":1,"time_scale":1,"wall_ttft_ms":4,"wall_e2e_ms":3}}}`, false},
		{"negative wall", `{"usage":{"kvgate_sim":{"ttft_ms":10,"e2e_ms":50,"max_itl_ms":1,"time_scale":1,"wall_ttft_ms":-1,"wall_e2e_ms":3}}}`, false},
		{"no usage", `{"choices":[]}`, false},
		{"no timing", `{"usage":{"prompt_tokens":3}}`, false},
		{"zero ttft", `{"usage":{"kvgate_sim":{"ttft_ms":0,"e2e_ms":50,"max_itl_ms":1,"time_scale":1}}}`, false},
		{"ttft after e2e", `{"usage":{"kvgate_sim":{"ttft_ms":60,"e2e_ms":50,"max_itl_ms":1,"time_scale":1}}}`, false},
		{"negative gap", `{"usage":{"kvgate_sim":{"ttft_ms":10,"e2e_ms":50,"max_itl_ms":-1,"time_scale":1}}}`, false},
		{"gap beyond e2e", `{"usage":{"kvgate_sim":{"ttft_ms":10,"e2e_ms":50,"max_itl_ms":51,"time_scale":1}}}`, false},
		{"beyond a day", `{"usage":{"kvgate_sim":{"ttft_ms":10,"e2e_ms":1e12,"max_itl_ms":1,"time_scale":1}}}`, false},
		{"no scale", `{"usage":{"kvgate_sim":{"ttft_ms":10,"e2e_ms":50,"max_itl_ms":1}}}`, false},
		{"scale too large", `{"usage":{"kvgate_sim":{"ttft_ms":10,"e2e_ms":50,"max_itl_ms":1,"time_scale":1e9}}}`, false},
		{"not a number", `{"usage":{"kvgate_sim":{"ttft_ms":"10","e2e_ms":50,"max_itl_ms":1,"time_scale":1}}}`, false},
		{"not JSON", `{"usage":`, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, ok := ParseTiming([]byte(tc.data)); ok != tc.ok {
				t.Errorf("ParseTiming(%s) ok = %v, want %v", tc.data, ok, tc.ok)
			}
		})
	}
}
