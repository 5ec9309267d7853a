package gateway

import (
	"encoding/json"
	"fmt"
	"testing"
)

// A program id (prompt_cache_key, a session header) names a program of
// the client's tenant only: tenants that do not isolate their caches share
// a partition (model, adapter, no salt), and before, b's X-Session-Id "s"
// continued a's program "s" — its home, context, turns and KV
// reservation, its turn priority in the queue. /debug/route?tenant= keys
// a request as that tenant's.
func TestProgramIdsPerTenant(t *testing.T) {
	f := newFakeReplica(t)
	cfg := baseConfig(f.srv.URL)
	cfg.AdminToken = "adm"
	cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}}, {Name: "b", APIKeys: []string{"kb"}}}
	gw := startGateway(t, cfg)
	allListed(t, gw)
	send := func(key, body string, hdr ...string) {
		t.Helper()
		if resp, b := post(t, gw.srv.URL+"/v1/completions", body, append(bearerHdr(key), hdr...)...); resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", key, resp.StatusCode, b)
		}
	}
	for i := range 2 {
		send("ka", fmt.Sprintf(`{"model":"m","prompt":"a's turn %d","max_tokens":2}`, i), "X-Session-Id", "s")
	}
	continues := func(tenant string) bool {
		t.Helper()
		resp, b := post(t, gw.srv.URL+"/debug/route?tenant="+tenant, `{"model":"m","prompt":"next"}`,
			"Authorization", "Bearer adm", "X-Session-Id", "s")
		var out struct {
			Program *struct {
				Continues bool `json:"continues"`
			} `json:"program"`
		}
		if resp.StatusCode != 200 || json.Unmarshal([]byte(b), &out) != nil || out.Program == nil {
			t.Fatalf("/debug/route: %d %s", resp.StatusCode, b)
		}
		return out.Program.Continues
	}
	if !continues("a") || continues("b") {
		t.Fatalf("after a's turns of program s: a's next continues %v, b's %v; want true, false", continues("a"), continues("b"))
	}
	send("kb", `{"model":"m","prompt":"b's turn","max_tokens":2}`, "X-Session-Id", "s")
	send("kb", `{"model":"m","prompt":"b's other turn","max_tokens":2,"prompt_cache_key":"s"}`)
	waitIdle(t, gw)
	if st := gw.g.rt.ProgramStats(); st.Tracked != 2 {
		t.Fatalf("tenants a and b naming program s: %d programs tracked, want 2", st.Tracked)
	}
}
