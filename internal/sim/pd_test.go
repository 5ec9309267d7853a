package sim

import (
	"encoding/json"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/costmodel"
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/testutil"
)

// prefillParams are what the proxy sends a prefill replica (vLLM's toy
// proxy: stream false, max_tokens 1).
const prefillParams = `"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,` +
	`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`

// kvOut is a prefill replica's kv_transfer_params.
type kvOut struct {
	DoRemotePrefill bool    `json:"do_remote_prefill"`
	DoRemoteDecode  bool    `json:"do_remote_decode"`
	RemoteBlockIDs  []int64 `json:"remote_block_ids"`
	RemoteEngineID  string  `json:"remote_engine_id"`
	RemoteRequestID string  `json:"remote_request_id"`
	RemoteHost      string  `json:"remote_host"`
	RemotePort      int     `json:"remote_port"`
	TPSize          int     `json:"tp_size"`
}

// pdFleet starts replica 0 as a prefill replica and replica 1 as a decode one.
func pdFleet(t *testing.T, cfg Config) *Fleet {
	t.Helper()
	cfg.Replicas = 2
	cfg.Roles = []engine.Role{engine.RolePrefill, engine.RoleDecode}
	return startFleet(t, cfg)
}

// prefill sends the proxy's first step and returns the answer's raw
// kv_transfer_params.
func prefill(t *testing.T, c *http.Client, url, text string) (completion, json.RawMessage) {
	t.Helper()
	r := testutil.Post(t, c, url+"/v1/completions",
		`{"model":"sim-llama-8b","prompt":`+jsonString(text)+`,"max_tokens":1,"stream":false,`+prefillParams+`}`)
	var raw struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	got := decodeCompletion(t, r)
	if err := json.Unmarshal([]byte(r.Body), &raw); err != nil || len(raw.KV) == 0 {
		t.Fatalf("prefill answer without kv_transfer_params: %s", r.Body)
	}
	return got, raw.KV
}

// pdDecodeBody is the proxy's second step: the original request with the
// prefill side's parameters.
func pdDecodeBody(text string, maxTokens int, stream bool, kv json.RawMessage) string {
	return `{"model":"sim-llama-8b","prompt":` + jsonString(text) + `,"max_tokens":` + strconv.Itoa(maxTokens) +
		`,"ignore_eos":true,"stream":` + strconv.FormatBool(stream) + `,"kv_transfer_params":` + string(kv) + `}`
}

// The protocol end to end: the prefill replica holds the prompt's blocks
// and names them; the decode replica pulls them (streamed or not), reports
// vLLM's cached_tokens (prompt − 1), tells the prefill side to release,
// and a follow-up turn pulls only the new part.
func TestPrefillDecodeProtocol(t *testing.T) {
	f := pdFleet(t, fast())
	c := testClient(t)
	pre, dec := f.Replicas()[0], f.Replicas()[1]
	text := words("pdt", 1000)
	got, raw := prefill(t, c, pre.URL(), text)
	var kv kvOut
	if err := json.Unmarshal(raw, &kv); err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(strings.TrimPrefix(pre.URL(), "http://"))
	if !kv.DoRemotePrefill || kv.DoRemoteDecode || len(kv.RemoteBlockIDs) != 63 || kv.RemoteHost != "127.0.0.1" ||
		strconv.Itoa(kv.RemotePort) != port || kv.RemoteEngineID != "kvgate-sim@127.0.0.1:"+port ||
		kv.RemoteRequestID == "" || kv.TPSize != 1 {
		t.Fatalf("kv_transfer_params %s", raw)
	}
	if got.Usage.CompletionTokens != 1 || got.Choices[0].FinishReason != "length" {
		t.Fatalf("prefill answer %+v", got)
	}
	if st := pre.EngineStats(0); st.Held != 1 || st.KVUsage == 0 {
		t.Fatalf("prefill side holds nothing: %+v", st)
	}
	for i, stream := range []bool{false, true} {
		if stream { // a second prefill for the streamed variant
			_, raw = prefill(t, c, pre.URL(), text)
		}
		r := testutil.Post(t, c, dec.URL()+"/v1/completions", pdDecodeBody(text, 5, stream, raw))
		if r.Status != http.StatusOK || r.Header.Get(HeaderKVPull) != "pulled" {
			t.Fatalf("decode: %d %q %s", r.Status, r.Header.Get(HeaderKVPull), r.Body)
		}
		if !stream {
			d := decodeCompletion(t, r)
			if d.Usage.PromptTokensDetails.CachedTokens != 999 || d.Usage.CompletionTokens != 5 ||
				!strings.Contains(r.Body, `"kv_transfer_params":null`) {
				t.Errorf("decode answer %s", r.Body)
			}
		} else if ev := sseEvents(t, r.Body); ev[len(ev)-1] != "[DONE]" || len(ev) != 6 {
			t.Errorf("stream %q", ev)
		}
		testutil.Eventually(t, 10*time.Second, "the prefill side's release", func() bool {
			return pre.EngineStats(0).HoldsReleased == int64(i+1)
		})
	}
	if st := pre.EngineStats(0); st.Held != 0 || st.KVUsage != 0 {
		t.Errorf("prefill side after the releases: %+v", st)
	}
	st := dec.EngineStats(0)
	// The second decode of the same prompt found 62 of its blocks cached
	// (the first one's pull) and pulled the rest: 1000 − 992 tokens.
	if st.Transfers != 2 || st.TransferTokens != 1000+8 || st.PromptLocalHit != 992 || st.PrefixHits != 992 {
		t.Errorf("decode side: %+v", st)
	}
	fams := scrape(t, c, dec.URL())
	if n := histCount(fams, MetricNixlBytes); n != 2 {
		t.Errorf("%d transfers in %s", n, MetricNixlBytes)
	}
	if b, _ := metricValue(fams, MetricNixlBytes, nil); b != 1008*131072 {
		t.Errorf("bytes %v, want %v", b, 1008*131072)
	}
	if ext, _ := metricValue(fams, MetricPromptBySource, map[string]string{"source": "external_kv_transfer"}); ext != 1008 {
		t.Errorf("external_kv_transfer tokens %v", ext)
	}
	if h, _ := metricValue(fams, MetricExternalHits, nil); h != 1008 {
		t.Errorf("external hits %v", h)
	}
}

