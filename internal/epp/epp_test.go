package epp

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strings"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/epp/standin"
	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/testutil"
)

var modes = []struct {
	name string
	mode standin.Mode
}{{"full_duplex_streamed", standin.FullDuplex}, {"buffered", standin.Buffered}}

// Through the Envoy stand-in in both body modes, streamed and not, a chat
// is answered by the replica the picker chose, whole, and its ticket
// settles exactly as kvgate serve settles it: served, with the usage the
// replica reported (prompt and cached tokens), the first token of a
// streamed answer (TTFT), and nothing left in flight.
func TestStandInBodyModes(t *testing.T) {
	fl := startSims(t, 2)
	for _, m := range modes {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", m.name, stream), func(t *testing.T) {
				r := startRig(t, gatewayConfig(fl, "ttft"), fl, standin.Config{RequestMode: m.mode, ResponseMode: m.mode,
					MessageTimeout: time.Minute})
				resp := post(t, r.front.URL, chat("You are terse.", "Say something about caches.", stream, 7))
				if resp.Status != http.StatusOK || resp.Header.Get("X-Kvgate-Replica") == "" {
					t.Fatalf("status %d, replica %q: %s", resp.Status, resp.Header.Get("X-Kvgate-Replica"), resp.Body)
				}
				checkAnswer(t, resp, stream, 7)
				testutil.Eventually(t, 10*time.Second, "the ticket settled", func() bool {
					return counter(t, r.reg, "kvgate_attempts_total", map[string]string{"verdict": "served"}) == 1
				})
				if got := counter(t, r.reg, "kvgate_replica_prompt_tokens_total", nil); got <= 0 {
					t.Errorf("prompt tokens counted %v: the usage was not read", got)
				}
				if got := counter(t, r.reg, "kvgate_time_to_first_token_seconds", nil); stream && got != 1 {
					t.Errorf("TTFT observations %v, want 1 for a streamed answer", got)
				}
				for i := range r.g.Router().Replicas() {
					if n := r.g.Router().InFlight(i); n != 0 {
						t.Errorf("replica %d: %d requests still in flight", i, n)
					}
				}
				if r.proxy.Stats.Picked.Load() != 1 {
					t.Errorf("the stand-in did not route by the picker: %+v", r.proxy.Stats.Picked.Load())
				}
			})
		}
	}
}

// checkAnswer checks a chat answer of n tokens: SSE chunks ending in
// [DONE], or one JSON body with its usage.
func checkAnswer(t *testing.T, resp testutil.Response, stream bool, n int) {
	t.Helper()
	if stream {
		if !strings.Contains(resp.Body, "data: [DONE]") || strings.Count(resp.Body, `"delta"`) < n {
			t.Fatalf("streamed answer cut: %q", resp.Body)
		}
		return
	}
	var body struct {
		Usage openai.Usage `json:"usage"`
	}
	if err := json.Unmarshal([]byte(resp.Body), &body); err != nil || body.Usage.CompletionTokens != n {
		t.Fatalf("answer %q: %v", resp.Body, err)
	}
}

// Conversations stick to a replica and distinct ones spread, through the
// picker as through kvgate serve on the same replicas: every turn of a
// conversation extends the last one's prompt, and lands where it did.
func TestStickinessAndSpread(t *testing.T) {
	fronts := map[string]func(t *testing.T) string{
		"serve": func(t *testing.T) string {
			fl := startSims(t, 4)
			cfg := gatewayConfig(fl, "ttft")
			g, _ := startGateway(t, cfg)
			srv := httpServer(t, g.Handler())
			return srv
		},
		"epp": func(t *testing.T) string {
			fl := startSims(t, 4)
			return startRig(t, gatewayConfig(fl, "ttft"), fl, standin.Config{MessageTimeout: time.Minute}).front.URL
		},
	}
	for name, start := range fronts {
		t.Run(name, func(t *testing.T) {
			url := start(t)
			used := map[string]bool{}
			for c := range 8 {
				system := fmt.Sprintf("Conversation %d. %s", c, strings.Repeat(fmt.Sprintf("context %d ", c), 120))
				first, history := "", "Hello."
				for turn := range 3 {
					resp := post(t, url, chat(system, history, turn%2 == 1, 4))
					if resp.Status != http.StatusOK {
						t.Fatalf("conversation %d turn %d: %d %s", c, turn, resp.Status, resp.Body)
					}
					rep := resp.Header.Get("X-Kvgate-Replica")
					if turn == 0 {
						first = rep
					} else if rep != first {
						t.Errorf("conversation %d turn %d went to %s, its first turn to %s", c, turn, rep, first)
					}
					history += " And then, turn " + fmt.Sprint(turn) + "."
				}
				used[first] = true
			}
			if len(used) < 2 {
				t.Errorf("8 conversations on %d replica(s) of 4: no spread", len(used))
			}
		})
	}
}

