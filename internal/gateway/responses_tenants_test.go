package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/testutil"
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

// A stored response's owner outlives the gateway that saw it created: two
// gateways share a Redis, tenant a creates a response through the first,
// and through the second tenant b gets the 404 of an unknown id (nothing
// reaches a replica) while a reads it from its replica, pinned by the
// shared record (the other replica is never asked). With tenants, an id
// whose owner no record names is refused alike, and one the gateway
// cannot check (Redis down) is a 503, not a 404. Before, the second
// gateway looked the id up for any tenant.
func TestStoredResponsesOwnerShared(t *testing.T) {
	rd := testutil.NewRedis(t)
	f1, f2 := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "m", "")
	cfg := baseConfig(f1.srv.URL, f2.srv.URL)
	cfg.SharedState = rd.URL()
	cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}}, {Name: "b", APIKeys: []string{"kb"}}}
	gws := [2]*testGW{startGatewayWith(t, cfg, Options{Registry: prometheus.NewRegistry()}),
		startGatewayWith(t, cfg, Options{Registry: prometheus.NewRegistry()})}
	for _, gw := range gws {
		allListed(t, gw)
		eventually(t, "shared state warm", func() bool { return gw.g.ctl.Ready() == nil })
	}
	status, out := callWithKey(t, http.MethodPost, gws[0].srv.URL+"/v1/responses", "ka", `{"model":"m","input":"a's secret"}`)
	var r struct {
		ID string `json:"id"`
	}
	if status != 200 || json.Unmarshal([]byte(out), &r) != nil || r.ID == "" {
		t.Fatalf("a's call: %d %s", status, out)
	}
	holder, other := f1, f2
	if !f1.holds(r.ID) {
		holder, other = f2, f1
	}
	c := redis.NewClient(&redis.Options{Addr: rd.Addr()})
	defer c.Close()
	eventually(t, "the record written", func() bool { return c.Exists(context.Background(), "kvgate:resp:"+r.ID).Val() == 1 })
	before := len(holder.requests()) + len(other.requests())
	for _, body := range []string{"", fmt.Sprintf(`{"model":"m","input":"and then?","previous_response_id":%q}`, r.ID)} {
		method, path := http.MethodGet, "/v1/responses/"+r.ID
		if body != "" {
			method, path = http.MethodPost, "/v1/responses"
		}
		if status, out := callWithKey(t, method, gws[1].srv.URL+path, "kb", body); status != http.StatusNotFound {
			t.Errorf("b's %s %s of a's response through the other gateway: %d %s, want 404", method, path, status, out)
		}
	}
	if n := len(holder.requests()) + len(other.requests()); n != before {
		t.Errorf("b's calls reached a replica: %d requests", n-before)
	}
	if status, out := callWithKey(t, http.MethodGet, gws[1].srv.URL+"/v1/responses/"+r.ID, "ka", ""); status != 200 {
		t.Errorf("a reading its own response through the other gateway: %d %s", status, out)
	}
	if n := len(other.requests()); n != 0 {
		t.Errorf("the replica not holding it was asked %d times: %v", n, other.requests())
	}
	// A response its owner deleted loses its record: the other gateway
	// knows nothing of it (a 404 of its own, no replica asked). Before, the
	// record stayed a day and the other gateway sent the call on.
	status, out = callWithKey(t, http.MethodPost, gws[0].srv.URL+"/v1/responses", "ka", `{"model":"m","input":"to delete"}`)
	var gone struct {
		ID string `json:"id"`
	}
	if status != 200 || json.Unmarshal([]byte(out), &gone) != nil || gone.ID == "" {
		t.Fatalf("a's second call: %d %s", status, out)
	}
	eventually(t, "the second record written", func() bool { return c.Exists(context.Background(), "kvgate:resp:"+gone.ID).Val() == 1 })
	if status, out := callWithKey(t, http.MethodDelete, gws[0].srv.URL+"/v1/responses/"+gone.ID, "ka", ""); status != 200 {
		t.Fatalf("a deleting its response: %d %s", status, out)
	}
	eventually(t, "the record deleted", func() bool { return c.Exists(context.Background(), "kvgate:resp:"+gone.ID).Val() == 0 })
	before = len(holder.requests()) + len(other.requests())
	if status, out := callWithKey(t, http.MethodGet, gws[1].srv.URL+"/v1/responses/"+gone.ID, "ka", ""); status != http.StatusNotFound {
		t.Errorf("a deleted response through the other gateway: %d %s, want 404", status, out)
	}
	if n := len(holder.requests()) + len(other.requests()); n != before {
		t.Errorf("a call naming a deleted response reached a replica: %d requests", n-before)
	}
	// No record names the owner of an id the replica holds: refused.
	holder.put("resp_made_elsewhere")
	if status, out := callWithKey(t, http.MethodGet, gws[1].srv.URL+"/v1/responses/resp_made_elsewhere", "ka", ""); status != http.StatusNotFound {
		t.Errorf("an id of unknown owner, with tenants: %d %s, want 404", status, out)
	}
	rd.Stop()
	if status, out := callWithKey(t, http.MethodGet, gws[1].srv.URL+"/v1/responses/resp_made_elsewhere", "ka", ""); status != http.StatusServiceUnavailable ||
		!strings.Contains(out, "shared_state_unavailable") {
		t.Errorf("an id whose owner cannot be checked: %d %s, want 503", status, out)
	}
	// An owner read once from the record is remembered: with Redis down,
	// its owner's calls go on (and, Redis up, cost no read each).
	if status, out := callWithKey(t, http.MethodGet, gws[1].srv.URL+"/v1/responses/"+r.ID, "ka", ""); status != 200 {
		t.Errorf("a reading its own response, checked before, with Redis down: %d %s, want 200", status, out)
	}
	for _, gw := range gws {
		waitIdle(t, gw)
	}
}

