package gateway

import (
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sharedstate"
)

// A stored response's home is its replica, not its slot: a replica
// removed and revived keeps its responses; once forgotten, its slot given
// to another replica is no home of them (the id is looked up again).
func TestResponseHomesFollowTheReplicaNotTheSlot(t *testing.T) {
	clk := clock.NewFake(time.Unix(100, 0))
	pol, _ := policy.New("least_load", policy.Options{})
	rt, err := router.New(router.Config{Replicas: []string{"http://a", "http://b"}, Policy: pol, Now: clk.Now, Dynamic: true})
	if err != nil {
		t.Fatal(err)
	}
	h := newResponseHomes(rt, 8, nil, false, time.Now)
	h.add("resp_b", 1, "", true, "")
	specs := func(urls ...string) {
		t.Helper()
		var sp []router.Spec
		for _, u := range urls {
			sp = append(sp, router.Spec{URL: u})
		}
		if _, err := rt.SetReplicas(sp); err != nil {
			t.Fatal(err)
		}
	}
	specs("http://a") // b removed, then revived: its responses are still there
	specs("http://a", "http://b")
	if r, ok := h.get("resp_b"); !ok || r.Name() != "http://b" {
		t.Fatalf("a revived replica lost its response: %v %v", r, ok)
	}
	specs("http://a")
	clk.Advance(router.DefaultForgetAfter + time.Second)
	specs("http://a", "http://c") // b forgotten: c takes its slot
	if rt.Replica(1).Name() != "http://c" {
		t.Fatalf("slot 1 holds %s, want c", rt.Replica(1).Name())
	}
	if r, ok := h.get("resp_b"); ok {
		t.Fatalf("b's response is homed on %s, which took b's slot", r.Name())
	}
	if _, ok := h.c.Peek("resp_b"); ok {
		t.Fatal("the stale home is kept")
	}
}

// A replica's response id is remembered only within the bound the shared
// record and the state file keep (a lying replica's megabyte id would be
// an LRU key, dropped from Redis and refusing the whole state file).
func TestResponseIDBounded(t *testing.T) {
	if got := responseIDOf([]byte(`{"object":"response","id":"resp_1"}`)); got != "resp_1" {
		t.Fatalf("a vLLM id: %q", got)
	}
	long := strings.Repeat("x", sharedstate.MaxResponseID+1)
	if got := responseIDOf([]byte(`{"id":"` + long + `"}`)); got != "" {
		t.Fatalf("an id over %d bytes was remembered", sharedstate.MaxResponseID)
	}
	g := &Gateway{}
	for id, want := range map[string]string{"resp_2": "resp_2", long: ""} {
		a := &attempt{}
		g.responseCreated(&exchange{}, a, []byte(`{"type":"response.created","response":{"id":"`+id+`"}}`))
		if a.respID != want {
			t.Errorf("streamed id of %d bytes: remembered %q, want %q", len(id), a.respID, want)
		}
	}
}
