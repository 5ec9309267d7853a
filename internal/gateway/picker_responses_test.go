package gateway

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
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
	// The stored response's own path: its owner's GET goes to its replica,
	// another tenant's is the 404 of an unknown id. Before, the picker
	// answered every /v1/responses/{id} "no such endpoint".
	get := func(key string) (*Handoff, Pick, *Reply) {
		return p.Pick(PickRequest{Context: context.Background(), Method: http.MethodGet, Target: "/v1/responses/resp_a1",
			Header: http.Header{"Authorization": {"Bearer " + key}}, RemoteAddr: "127.0.0.1:1"})
	}
	if h, got, reply := get("ka"); reply != nil || got.Endpoint != first.Endpoint {
		t.Errorf("a's GET of its response: %+v %v, want %s", got, reply, first.Endpoint)
	} else {
		h.End(false)
	}
	if h, _, reply := get("kb"); reply == nil || reply.Status != http.StatusNotFound {
		if h != nil {
			h.End(false)
		}
		t.Errorf("b's GET of a's response: %v, want a 404", reply)
	}
	waitIdle(t, gw)
}

// Behind the picker, a tenant's stream the gateway asked the usage of is
// read event by event to take the usage chunk out; an answer whose body is
// encoded (gzip: a compressor between the replica and the picker) has no
// events to find, and passes as it comes, each chunk at once. Before,
// the picker held the encoded bytes, looking for an event's end, up to 4
// × max_stream_line_bytes (4 MiB): the client's stream stalled.
func TestPickerEncodedStreamPasses(t *testing.T) {
	f := newAPIReplica(t, "a", "m", "")
	cfg := baseConfig(f.srv.URL)
	cfg.Tenants = []TenantConfig{{Name: "a", APIKeys: []string{"ka"}}}
	gw := startGateway(t, cfg)
	allListed(t, gw)
	p, err := gw.g.NewPicker(0)
	if err != nil {
		t.Fatal(err)
	}
	h, pk, reply := p.Pick(PickRequest{Context: context.Background(), Method: http.MethodPost, Target: "/v1/chat/completions",
		Header: http.Header{"Authorization": {"Bearer ka"}, "Content-Type": {"application/json"}},
		Body:   []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`), RemoteAddr: "127.0.0.1:1", EditsAnswer: true})
	if reply != nil {
		t.Fatalf("refused: %d %s", reply.Status, reply.Body)
	}
	defer h.End(false)
	if !strings.Contains(string(pk.Body), `"include_usage":true`) {
		t.Fatalf("the usage not asked for: %s", pk.Body)
	}
	h.Respond(http.StatusOK, http.Header{"Content-Type": {"text/event-stream"}, "Content-Encoding": {"gzip"}}, "")
	chunk := []byte("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + strings.Repeat("\x8a\x01", 100)) // no blank line in it
	if got := h.Body(chunk, false); string(got) != string(chunk) {
		t.Fatalf("an encoded chunk: %d bytes passed of %d", len(got), len(chunk))
	}
}

// Behind the picker, without tenants, a call naming a stored response the
// gateway does not know (made on a replica directly, or before a restart)
// is pinned to the replica holding it: the picker asks the replicas, as
// the HTTP front's lookup does by trying each, since the proxy sends a
// call once. An id no replica holds is the 404 of an unknown one, and an
// id no replica makes is refused without asking any; when a replica did
// not answer and none has it, 503. Before, such a call went by load to
// one replica, which answered 404 unless it held the response.
func TestPickerFindsAStoredResponse(t *testing.T) {
	f1, f2 := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "m", "")
	gw := startGateway(t, baseConfig(f1.srv.URL, f2.srv.URL))
	allListed(t, gw)
	p, err := gw.g.NewPicker(0)
	if err != nil {
		t.Fatal(err)
	}
	pick := func(method, target, body string) (Pick, *Reply) {
		h, got, reply := p.Pick(PickRequest{Context: context.Background(), Method: method, Target: target,
			Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(body), RemoteAddr: "127.0.0.1:1"})
		if h != nil {
			h.End(false)
		}
		return got, reply
	}
	f2.put("resp_made_on_b")
	ep2, err := Endpoint(f2.srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	for range 4 { // by load alone, one of them would go to a
		for _, c := range []struct{ method, target, body string }{
			{http.MethodPost, "/v1/responses", `{"model":"m","input":"and then?","previous_response_id":"resp_made_on_b"}`},
			{http.MethodGet, "/v1/responses/resp_made_on_b", ""},
		} {
			got, reply := pick(c.method, c.target, c.body)
			if reply != nil || got.Endpoint != ep2 {
				t.Fatalf("%s %s: %+v %v; want the replica holding it, %s", c.method, c.target, got, reply, ep2)
			}
		}
	}
	before := len(f1.requests()) + len(f2.requests())
	if _, reply := pick(http.MethodPost, "/v1/responses", `{"model":"m","input":"x","previous_response_id":"resp_nowhere"}`); reply == nil ||
		reply.Status != http.StatusNotFound {
		t.Errorf("an id no replica holds: %v, want 404", reply)
	}
	if n := len(f1.requests()) + len(f2.requests()) - before; n != 2 {
		t.Errorf("an unknown id asked %d replicas, want both", n)
	}
	before = len(f1.requests()) + len(f2.requests())
	if _, reply := pick(http.MethodPost, "/v1/responses", `{"model":"m","input":"x","previous_response_id":"../../metrics"}`); reply == nil ||
		reply.Status != http.StatusNotFound {
		t.Errorf("an id no replica makes: %v, want 404", reply)
	}
	if n := len(f1.requests()) + len(f2.requests()) - before; n != 0 {
		t.Errorf("an id no replica makes asked %d replicas", n)
	}
	f1.srv.Close() // still in rotation until a health check says otherwise
	if _, reply := pick(http.MethodGet, "/v1/responses/resp_made_on_a", ""); reply == nil || reply.Status != http.StatusServiceUnavailable {
		t.Errorf("an id not on b, a not answering: %v, want 503", reply)
	}
}

// A call pinned to the replica holding its stored response names no
// fallback endpoint: no other replica holds the response, so the proxy,
// moving on when the holder refuses, would have the client told by a
// fallback that its response does not exist (a 404 it may take for the
// conversation's end; serve answers 503 then: errHolderDown). Before, the
// pick listed epp.fallbacks (default 1) of the others, by load.
func TestPickerPinnedCallNamesNoFallback(t *testing.T) {
	f1, f2, f3 := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "m", ""), newAPIReplica(t, "c", "m", "")
	gw := startGateway(t, baseConfig(f1.srv.URL, f2.srv.URL, f3.srv.URL))
	allListed(t, gw)
	p, err := gw.g.NewPicker(2)
	if err != nil {
		t.Fatal(err)
	}
	f2.put("resp_made_on_b")
	ep2, err := Endpoint(f2.srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	// Looked up first, then known.
	for _, c := range []struct{ method, target, body string }{
		{http.MethodGet, "/v1/responses/resp_made_on_b", ""},
		{http.MethodPost, "/v1/responses", `{"model":"m","input":"and then?","previous_response_id":"resp_made_on_b"}`},
		{http.MethodDelete, "/v1/responses/resp_made_on_b", ""},
	} {
		h, got, reply := p.Pick(PickRequest{Context: context.Background(), Method: c.method, Target: c.target,
			Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(c.body), RemoteAddr: "127.0.0.1:1"})
		if reply != nil {
			t.Fatalf("%s %s: %d %s", c.method, c.target, reply.Status, reply.Body)
		}
		h.End(false)
		if got.Endpoint != ep2 || len(got.Fallbacks) != 0 {
			t.Errorf("%s %s: %s then %v; want %s alone", c.method, c.target, got.Endpoint, got.Fallbacks, ep2)
		}
	}
	// A call of no stored response keeps its fallbacks.
	h, got, reply := p.Pick(PickRequest{Context: context.Background(), Method: http.MethodPost, Target: "/v1/responses",
		Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"model":"m","input":"hi"}`), RemoteAddr: "127.0.0.1:1"})
	if reply != nil {
		t.Fatalf("a new call: %d %s", reply.Status, reply.Body)
	}
	h.End(false)
	if len(got.Fallbacks) != 2 {
		t.Errorf("a new call: fallbacks %v, want 2", got.Fallbacks)
	}
}