// The gateway's own answers reach the client as local replies: an unknown
// model (404), a subset hint naming no replica (503), a path it does not
// serve (404).
func TestLocalReplies(t *testing.T) {
	fl := startSims(t, 2)
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			r := startRig(t, gatewayConfig(fl, "ttft"), fl, standin.Config{RequestMode: m.mode, ResponseMode: m.mode,
				MessageTimeout: time.Minute, Subset: func(req *http.Request) []string {
					if req.Header.Get("X-Test-Subset") == "" {
						return nil
					}
					return strings.Split(req.Header.Get("X-Test-Subset"), ",")
				}})
			resp := testutil.Post(t, nil, r.front.URL+"/v1/chat/completions", strings.Replace(chat("s", "u", false, 2),
				`"sim-llama-8b"`, `"gpt-9"`, 1))
			if resp.Status != http.StatusNotFound || !strings.Contains(resp.Body, "model_not_found") {
				t.Fatalf("unknown model: %d %s", resp.Status, resp.Body)
			}
			resp = testutil.Post(t, nil, r.front.URL+"/v1/chat/completions", chat("s", "u", false, 2), "X-Test-Subset", "10.9.9.9:1")
			if resp.Status != http.StatusServiceUnavailable {
				t.Fatalf("subset of no replica: %d %s", resp.Status, resp.Body)
			}
			resp = testutil.Post(t, nil, r.front.URL+"/reset_prefix_cache", "{}")
			if resp.Status != http.StatusNotFound {
				t.Fatalf("a path outside the allow-list: %d %s", resp.Status, resp.Body)
			}
			if r.proxy.Stats.Local.Load() != 3 {
				t.Fatalf("%d local replies, want 3", r.proxy.Stats.Local.Load())
			}
		})
	}
}

// A subset hint restricts the pick: every request goes to the one
// endpoint the proxy allows, whatever the policy prefers.
func TestSubsetHint(t *testing.T) {
	fl := startSims(t, 3)
	only, err := gateway.Endpoint(fl.URLs()[2])
	if err != nil {
		t.Fatal(err)
	}
	r := startRig(t, gatewayConfig(fl, "round_robin"), fl, standin.Config{MessageTimeout: time.Minute,
		Subset: func(*http.Request) []string { return []string{only} }})
	for i := range 6 {
		resp := post(t, r.front.URL, chat("s", fmt.Sprint("question ", i), false, 2))
		if resp.Status != http.StatusOK || resp.Header.Get("X-Kvgate-Replica") != fl.URLs()[2] {
			t.Fatalf("request %d: %d on %q, want %s", i, resp.Status, resp.Header.Get("X-Kvgate-Replica"), fl.URLs()[2])
		}
	}
}

// silent is a picker that reads every message and never answers.
type silent struct {
	extprocv3.UnimplementedExternalProcessorServer
}

func (silent) Process(s extprocv3.ExternalProcessor_ProcessServer) error {
	for {
		if _, err := s.Recv(); err != nil {
			return nil
		}
	}
}

