package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/sim"
)

// These tests drive precise mode with publishers that are not the sim's:
// the replicas (sims without KV events) serve HTTP, and each test publishes
// the events a real engine would, in the topology and form under test.

// preciseText is a prompt of 8 blocks of 16 tokens (approximate tokenizer:
// the sim's, so its /tokenize gives the ids the events carry).
func preciseText(tag string) string {
	return (tag + strings.Repeat(" the cache holds this prompt", 30))[:8*16*4]
}

// storedEvent reports text's first blocks of blockSize tokens stored, as a
// root chain (parent nil, or 0 in llm-d's positional form).
func storedEvent(text string, blockSize int, base uint64, parentZero bool) kvevents.Batch {
	ids := prompt.Approx{}.Encode(nil, text)
	n := len(ids) / blockSize
	hs := make([]uint64, n)
	for k := range hs {
		hs[k] = base + uint64(k)
	}
	ev := &kvevents.BlockStored{BlockHashes: hs, TokenIDs: ids[:n*blockSize], BlockSize: blockSize, Medium: "GPU"}
	if parentZero {
		zero := uint64(0)
		ev.ParentBlockHash = &zero
	}
	return kvevents.Batch{Events: []kvevents.Event{ev}}
}

// publisher starts a kvevents publisher for a test.
func publisher(t *testing.T, endpoint string, o kvzmq.PublisherOptions) kvzmq.Publisher {
	t.Helper()
	p, err := kvzmq.NewPublisher(context.Background(), endpoint, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func boundAddr(p kvzmq.Publisher) string {
	return "tcp://" + p.(interface{ Addr() net.Addr }).Addr().String()
}

func replayAddr(p kvzmq.Publisher) string {
	return "tcp://" + p.(interface{ ReplayAddr() net.Addr }).ReplayAddr().String()
}

// matchOn is the match the gateway's router sees on replica i for a
// completion of text under model.
func matchOn(gw *testGW, model, text string, i int) int {
	rt := gw.g.Router()
	req := rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: model, Text: text, KeyText: text, Prompts: 1}, "", "")
	return rt.Views(req)[i].Match
}

