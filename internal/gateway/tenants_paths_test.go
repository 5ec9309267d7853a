package gateway

import (
	"strings"
	"testing"
)

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

// The salt the gateway sends stays within vLLM's bound on cache_salt
// (1,024 characters) whenever the client's did: a long salt's prefixed
// form names the salt by its SHA-256, apart per client salt and per
// tenant. Before, a client's valid 1,020-character salt went out as
// 1,034 characters and vLLM refused the request.
func TestTenantSaltWithinVLLMBound(t *testing.T) {
	tc := &tenancy{isolating: true}
	gold := &tenant{name: "gold", isolate: true}
	long := strings.Repeat("s", 1020)
	for _, c := range []struct {
		t          *tenant
		salt, head string
	}{{nil, long, saltClient}, {gold, long, saltTenant + "gold:"}, {gold, long[:1000], saltTenant + "gold:"}, {nil, "short", saltClient + "short"}} {
		got, ok := tc.salt(c.t, c.salt)
		if !ok || len(got) > maxCacheSalt || !strings.HasPrefix(got, c.head) {
			t.Errorf("salt %d chars of %q: sent %d chars %.40q", len(c.salt), c.t.label(), len(got), got)
		}
		if other, _ := tc.salt(c.t, "x"+c.salt[1:]); other == got {
			t.Errorf("two salts of %q sent as one: %.40q", c.t.label(), got)
		}
	}
	if got, _ := tc.salt(nil, long+long); got != saltClient+long+long {
		t.Errorf("a salt over vLLM's bound is the client's to fix (vLLM refuses it): sent %.40q", got)
	}
}