// The transfer is part of the decode request's TTFT, exactly: the
// profile's transfer time, then one step for the last prompt token.
func TestPullTimeInTTFT(t *testing.T) {
	clk := newFakeClock()
	f := pdFleet(t, Config{Clock: clk, Seed: 1})
	c := testClient(t)
	pre, dec := f.Replicas()[0], f.Replicas()[1]
	prof := costmodel.MustLookup(costmodel.Default)
	const n = 2000
	text := words("ttf", n)
	done := make(chan testutil.Response, 1)
	go func() {
		done <- testutil.Post(t, c, pre.URL()+"/v1/completions",
			`{"model":"sim-llama-8b","prompt":`+jsonString(text)+`,"max_tokens":1,`+prefillParams+`}`)
	}()
	clk.Advance(waitTimer(t, clk))
	r := <-done
	var raw struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	decodeCompletion(t, r)
	if err := json.Unmarshal([]byte(r.Body), &raw); err != nil {
		t.Fatal(err)
	}
	// The prefill replica's hold (480 s) is armed beside the decode's timer.
	hold := waitTimer(t, clk)
	if hold != engine.DefaultKVHoldTimeout {
		t.Fatalf("hold timer %v", hold)
	}
	go func() { done <- testutil.Post(t, c, dec.URL()+"/v1/completions", pdDecodeBody(text, 1, false, raw.KV)) }()
	if got := secondTimer(t, clk); got != prof.TransferTime(n) {
		t.Fatalf("the decode replica waits %v, want the transfer's %v", got, prof.TransferTime(n))
	}
	clk.Advance(prof.TransferTime(n))
	// The transfer's end releases the prefill side's hold (and its timer).
	testutil.Eventually(t, 10*time.Second, "the release", func() bool { return pre.EngineStats(0).Held == 0 })
	step := prof.StepTime(costmodel.Step{Tokens: 1, PrefillCtx: n})
	if got := waitTimer(t, clk); got != step {
		t.Fatalf("then a step of %v, want %v", got, step)
	}
	clk.Advance(step)
	d := decodeCompletion(t, <-done)
	if d.Usage.PromptTokensDetails.CachedTokens != n-1 {
		t.Errorf("cached %d", d.Usage.PromptTokensDetails.CachedTokens)
	}
	ttft, _ := metricValue(scrape(t, c, dec.URL()), MetricTTFT, nil)
	if want := (prof.TransferTime(n) + step).Seconds(); ttft < want-1e-9 || ttft > want+1e-9 {
		t.Errorf("TTFT %.9f s, want %.9f s", ttft, want)
	}
	if st := pre.EngineStats(0); st.HoldsReleased != 1 {
		t.Errorf("prefill side %+v", st)
	}
}

// secondTimer waits until the fake clock has two armed timers (the
// prefill replica's hold and the decode replica's) and returns the nearer.
func secondTimer(t *testing.T, clk *clock.Fake) time.Duration {
	t.Helper()
	var p []time.Duration
	testutil.Eventually(t, 10*time.Second, "two armed timers", func() bool {
		p = clk.Pending()
		return len(p) == 2
	})
	return p[0]
}

