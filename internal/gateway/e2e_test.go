package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/sim"
)

// startSim starts simulated replicas for a test.
func startSim(t *testing.T, cfg sim.Config) *sim.Fleet {
	t.Helper()
	cfg.Port = 0
	if cfg.TimeScale == 0 {
		cfg.TimeScale = 50
	}
	fl, err := sim.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = fl.Close() })
	return fl
}

func simConfig(policy string, urls ...string) Config {
	cfg := baseConfig(urls...)
	cfg.Policy = policy
	return cfg
}

// followKVEvents points cfg at the fleet's KV-event publishers and replay
// sockets: a batch published before the gateway subscribed is replayed.
func followKVEvents(cfg *Config, fl *sim.Fleet) {
	for i, r := range fl.Replicas() {
		cfg.Replicas[i].KVEvents, cfg.Replicas[i].KVEventsReplay = r.KVEndpoint(), r.KVReplayEndpoint()
	}
}

// waitHealthy waits until every replica is a candidate: its first health
// check passed, its models listed (a replica is a candidate for the
// models it serves only), its metrics scraped. Waiting for the fleet's
// models and every scrape was not enough: on a busy host one replica's
// model list could come after the others', and a test's first request
// went to the one replica listed.
func waitHealthy(t *testing.T, gw *testGW) {
	t.Helper()
	eventually(t, "replicas checked, scraped and their models listed", func() bool {
		if len(gw.g.Fleet().Models()) == 0 {
			return false
		}
		rt := gw.g.Router()
		for i := range rt.Replicas() {
			if r := rt.Replica(i); !r.Ready() || r.Served() == nil {
				return false
			}
			if _, _, ok := rt.ReplicaMetrics(i); !ok {
				return false
			}
		}
		return true
	})
}

func client(url string) openai.Client {
	return openai.NewClient(option.WithBaseURL(url+"/v1/"), option.WithAPIKey("k"), option.WithMaxRetries(0))
}

// The official OpenAI client works through the gateway, streamed and not,
// chat and completions.
func TestOpenAIClientThroughGateway(t *testing.T) {
	fl := startSim(t, sim.Config{Replicas: 2})
	gw := startGateway(t, simConfig("ttft", fl.URLs()...))
	waitHealthy(t, gw)
	ctx := context.Background()
	c := client(gw.srv.URL)
	ignoreEOS := option.WithJSONSet("ignore_eos", true)
	var raw *http.Response
	comp, err := c.Completions.New(ctx, openai.CompletionNewParams{Model: sim.DefaultModel,
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("Tell me about caches.")}, MaxTokens: openai.Int(5)},
		ignoreEOS, option.WithResponseInto(&raw))
	if err != nil {
		t.Fatal(err)
	}
	if comp.Usage.CompletionTokens != 5 || len(comp.Choices) != 1 || raw == nil || raw.Header.Get("X-Kvgate-Replica") == "" {
		t.Fatalf("completion %+v", comp)
	}
	st := c.Completions.NewStreaming(ctx, openai.CompletionNewParams{Model: sim.DefaultModel,
		Prompt:        openai.CompletionNewParamsPromptUnion{OfString: openai.String("Stream me.")},
		MaxTokens:     openai.Int(6),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}}, ignoreEOS)
	text, chunks := "", 0
	for st.Next() {
		for _, ch := range st.Current().Choices {
			text += ch.Text
		}
		chunks++
	}
	if err := st.Err(); err != nil || (prompt.Approx{}).Count(text) != 6 || chunks < 6 {
		t.Fatalf("stream: %v %q in %d chunks", err, text, chunks)
	}
	st.Close()
	msgs := []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Be brief."), openai.UserMessage("Hi")}
	chat, err := c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: sim.DefaultModel, Messages: msgs,
		MaxTokens: openai.Int(4)}, ignoreEOS)
	if err != nil || chat.Usage.CompletionTokens != 4 || chat.Choices[0].Message.Role != "assistant" {
		t.Fatalf("chat %v %+v", err, chat)
	}
	cs := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{Model: sim.DefaultModel, Messages: msgs,
		MaxTokens: openai.Int(7)}, ignoreEOS)
	var acc openai.ChatCompletionAccumulator
	for cs.Next() {
		acc.AddChunk(cs.Current())
	}
	if err := cs.Err(); err != nil || (prompt.Approx{}).Count(acc.Choices[0].Message.Content) != 7 {
		t.Fatalf("chat stream %v %+v", err, acc.Choices)
	}
	cs.Close()
	_, err = c.Chat.Completions.New(ctx, openai.ChatCompletionNewParams{Model: "gpt-9", Messages: msgs})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 {
		t.Fatalf("unknown model: %v", err)
	}
	models, err := c.Models.List(ctx)
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != sim.DefaultModel {
		t.Fatalf("models %v %+v", err, models)
	}
}