// routedTo sends text once and returns the replica that served it.
func routedTo(t *testing.T, gw *testGW, model, text string) string {
	t.Helper()
	resp, body := post(t, gw.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"max_tokens":1,"prompt":%q}`, model, text))
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	return resp.Header.Get("X-Kvgate-Replica")
}

// A late join: a publisher counting from 1 (llm-d's simulator) whose
// replica was warmed before the gateway started is routed to from the
// first request, through its replay endpoint; a prompt warmed after the
// start is routed to as soon as its events arrive.
func TestPreciseLateJoinBoundPublishers(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 2})
	topic := func(i int) string {
		return "kv@" + strings.TrimPrefix(fl.URLs()[i], "http://") + "@" + sim.DefaultModel
	}
	p0 := publisher(t, "tcp://127.0.0.1:0", kvzmq.PublisherOptions{Topic: topic(0)})
	p1 := publisher(t, "tcp://127.0.0.1:0", kvzmq.PublisherOptions{Topic: topic(1), FirstSeq: 1, ReplayEndpoint: "tcp://127.0.0.1:0"})
	before, after := preciseText("warmed before the gateway"), preciseText("warmed after the gateway")
	if err := p1.Publish(storedEvent(before, 16, 1000, false)); err != nil {
		t.Fatal(err)
	}
	cfg := simConfig("precise", fl.URLs()...)
	cfg.Tokenizer = "remote"
	cfg.Replicas[0].KVEvents = boundAddr(p0)
	cfg.Replicas[1].KVEvents, cfg.Replicas[1].KVEventsReplay = boundAddr(p1), replayAddr(p1)
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	eventually(t, "the replayed blocks indexed", func() bool { return matchOn(gw, sim.DefaultModel, before, 1) == 8 })
	if r := routedTo(t, gw, sim.DefaultModel, before); r != fl.URLs()[1] {
		t.Fatalf("the first request for a prompt warmed before the start went to %s, want %s", r, fl.URLs()[1])
	}
	// Warmed on replica 0 after the start: its publisher counts from 0, but
	// the gateway may have connected after a batch or not; either way what
	// it reports counts at once.
	eventually(t, "the subscriber connected", func() bool {
		_ = p0.Publish(kvevents.Batch{})
		return counterValue(t, gw.g.reg, "kvgate_kv_events_batches_total", map[string]string{"replica": fl.URLs()[0]}) > 0
	})
	if err := p0.Publish(storedEvent(after, 16, 2000, false)); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the new blocks indexed", func() bool { return matchOn(gw, sim.DefaultModel, after, 0) == 8 })
	if r := routedTo(t, gw, sim.DefaultModel, after); r != fl.URLs()[0] {
		t.Fatalf("a prompt warmed on replica 0 went to %s", r)
	}
	if n := counterValue(t, gw.g.reg, "kvgate_kv_events_replayed_total", map[string]string{"replica": fl.URLs()[1]}); n != 1 {
		t.Fatalf("%v batches replayed for replica 1, want 1", n)
	}
}

// llm-d's topology: the replicas connect to the gateway's bound socket and
// the topic names them; their events are positional with parent 0, their
// blocks 32 tokens, their topic names the base model while requests use an
// alias (--served-model-name).
func TestPreciseListenConnectingPublishers(t *testing.T) {
	const base, alias = "org/base-8b", "chat"
	fl := startSim(t, sim.Config{Replicas: 2, Model: base, ServedModelNames: []string{alias}, BlockSize: 32})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	listen := "tcp://" + ln.Addr().String()
	_ = ln.Close()
	cfg := simConfig("precise", fl.URLs()...)
	cfg.Tokenizer = "remote"
	cfg.KVEventsListen = listen
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	pubs := make([]kvzmq.Publisher, 2)
	for i := range pubs {
		topic := "kv@" + strings.TrimPrefix(fl.URLs()[i], "http://") + "@" + base
		pubs[i] = publisher(t, listen, kvzmq.PublisherOptions{Topic: topic, Connect: true, Form: kvevents.FormArray})
	}
	stranger := publisher(t, listen, kvzmq.PublisherOptions{Topic: "kv@10.9.9.9:8000@" + base, Connect: true})
	text := preciseText("connected replica one")
	eventually(t, "the events of replica 1 indexed, the stranger's counted", func() bool {
		_ = pubs[1].Publish(storedEvent(text, 32, 500, true))
		_ = stranger.Publish(storedEvent(text, 32, 900, true))
		return matchOn(gw, alias, text, 1) == 8 && counterValue(t, gw.g.reg, "kvgate_kv_events_unknown_topic_total", nil) > 0
	})
	if m := matchOn(gw, alias, text, 0); m != 0 {
		t.Fatalf("replica 0 credited with %d blocks it never reported", m)
	}
	if r := routedTo(t, gw, alias, text); r != fl.URLs()[1] {
		t.Fatalf("routed to %s, want %s", r, fl.URLs()[1])
	}
	for _, reason := range []string{"block_size", "unknown_parent"} {
		if n := counterValue(t, gw.g.reg, "kvgate_kv_events_dropped_total", map[string]string{"replica": fl.URLs()[1], "reason": reason}); n != 0 {
			t.Fatalf("%v events dropped for %s", n, reason)
		}
	}
}

// cfgModel is the model the gap test's events and requests name.
const cfgModel = "m"

// A gap filled from the replay endpoint keeps the replica in sync; without
// one the replica falls back (its reported blocks still count).
func TestPreciseGapResync(t *testing.T) {
	for _, withReplay := range []bool{true, false} {
		t.Run(fmt.Sprint("replay=", withReplay), func(t *testing.T) {
			opts := kvzmq.PublisherOptions{Topic: "kv@127.0.0.1:1@" + cfgModel}
			if withReplay {
				opts.ReplayEndpoint = "tcp://127.0.0.1:0"
			}
			p := publisher(t, "tcp://127.0.0.1:0", opts)
			cfg := baseConfig("http://127.0.0.1:1")
			cfg.Tokenizer = "remote"
			cfg.Replicas[0].KVEvents = "tcp://127.0.0.1:2" // not followed: the test hands batches over itself
			if withReplay {
				cfg.Replicas[0].KVEventsReplay = replayAddr(p)
			}
			g, err := New(cfg, Options{})
			if err != nil {
				t.Fatal(err)
			}
			texts := make([]string, 6)
			var batches []kvevents.Batch
			for k := range texts {
				texts[k] = preciseText(fmt.Sprint("batch ", k))
				batches = append(batches, storedEvent(texts[k], 16, uint64(100*k), false))
				if err := p.Publish(batches[k]); err != nil {
					t.Fatal(err)
				}
			}
			ctx := context.Background()
			for _, k := range []int{0, 1, 2, 5} { // 3 and 4 lost
				ctlOf(g).onKVMessage(ctx, 0, kvevents.Message{Topic: opts.Topic, Seq: uint64(k), Batch: batches[k]})
			}
			synced := counterValue(t, g.reg, "kvgate_kv_events_synced", nil)
			replayed := counterValue(t, g.reg, "kvgate_kv_events_replayed_total", nil)
			gw := &testGW{g: g}
			switch {
			case withReplay && (synced != 1 || replayed != 2 || matchOn(gw, cfgModel, texts[3], 0) != 8):
				t.Fatalf("with a replay endpoint: synced %v, replayed %v, batch 3 match %d", synced, replayed, matchOn(gw, cfgModel, texts[3], 0))
			case !withReplay && (synced != 0 || matchOn(gw, cfgModel, texts[5], 0) != 8):
				t.Fatalf("without: synced %v, batch 5 match %d", synced, matchOn(gw, cfgModel, texts[5], 0))
			}
			if n := counterValue(t, g.reg, "kvgate_kv_events_gaps_total", nil); n != 1 {
				t.Fatalf("%v gaps", n)
			}
		})
	}
}

// Data-parallel servers: 2 servers × 2 ranks are 4 targets; a
// conversation's turns stay on one (server, rank), which the server
// honours, and every rank is a target that serves.
func TestDataParallelRanksAreTargets(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 2, DataParallelSize: 2})
	gw := startGateway(t, simConfig("ttft", fl.URLs()...))
	waitHealthy(t, gw)
	if n := gw.g.Router().Replicas(); n != 4 {
		t.Fatalf("%d targets, want 4 (counted from the servers' metrics)", n)
	}
	served := map[string]int{}
	for c := range 8 {
		history := fmt.Sprintf("conversation %d: ", c) + strings.Repeat(fmt.Sprintf("context of conversation %d. ", c), 40)
		var where string
		for turn := range 4 {
			history += fmt.Sprintf(" turn %d asks something new.", turn)
			resp, body := post(t, gw.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"max_tokens":2,"prompt":%q}`, sim.DefaultModel, history))
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			rank := resp.Header.Get("X-Kvgate-Rank")
			if got := resp.Header.Get(sim.HeaderDataParallelRank); got != rank || rank == "" {
				t.Fatalf("the gateway said rank %q, the server served it on rank %q", rank, got)
			}
			at := resp.Header.Get("X-Kvgate-Replica") + "#" + rank
			if turn > 0 && at != where {
				t.Fatalf("conversation %d moved from %s to %s at turn %d", c, where, at, turn)
			}
			where = at
		}
		served[where]++
	}
	if len(served) < 2 {
		t.Fatalf("8 conversations all on one target: %v", served)
	}
	waitIdle(t, gw)
	// Every rank serves: round robin over the same servers reaches all four.
	rr := startGateway(t, simConfig("round_robin", fl.URLs()...))
	waitHealthy(t, rr)
	ranks := map[string]int{}
	for i := range 8 {
		resp, body := post(t, rr.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"max_tokens":1,"prompt":"request %d"}`, sim.DefaultModel, i))
		if resp.StatusCode != 200 || resp.Header.Get(sim.HeaderDataParallelRank) != resp.Header.Get("X-Kvgate-Rank") {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		ranks[resp.Header.Get("X-Kvgate-Replica")+"#"+resp.Header.Get("X-Kvgate-Rank")]++
	}
	if len(ranks) != 4 {
		t.Fatalf("round robin reached %d of 4 (server, rank) targets: %v", len(ranks), ranks)
	}
	waitIdle(t, rr)
}

// Events that never match requests (here: a replica whose publisher sends
// nothing but an empty first batch, so kvgate trusts an empty index while
// the engine caches every prompt) show in
// kvgate_precise_underpredicted_total, and are warned about once.
func TestPreciseUnderpredictionWarned(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 1})
	p := publisher(t, "tcp://127.0.0.1:0", kvzmq.PublisherOptions{
		Topic: "kv@" + strings.TrimPrefix(fl.URLs()[0], "http://") + "@" + sim.DefaultModel, ReplayEndpoint: "tcp://127.0.0.1:0"})
	if err := p.Publish(kvevents.Batch{}); err != nil { // seq 0, replayed when the gateway connects
		t.Fatal(err)
	}
	cfg := simConfig("precise", fl.URLs()...)
	cfg.Tokenizer = "remote"
	cfg.Replicas[0].KVEvents, cfg.Replicas[0].KVEventsReplay = boundAddr(p), replayAddr(p)
	var logs syncLog
	g, err := New(cfg, Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	gw := &testGW{g: g, srv: httptest.NewServer(g.Handler()), cancel: cancel, done: make(chan struct{})}
	go func() { defer close(gw.done); g.Run(ctx) }()
	t.Cleanup(func() { gw.srv.Close(); cancel(); <-gw.done })
	waitHealthy(t, gw)
	eventually(t, "in sync from an empty first batch", func() bool { return g.rt.Replica(0).PreciseSynced() })
	text := preciseText("cached by the engine, never reported")
	for range 12 {
		routedTo(t, gw, sim.DefaultModel, text)
	}
	n := counterValue(t, g.reg, "kvgate_precise_underpredicted_total", map[string]string{"replica": fl.URLs()[0]})
	if n < 10 {
		t.Fatalf("%v underpredictions in 11 cached requests, want ≥ 10", n)
	}
	if c := strings.Count(logs.String(), "keeps reporting more cached prompt tokens"); c != 1 {
		t.Fatalf("warned %d times, want once:\n%s", c, logs.String())
	}
}

// A prompt warmed directly on a replica (not through the gateway) before
// the gateway starts, and another after, are each routed to their replica
// from the first request through the gateway: sims publishing as vLLM, the
// first through its replay socket.
func TestPreciseWarmedDirectlyOnReplicas(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 3, KVEvents: true, KVEventsReplay: true})
	warm := func(i int, text string) {
		t.Helper()
		resp, body := post(t, fl.URLs()[i]+"/v1/completions", fmt.Sprintf(`{"model":%q,"max_tokens":1,"prompt":%q}`, sim.DefaultModel, text))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	before, after := preciseText("warmed on replica 2 before"), preciseText("warmed on replica 1 after")
	warm(2, before)
	cfg := simConfig("precise", fl.URLs()...)
	cfg.Tokenizer = "remote"
	followKVEvents(&cfg, fl)
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	eventually(t, "the replayed blocks indexed", func() bool { return matchOn(gw, sim.DefaultModel, before, 2) == 8 })
	if r := routedTo(t, gw, sim.DefaultModel, before); r != fl.URLs()[2] {
		t.Fatalf("warmed before the start: routed to %s, want %s", r, fl.URLs()[2])
	}
	warm(1, after)
	eventually(t, "the new blocks indexed", func() bool { return matchOn(gw, sim.DefaultModel, after, 1) == 8 })
	if r := routedTo(t, gw, sim.DefaultModel, after); r != fl.URLs()[1] {
		t.Fatalf("warmed after the start: routed to %s, want %s", r, fl.URLs()[1])
	}
}

// A tool-using chat warmed on a replica is matched there in precise mode:
// the gateway's /tokenize call carries the chat's tools, which the
// replica's chat template renders ahead of the conversation, so the ids it
// hashes are those of the replica's KV events. Before, it sent the
// messages alone and matched nothing.
func TestPreciseChatWithTools(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 3, KVEvents: true, KVEventsReplay: true})
	chat := fmt.Sprintf(`{"model":%q,"max_tokens":1,"messages":[{"role":"system","content":%q},{"role":"user","content":"fix it"}],`+
		`"tools":[{"type":"function","function":{"name":"bash","description":%q,"parameters":{"type":"object"}}}]}`,
		sim.DefaultModel, preciseText("an agent's system prompt"), strings.Repeat("runs a shell command and returns its output; ", 20))
	resp, body := post(t, fl.URLs()[1]+"/v1/chat/completions", chat)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	cfg := simConfig("precise", fl.URLs()...)
	cfg.Tokenizer, cfg.AdminToken = "remote", "tok"
	followKVEvents(&cfg, fl)
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	var d struct {
		Decision struct {
			Replica int `json:"replica"`
			Matched int `json:"matched_blocks"`
		} `json:"decision"`
	}
	eventually(t, "the warmed chat matched on its replica", func() bool {
		resp, body := post(t, gw.srv.URL+"/debug/route", chat, "Authorization", "Bearer tok")
		if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &d) != nil {
			t.Fatalf("/debug/route: %d %s", resp.StatusCode, body)
		}
		return d.Decision.Replica == 1 && d.Decision.Matched > 16
	})
}
