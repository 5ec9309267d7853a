package gateway

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// twoPoolGateway is a gateway with pools llama (two replicas of
// llama-3-8b, least_load) and qwen (two replicas of Qwen/Qwen2.5-7B,
// round_robin; the second also serves the adapter support-lora, and the
// first an adapter llama-special that no llama replica serves).
func twoPoolGateway(t *testing.T) (*testGW, []string, []string) {
	t.Helper()
	llama := startSim(t, sim.Config{Replicas: 2, Model: "llama-3-8b"})
	qwen := startSim(t, sim.Config{Replicas: 2, Model: "Qwen/Qwen2.5-7B",
		PerReplica: []sim.ReplicaOverride{{Model: "Qwen/Qwen2.5-7B", Adapters: []string{"llama-special"}},
			{Model: "Qwen/Qwen2.5-7B", Adapters: []string{"support-lora"}}}})
	cfg := baseConfig()
	cfg.AdminToken = "tok"
	cfg.Pools = []PoolConfig{
		{Name: "llama", Models: []string{"meta-llama/Llama-3.1-8B-Instruct", "llama-*"}, Policy: "least_load"},
		{Name: "qwen", Models: []string{"Qwen/*"}, Policy: "round_robin"},
	}
	for _, u := range llama.URLs() {
		cfg.Pools[0].Replicas = append(cfg.Pools[0].Replicas, ReplicaConfig{URL: u})
	}
	for _, u := range qwen.URLs() {
		cfg.Pools[1].Replicas = append(cfg.Pools[1].Replicas, ReplicaConfig{URL: u})
	}
	gw := startGateway(t, cfg)
	eventually(t, "every replica lists its models", func() bool {
		for i := range gw.g.Router().Replicas() {
			if gw.g.Router().Replica(i).Served() == nil {
				return false
			}
		}
		return true
	})
	return gw, llama.URLs(), qwen.URLs()
}

// A two-model config routes each model only to its replicas, each with
// its policy.
func TestPoolsRouteEachModelToItsReplicas(t *testing.T) {
	gw, llama, qwen := twoPoolGateway(t)
	got := map[string][]string{}
	for i := range 8 {
		for _, model := range []string{"llama-3-8b", "Qwen/Qwen2.5-7B", "support-lora"} {
			body := fmt.Sprintf(`{"model":%q,"prompt":"request %d for %s","max_tokens":2}`, model, i, model)
			resp, out := post(t, gw.srv.URL+"/v1/completions", body)
			if resp.StatusCode != 200 {
				t.Fatalf("%s: %d %s", model, resp.StatusCode, out)
			}
			got[model] = append(got[model], resp.Header.Get("X-Kvgate-Replica"))
		}
	}
	for model, pool := range map[string][]string{"llama-3-8b": llama, "Qwen/Qwen2.5-7B": qwen, "support-lora": qwen[1:]} {
		for _, r := range got[model] {
			if !slices.Contains(pool, r) {
				t.Fatalf("%s went to %s, outside its pool's %v (all: %v)", model, r, pool, got[model])
			}
		}
	}
	// Each pool's policy decided its requests: the live decisions' reasons
	// (the live view's list) name it.
	eventually(t, "every request's decision noted", func() bool { return gw.g.ui.Snapshot(time.Now()).Attempts == 24 })
	for _, d := range gw.g.ui.Snapshot(time.Now()).Decisions {
		want := map[bool]string{true: "fewest in flight", false: "round robin"}[d.Model == "llama-3-8b"]
		if d.Decision.Reason != want {
			t.Fatalf("a request for %s was decided %q, want %q", d.Model, d.Decision.Reason, want)
		}
	}
	for _, c := range []struct{ model, pool, policy, reason string }{
		{"llama-3-8b", "llama", "least_load", "fewest in flight"},
		{"Qwen/Qwen2.5-7B", "qwen", "round_robin", "round robin"},
	} {
		d := debugRoute(t, gw, c.model)
		if d.Pool != c.pool || d.Policy != c.policy || d.Decision.Reason != c.reason {
			t.Fatalf("/debug/route for %s: pool %q policy %q reason %q; want %s, %s, %q", c.model, d.Pool, d.Policy, d.Decision.Reason, c.pool, c.policy, c.reason)
		}
		for _, r := range d.Replicas {
			if r.Healthy != (r.Pool == c.pool) {
				t.Fatalf("/debug/route for %s: replica %s of pool %s healthy %v", c.model, r.URL, r.Pool, r.Healthy)
			}
		}
	}
}