// A picker that never answers does not wedge the proxy: each request
// fails with a 504 once the message timeout passes, or, with
// failure_mode_allow, goes to one of the cluster's endpoints without it —
// in both body modes. The timeout runs on a fake clock, advanced once the
// proxy waits for the answer.
func TestSilentPicker(t *testing.T) {
	fl := startSims(t, 1)
	ep, _ := gateway.Endpoint(fl.URLs()[0])
	conn := servePicker(t, func(gs *grpc.Server) { extprocv3.RegisterExternalProcessorServer(gs, silent{}) })
	for _, m := range modes {
		for _, allow := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/failure_mode_allow=%v", m.name, allow), func(t *testing.T) {
				c := clock.NewFake(time.Time{})
				p := standin.New(standin.Config{Conn: conn, RequestMode: m.mode, ResponseMode: m.mode, Clock: c,
					MessageTimeout: time.Second, FailureModeAllow: allow, Cluster: []string{ep}})
				res := postAsync(httpServer(t, p), chat("s", "u", false, 2))
				if !c.WaitTimers(1, time.Minute) {
					t.Fatal("the proxy never waited for the picker's answer")
				}
				c.Advance(time.Second)
				r := <-res
				want := http.StatusGatewayTimeout
				if allow {
					want = http.StatusOK
				}
				if r.err != nil || r.status != want {
					t.Fatalf("status %d (%v), want %d: %s", r.status, r.err, want, r.body)
				}
			})
		}
	}
}

// fakeReplica is a vLLM-like replica that answers chats with code (200:
// a short answer with its usage).
func fakeReplica(t *testing.T, code int) string {
	t.Helper()
	return fakeReplicaWith(t, code, nil)
}

// fakeReplicaWith is fakeReplica answering chats with header's headers too.
func fakeReplicaWith(t *testing.T, code int, header http.Header) string {
	t.Helper()
	return httpServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/chat/completions" {
			maps.Copy(w.Header(), header)
		}
		switch r.URL.Path {
		case "/metrics":
			_, _ = w.Write([]byte("vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n"))
		case "/v1/models":
			_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"` + "sim-llama-8b" + `","object":"model"}]}`))
		case "/v1/chat/completions":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(code)
			if code == http.StatusOK {
				_, _ = w.Write([]byte(`{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant",` +
					`"content":"ok"}}],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}`))
			}
		}
	}))
}

// When the chosen replica refuses (503), the proxy moves on to the
// fallback the pick listed and says so (the served endpoint's metadata):
// the refusal is settled against the chosen replica, the answer against
// the fallback.
func TestFallbackServed(t *testing.T) {
	refuser, good := fakeReplica(t, http.StatusServiceUnavailable), fakeReplica(t, http.StatusOK)
	cfg := gateway.Defaults()
	cfg.Policy = "round_robin"
	cfg.EjectAfter = 1000 // the refuser stays in rotation: each request may pick it
	cfg.ScrapeInterval, cfg.HealthInterval = gateway.Duration(20*time.Millisecond), gateway.Duration(50*time.Millisecond)
	cfg.Replicas = []gateway.ReplicaConfig{{URL: refuser}, {URL: good}}
	r := startRig(t, cfg, nil, standin.Config{MessageTimeout: time.Minute})
	for i := range 4 {
		resp := post(t, r.front.URL, chat("s", fmt.Sprint("q", i), false, 2))
		if resp.Status != http.StatusOK || resp.Header.Get("X-Kvgate-Replica") != good {
			t.Fatalf("request %d: %d from %q, want the good replica's answer", i, resp.Status, resp.Header.Get("X-Kvgate-Replica"))
		}
	}
	testutil.Eventually(t, 10*time.Second, "the attempts settled", func() bool {
		return counter(t, r.reg, "kvgate_attempts_total", map[string]string{"replica": good, "verdict": "served"}) == 4
	})
	if n := counter(t, r.reg, "kvgate_attempts_total", map[string]string{"replica": refuser, "verdict": "refused"}); n != 2 {
		t.Fatalf("%v refusals settled against the refuser, want 2 (round robin chose it for every other request)", n)
	}
	if r.proxy.Stats.Fallbacks.Load() != 2 {
		t.Fatalf("the stand-in used %d fallbacks, want 2", r.proxy.Stats.Fallbacks.Load())
	}
}

