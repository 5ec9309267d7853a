package gateway

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
)

// A stored response created through the gateway by one tenant is not
// another tenant's to read, continue, cancel or delete: the replica keeps
// no owner (vLLM's store is the server's), so the gateway, which saw the
// owner's key, answers 404 as for an id it does not hold, and nothing
// reaches the replica. Before, tenant b holding a's response id read it.
func TestStoredResponsesPerTenant(t *testing.T) {
	f := newAPIReplica(t, "a", "m", "")
	cfg := baseConfig(f.srv.URL)
	cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}}, {Name: "b", APIKeys: []string{"kb"}}}
	gw := startGateway(t, cfg)
	allListed(t, gw)
	call := func(key, method, path, body string) (int, string) {
		t.Helper()
		return callWithKey(t, method, gw.srv.URL+path, key, body)
	}
	status, out := call("ka", http.MethodPost, "/v1/responses", `{"model":"m","input":"a's secret"}`)
	var r struct {
		ID string `json:"id"`
	}
	if status != 200 || json.Unmarshal([]byte(out), &r) != nil || r.ID == "" {
		t.Fatalf("a's call: %d %s", status, out)
	}
	before := len(f.requests())
	for _, c := range []struct{ method, path, body string }{
		{http.MethodGet, "/v1/responses/" + r.ID, ""},
		{http.MethodPost, "/v1/responses/" + r.ID + "/cancel", ""},
		{http.MethodPost, "/v1/responses", fmt.Sprintf(`{"model":"m","input":"and then?","previous_response_id":%q}`, r.ID)},
		{http.MethodDelete, "/v1/responses/" + r.ID, ""},
	} {
		if status, out := call("kb", c.method, c.path, c.body); status != http.StatusNotFound {
			t.Errorf("b's %s %s of a's response: %d %s, want 404", c.method, c.path, status, out)
		}
	}
	if got := f.requests(); len(got) != before {
		t.Errorf("b's calls reached the replica: %v", got[before:])
	}
	if status, out := call("ka", http.MethodGet, "/v1/responses/"+r.ID, ""); status != 200 {
		t.Errorf("a reading its own response: %d %s", status, out)
	}
	waitIdle(t, gw)
}
