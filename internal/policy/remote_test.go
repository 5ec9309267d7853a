package policy

import (
	"slices"
	"strings"
	"testing"
)

// remoteOf is the remote form of req as another gateway shares it: the
// blocks from off on, no text, no ID.
func remoteOf(req *Request, off int) *Request {
	return &Request{Now: req.Now, Model: req.Model, Tokens: req.Tokens, BlockOffset: off, Blocks: slices.Clone(req.Blocks[off:])}
}

// A policy with its own index learns another gateway's decisions from their
// compact form (the blocks after the sender's match): llm-d's and
// lru_affinity's block keys land where a local decision would put them.
func TestRemoteDecisionsTeachPrivateIndexes(t *testing.T) {
	base := strings.Repeat("a shared system prompt for everyone in the conversation. ", 30)
	turn1 := base + strings.Repeat("the first question. ", 20)
	turn2 := turn1 + strings.Repeat("and the follow-up question. ", 20)
	turn3 := turn2 + strings.Repeat("and a third one. ", 20)
	for _, name := range []string{"llmd", "lru_affinity"} {
		t.Run(name, func(t *testing.T) {
			local, err := New(name, Options{Seed: 1, BlockSize: 16})
			if err != nil {
				t.Fatal(err)
			}
			remote, _ := New(name, Options{Seed: 1, BlockSize: 16})
			rs := peerViews(4)
			r1, r2 := llmdReq(1, "m", turn1), llmdReq(2, "m", turn2)
			// Gateway A routed turn 1 then turn 2 to replica 2; B hears both,
			// turn 2 as the blocks after turn 1's.
			llmdRouted(local, rs, 2, r1)
			llmdRouted(local, rs, 2, r2)
			for _, rq := range []struct {
				req *Request
				off int
			}{{r1, 0}, {r2, len(r1.Blocks)}} {
				peerObserve(remote, Event{Kind: Routed, Remote: true, At: rq.req.Now, Req: remoteOf(rq.req, rq.off),
					Decision: Decision{Replica: rs[2].Index, Matched: rq.off}, Replica: rs[2].Index})
			}
			r3 := llmdReq(3, "m", turn3)
			dl, err := local.Pick(r3, rs)
			if err != nil {
				t.Fatal(err)
			}
			dr, err := remote.Pick(r3, rs)
			if err != nil {
				t.Fatal(err)
			}
			want := rs[2].Index
			if dl.Replica != want || dr.Replica != want || dr.Matched != dl.Matched {
				t.Fatalf("local picked %d (matched %d), remote-taught %d (matched %d); want both on %d", dl.Replica, dl.Matched, dr.Replica, dr.Matched, want)
			}
		})
	}
}
