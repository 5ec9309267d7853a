package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/sim"
)

// text is about n tokens of prose tagged by tag, a whole number of 64-byte
// blocks (16 tokens) long, so that it is a block-aligned prefix of anything
// it starts.
func pullText(tag string, n int) string {
	var sb strings.Builder
	for i := 0; sb.Len() < 4*n; i++ {
		fmt.Fprintf(&sb, "%s%04d ", tag, i)
	}
	return sb.String()[:4*n/64*64]
}

// saturate keeps replica url busy with requests of its own (another
// client's, not through the gateway) until the test ends: many long
// distinct prompts, so that its scraped waiting queue is long and the
// prompts evict older ones from its GPU cache.
func saturate(t *testing.T, url string, n int) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &http.Client{}
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait(); c.CloseIdleConnections() })
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":200,"ignore_eos":true}`, sim.DefaultModel, pullText(fmt.Sprintf("h%02d", i), 6000))
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := c.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
}

// Live, 4 sims with a host tier behind the gateway, with kv_pulls: a long
// prompt's holder is saturated by another client, so its next turn goes to
// an idle replica that pulls the prefix from the holder (usage counts the
// pulled tokens cached; X-Kvgate-Pull-From and /debug/route name the
// holder); when the holder has evicted the prefix meanwhile, the pull
// finds nothing and the replica computes the prompt, without an error to
// the client. The sims run on a fake clock that only the test moves, from
// one armed timer to the next while it waits for an answer: the holder
// stays saturated for as long as the test needs, however slow the host.
func TestPeerPullLive(t *testing.T) {
	for _, c := range []struct {
		name    string
		offload int // the sims' host tier: large enough to keep the prefix, or none
		pulled  bool
	}{{"pulled", 20000, true}, {"evicted at the source", 0, false}} {
		t.Run(c.name, func(t *testing.T) {
			clk := clock.NewFake(time.Time{})
			fl := startSim(t, sim.Config{Replicas: 4, KVBlocks: 1024, OffloadBlocks: c.offload, TimeScale: 1, Clock: clk})
			cfg := simConfig("ttft", fl.URLs()...)
			cfg.KVPulls.Enabled, cfg.OffloadBlocks = true, c.offload
			cfg.AdminToken = "t"
			gw := startGateway(t, cfg)
			waitHealthy(t, gw)
			prefix := pullText("conv", 8000)
			turn := func(q string) (int, http.Header, string) {
				return driveClock(t, clk, gw.srv.URL+"/v1/completions",
					fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":4}`, sim.DefaultModel, prefix+q))
			}
			code, hdr, _ := turn("first question?")
			holder := hdr.Get("X-Kvgate-Replica")
			if code != http.StatusOK || holder == "" || hdr.Get(headerPullFrom) != "" {
				t.Fatalf("first turn: %d on %q, pull from %q", code, holder, hdr.Get(headerPullFrom))
			}
			i := slices.Index(fl.URLs(), holder)
			saturate(t, holder, 24) // queued: the clock stands still
			eventually(t, "the holder's queue scraped", func() bool {
				m, _, ok := gw.g.Router().ReplicaMetrics(i)
				return ok && m.Waiting >= 12
			})
			if !c.pulled { // the holder computes its queue's first prompts, which evict the prefix
				for k := 0; servable(t, holder, prefix) > 0; k++ {
					if k == 100_000 || !nextTimer(clk) {
						t.Fatalf("the holder does not evict the prefix after %d steps", k)
					}
				}
				eventually(t, "the holder's queue still long", func() bool {
					m, _, ok := gw.g.Router().ReplicaMetrics(i)
					return ok && m.Waiting >= 12
				})
			} else if n := servable(t, holder, prefix); n != 500 {
				t.Fatalf("the holder serves %d blocks of the prefix, want 500", n)
			}
			// /debug/route shows the pull before anything is sent.
			dr, body := post(t, gw.srv.URL+"/debug/route", fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":4}`,
				sim.DefaultModel, prefix+"second question?"), "Authorization", "Bearer t")
			var route struct {
				PullFrom string `json:"pull_from"`
			}
			if dr.StatusCode != http.StatusOK || json.Unmarshal([]byte(body), &route) != nil || route.PullFrom != holder {
				t.Fatalf("/debug/route %d: %s", dr.StatusCode, body)
			}
			code, hdr, body = turn("second question?")
			var out struct {
				Usage struct {
					Details struct {
						Cached int `json:"cached_tokens"`
					} `json:"prompt_tokens_details"`
				} `json:"usage"`
			}
			if code != http.StatusOK || json.Unmarshal([]byte(body), &out) != nil {
				t.Fatalf("second turn: %d %s", code, body)
			}
			got, cached := hdr.Get("X-Kvgate-Replica"), out.Usage.Details.Cached
			t.Logf("second turn on %s pulling from %q: %d tokens cached", got, hdr.Get(headerPullFrom), cached)
			if got == holder || hdr.Get(headerPullFrom) != holder {
				t.Fatalf("second turn on %s (holder %s), pull from %q", got, holder, hdr.Get(headerPullFrom))
			}
			if c.pulled != (cached >= 8000) || (!c.pulled && cached != 0) {
				t.Fatalf("cached %d tokens, pulled %v", cached, c.pulled)
			}
			result := map[bool]string{true: "pulled", false: "missed"}[c.pulled]
			if n := simPulls(t, got, result); n != 1 {
				t.Fatalf("%s counts %v pulls %s, want 1", got, n, result)
			}
		})
	}
}

