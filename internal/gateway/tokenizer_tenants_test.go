package gateway

import (
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"
)

// tokenizeStub is a stub replica (models: its /v1/models) whose /tokenize
// answers 17 tokens at once, counted in calls.
func tokenizeStub(t *testing.T, models string, calls *atomic.Int64) *stub {
	s := newStub(t, models, okStream(1))
	mux := http.NewServeMux()
	mux.Handle("/", s.srv.Config.Handler)
	mux.HandleFunc("/tokenize", func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		_, _ = io.WriteString(w, `{"tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`)
	})
	s.srv.Config.Handler = mux
	return s
}

// The remote tokenizer's cache is keyed by the prompt's cache salt too:
// an isolated tenant's prompts are not another's cache hits. Before, a
// tenant whose prompt was tokenized at once (µs: cached) instead of after
// a call to a replica (ms) learnt that another tenant had just sent that
// exact text: the prompt-guessing channel isolate_cache closes in the KV
// cache, open in the gateway's.
func TestRemoteTokenizerCachePerSalt(t *testing.T) {
	var calls atomic.Int64
	s := tokenizeStub(t, "", &calls)
	cfg := baseConfig(s.srv.URL)
	cfg.Tokenizer = "remote"
	cfg.TokenizeTimeout = Duration(time.Minute)
	cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}, IsolateCache: true},
		{Name: "b", APIKeys: []string{"kb"}, IsolateCache: true}}
	gw := startGateway(t, cfg)
	allListed(t, gw)
	body := `{"model":"m","prompt":"the secret prompt of tenant a"}`
	for i, c := range []struct {
		key  string
		want int64
	}{{"ka", 1}, {"ka", 1}, {"kb", 2}, {"kb", 2}} {
		if resp, b := post(t, gw.srv.URL+"/v1/completions", body, bearerHdr(c.key)...); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		if n := calls.Load(); n != c.want {
			t.Fatalf("request %d (%s): %d /tokenize calls, want %d", i, c.key, n, c.want)
		}
	}
	waitIdle(t, gw)
}
