package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/sim"
)

func TestSimFlagErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"replicas", []string{"--replicas", "0"}, "--replicas 0"},
		{"port", []string{"--replicas", "3", "--port", "65534"}, "out of range"},
		{"negative port", []string{"--port", "-1"}, "out of range"},
		{"kv port", []string{"--kv-events-port", "70000"}, "--kv-events-port"},
		{"time scale", []string{"--time-scale", "0"}, "--time-scale 0"},
		{"profile", []string{"--profile", "tpu-v9"}, "llama3-70b-h100-tp2, llama3-8b-h100"},
		{"form", []string{"--kv-events-form", "xml"}, "map or array"},
		{"fault replicas", []string{"--fault-replicas", "x"}, "--fault-replicas"},
		{"fault rate", []string{"--fault-error-rate", "2", "--port", "0"}, "error rate"},
		{"stray argument", []string{"extra"}, "unexpected argument"},
		{"unknown flag", []string{"--gpus", "8"}, "gpus"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errs := runCmd(t, "", append([]string{"sim"}, tc.args...)...)
			if code != 2 || out != "" || !strings.Contains(errs, tc.want) {
				t.Errorf("code %d out %q err %q, want 2 and %q", code, out, errs, tc.want)
			}
		})
	}
}

// syncBuffer is a bytes.Buffer safe for one writer and one poller.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// freePorts finds a run of n consecutive free loopback ports, avoiding
// those in skip. Another process may take one before the sim binds it; the
// caller then retries.
func freePorts(t *testing.T, n int, skip ...int) int {
	t.Helper()
	for range 50 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if base+n > 65535 {
			continue
		}
		var held []net.Listener
		ok := true
		for i := range n {
			if slices.Contains(skip, base+i) {
				ok = false
				break
			}
			l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(base+i)))
			if err != nil {
				ok = false
				break
			}
			held = append(held, l)
		}
		for _, l := range held {
			l.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatal("no free port range")
	return 0
}