type debugAnswer struct {
	Pool     string `json:"pool"`
	Policy   string `json:"policy"`
	Decision struct {
		Reason string `json:"reason"`
	} `json:"decision"`
	Replicas []struct {
		URL     string `json:"url"`
		Pool    string `json:"pool"`
		Healthy bool   `json:"healthy"`
	} `json:"replicas"`
}

func debugRoute(t *testing.T, gw *testGW, model string) debugAnswer {
	t.Helper()
	resp, body := post(t, gw.srv.URL+"/debug/route", fmt.Sprintf(`{"model":%q,"prompt":"hello"}`, model), "Authorization", "Bearer tok")
	if resp.StatusCode != 200 {
		t.Fatalf("/debug/route %s: %d %s", model, resp.StatusCode, body)
	}
	var d debugAnswer
	if err := json.Unmarshal([]byte(body), &d); err != nil {
		t.Fatal(err)
	}
	return d
}

// /v1/models lists what a pool routes to a replica listing it; a model no
// pool routes there is neither listed nor served.
func TestPoolsModelsAndUnroutedModels(t *testing.T) {
	gw, _, _ := twoPoolGateway(t)
	resp, body := get(t, gw.srv.URL+"/v1/models")
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal([]byte(body), &list); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	slices.Sort(ids)
	// llama-special is listed by a qwen replica but routed by the llama
	// pool, whose replicas do not serve it.
	if strings.Join(ids, ",") != "Qwen/Qwen2.5-7B,llama-3-8b,support-lora" {
		t.Fatalf("/v1/models lists %v", ids)
	}
	for _, model := range []string{"llama-special", "mistral-7b"} {
		resp, body := post(t, gw.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"x","max_tokens":1}`, model))
		if resp.StatusCode != 404 || !strings.Contains(body, "model_not_found") && !strings.Contains(body, "does not exist") {
			t.Fatalf("%s: %d %s, want 404", model, resp.StatusCode, body)
		}
	}
	resp, body = get(t, gw.srv.URL+"/metrics")
	if resp.StatusCode != 200 || strings.Count(body, "kvgate_pool_info{") != 4 || !strings.Contains(body, `kvgate_pool_info{pool="qwen"`) {
		t.Fatalf("kvgate_pool_info: %s", grepLines(body, "kvgate_pool_info"))
	}
	resp, body = get(t, gw.srv.URL+"/admin/replicas", "Authorization", "Bearer tok")
	if resp.StatusCode != 200 || strings.Count(body, `"pool": "llama"`) != 2 || strings.Count(body, `"pool": "qwen"`) != 2 {
		t.Fatalf("/admin/replicas: %d %s", resp.StatusCode, body)
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// The pool without replicas: takes what the replicas file lists, and only
// that pool changes when the file does: the other pool's replicas stay.
func TestPoolsFedByTheReplicasFileLive(t *testing.T) {
	llama := startSim(t, sim.Config{Replicas: 1, Model: "llama-3-8b"})
	qwen := startSim(t, sim.Config{Replicas: 2, Model: "Qwen/Qwen2.5-7B"})
	path := filepath.Join(t.TempDir(), "replicas.yaml")
	writeAtomically(t, path, "- url: "+qwen.URLs()[0]+"\n")
	cfg := baseConfig()
	cfg.ReplicasFile = path
	cfg.Pools = []PoolConfig{
		{Name: "llama", Models: []string{"llama-*"}, Replicas: []ReplicaConfig{{URL: llama.URLs()[0]}}},
		{Name: "qwen", Models: []string{"Qwen/*"}, Policy: "least_load"},
	}
	tg := startGatewayWith(t, cfg, Options{})
	eventually(t, "both pools routable", func() bool {
		return routable(tg, llama.URLs()[0]) && routable(tg, qwen.URLs()[0])
	})
	writeAtomically(t, path, "- url: "+qwen.URLs()[0]+"\n- url: "+qwen.URLs()[1]+"\n")
	tg.g.Reload()
	eventually(t, "the second qwen replica added", func() bool { return routable(tg, qwen.URLs()[1]) })
	for i, want := range map[int]string{0: "llama", 1: "qwen", 2: "qwen"} {
		if got := tg.g.rt.Replica(i).Pool(); got != want || tg.g.rt.Replica(i).Removed() {
			t.Fatalf("replica %s: pool %q removed %v, want %s", tg.g.rt.Name(i), got, tg.g.rt.Replica(i).Removed(), want)
		}
	}
	for i := range 6 {
		for model, pool := range map[string][]string{"llama-3-8b": llama.URLs(), "Qwen/Qwen2.5-7B": qwen.URLs()} {
			resp, out := post(t, tg.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"p %d","max_tokens":1}`, model, i))
			if resp.StatusCode != 200 || !slices.Contains(pool, resp.Header.Get("X-Kvgate-Replica")) {
				t.Fatalf("%s: %d from %s (%s), want one of %v", model, resp.StatusCode, resp.Header.Get("X-Kvgate-Replica"), out, pool)
			}
		}
	}
	// A file naming the llama replica too is refused whole (a replica in
	// two pools): the next good file, processed after it, removes the
	// second qwen replica and leaves the llama pool's as it was.
	writeAtomically(t, path, "- url: "+qwen.URLs()[0]+"\n- url: "+llama.URLs()[0]+"\n")
	tg.g.Reload()
	writeAtomically(t, path, "- url: "+qwen.URLs()[0]+"\n")
	tg.g.Reload()
	eventually(t, "the second qwen replica removed", func() bool { return tg.g.rt.Replica(2).Removed() })
	if tg.g.rt.Replica(0).Pool() != "llama" || tg.g.rt.Replica(0).Removed() || tg.g.rt.Replicas() != 3 || tg.g.rt.Active() != 2 {
		t.Fatalf("after a refused file: replica 0 in %q, %d slots, %d active", tg.g.rt.Replica(0).Pool(), tg.g.rt.Replicas(), tg.g.rt.Active())
	}
}

