package gateway

import (
	"encoding/json"
	"testing"
)

// A client's kv_transfer_params never reach a replica, on any fleet and
// any path: they could point a replica's KV connector at any host (a
// remote prefill or a P2P pull to fetch, or to serve as this prompt's KV
// for every later client). Before, they were dropped only on a
// prefill/decode fleet's completions and chat and when a decision named a
// peer pull; a plain fleet's completions and every Responses call (on a
// prefill/decode fleet too: it goes whole to a decode replica) passed them.
func TestClientKVTransferParamsDropped(t *testing.T) {
	const evil = `"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"10.9.9.9","remote_port":1,` +
		`"remote_kv_source":{"remote_host":"10.9.9.9","remote_port":1}}`
	t.Run("completions", func(t *testing.T) {
		f := newFakeReplica(t)
		gw := startGateway(t, baseConfig(f.srv.URL))
		for _, body := range []string{`{"model":"m","prompt":"hi",` + evil + `}`,
			`{"model":"m","prompt":"hi","kv_transfer_p\u0061rams":{"remote_host":"10.9.9.9"}}`} {
			if resp, b := post(t, gw.srv.URL+"/v1/completions", body); resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, b)
			}
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		for _, sent := range f.bodies {
			if kvParamsIn(t, sent) {
				t.Errorf("the replica got the client's kv_transfer_params: %s", sent)
			}
		}
	})
	t.Run("responses", func(t *testing.T) {
		f := newAPIReplica(t, "a", "m", "")
		gw := apiGateway(t, f)
		if resp, b := post(t, gw.srv.URL+"/v1/responses", `{"model":"m","input":"hi",`+evil+`}`); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		if sent := f.body("/v1/responses"); kvParamsIn(t, []byte(sent)) {
			t.Errorf("the replica got the client's kv_transfer_params: %s", sent)
		}
	})
}

// pass_kv_transfer_params lets a client's through to an aggregated
// fleet, for a trusted prefill/decode proxy in front of kvgate that routes
// each of its steps through it.
func TestClientKVTransferParamsPassedWhenConfigured(t *testing.T) {
	f := newFakeReplica(t)
	cfg := baseConfig(f.srv.URL)
	cfg.PassKVTransferParams = true
	gw := startGateway(t, cfg)
	body := `{"model":"m","prompt":"hi","kv_transfer_params":{"do_remote_decode":true}}`
	if resp, b := post(t, gw.srv.URL+"/v1/completions", body); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, b)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.bodies) != 1 || !kvParamsIn(t, f.bodies[0]) {
		t.Errorf("with pass_kv_transfer_params the replica got %q, want the client's kv_transfer_params", f.bodies)
	}
}

// kvParamsIn: the JSON object body has a kv_transfer_params member.
func kvParamsIn(t *testing.T, body []byte) bool {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("%s: %v", body, err)
	}
	_, ok := m["kv_transfer_params"]
	return ok
}

// The Anthropic SDK's key header is a client's credential as Authorization
// is: with gateway keys it is the gateway's and never reaches a replica
// (the replica gets its own api_key); with none, the client's key is meant
// for the replicas and passes, as its Authorization does.
func TestClientAPIKeyHeaderNotForwarded(t *testing.T) {
	for _, keys := range []bool{true, false} {
		f := newFakeReplica(t)
		cfg := baseConfig(f.srv.URL)
		hdr := []string{"X-Api-Key", "client-secret"}
		if keys {
			cfg.APIKeys = []string{"k"}
			hdr = append(hdr, "Authorization", "Bearer k")
		}
		gw := startGateway(t, cfg)
		if resp, b := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"hi"}`, hdr...); resp.StatusCode != 200 {
			t.Fatalf("keys %v: %d %s", keys, resp.StatusCode, b)
		}
		f.mu.Lock()
		got := f.headers[0].Get("X-Api-Key")
		f.mu.Unlock()
		if want := map[bool]string{true: "", false: "client-secret"}[keys]; got != want {
			t.Errorf("gateway keys %v: the replica got X-Api-Key %q, want %q", keys, got, want)
		}
	}
}