// A conversation's turns stay on one replica under the cache-aware
// policies, while round robin spreads them.
func TestConversationAffinity(t *testing.T) {
	for _, pol := range []string{"ttft", "sglang", "precise", "round_robin"} {
		t.Run(pol, func(t *testing.T) {
			fl := startSim(t, sim.Config{Replicas: 4, KVEvents: pol == "precise", KVEventsReplay: pol == "precise"})
			cfg := simConfig(pol, fl.URLs()...)
			if pol == "precise" {
				cfg.Tokenizer = "remote"
				followKVEvents(&cfg, fl)
			}
			gw := startGateway(t, cfg)
			waitHealthy(t, gw)
			history := []string{"system", strings.Repeat("You are a helpful assistant who answers at length. ", 20)}
			seen := map[string]int{}
			for turn := range 6 {
				history = append(history, "user", fmt.Sprintf("Question number %d: %s", turn, strings.Repeat("why? ", 40)))
				msgs := ""
				for i := 0; i < len(history); i += 2 {
					if i > 0 {
						msgs += ","
					}
					msgs += fmt.Sprintf(`{"role":%q,"content":%q}`, history[i], history[i+1])
				}
				resp, body := post(t, gw.srv.URL+"/v1/chat/completions",
					`{"model":"`+sim.DefaultModel+`","max_tokens":8,"ignore_eos":true,"messages":[`+msgs+`]}`)
				if resp.StatusCode != 200 {
					t.Fatalf("turn %d: %d %s", turn, resp.StatusCode, body)
				}
				seen[resp.Header.Get("X-Kvgate-Replica")]++
				history = append(history, "assistant", "Because caches are fast.")
				if pol == "precise" && turn == 0 {
					// Let the KV events of the first turn arrive, as they would between a user's turns.
					eventually(t, "precise index synced", func() bool { return gw.g.Router().Precise().Index().Len() > 0 })
				}
			}
			if pol == "round_robin" {
				if len(seen) < 3 {
					t.Fatalf("round_robin kept a conversation on %d replicas: %v", len(seen), seen)
				}
				return
			}
			if len(seen) != 1 {
				t.Fatalf("%s spread a conversation over %v", pol, seen)
			}
		})
	}
}

