package sharedstate

import (
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/router"
)

// TestPeersFollowTheMembership: a replica added to the router after the
// peers were made (discovery) takes the other gateways' load by name.
func TestPeersFollowTheMembership(t *testing.T) {
	rt := testRouter(t, "http://a")
	p := NewPeers(rt, "me", time.Minute)
	if _, err := rt.SetReplicas([]router.Spec{{URL: "http://a"}, {URL: "http://b"}}); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(10, 0)
	b := &Batch{Gateway: "other", At: now, Loads: []ReplicaLoad{{Replica: "http://b", Load: router.Load{InFlight: 3}}}}
	p.Apply(b, now)
	if got := rt.RemoteLoad(1); got.InFlight != 3 {
		t.Fatalf("remote load on the added replica %+v, want 3 in flight", got)
	}
	p.Expire(now.Add(2 * time.Minute))
	if got := rt.RemoteLoad(1); got != (router.Load{}) {
		t.Fatalf("remote load after the peer expired %+v", got)
	}
}