// waitFor checks cond every 5 ms until it holds; after d it fails the test.
func waitFor(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(d)
	for !cond() {
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// startSim runs `kvgate sim` with args plus --port and --kv-events-port on
// free ports, until the test ends.
func startSim(t *testing.T, replicas int, args ...string) (port, kvPort int, out *syncBuffer) {
	t.Helper()
	for attempt := 0; ; attempt++ {
		port = freePorts(t, replicas)
		kvPort = freePorts(t, replicas, port)
		ctx, cancel := context.WithCancel(context.Background())
		out = &syncBuffer{}
		errOut := &syncBuffer{}
		done := make(chan int, 1)
		full := append([]string{"sim", "--replicas", strconv.Itoa(replicas), "--port", strconv.Itoa(port),
			"--kv-events-port", strconv.Itoa(kvPort)}, args...)
		go func() { done <- run(ctx, full, strings.NewReader(""), out, errOut) }()
		started := false
		waitFor(t, 10*time.Second, "the sim to start", func() bool {
			select {
			case code := <-done:
				done <- code
				return true
			default:
			}
			started = strings.Count(out.String(), "\n") == replicas
			return started
		})
		if started {
			t.Cleanup(func() {
				cancel()
				if code := <-done; code != 0 {
					t.Errorf("kvgate sim exited %d: %s", code, errOut.String())
				}
			})
			return port, kvPort, out
		}
		cancel()
		if code := <-done; attempt >= 3 || !strings.Contains(errOut.String(), "address already in use") {
			t.Fatalf("kvgate sim exited %d: %s", code, errOut.String())
		}
	}
}

// The "done when" test of `kvgate sim`: the official OpenAI client, a
// Prometheus text parser and a KV-event subscriber against a running sim.
func TestSimEndToEnd(t *testing.T) {
	// Cleanups run last-registered first: the leak check runs after the
	// sim has stopped and the client's connections are closed.
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { goleak.VerifyNone(t, ignore) })
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	hc := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	const replicas = 2
	port, kvPort, out := startSim(t, replicas, "--kv-blocks", "160", "--seed", "1")

	// One line per replica: URL, KV endpoint, topic, per the contract.
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	for i, line := range lines {
		want := fmt.Sprintf("replica %d http://127.0.0.1:%d kv-events tcp://127.0.0.1:%d topic kv@127.0.0.1:%d@sim-llama-8b",
			i, port+i, kvPort+i, port+i)
		if line != want {
			t.Errorf("line %d: %q, want %q", i, line, want)
		}
	}
	url := fmt.Sprintf("http://127.0.0.1:%d", port)
	topic := fmt.Sprintf("kv@127.0.0.1:%d@sim-llama-8b", port)
	ctx := t.Context()

	// Subscribe to replica 0's KV events first.
	var mu sync.Mutex
	var stored, removed []uint64
	var badEvents []string
	root := prompt.RootOf("engine", prompt.Key{Model: "sim-llama-8b"})
	sub, err := kvevents.Subscribe(ctx, fmt.Sprintf("tcp://127.0.0.1:%d", kvPort), topic, func(m kvevents.Message) {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range m.Batch.Events {
			switch ev := ev.(type) {
			case *kvevents.BlockStored:
				parent := root
				if ev.ParentBlockHash != nil {
					parent = *ev.ParentBlockHash
				}
				if got := prompt.BlockHashes(nil, parent, prompt.TokenBytes(nil, ev.TokenIDs), ev.BlockSize); !slices.Equal(got, ev.BlockHashes) {
					badEvents = append(badEvents, fmt.Sprintf("stored %x: token ids hash to %x", ev.BlockHashes, got))
				}
				stored = append(stored, ev.BlockHashes...)
			case *kvevents.BlockRemoved:
				removed = append(removed, ev.BlockHashes...)
			}
		}
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()

	client := openai.NewClient(option.WithBaseURL(url+"/v1/"), option.WithAPIKey("sim"), option.WithMaxRetries(0),
		option.WithHTTPClient(hc))
	ignoreEOS := option.WithJSONSet("ignore_eos", true)
	// Warm up until the subscription is live (ZMQ joins asynchronously).
	waitFor(t, 20*time.Second, "KV events", func() bool {
		_, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "sim-llama-8b",
			Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String(strings.Repeat("warm", 16))},
			MaxTokens: openai.Int(1)})
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		defer mu.Unlock()
		return len(stored) > 0
	})

	// Completions, not streamed: exactly max_tokens with ignore_eos.
	text := func(tag string, tokens int) string {
		var sb strings.Builder
		for i := 0; sb.Len() < 4*tokens; i++ {
			fmt.Fprintf(&sb, "%s%04d ", tag, i)
		}
		return sb.String()[:4*tokens]
	}
	a := text("aa", 2000)
	ttft := func(p string) (time.Duration, openai.CompletionUsage) {
		start := time.Now()
		st := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{Model: "sim-llama-8b",
			Prompt:        openai.CompletionNewParamsPromptUnion{OfString: openai.String(p)},
			MaxTokens:     openai.Int(8),
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}}, ignoreEOS)
		defer st.Close()
		var first time.Duration
		var usage openai.CompletionUsage
		var sb strings.Builder
		for st.Next() {
			ch := st.Current()
			if len(ch.Choices) > 0 {
				if first == 0 {
					first = time.Since(start)
				}
				sb.WriteString(ch.Choices[0].Text)
			}
			if ch.Usage.TotalTokens > 0 {
				usage = ch.Usage
			}
		}
		if err := st.Err(); err != nil {
			t.Fatal(err)
		}
		if (prompt.Approx{}).Count(sb.String()) != 8 || usage.CompletionTokens != 8 {
			t.Fatalf("streamed %q, usage %+v", sb.String(), usage)
		}
		return first, usage
	}
	cold, u1 := ttft(a)
	warm, u2 := ttft(a)
	if u1.PromptTokens != 2000 || u1.PromptTokensDetails.CachedTokens != 0 ||
		u2.PromptTokensDetails.CachedTokens < 2000-16 {
		t.Errorf("usage cold %+v warm %+v", u1, u2)
	}
	t.Logf("TTFT of a 2000-token prompt: cold %v, cached %v", cold, warm)
	// Cost model: ≈ 90 ms of prefill cold, ≈ 11 ms warm (time scale 1).
	if !(warm < cold) || cold < 80*time.Millisecond {
		t.Errorf("TTFT cold %v, warm %v", cold, warm)
	}

	comp, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "sim-llama-8b",
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(a)}, MaxTokens: openai.Int(5)}, ignoreEOS)
	if err != nil {
		t.Fatal(err)
	}
	if len(comp.Choices) != 1 || comp.Choices[0].FinishReason != "length" || comp.Usage.CompletionTokens != 5 ||
		(prompt.Approx{}).Count(comp.Choices[0].Text) != 5 || comp.Usage.PromptTokensDetails.CachedTokens < 2000-16 {
		t.Errorf("completion %+v", comp)
	}

	// Chat, streamed and not.
	msgs := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("You are terse."), openai.UserMessage("Hello!")}
	chat, err := client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "sim-llama-8b",
		Messages: msgs, MaxTokens: openai.Int(6)}, ignoreEOS)
	if err != nil {
		t.Fatal(err)
	}
	if len(chat.Choices) != 1 || chat.Choices[0].Message.Role != "assistant" || chat.Usage.CompletionTokens != 6 ||
		(prompt.Approx{}).Count(chat.Choices[0].Message.Content) != 6 || chat.Choices[0].FinishReason != "length" {
		t.Errorf("chat %+v", chat)
	}
	st := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{Model: "sim-llama-8b",
		Messages: msgs, MaxTokens: openai.Int(7),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}}, ignoreEOS)
	var acc openai.ChatCompletionAccumulator
	for st.Next() {
		acc.AddChunk(st.Current())
	}
	if err := st.Err(); err != nil {
		t.Fatal(err)
	}
	st.Close()
	if len(acc.Choices) != 1 || (prompt.Approx{}).Count(acc.Choices[0].Message.Content) != 7 ||
		acc.Choices[0].FinishReason != "length" || acc.Usage.CompletionTokens != 7 ||
		acc.Usage.PromptTokens != chat.Usage.PromptTokens || acc.Usage.PromptTokensDetails.CachedTokens != 0 {
		t.Errorf("streamed chat %+v usage %+v", acc.Choices, acc.Usage)
	}
	// Unknown model: the client's typed error with OpenAI's code.
	_, err = client.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "gpt-9", Messages: msgs})
	var apiErr *openai.Error
	if !errorsAs(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" {
		t.Errorf("unknown model: %v", err)
	}

	// /metrics: every contract metric, by a Prometheus text parser.
	for i := range replicas {
		r, err := hc.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port+i))
		if err != nil {
			t.Fatal(err)
		}
		p := expfmt.NewTextParser(model.LegacyValidation)
		fams, err := p.TextToMetricFamilies(r.Body)
		r.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range sim.ContractMetrics {
			if fams[name] == nil || len(fams[name].GetMetric()) == 0 {
				t.Errorf("replica %d: no %s", i, name)
			}
		}
		if i == 0 {
			if n := fams[sim.MetricTTFT].GetMetric()[0].GetHistogram().GetSampleCount(); n < 5 {
				t.Errorf("replica 0: %d TTFT samples", n)
			}
		}
	}

	// KV events: prompt a's blocks were stored; a different long prompt
	// overfills the 160-block cache and evicts some of them.
	aHashes := prompt.ApproxBlockHashes(nil, root, a, 16)
	if _, err := client.Completions.New(ctx, openai.CompletionNewParams{Model: "sim-llama-8b",
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(text("bb", 2000))}, MaxTokens: openai.Int(1)}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "stored and removed events of prompt a", func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, h := range aHashes {
			if !slices.Contains(stored, h) {
				return false
			}
		}
		return slices.ContainsFunc(removed, func(h uint64) bool { return slices.Contains(aHashes, h) })
	})
	mu.Lock()
	defer mu.Unlock()
	if len(badEvents) > 0 {
		t.Errorf("%d bad stored events, first: %s", len(badEvents), badEvents[0])
	}
}

func errorsAs(err error, target **openai.Error) bool { return errors.As(err, target) }