// muted is a picker stream whose answers of the kinds drop says are
// dropped: the picker picks, then goes silent. The first dropped answer
// is told on dropped.
type muted struct {
	grpc.ServerStream
	drop    func(*extprocv3.ProcessingResponse) bool
	dropped chan<- struct{}
}

func (m muted) SendMsg(msg any) error {
	if r, ok := msg.(*extprocv3.ProcessingResponse); ok && m.drop(r) {
		select {
		case m.dropped <- struct{}{}:
		default:
		}
		return nil
	}
	return m.ServerStream.SendMsg(msg)
}

// mute is a stream interceptor dropping the answers drop says.
func mute(drop func(*extprocv3.ProcessingResponse) bool, dropped chan<- struct{}) grpc.ServerOption {
	return grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		return h(srv, muted{ss, drop, dropped})
	})
}

// A picker that picks and then never answers the response's messages does
// not wedge the proxy either: once the message timeout passes (a fake
// clock, advanced when the proxy waits for an answer that was dropped),
// the client gets a 504 (silent on the response header) or its connection
// cut (silent on the body: part of the answer may have left), or with
// failure_mode_allow the whole answer without the picker; kvgate settles
// the request when the proxy ends the stream, nothing stays in flight. In
// both body modes.
func TestPickerSilentOnTheAnswer(t *testing.T) {
	fl := startSims(t, 2)
	silentOn := map[string]func(*extprocv3.ProcessingResponse) bool{
		"header": func(r *extprocv3.ProcessingResponse) bool {
			return r.GetResponseHeaders() != nil || r.GetResponseBody() != nil
		},
		"body": func(r *extprocv3.ProcessingResponse) bool { return r.GetResponseBody() != nil },
	}
	for _, m := range modes {
		for part, drop := range silentOn {
			for _, allow := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/silent_on=%s/failure_mode_allow=%v", m.name, part, allow), func(t *testing.T) {
					c, dropped := clock.NewFake(time.Time{}), make(chan struct{}, 1)
					r := startRig(t, gatewayConfig(fl, "ttft"), fl, standin.Config{RequestMode: m.mode, ResponseMode: m.mode,
						MessageTimeout: time.Second, Clock: c, FailureModeAllow: allow}, mute(drop, dropped))
					res := postAsync(r.front.URL, chat("s", "u", false, 5))
					select {
					case <-dropped:
					case got := <-res:
						t.Fatalf("answered %+v before the picker went silent", got)
					}
					if !c.WaitTimers(1, time.Minute) {
						t.Fatal("the proxy never waited for the dropped answer")
					}
					c.Advance(time.Second)
					checkSilentOutcome(t, r, <-res, part, allow)
					testutil.Eventually(t, 10*time.Second, "the request settled", func() bool {
						return counter(t, r.reg, "kvgate_attempts_total", nil) == 1 && r.g.Router().InFlight(0)+r.g.Router().InFlight(1) == 0
					})
				})
			}
		}
	}
}

// checkSilentOutcome checks what the client got when the picker went
// silent on part of the answer.
func checkSilentOutcome(t *testing.T, r *rig, got posted, part string, allow bool) {
	t.Helper()
	switch {
	case allow:
		if got.err != nil || got.status != http.StatusOK || r.proxy.Stats.FailedOpen.Load() != 1 {
			t.Fatalf("%+v (failed open %d): want the whole answer", got, r.proxy.Stats.FailedOpen.Load())
		}
		checkAnswer(t, testutil.Response{Status: got.status, Body: got.body}, false, 5)
	case part == "header":
		if got.err != nil || got.status != http.StatusGatewayTimeout {
			t.Fatalf("%+v: want a 504", got)
		}
	case got.err == nil:
		t.Fatalf("answer %+v read whole: want the connection cut", got)
	}
	if r.proxy.Stats.Picked.Load() != 1 || !allow && r.proxy.Stats.FailedClosed.Load() != 1 {
		t.Fatalf("picked %d, failed closed %d: want the pick, then the failure", r.proxy.Stats.Picked.Load(),
			r.proxy.Stats.FailedClosed.Load())
	}
}