// Each pool's own replicas file: a change of one pool's file changes that
// pool only, and a list naming another pool's replica is refused whole.
func TestPoolsOwnReplicasFiles(t *testing.T) {
	llama := startSim(t, sim.Config{Replicas: 2, Model: "llama-3-8b"})
	qwen := startSim(t, sim.Config{Replicas: 2, Model: "Qwen/Qwen2.5-7B"})
	dir := t.TempDir()
	lpath, qpath := filepath.Join(dir, "llama.yaml"), filepath.Join(dir, "qwen.yaml")
	writeAtomically(t, lpath, "- url: "+llama.URLs()[0]+"\n- url: "+llama.URLs()[1]+"\n")
	writeAtomically(t, qpath, "- url: "+qwen.URLs()[0]+"\n")
	cfg := baseConfig()
	cfg.Pools = []PoolConfig{
		{Name: "llama", Models: []string{"llama-*"}, ReplicasFile: lpath},
		{Name: "qwen", Models: []string{"Qwen/*"}, ReplicasFile: qpath},
	}
	tg := startGatewayWith(t, cfg, Options{})
	eventually(t, "the pools' replicas routable", func() bool {
		return routable(tg, llama.URLs()[0]) && routable(tg, llama.URLs()[1]) && routable(tg, qwen.URLs()[0])
	})
	writeAtomically(t, qpath, "- url: "+qwen.URLs()[0]+"\n- url: "+qwen.URLs()[1]+"\n")
	tg.g.Reload()
	eventually(t, "qwen's second replica added", func() bool { return routable(tg, qwen.URLs()[1]) })
	writeAtomically(t, lpath, "- url: "+llama.URLs()[0]+"\n")
	tg.g.Reload()
	eventually(t, "llama's second replica removed", func() bool { return replicaStateOf(tg, llama.URLs()[1]) == "removed" })
	// A qwen list naming a llama replica is refused; the next good one,
	// processed after it, is applied.
	writeAtomically(t, qpath, "- url: "+qwen.URLs()[0]+"\n- url: "+llama.URLs()[0]+"\n")
	tg.g.Reload()
	writeAtomically(t, qpath, "- url: "+qwen.URLs()[1]+"\n")
	tg.g.Reload()
	eventually(t, "qwen's first replica removed", func() bool { return replicaStateOf(tg, qwen.URLs()[0]) == "removed" })
	want := map[string]string{llama.URLs()[0]: "llama/active", llama.URLs()[1]: "llama/removed",
		qwen.URLs()[0]: "qwen/removed", qwen.URLs()[1]: "qwen/active"}
	for url, w := range want {
		i, ok := tg.g.rt.Lookup(url)
		if got := tg.g.rt.Replica(i).Pool() + "/" + replicaStateOf(tg, url); !ok || got != w {
			t.Errorf("%s: %s, want %s", url, got, w)
		}
	}
	for model, url := range map[string]string{"llama-3-8b": llama.URLs()[0], "Qwen/Qwen2.5-7B": qwen.URLs()[1]} {
		resp, out := post(t, tg.srv.URL+"/v1/completions", fmt.Sprintf(`{"model":%q,"prompt":"p","max_tokens":1}`, model))
		if resp.StatusCode != 200 || resp.Header.Get("X-Kvgate-Replica") != url {
			t.Fatalf("%s: %d from %s (%s), want %s", model, resp.StatusCode, resp.Header.Get("X-Kvgate-Replica"), out, url)
		}
	}
}