// With no replica in rotation, a call naming a stored response the
// gateway does not know is a 503, as serve's: no replica was asked, so
// nothing says the response does not exist. Before, the picker's lookup,
// with none to ask, answered the 404 of an unknown id, which a client
// takes for its conversation's end.
func TestPickerLookupWithoutReplicas(t *testing.T) {
	f := newAPIReplica(t, "a", "m", "")
	gw, clk := gwWithClock(t, baseConfig(f.srv.URL))
	rep := gw.g.Router().Replica(0)
	eventually(t, "the replica checked", rep.Ready)
	rep.SetHealthOK(false, clk.Now()) // the next check is an hour away on the fake clock
	p, err := gw.g.NewPicker(0)
	if err != nil {
		t.Fatal(err)
	}
	f.put("resp_1")
	for _, c := range []struct{ method, target, body string }{
		{http.MethodGet, "/v1/responses/resp_1", ""},
		{http.MethodPost, "/v1/responses", `{"model":"m","input":"and then?","previous_response_id":"resp_1"}`},
	} {
		h, _, reply := p.Pick(PickRequest{Context: context.Background(), Method: c.method, Target: c.target,
			Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(c.body), RemoteAddr: "127.0.0.1:1"})
		if h != nil {
			h.End(false)
		}
		if reply == nil || reply.Status != http.StatusServiceUnavailable {
			t.Errorf("%s %s, no replica in rotation: %v, want 503", c.method, c.target, reply)
		}
	}
	if n := len(f.requests()); n != 0 {
		t.Errorf("a replica out of rotation was asked: %v", f.requests())
	}
}

