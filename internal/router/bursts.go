package router

import (
	"fmt"
	"sync"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvgate/kvgate/internal/policy"
)

// Bursts: requests of one tenant with an identical prompt arriving
// together (the n samples of one prompt in an RL rollout, best-of-N
// fan-out) go to the replica the first one went to, so the prompt is
// prefilled once and the others hit it, up to ProgramConfig.BurstCap per
// replica; the next one past the cap is placed afresh and starts the
// burst's next group there. A
// burst lasts ProgramConfig.BurstWindow from its first request. llm-d's
// burst-prefix-cache-producer does the same by holding every request for
// its window and placing the window's groups together; kvgate holds none:
// the first request of a burst goes at once, placed by the policy, and the
// others follow it, so a burst stays together whatever each of them would
// choose alone under load (the index credits the first once it is sent:
// the others see its replica holding the prompt, Config.ConfirmOnAccept). Only for
// policies that place programs (policy.PlacesPrograms); the OpenAI n
// parameter is one request already.

// maxBursts bounds the bursts remembered at once: far more than a window
// of 100 ms sees (a thousand distinct prompts at 10,000 requests/s); past
// it the oldest is forgotten early.
const maxBursts = 1 << 14

// burst is one burst's last group: its replica, how many requests it took.
type burst struct {
	key     uint64
	replica int
	serial  uint64
	count   int
	start   time.Time
}

// bursts are the bursts under way, oldest first.
type bursts struct {
	window time.Duration // ≤ 0: off
	cap    int           // < 0: none
	mu     sync.Mutex
	byKey  map[uint64]*burst
	order  []*burst
}

func newBursts(cfg ProgramConfig) *bursts {
	return &bursts{window: cfg.BurstWindow, cap: cfg.BurstCap, byKey: map[uint64]*burst{}}
}

// burstTail is how much of a prompt's routing text's end the burst key
// hashes: more than a block's text (16 tokens), so that two prompts that
// differ only past their last full block differ there.
const burstTail = 256

// burstKey names req's prompt and tenant: its last full block's chained
// hash (which names every full block before it), its token count and the
// end of its routing text (the partial block the chain does not cover: a
// chat's two questions of the same length on one long context were one
// burst); 0 for a prompt without a full block. The tenant: a burst and its
// cap per replica are one tenant's (another tenant sending the same prompt
// together took places in the first one's group); isolated tenants' salts
// tell their blocks apart already. No tenant ("") leaves the key as it was.
func burstKey(req *policy.Request) uint64 {
	if len(req.Blocks) == 0 {
		return 0
	}
	tail := req.Text[max(len(req.Text)-burstTail, 0):]
	k := req.Blocks[len(req.Blocks)-1] ^ (uint64(req.Tokens) * 0x9E3779B97F4A7C15) ^ (xxh3.HashString(tail) * 0xC2B2AE3D27D4EB4F)
	if req.Tenant != "" {
		k ^= xxh3.HashString(req.Tenant) * 0x165667B19E3779F9
	}
	if k == 0 {
		k = 1
	}
	return k
}

// expire forgets the bursts older than the window at now. b.mu held.
func (b *bursts) expire(now time.Time) {
	n := 0
	for n < len(b.order) && (now.Sub(b.order[n].start) > b.window || len(b.order)-n > maxBursts) {
		if e := b.order[n]; b.byKey[e.key] == e {
			delete(b.byKey, e.key)
		}
		n++
	}
	if n > 0 {
		b.order = append(b.order[:0], b.order[n:]...)
	}
}

// burstPick is the decision for req when it belongs to a burst whose group
// has room on a candidate replica (nothing changes: burstRouted counts it).
func (rt *Router) burstPick(req *policy.Request, views []policy.ReplicaView) (policy.Decision, bool) {
	b := rt.bursts
	key := burstKey(req)
	if b.window <= 0 || key == 0 {
		return policy.Decision{}, false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(req.Now)
	e, ok := b.byKey[key]
	if !ok || e.replica >= len(views) || !views[e.replica].Healthy || rt.serialOf(e.replica) != e.serial ||
		(b.cap >= 0 && e.count >= b.cap) {
		return policy.Decision{}, false
	}
	v := &views[e.replica]
	return policy.Decision{Replica: e.replica, Matched: min(v.Match, len(req.Blocks)), Load: float64(v.InFlight),
		Reason: fmt.Sprintf("burst: an identical prompt went here %v ago (%d of this group)", req.Now.Sub(e.start), e.count)}, true
}

// follows counts t, a burst's follower, in its replica's burstPending
// until its first token (or its end without one).
func (t *Ticket) follows() {
	t.mu.Lock()
	defer t.mu.Unlock()
	if !t.first && !t.done && !t.burst {
		t.burst = true
		t.r.burstPending.Add(1)
	}
}

// burstRouted counts t's request in its burst's group, or starts a group on
// its replica.
func (rt *Router) burstRouted(req *policy.Request, t *Ticket) {
	b := rt.bursts
	key := burstKey(req)
	if b.window <= 0 || key == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(req.Now)
	if e, ok := b.byKey[key]; ok && e.replica == t.Replica && e.serial == t.r.serial {
		e.count++
		t.follows()
		return
	}
	e := &burst{key: key, replica: t.Replica, serial: t.r.serial, count: 1, start: req.Now}
	b.byKey[key] = e
	b.order = append(b.order, e)
}