// holds reports whether the replica stores response id.
func (f *apiReplica) holds(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.store[id]
}

// put stores response id as if a call made it straight on the replica.
func (f *apiReplica) put(id string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.store[id] = true
}

// A streamed response's id is its owner's to name as soon as the client
// reads it (response.created), while the stream goes on: a GET (or, in
// background mode, a cancel) of it reaches its replica. Before, the
// gateway remembered the response, and recorded its owner, only once the
// stream had ended: with tenants, the id was meanwhile refused as one of
// unknown owner (404).
func TestStreamedResponseOwnedAtOnce(t *testing.T) {
	f := newAPIReplica(t, "a", "m", "")
	f.hold = make(chan struct{})
	release := sync.OnceFunc(func() { close(f.hold) })
	defer release()
	cfg := baseConfig(f.srv.URL)
	cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}}, {Name: "b", APIKeys: []string{"kb"}}}
	gw := startGateway(t, cfg)
	allListed(t, gw)
	req, _ := http.NewRequest(http.MethodPost, gw.srv.URL+"/v1/responses", strings.NewReader(`{"model":"m","input":"x","stream":true}`))
	req.Header.Set("Authorization", "Bearer ka")
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	ev, err := openai.NewEventReader(resp.Body, 1<<20).Next()
	var created struct {
		Response struct {
			ID string `json:"id"`
		} `json:"response"`
	}
	if err != nil || json.Unmarshal(ev.Data, &created) != nil || created.Response.ID == "" {
		t.Fatalf("the stream's first event: %q %v", ev.Raw, err)
	}
	id := created.Response.ID
	if status, out := callWithKey(t, http.MethodGet, gw.srv.URL+"/v1/responses/"+id, "ka", ""); status != http.StatusOK {
		t.Errorf("the owner reading its response while it streams: %d %s, want 200", status, out)
	}
	if status, out := callWithKey(t, http.MethodGet, gw.srv.URL+"/v1/responses/"+id, "kb", ""); status != http.StatusNotFound {
		t.Errorf("another tenant reading it while it streams: %d %s, want 404", status, out)
	}
	// Its owner deletes it before the stream ends: the stream's end does
	// not remember it again (before, the attempt's end recorded it anew,
	// here and in the shared state, for a day).
	if status, out := callWithKey(t, http.MethodDelete, gw.srv.URL+"/v1/responses/"+id, "ka", ""); status != http.StatusOK {
		t.Fatalf("the owner deleting its response while it streams: %d %s", status, out)
	}
	release()
	_, _ = io.Copy(io.Discard, resp.Body)
	waitIdle(t, gw)
	if _, ok := gw.g.pt.homes.c.Peek(id); ok {
		t.Error("a response deleted while it streamed is remembered again at the stream's end")
	}
}