// posted is a chat's outcome: the status and the body, or the error of a
// cut connection.
type posted struct {
	status int
	body   string
	err    error
}

// postAsync posts a chat to url (the stand-in's front); the outcome comes
// on the channel.
func postAsync(url, body string) <-chan posted {
	res := make(chan posted, 1)
	go func() {
		resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			res <- posted{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		res <- posted{resp.StatusCode, string(b), err}
	}()
	return res
}

// lastWordWaits is a picker stream that, once it has sent the answer's
// last chunk back, returns only when the proxy has ended the stream — as
// Envoy does as soon as it has that chunk: whatever the picker does after
// its last word happens with the stream gone.
type lastWordWaits struct{ grpc.ServerStream }

func (s lastWordWaits) SendMsg(msg any) error {
	err := s.ServerStream.SendMsg(msg)
	r, _ := msg.(*extprocv3.ProcessingResponse)
	if b := r.GetResponseBody(); b != nil && (b.GetResponse().GetBodyMutation().GetStreamedResponse().GetEndOfStream() ||
		b.GetResponse().GetBodyMutation() == nil) {
		select {
		case <-s.Context().Done():
		case <-time.After(time.Minute): // a proxy that never ends it: go on
		}
	}
	return err
}

// An answer whose last chunk the picker sent back is settled served, even
// when the proxy ends the stream at once (the picker settles before its
// last word) — in both body modes, streamed or not.
func TestSettledBeforeTheLastWord(t *testing.T) {
	fl := startSims(t, 2)
	wait := grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		return h(srv, lastWordWaits{ss})
	})
	for _, m := range modes {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/stream=%v", m.name, stream), func(t *testing.T) {
				r := startRig(t, gatewayConfig(fl, "ttft"), fl, standin.Config{RequestMode: m.mode, ResponseMode: m.mode,
					MessageTimeout: time.Minute}, wait)
				resp := post(t, r.front.URL, chat("s", "u", stream, 3))
				checkAnswer(t, resp, stream, 3)
				testutil.Eventually(t, 10*time.Second, "the request settled", func() bool {
					return counter(t, r.reg, "kvgate_attempts_total", nil) == 1
				})
				if n := counter(t, r.reg, "kvgate_attempts_total", map[string]string{"verdict": "served"}); n != 1 {
					t.Fatalf("%v served, want 1: a complete answer settled otherwise", n)
				}
			})
		}
	}
}

// Only kvgate names the route: X-Kvgate-* headers a replica answers with
// (a compromised replica, or a gateway behind it) never reach the client
// through the picker either, in both body modes; its other headers do.
func TestReplicaGatewayHeadersStripped(t *testing.T) {
	evil := fakeReplicaWith(t, http.StatusOK, http.Header{"X-Kvgate-Replica": {"http://evil"}, "X-Kvgate-Pull-From": {"http://evil"},
		"X-Other": {"kept"}})
	for _, m := range modes {
		t.Run(m.name, func(t *testing.T) {
			cfg := gateway.Defaults()
			cfg.ScrapeInterval, cfg.HealthInterval = gateway.Duration(20*time.Millisecond), gateway.Duration(50*time.Millisecond)
			cfg.Replicas = []gateway.ReplicaConfig{{URL: evil}}
			r := startRig(t, cfg, nil, standin.Config{RequestMode: m.mode, ResponseMode: m.mode, MessageTimeout: time.Minute})
			resp := post(t, r.front.URL, chat("s", "u", false, 2))
			if resp.Status != http.StatusOK || resp.Header.Get("X-Kvgate-Replica") != evil || resp.Header.Get("X-Other") != "kept" {
				t.Fatalf("%d, X-Kvgate-Replica %q, X-Other %q: want kvgate's replica and the replica's other headers", resp.Status,
					resp.Header.Get("X-Kvgate-Replica"), resp.Header.Get("X-Other"))
			}
			for k, v := range resp.Header {
				if strings.HasPrefix(k, "X-Kvgate-") && strings.Contains(strings.Join(v, ","), "evil") {
					t.Errorf("the client got the replica's %s: %q", k, v)
				}
			}
		})
	}
}