// The picker's lookup reads a replica's answer as whether it holds the
// response: 200 it does; 408, 429 and 5xx it could not tell (the lookup
// answers 503 "retry later" if no other has it); anything else, 404 or a
// refusal (401, 405: a replica that would refuse the call too; 508: a
// replica leading back to this gateway, which refuses the probe as it
// would the call), it does not. Before, a 401, 405 or 508 made every
// lookup of an unknown id a 503 for as long as that replica stayed in
// the fleet.
func TestPickerLookupReadsAnswers(t *testing.T) {
	var status atomic.Int64
	var via atomic.Value
	s := newStub(t, "", okStream(1))
	inner := s.srv.Config.Handler
	s.srv.Config.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/v1/responses/") {
			via.Store(strings.Join(r.Header.Values("Via"), ", "))
			w.WriteHeader(int(status.Load()))
			return
		}
		inner.ServeHTTP(w, r)
	})
	gw := startGateway(t, baseConfig(s.srv.URL))
	for code, want := range map[int]string{200: "holds", 404: "not", 401: "not", 405: "not", 508: "not", 408: "unsure", 429: "unsure", 500: "unsure", 503: "unsure"} {
		status.Store(int64(code))
		has, err := gw.g.holdsResponse(context.Background(), 0, "resp_1", []string{"1.1 proxy", "1.1 " + gw.g.via})
		got := map[bool]string{true: "holds", false: "not"}[has]
		if err != nil {
			got = "unsure"
		}
		if got != want {
			t.Errorf("a replica answering %d: %s, want %s", code, got, want)
		}
	}
	// The probe carries the call's hops and this gateway's (loop detection).
	if got := via.Load(); got != "1.1 proxy, 1.1 "+gw.g.via {
		t.Errorf("the probe's Via: %q", got)
	}
	// A probe come back to this gateway (a replica leading to it) is
	// answered 508, which the lookup reads as "not here".
	req, _ := http.NewRequest(http.MethodGet, gw.srv.URL+"/v1/responses/resp_1", nil)
	req.Header.Set("Via", "1.1 "+gw.g.via)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusLoopDetected {
		t.Errorf("a looped probe: %d", resp.StatusCode)
	}
}