// Without shared state, a stored response's owner outlives a restart:
// the homes are written beside state_file at shutdown and read at start.
// With tenants an id whose owner the gateway does not know is refused
// (404), so before, a restart ended every tenant's open Responses chain:
// tenant a's own GET of its response got 404 from the restarted gateway.
// Tenant b still gets 404, and a file out of bounds is refused whole.
func TestStoredResponsesOwnerAcrossRestart(t *testing.T) {
	f := newAPIReplica(t, "a", "m", "")
	cfg := baseConfig(f.srv.URL)
	cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}}, {Name: "b", APIKeys: []string{"kb"}}}
	cfg.StateFile = filepath.Join(t.TempDir(), "kvgate.state")
	first := startGateway(t, cfg)
	allListed(t, first)
	status, out := callWithKey(t, http.MethodPost, first.srv.URL+"/v1/responses", "ka", `{"model":"m","input":"a's secret"}`)
	var r struct {
		ID string `json:"id"`
	}
	if status != 200 || json.Unmarshal([]byte(out), &r) != nil || r.ID == "" {
		t.Fatalf("a's call: %d %s", status, out)
	}
	waitIdle(t, first)
	first.stop()

	again := startGateway(t, cfg)
	allListed(t, again)
	if status, out := callWithKey(t, http.MethodGet, again.srv.URL+"/v1/responses/"+r.ID, "ka", ""); status != 200 {
		t.Errorf("a reading its own response after the restart: %d %s", status, out)
	}
	if status, out := callWithKey(t, http.MethodGet, again.srv.URL+"/v1/responses/"+r.ID, "kb", ""); status != http.StatusNotFound {
		t.Errorf("b reading a's response after the restart: %d %s, want 404", status, out)
	}
	waitIdle(t, again)
	again.stop()

	// A tampered file (an entry's tenant without an owner) is refused whole.
	path := responsesPath(cfg.StateFile)
	bad := fmt.Sprintf(`{"version":1,"homes":[{"id":%q,"replica":%q,"tenant":"b"}]}`, r.ID, f.srv.URL)
	if err := os.WriteFile(path, []byte(bad), 0o600); err != nil {
		t.Fatal(err)
	}
	h := newResponseHomes(again.g.rt, 16, nil, true, time.Now)
	if n, err := h.load(path); err == nil || n != 0 || h.c.Len() != 0 {
		t.Fatalf("a tampered file: %d homes, %v; want refused", n, err)
	}
}

// vLLM takes a Responses call's id from its request_id: with tenants, a
// client naming another tenant's response id there would take it over.
// The gateway drops the member (spelled plainly or with escapes), so the
// replica makes an id of its own; without tenants it stays the client's.
func TestResponsesRequestIDNotTheClients(t *testing.T) {
	for _, tenants := range []bool{true, false} {
		f := newAPIReplica(t, "a", "m", "")
		cfg := baseConfig(f.srv.URL)
		key := ""
		if tenants {
			cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}}}
			key = "ka"
		}
		gw := startGateway(t, cfg)
		allListed(t, gw)
		for _, body := range []string{`{"model":"m","input":"hi","request_id":"resp_theirs"}`,
			`{"model":"m","input":"hi","request\u005fid":"resp_theirs"}`} {
			if status, out := callWithKey(t, http.MethodPost, gw.srv.URL+"/v1/responses", key, body); status != 200 {
				t.Fatalf("tenants %v: %d %s", tenants, status, out)
			}
			if got := f.body("/v1/responses"); strings.Contains(got, "resp_theirs") == tenants {
				t.Errorf("tenants %v: the replica got %s", tenants, got)
			}
		}
		waitIdle(t, gw)
	}
}