// Precise mode: the gateway's index holds exactly the blocks the replicas
// report stored, and blocks a replica evicts leave it.
func TestPreciseIndexFollowsKVEvents(t *testing.T) {
	const kvBlocks = 96
	fl := startSim(t, sim.Config{Replicas: 2, KVEvents: true, KVEventsReplay: true, KVBlocks: kvBlocks})
	cfg := simConfig("precise", fl.URLs()...)
	cfg.Tokenizer = "remote"
	followKVEvents(&cfg, fl)
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	pix := gw.g.Router().Precise().Index()
	held := func(r int) int { return fl.Replicas()[r].Stats().CachedBlocks }
	settled := func() bool { return pix.ReplicaLen(0) == held(0) && pix.ReplicaLen(1) == held(1) }
	// Each prompt is 32 blocks of 16 tokens (2,048 bytes); 3 per replica fit, the 4th evicts.
	var first, last string
	perReplica := map[string]int{} // prompts served since the first, by the first's replica
	firstOn := ""
	for i := range 10 {
		text := fmt.Sprintf("%04d ", i) + strings.Repeat(fmt.Sprintf("prompt %d says something. ", i), 100)
		text = text[:2048]
		if i == 0 {
			first = text
		}
		last = text
		resp, body := post(t, gw.srv.URL+"/v1/completions", `{"model":"`+sim.DefaultModel+`","max_tokens":2,"ignore_eos":true,"prompt":"`+text+`"}`)
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if i == 0 {
			firstOn = resp.Header.Get("X-Kvgate-Replica")
		}
		perReplica[resp.Header.Get("X-Kvgate-Replica")]++
		// Settled: the counts agree and this prompt's blocks have arrived (a
		// full cache evicts as many blocks as it stores, so counts alone can
		// agree before the events do).
		blocks := prompt.ApproxBlockHashes(nil, prompt.Key{Model: sim.DefaultModel}.Root(), text, 16)
		eventually(t, "index equals the replicas' cached blocks", func() bool {
			m := pix.Match(blocks, nil)
			return settled() && max(m[0], m[1]) == len(blocks)
		})
	}
	root := prompt.Key{Model: sim.DefaultModel}.Root()
	lastBlocks := prompt.ApproxBlockHashes(nil, root, last, 16)
	firstBlocks := prompt.ApproxBlockHashes(nil, root, first, 16)
	m := pix.Match(lastBlocks, nil)
	if max(m[0], m[1]) != len(lastBlocks) {
		t.Fatalf("the last prompt's %d blocks are not all indexed: %v", len(lastBlocks), m)
	}
	if held(0)+held(1) > 2*kvBlocks || pix.Len() != held(0)+held(1) {
		t.Fatalf("index %d entries, replicas hold %d + %d", pix.Len(), held(0), held(1))
	}
	// The first prompt's replica took 3 more since (a full cache): it
	// evicted the first prompt, and the index must have heard.
	if m := pix.Match(firstBlocks, nil); perReplica[firstOn] > 3 && max(m[0], m[1]) == len(firstBlocks) {
		t.Fatalf("the first prompt survived %d later ones on its replica in a %d-block cache: %v", perReplica[firstOn]-1, kvBlocks, m)
	}
	evicted := fl.Replicas()[0].Stats().EvictedBlocks + fl.Replicas()[1].Stats().EvictedBlocks
	if evicted == 0 {
		t.Fatal("no eviction happened: the test did not exercise removals")
	}
}

// A replica stopped during the run is ejected and traffic goes on.
func TestStoppedReplicaIsEjected(t *testing.T) {
	a := startSim(t, sim.Config{Replicas: 2})
	b := startSim(t, sim.Config{Replicas: 1})
	cfg := simConfig("round_robin", append(a.URLs(), b.URLs()...)...)
	cfg.EjectAfter = 1
	gw := startGateway(t, cfg)
	waitHealthy(t, gw)
	send := func(n int) map[string]int {
		seen := map[string]int{}
		for i := range n {
			resp, body := post(t, gw.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":"%s","max_tokens":2,"prompt":"request %d"}`, sim.DefaultModel, i))
			if resp.StatusCode != 200 {
				t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
			}
			seen[resp.Header.Get("X-Kvgate-Replica")]++
		}
		return seen
	}
	if seen := send(6); seen[b.URLs()[0]] == 0 {
		t.Fatalf("replica b unused before the stop: %v", seen)
	}
	_ = b.Close()
	seen := send(12) // every request still succeeds: refused connections are retried elsewhere
	if seen[b.URLs()[0]] != 0 {
		t.Fatalf("a stopped replica answered: %v", seen)
	}
	eventually(t, "stopped replica out of rotation", func() bool { return !gw.g.Router().Healthy(2) })
	for i := range 3 {
		eventually(t, "in-flight back to zero", func() bool { return gw.g.Router().InFlight(i) == 0 })
	}
}