// With pools, the picker's lookup asks only the replicas the call may go
// to: those of the pool routing its model. A response held in another
// pool is not the call's (serve's lookup tries the same replicas): 404,
// and the other pool's replica is not asked. Before, it was asked, found
// holding it, and the call pinned where no route could take it (503).
func TestPickerLookupStaysInThePool(t *testing.T) {
	a, b := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "other", "")
	cfg := baseConfig()
	cfg.Pools = []PoolConfig{
		{Name: "a", Models: []string{"m"}, Replicas: []ReplicaConfig{{URL: a.srv.URL}}},
		{Name: "b", Models: []string{"other"}, Replicas: []ReplicaConfig{{URL: b.srv.URL}}},
	}
	gw := startGateway(t, cfg)
	allListed(t, gw)
	p, err := gw.g.NewPicker(0)
	if err != nil {
		t.Fatal(err)
	}
	b.put("resp_in_b")
	before := len(b.requests())
	h, _, reply := p.Pick(PickRequest{Context: context.Background(), Method: http.MethodPost, Target: "/v1/responses",
		Header: http.Header{"Content-Type": {"application/json"}}, RemoteAddr: "127.0.0.1:1",
		Body: []byte(`{"model":"m","input":"x","previous_response_id":"resp_in_b"}`)})
	if h != nil {
		h.End(false)
	}
	if reply == nil || reply.Status != http.StatusNotFound {
		t.Errorf("model m naming a response held in pool b: %v, want 404", reply)
	}
	if n := len(b.requests()) - before; n != 0 {
		t.Errorf("the other pool's replica was asked %d times", n)
	}
}

// Behind a proxy the index credits the request to the picked replica once
// the pick has left (Sent), not while picking, and forgets it when the
// exchange ends without the replica's answer; an answered one stays.
func TestPickerCreditsOnceSentUntilAnswered(t *testing.T) {
	f := newAPIReplica(t, "a", "m", "")
	gw := startGateway(t, baseConfig(f.srv.URL))
	allListed(t, gw)
	p, err := gw.g.NewPicker(0)
	if err != nil {
		t.Fatal(err)
	}
	idx := gw.g.Router().Index()
	pick := func(text string) *Handoff {
		h, _, reply := p.Pick(PickRequest{Context: context.Background(), Method: http.MethodPost, Target: "/v1/completions",
			Header: http.Header{"Content-Type": {"application/json"}},
			Body:   []byte(`{"model":"m","prompt":"` + strings.Repeat(text, 200) + `"}`), RemoteAddr: "127.0.0.1:1"})
		if reply != nil {
			t.Fatalf("refused: %d %s", reply.Status, reply.Body)
		}
		return h
	}
	h := pick("lost ")
	if n := idx.Len(); n != 0 {
		t.Fatalf("picked, not sent: %d entries credited, want 0", n)
	}
	h.Sent()
	if idx.Len() == 0 {
		t.Fatal("sent: nothing credited")
	}
	h.End(false) // the proxy gave up before any answer
	if n := idx.Len(); n != 0 {
		t.Fatalf("ended unanswered: %d entries kept, want 0", n)
	}
	h = pick("kept ")
	h.Sent()
	h.Respond(http.StatusOK, http.Header{"Content-Type": {"application/json"}}, "")
	h.End(true)
	waitIdle(t, gw)
	if idx.Len() == 0 {
		t.Fatal("answered: the credit was forgotten")
	}
}