// A decode replica that cannot read the prefill side computes the prompt
// itself: unreachable, unknown request, released or expired hold.
func TestPullFallsBackToRecompute(t *testing.T) {
	cfg := fast()
	cfg.KVHoldTimeout = time.Millisecond // virtual: a microsecond of wall time
	f := pdFleet(t, cfg)
	c := testClient(t)
	pre, dec := f.Replicas()[0], f.Replicas()[1]
	text := words("fbk", 300)
	_, expired := prefill(t, c, pre.URL(), text)
	testutil.Eventually(t, 10*time.Second, "the hold's expiry", func() bool {
		return pre.EngineStats(0).HoldsExpired == 1
	})
	var kv map[string]any
	_ = json.Unmarshal(expired, &kv)
	kv["remote_request_id"] = "kvsim-999"
	unknown, _ := json.Marshal(kv)
	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	kv["remote_port"] = ln.Addr().(*net.TCPAddr).Port
	_ = ln.Close()
	closed, _ := json.Marshal(kv)
	for i, tc := range []struct {
		name string
		kv   json.RawMessage
		want string
	}{{"expired", expired, "404"}, {"unknown request", unknown, "404"}, {"unreachable", closed, "connection refused"}} {
		t.Run(tc.name, func(t *testing.T) {
			r := testutil.Post(t, c, dec.URL()+"/v1/completions", pdDecodeBody(text, 2, false, tc.kv))
			h := r.Header.Get(HeaderKVPull)
			if !strings.HasPrefix(h, "recomputed: ") || !strings.Contains(h, tc.want) {
				t.Errorf("header %q, want a recompute for %q", h, tc.want)
			}
			if d := decodeCompletion(t, r); d.Usage.PromptTokensDetails.CachedTokens != 0 && i == 0 {
				t.Errorf("cached %d on a cold decode replica", d.Usage.PromptTokensDetails.CachedTokens)
			}
			if v, _ := metricValue(scrape(t, c, dec.URL()), MetricNixlFailedTransfers, nil); v != float64(i+1) {
				t.Errorf("failed transfers %v", v)
			}
		})
	}
	if st := dec.EngineStats(0); st.Transfers != 0 || st.PromptComputed == 0 {
		t.Errorf("decode side %+v", st)
	}
}

// Bad kv_transfer_params are 400s in OpenAI's shape naming the field, and
// a transfer sent to the wrong role is refused.
func TestKVTransferParamsErrors(t *testing.T) {
	f := pdFleet(t, fast())
	c := testClient(t)
	pre, dec := f.Replicas()[0].URL(), f.Replicas()[1].URL()
	body := func(kv string, extra ...string) string {
		return `{"model":"sim-llama-8b","prompt":"hello there","max_tokens":1` + strings.Join(extra, "") +
			`,"kv_transfer_params":` + kv + `}`
	}
	good := `"remote_engine_id":"e","remote_request_id":"kvsim-1","remote_host":"127.0.0.1","remote_port":1,"remote_block_ids":[0]`
	pull := func(s string) string { return `{"do_remote_prefill":true,` + s + `}` }
	tests := []struct {
		name, url, body, param string
	}{
		{"not an object", pre, body(`[1]`), "kv_transfer_params"},
		{"flag a string", pre, body(`{"do_remote_decode":"yes"}`), "kv_transfer_params.do_remote_decode"},
		{"both flags", pre, body(`{"do_remote_decode":true,"do_remote_prefill":true}`), "kv_transfer_params"},
		{"port 0", dec, body(pull(strings.Replace(good, `"remote_port":1`, `"remote_port":0`, 1))), "kv_transfer_params.remote_port"},
		{"port a string", dec, body(pull(strings.Replace(good, `"remote_port":1`, `"remote_port":"1"`, 1))), "kv_transfer_params.remote_port"},
		{"negative block", dec, body(pull(strings.Replace(good, `[0]`, `[-1]`, 1))), "kv_transfer_params.remote_block_ids"},
		{"block ids strings", dec, body(pull(strings.Replace(good, `[0]`, `["0"]`, 1))), "kv_transfer_params.remote_block_ids"},
		{"no blocks", dec, body(pull(strings.Replace(good, `[0]`, `[]`, 1))), "kv_transfer_params.remote_block_ids"},
		{"no engine id", dec, body(pull(strings.Replace(good, `"remote_engine_id":"e",`, ``, 1))), "kv_transfer_params.remote_engine_id"},
		{"no request id", dec, body(pull(strings.Replace(good, `"remote_request_id":"kvsim-1",`, ``, 1))), "kv_transfer_params.remote_request_id"},
		{"host a number", dec, body(pull(strings.Replace(good, `"127.0.0.1"`, `127`, 1))), "kv_transfer_params.remote_host"},
		{"tp_size 0", dec, body(pull(good + `,"tp_size":0`)), "kv_transfer_params.tp_size"},
		{"remote decode streamed", pre, body(`{"do_remote_decode":true}`, `,"stream":true`), "stream"},
		{"remote decode n 2", pre, body(`{"do_remote_decode":true}`, `,"n":2`), "kv_transfer_params"},
		{"remote decode to a decode replica", dec, body(`{"do_remote_decode":true}`), "kv_transfer_params"},
		{"remote prefill to a prefill replica", pre, body(pull(good)), "kv_transfer_params"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := testutil.Post(t, c, tc.url+"/v1/completions", tc.body)
			var e struct {
				Error struct {
					Type, Message string
					Param         *string
				}
			}
			if err := json.Unmarshal([]byte(r.Body), &e); err != nil || r.Status != 400 ||
				e.Error.Type != "invalid_request_error" || e.Error.Param == nil || *e.Error.Param != tc.param {
				t.Errorf("%d %s, want 400 naming %s", r.Status, r.Body, tc.param)
			}
		})
	}
	// Plain requests are served by every role; unknown keys and nulls pass.
	for _, url := range []string{pre, dec} {
		decodeCompletion(t, testutil.Post(t, c, url+"/v1/completions", body(`{"x":1,"do_remote_decode":null}`)))
		decodeCompletion(t, testutil.Post(t, c, url+"/v1/completions", `{"model":"sim-llama-8b","prompt":"hi","max_tokens":2}`))
	}
}

