package gateway

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"
)

// An id every replica answered 404 for is answered 404 at once for
// absentTTL, by serve and by the endpoint picker: a client polling an id
// that does not exist costs the replicas one lookup per TTL, not one
// request each per poll. Past the TTL the replicas are asked again (an id
// stored on a replica past the gateway is found then); a call of another
// model is another lookup; and a lookup that did not ask every replica of
// the pool (the proxy's subset, a replica out of rotation) is not
// remembered, nor is an id no replica could have made.
func TestLookupRemembersAnAbsentID(t *testing.T) {
	a, b := newAPIReplica(t, "a", "m", ""), newAPIReplica(t, "b", "m", "")
	cfg := baseConfig(a.srv.URL, b.srv.URL)
	gw, clk := gwWithClock(t, cfg)
	allListed(t, gw)
	asked := func() int { return len(a.requests()) + len(b.requests()) }
	get := func(id string) (int, string) {
		status, _, body := do(t, "GET", gw.srv.URL+"/v1/responses/"+id, "", "")
		return status, body
	}
	before := asked()
	if status, body := get("resp_gone"); status != http.StatusNotFound || !strings.Contains(body, "not found") {
		t.Fatalf("an unknown id: %d %s", status, body)
	}
	if n := asked() - before; n != 2 {
		t.Fatalf("the lookup asked %d replicas, want both", n)
	}
	before = asked()
	for range 3 {
		if status, body := get("resp_gone"); status != http.StatusNotFound || !strings.Contains(body, "resp_gone") {
			t.Fatalf("the same id again: %d %s", status, body)
		}
	}
	if n := asked() - before; n != 0 {
		t.Fatalf("the id every replica denied was asked again %d times within the TTL", n)
	}
	// An id no replica could have made (past sharedstate.MaxResponseID)
	// is not remembered: entries stay small whatever a client names.
	long := `{"model":"m","input":"x","previous_response_id":"resp_` + strings.Repeat("f", 300) + `"}`
	before = asked()
	for range 2 {
		if status, _, _ := do(t, "POST", gw.srv.URL+"/v1/responses", "application/json", long); status != http.StatusNotFound {
			t.Fatalf("a 305-character id: %d, want 404", status)
		}
	}
	if n := asked() - before; n != 4 {
		t.Fatalf("a 305-character id asked %d replicas over two calls, want both each time", n)
	}
	// A call of a model names its pool: asked anew.
	before = asked()
	status, _, _ := do(t, "POST", gw.srv.URL+"/v1/responses", "application/json",
		`{"model":"m","input":"x","previous_response_id":"resp_gone"}`)
	if status != http.StatusNotFound || asked()-before != 2 {
		t.Fatalf("the id under model m: %d, %d replicas asked; want 404 from both", status, asked()-before)
	}
	// Past the TTL: asked again, and found where it now is.
	b.put("resp_gone")
	clk.Advance(absentTTL)
	if status, body := get("resp_gone"); status != http.StatusOK {
		t.Fatalf("past the TTL, the id stored on b since: %d %s", status, body)
	}
	// The endpoint picker remembers the same way.
	p, err := gw.g.NewPicker(0)
	if err != nil {
		t.Fatal(err)
	}
	var subset []string // the endpoints the proxy lets the picker choose from (nil: all)
	pick := func(id string) *Reply {
		h, _, reply := p.Pick(PickRequest{Context: context.Background(), Method: http.MethodGet, Subset: subset,
			Target: "/v1/responses/" + id, Header: http.Header{"Content-Type": {"application/json"}}, RemoteAddr: "127.0.0.1:1"})
		if h != nil {
			h.End(false)
		}
		return reply
	}
	before = asked()
	for range 3 {
		if reply := pick("resp_nowhere"); reply == nil || reply.Status != http.StatusNotFound {
			t.Fatalf("the picker, an unknown id: %+v, want 404", reply)
		}
	}
	if n := asked() - before; n != 2 {
		t.Fatalf("the picker asked %d replicas for an unknown id three times, want each once", n)
	}
	// A lookup within a subset of the pool asked only part of it.
	epb, err := Endpoint(b.srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	subset = []string{epb}
	beforeA, beforeB := len(a.requests()), len(b.requests())
	for range 2 {
		if reply := pick("resp_subset"); reply == nil || reply.Status != http.StatusNotFound {
			t.Fatalf("the picker, an unknown id within b alone: %+v, want 404", reply)
		}
	}
	if na, nb := len(a.requests())-beforeA, len(b.requests())-beforeB; na != 0 || nb != 2 {
		t.Fatalf("within b alone, two calls asked a %d and b %d times, want b twice", na, nb)
	}
	subset = nil
	// A lookup while a replica is out of rotation is not remembered. a's
	// health check fails, so that no probe puts it back (one woken by the
	// clock's advance above could, after a SetHealthy).
	a.down.Store(true)
	eventually(t, "a out of rotation", func() bool {
		clk.Advance(time.Second) // the next health check
		return !gw.g.rt.Healthy(0)
	})
	before = asked()
	for range 2 {
		if status, _ := get("resp_elsewhere"); status != http.StatusNotFound {
			t.Fatalf("b alone asked: %d, want 404", status)
		}
	}
	if n := asked() - before; n != 2 {
		t.Fatalf("with a out of rotation, b was asked %d times for two calls, want 2", n)
	}
}
