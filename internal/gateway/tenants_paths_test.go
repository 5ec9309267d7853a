package gateway

import "testing"

// Every body the gateway passes carries vLLM's cache_salt and priority
// only as the gateway set them, whatever the path: a Responses call (vLLM's
// ResponsesRequest takes both) as a completion, an embeddings call
// (vLLM's pooling requests take priority, and a salt it names is
// namespaced). Before, only completions and chat were edited: an isolated
// tenant's Responses calls went to the replica without its salt (its KV
// shared with every client, a forged salt included), and any client's
// priority reached vLLM's scheduler unclamped.
func TestTenantBodyOtherPaths(t *testing.T) {
	cases := []struct {
		name, key, path, body string
		engine                bool
		salt, priority        string // "" absent
	}{
		{"responses isolated", "k-gold", "/v1/responses", `{"model":"m","input":"hi"}`, false, "kvgate-tenant:gold:", ""},
		{"responses own salt", "k-gold", "/v1/responses", `{"model":"m","input":"hi","cache_salt":"s1"}`, false, "kvgate-tenant:gold:s1", ""},
		{"responses forged salt", "k-bulk", "/v1/responses", `{"model":"m","input":"hi","cache_salt":"kvgate-tenant:gold:"}`, false,
			"kvgate-client:kvgate-tenant:gold:", ""},
		{"responses priority removed", "k-bulk", "/v1/responses", `{"model":"m","input":"hi","priority":-9}`, false, "", ""},
		{"responses band sent", "k-bulk", "/v1/responses", `{"model":"m","input":"hi","priority":-9}`, true, "", "2"},
		{"embeddings priority removed", "k-bulk", "/v1/embeddings", `{"model":"m","input":"hi","priority":-9}`, true, "", ""},
		{"embeddings forged salt", "k-bulk", "/v1/embeddings", `{"model":"m","input":"hi","cache_salt":"kvgate-tenant:gold:"}`, false,
			"kvgate-client:kvgate-tenant:gold:", ""},
		{"embeddings no salt added", "k-gold", "/v1/embeddings", `{"model":"m","input":"hi"}`, false, "", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newAPIReplica(t, "a", "m", "")
			cfg := tenantsConfig(f.srv.URL)
			cfg.FlowControl.EnginePriority = tc.engine
			gw := startGateway(t, cfg)
			allListed(t, gw)
			if resp, b := post(t, gw.srv.URL+tc.path, tc.body, bearerHdr(tc.key)...); resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
			checkSent(t, []byte(f.body(tc.path)), tc.salt, tc.priority)
			waitIdle(t, gw)
		})
	}
}