// The side channel answers 404 for what it does not hold, 409 for other
// block ids, 400 for a body it cannot read.
func TestSideChannel(t *testing.T) {
	f := pdFleet(t, fast())
	c := testClient(t)
	pre := f.Replicas()[0]
	_, raw := prefill(t, c, pre.URL(), words("sid", 40))
	var kv kvOut
	_ = json.Unmarshal(raw, &kv)
	read := func(q kvReadRequest) int {
		b, _ := json.Marshal(q)
		return testutil.Post(t, c, pre.URL()+PathKVRead, string(b)).Status
	}
	ok := kvReadRequest{EngineID: kv.RemoteEngineID, RequestID: kv.RemoteRequestID, BlockIDs: kv.RemoteBlockIDs}
	if s := read(ok); s != 200 {
		t.Errorf("read: %d", s)
	}
	for _, tc := range []struct {
		q    kvReadRequest
		want int
	}{
		{kvReadRequest{EngineID: "other", RequestID: kv.RemoteRequestID}, 404},
		{kvReadRequest{EngineID: kv.RemoteEngineID, RequestID: "cmpl-1"}, 404},
		{kvReadRequest{EngineID: kv.RemoteEngineID, RequestID: kv.RemoteRequestID, BlockIDs: []int64{7}}, 409},
	} {
		if s := read(tc.q); s != tc.want {
			t.Errorf("%+v: %d, want %d", tc.q, s, tc.want)
		}
	}
	if s := testutil.Post(t, c, pre.URL()+PathKVRead, `{"engine_id":1}`).Status; s != 400 {
		t.Errorf("bad body: %d", s)
	}
	rel := func() int {
		b, _ := json.Marshal(kvReadRequest{EngineID: kv.RemoteEngineID, RequestID: kv.RemoteRequestID})
		return testutil.Post(t, c, pre.URL()+PathKVRelease, string(b)).Status
	}
	if a, b := rel(), rel(); a != 200 || b != 404 {
		t.Errorf("release twice: %d then %d", a, b)
	}
	if s := read(ok); s != 404 {
		t.Errorf("read after the release: %d", s)
	}
}

func TestRoleConfig(t *testing.T) {
	for _, cfg := range []Config{
		{Replicas: 1, Roles: []engine.Role{engine.RolePrefill, engine.RoleDecode}},
		{Replicas: 1, Role: 9},
		{Replicas: 1, KVHoldTimeout: -time.Second},
	} {
		if _, err := Start(t.Context(), cfg); err == nil {
			t.Errorf("%+v accepted", cfg)
		}
	}
	f := startFleet(t, Config{Replicas: 3, Role: engine.RoleDecode, Roles: []engine.Role{engine.RolePrefill}})
	for i, want := range []engine.Role{engine.RolePrefill, engine.RoleDecode, engine.RoleDecode} {
		if got := f.Replicas()[i].Config().Role; got != want {
			t.Errorf("replica %d: %v, want %v", i, got, want)
		}
	}
}
