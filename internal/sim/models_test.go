package sim

import (
	"encoding/json"
	"net/http"
	"slices"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/testutil"
)

// modelCard is what a test reads of a /v1/models entry.
type modelCard struct {
	ID          string
	Object      string
	Root        string
	Parent      string // "" for null
	MaxModelLen int
}

func listModels(t *testing.T, c *http.Client, url string) []modelCard {
	t.Helper()
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID          string  `json:"id"`
			Object      string  `json:"object"`
			Root        string  `json:"root"`
			Parent      *string `json:"parent"`
			MaxModelLen int     `json:"max_model_len"`
		} `json:"data"`
	}
	r := get(t, c, url+"/v1/models")
	if err := json.Unmarshal([]byte(r.Body), &list); err != nil || list.Object != "list" {
		t.Fatalf("/v1/models %d %s: %v", r.Status, r.Body, err)
	}
	var out []modelCard
	for _, d := range list.Data {
		m := modelCard{ID: d.ID, Object: d.Object, Root: d.Root, MaxModelLen: d.MaxModelLen}
		if d.Parent != nil {
			m.Parent = *d.Parent
		}
		out = append(out, m)
	}
	return out
}

func ids(cards []modelCard) []string {
	out := make([]string, len(cards))
	for i, m := range cards {
		out[i] = m.ID
	}
	return out
}

// --served-model-name: requests use the aliases, the model path is not a
// name; /v1/models lists the aliases with root = the path; the first alias
// names the model in metrics and the adapters' parent; aliases share one
// cache.
func TestServedModelNames(t *testing.T) {
	const path = "meta-llama/Llama-3.1-8B-Instruct"
	cfg := fast()
	cfg.Model, cfg.ServedModelNames, cfg.Adapters = path, []string{"llama", "llama-8b"}, []string{"sql-lora"}
	cfg.KVBlocks = 1000
	f := startFleet(t, cfg)
	c := testClient(t)
	url := f.URLs()[0]
	want := []modelCard{
		{ID: "llama", Object: "model", Root: path, MaxModelLen: 16000},
		{ID: "llama-8b", Object: "model", Root: path, MaxModelLen: 16000},
		{ID: "sql-lora", Object: "model", Root: "sql-lora", Parent: "llama", MaxModelLen: 16000},
	}
	if got := listModels(t, c, url); !slices.Equal(got, want) {
		t.Errorf("models %+v, want %+v", got, want)
	}
	text := jsonString(words("ali", 100))
	send := func(model string) testutil.Response {
		return testutil.Post(t, c, url+"/v1/completions", `{"model":"`+model+`","prompt":`+text+`,"max_tokens":1}`)
	}
	if r := send(path); r.Status != 404 {
		t.Errorf("the model path as a name: %d", r.Status)
	}
	first := decodeCompletion(t, send("llama"))
	second := decodeCompletion(t, send("llama-8b"))
	if first.Model != "llama" || second.Model != "llama-8b" || second.Usage.PromptTokensDetails.CachedTokens != 96 {
		t.Errorf("models %q %q, the alias hit %d cached tokens, want 96", first.Model, second.Model,
			second.Usage.PromptTokensDetails.CachedTokens)
	}
	if _, ok := metricValue(scrape(t, c, url), MetricRequestSuccess, map[string]string{"model_name": "llama"}); !ok {
		t.Error("metrics not labelled with the first served name")
	}
	if r := testutil.Post(t, c, url+"/tokenize", `{"prompt":"hello world"}`); r.Status != 200 {
		t.Errorf("tokenize without a model: %d %s", r.Status, r.Body)
	}
}