// driveClock posts body to url and, until the answer comes, moves the
// sims' fake clock to their next armed timer (a step's end, a transfer's),
// as fast as they arm them: virtual time runs only while a request waits.
// Bounded: a million timers at most.
func driveClock(t *testing.T, clk *clock.Fake, url, body string) (int, http.Header, string) {
	t.Helper()
	type answer struct {
		code int
		hdr  http.Header
		body string
		err  error
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := http.Post(url, "application/json", strings.NewReader(body))
		if err != nil {
			done <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		done <- answer{resp.StatusCode, resp.Header, string(b), err}
	}()
	for k := 0; k < 1_000_000; k++ {
		select {
		case a := <-done:
			if a.err != nil {
				t.Fatalf("POST %s: %v", url, a.err)
			}
			return a.code, a.hdr, a.body
		default:
		}
		nextTimer(clk)
	}
	t.Fatalf("POST %s: no answer after a million timers", url)
	return 0, nil, ""
}

// nextTimer moves clk to its earliest armed timer, waiting (a bounded
// while, yielding) for the sims' drivers to arm one; false when none came.
func nextTimer(clk *clock.Fake) bool {
	for range 100_000 {
		if p := clk.Pending(); len(p) > 0 {
			clk.Advance(slices.Min(p))
			return true
		}
		runtime.Gosched()
	}
	return false
}

// simPulls is a sim's count of peer pulls with result (pulled, missed).
func simPulls(t *testing.T, url, result string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	total := 0.0
	for _, m := range fams[sim.MetricPeerPulls].GetMetric() {
		if matches(m, map[string]string{"result": result}) {
			total += m.GetCounter().GetValue()
		}
	}
	return total
}

// servable asks a sim (its side channel, as a peer would) how many leading
// blocks of text's prompt it holds in any tier.
func servable(t *testing.T, url, text string) int {
	t.Helper()
	hashes := prompt.ApproxBlockHashes(nil, prompt.RootOf("engine", prompt.Key{Model: sim.DefaultModel}), text, 16)
	body, _ := json.Marshal(map[string]any{"block_hashes": hashes})
	resp, out := post(t, url+sim.PathKVServable, string(body))
	var a struct {
		Blocks int `json:"blocks"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal([]byte(out), &a) != nil {
		t.Fatalf("servable: %d %s", resp.StatusCode, out)
	}
	return a.Blocks
}

// The pull goes to the replica as llm-d's sidecar sends it: the client's
// kv_transfer_params replaced by {param: {kv_request_id, remote_host,
// remote_port}} (every other member kept), remote_port the source's own
// or kv_pulls.port; the answer names the source.
func TestPullBodyShape(t *testing.T) {
	for _, c := range []struct {
		name  string
		param string
		port  int
	}{{"defaults", DefaultKVPullParam, 0}, {"configured", "p2p", 7777}} {
		t.Run(c.name, func(t *testing.T) {
			a, b := newFakeReplica(t), newFakeReplica(t)
			cfg := simConfig("round_robin", a.srv.URL, b.srv.URL)
			cfg.KVPulls = KVPullsConfig{Enabled: true, Param: c.param, Port: c.port}
			gw := startGateway(t, cfg)
			// Healthy, and their models listed: round_robin then alternates
			// (a replica whose models are not known yet is not a candidate).
			eventually(t, "both replicas healthy, their models listed", func() bool {
				rt := gw.g.Router()
				return rt.Healthy(0) && rt.Healthy(1) && rt.Replica(0).Served() != nil && rt.Replica(1).Served() != nil
			})
			body := `{"model":"m","prompt":"` + pullText("x", 200) + `","max_tokens":3,` +
				`"kv_transfer_params":{"remote_kv_source":{"remote_host":"evil","remote_port":1}}}`
			first, _ := post(t, gw.srv.URL+"/v1/completions", body, "X-Request-Id", "dup")
			second, _ := post(t, gw.srv.URL+"/v1/completions", body, "X-Request-Id", "dup")
			src, dst := first.Header.Get("X-Kvgate-Replica"), second.Header.Get("X-Kvgate-Replica")
			if src == dst || second.Header.Get(headerPullFrom) != src || first.Header.Get(headerPullFrom) != "" {
				t.Fatalf("first on %s, second on %s pulling from %q", src, dst, second.Header.Get(headerPullFrom))
			}
			rep := b
			if dst == a.srv.URL {
				rep = a
			}
			rep.mu.Lock()
			sent, id := rep.bodies[len(rep.bodies)-1], rep.headers[len(rep.headers)-1].Get("X-Request-Id")
			rep.mu.Unlock()
			// The pull's id is its own (kvTransferID), the replica's
			// request id too; the client's stays the answer's.
			if !strings.HasPrefix(id, "dup-kv") || second.Header.Get("X-Request-Id") != "dup" {
				t.Fatalf("the replica's request id %q, the answer's %q", id, second.Header.Get("X-Request-Id"))
			}
			var got map[string]json.RawMessage
			if err := json.Unmarshal(sent, &got); err != nil || string(got["max_tokens"]) != "3" {
				t.Fatalf("sent %s", sent)
			}
			var kv map[string]kvPullSource
			if err := json.Unmarshal(got["kv_transfer_params"], &kv); err != nil || len(kv) != 1 {
				t.Fatalf("kv_transfer_params %s", got["kv_transfer_params"])
			}
			want := kvPullSource{RequestID: id, Host: "127.0.0.1", Port: c.port}
			if c.port == 0 {
				want.Port = portOf(t, src)
			}
			if kv[c.param] != want {
				t.Fatalf("%s: %+v, want %+v", c.param, kv[c.param], want)
			}
		})
	}
}

func portOf(t *testing.T, u string) int {
	t.Helper()
	var p int
	if _, err := fmt.Sscanf(u[strings.LastIndex(u, ":")+1:], "%d", &p); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestKVPullsConfig(t *testing.T) {
	for _, c := range []struct {
		yaml, err string
	}{
		{"kv_pulls: {enabled: true}\noffload_blocks: 120000", ""},
		{"kv_pulls: {param: 'Remote KV'}", "kv_pulls.param"},
		{"kv_pulls: {port: 70000}", "kv_pulls.port"},
		{"offload_blocks: -1", "offload_blocks"},
	} {
		cfg, err := ParseConfig([]byte("replicas: [{url: 'http://a:1'}]\n" + c.yaml))
		if err == nil {
			err = cfg.Validate()
		}
		if (err == nil) != (c.err == "") || (err != nil && !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%s: %v", c.yaml, err)
		}
	}
}