// Remote tokenization asks a replica of the model's pool only, even when
// another pool's replica lists the model too.
func TestPoolsRemoteTokenizerStaysInThePool(t *testing.T) {
	var own, other atomic.Int64
	mk := func(models string, calls *atomic.Int64) *stub { return tokenizeStub(t, models, calls) }
	a := mk(`{"object":"list","data":[{"id":"m","object":"model"}]}`, &own)
	b := mk(`{"object":"list","data":[{"id":"m","object":"model"},{"id":"other","object":"model"}]}`, &other)
	cfg := baseConfig()
	cfg.Tokenizer = "remote"
	cfg.Pools = []PoolConfig{
		{Name: "a", Models: []string{"m"}, Replicas: []ReplicaConfig{{URL: a.srv.URL}}},
		{Name: "b", Models: []string{"other"}, Replicas: []ReplicaConfig{{URL: b.srv.URL}}},
	}
	gw := startGateway(t, cfg)
	eventually(t, "both replicas listed", func() bool {
		return gw.g.rt.Replica(0).Served() != nil && gw.g.rt.Replica(1).Served() != nil
	})
	for i := range 6 {
		r := testutil.Post(t, nil, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"distinct prompt `+strings.Repeat("z", i)+`"}`)
		if r.Status != 200 || r.Header.Get("X-Kvgate-Replica") != a.srv.URL {
			t.Fatalf("%d from %s: %s", r.Status, r.Header.Get("X-Kvgate-Replica"), r.Body)
		}
	}
	if own.Load() != 6 || other.Load() != 0 {
		t.Fatalf("tokenize calls: the pool's replica %d, the other pool's %d; want 6 and 0", own.Load(), other.Load())
	}
}