// PerReplica: replicas of one fleet serving different models and adapters.
func TestHeterogeneousFleet(t *testing.T) {
	cfg := fast()
	cfg.Replicas, cfg.Adapters = 3, []string{"a"}
	cfg.PerReplica = []ReplicaOverride{
		{},
		{Model: "other", Adapters: []string{}},
		{ServedModelNames: []string{"alias"}, Adapters: []string{"b", "c"}},
	}
	f := startFleet(t, cfg)
	c := testClient(t)
	tests := []struct {
		models, refused []string
		metricsModel    string
	}{
		{[]string{DefaultModel, "a"}, []string{"other", "alias", "b"}, DefaultModel},
		{[]string{"other"}, []string{DefaultModel, "a", "alias"}, "other"},
		{[]string{"alias", "b", "c"}, []string{DefaultModel, "a", "other"}, "alias"},
	}
	for i, tc := range tests {
		url := f.URLs()[i]
		if got := ids(listModels(t, c, url)); !slices.Equal(got, tc.models) {
			t.Errorf("replica %d serves %v, want %v", i, got, tc.models)
		}
		for _, m := range tc.models {
			decodeCompletion(t, testutil.Post(t, c, url+"/v1/completions", `{"model":"`+m+`","prompt":"x","max_tokens":1}`))
		}
		for _, m := range tc.refused {
			if r := testutil.Post(t, c, url+"/v1/completions", `{"model":"`+m+`","prompt":"x"}`); r.Status != 404 {
				t.Errorf("replica %d, model %s: %d", i, m, r.Status)
			}
		}
		if _, ok := metricValue(scrape(t, c, url), MetricRunning, map[string]string{"model_name": tc.metricsModel}); !ok {
			t.Errorf("replica %d: metrics not labelled %q", i, tc.metricsModel)
		}
		if got := f.Replicas()[i].Config().ServedModelNames[0]; got != tc.metricsModel {
			t.Errorf("replica %d: Config() serves %q", i, got)
		}
	}
	if f.Config().Model != DefaultModel || len(f.Config().Adapters) != 1 {
		t.Errorf("the fleet's config changed: %+v", f.Config())
	}
}

// loraSeries are the vllm:lora_requests_info series: labels → value.
func loraSeries(t *testing.T, c *http.Client, url string) map[[3]string]float64 {
	t.Helper()
	out := map[[3]string]float64{}
	fam := scrape(t, c, url)[MetricLoRAInfo]
	if fam == nil {
		return out
	}
	if fam.GetType().String() != "GAUGE" {
		t.Fatalf("%s is a %s", MetricLoRAInfo, fam.GetType())
	}
	for _, m := range fam.GetMetric() {
		l := map[string]string{}
		for _, p := range m.GetLabel() {
			l[p.GetName()] = p.GetValue()
		}
		if len(l) != 3 {
			t.Fatalf("labels %v", l)
		}
		out[[3]string{l["max_lora"], l["running_lora_adapters"], l["waiting_lora_adapters"]}] = m.GetGauge().GetValue()
	}
	return out
}

// vllm:lora_requests_info reports the adapters of the running and the
// waiting requests, valued at the scrape's Unix time; a label set seen
// before stays with the time it was last seen, as in vLLM. A replica
// without adapters has no such metric.
func TestLoRARequestsInfo(t *testing.T) {
	clk := newFakeClock()
	cfg := Config{Clock: clk, Seed: 1, MaxSeqs: 1, Adapters: []string{"sql", "chat"}}
	f := startFleet(t, cfg)
	c := testClient(t)
	url := f.URLs()[0]
	done := make(chan testutil.Response, 3)
	send := func(model string, live int) {
		go func() {
			done <- testutil.Post(t, c, url+"/v1/completions", `{"model":"`+model+`","prompt":"hi","max_tokens":2}`)
		}()
		testutil.Eventually(t, 10*time.Second, model+" queued", func() bool {
			st := f.Replicas()[0].Stats()
			return st.Running+st.Waiting == live
		})
	}
	send("sql", 1) // admitted at once; the others wait (MaxSeqs 1)
	send("chat", 2)
	send(DefaultModel, 3)
	testutil.Eventually(t, 10*time.Second, "the first admitted", func() bool {
		return f.Replicas()[0].Stats().Running == 1
	})
	t0 := float64(clk.Now().UnixNano()) / 1e9
	busy := [3]string{"2", "sql", "chat"}
	if got := loraSeries(t, c, url); len(got) != 1 || got[busy] != t0 {
		t.Fatalf("series %v, want %v at %v", got, busy, t0)
	}
	for range 3 {
		decodeCompletion(t, finish(t, clk, done))
	}
	clk.Advance(time.Second)
	idle := [3]string{"2", "", ""}
	got := loraSeries(t, c, url)
	if now := float64(clk.Now().UnixNano()) / 1e9; len(got) != 2 || got[busy] != t0 || got[idle] != now {
		t.Errorf("series %v, want %v at %v and %v at %v", got, busy, t0, idle, now)
	}
	plain := startFleet(t, fast())
	if got := loraSeries(t, c, plain.URLs()[0]); len(got) != 0 {
		t.Errorf("a replica without adapters reports %v", got)
	}
}
