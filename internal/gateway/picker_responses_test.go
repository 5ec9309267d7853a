package gateway

import (
	"context"
	"fmt"
	"net/http"
	"testing"
)

// Behind an endpoint picker a stored response is its tenant's too, as in
// serve: a response created through the picker is remembered (its replica
// and owner), another tenant naming it as previous_response_id gets the
// 404 of an unknown id (nothing is routed), and its owner's next call goes
// to the replica holding it. Before, the picker routed any tenant's call
// naming it by the policy: the replica that held it continued another
// tenant's conversation.
func TestPickerStoredResponsesPerTenant(t *testing.T) {
	f1, f2 := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "m", "")
	cfg := baseConfig(f1.srv.URL, f2.srv.URL)
	cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}}, {Name: "b", APIKeys: []string{"kb"}}}
	gw := startGateway(t, cfg)
	allListed(t, gw)
	p, err := gw.g.NewPicker(0)
	if err != nil {
		t.Fatal(err)
	}
	pick := func(key, body string) (*Handoff, Pick, *Reply) {
		return p.Pick(PickRequest{Context: context.Background(), Method: http.MethodPost, Target: "/v1/responses",
			Header: http.Header{"Authorization": {"Bearer " + key}, "Content-Type": {"application/json"}},
			Body:   []byte(body), RemoteAddr: "127.0.0.1:1", EditsAnswer: true})
	}
	h, first, reply := pick("ka", `{"model":"m","input":"a's secret"}`)
	if reply != nil {
		t.Fatalf("a's call refused: %d %s", reply.Status, reply.Body)
	}
	h.Respond(http.StatusOK, http.Header{"Content-Type": {"application/json"}}, "")
	h.Body([]byte(`{"id":"resp_a1","object":"response","created_at":1,"model":"m","status":"completed","output":[],`+
		`"usage":{"input_tokens":4,"output_tokens":1,"total_tokens":5}}`), true)
	h.End(true)
	next := func(key string) string {
		return fmt.Sprintf(`{"model":"m","input":"and then? (%s)","previous_response_id":"resp_a1"}`, key)
	}
	if h, _, reply := pick("kb", next("b")); reply == nil || reply.Status != http.StatusNotFound {
		if h != nil {
			h.End(false)
		}
		t.Errorf("b naming a's response through the picker: %v, want a 404", reply)
	}
	for range 4 {
		h, got, reply := pick("ka", next("a"))
		if reply != nil {
			t.Fatalf("a continuing its response: %d %s", reply.Status, reply.Body)
		}
		h.End(false)
		if got.Endpoint != first.Endpoint {
			t.Fatalf("a's next call went to %s, its response is on %s", got.Endpoint, first.Endpoint)
		}
	}
	waitIdle(t, gw)
}
