// Package sharedstate keeps several kvgate gateways in front of one fleet
// close to one view: each publishes its routing decisions (the blocks new
// to the chosen replica) and its own load counts, and applies the others'
// to its router (router.ApplyRemote, router.SetRemoteLoad). Nothing here is
// on a request's path: a gateway always routes on its local view, and the
// shared state only keeps that view close to the union of all of them.
package sharedstate

import (
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/router"
)

// Decision is one shared routing decision: the replica (by name, as every
// gateway configures it), and the prompt's blocks from Offset on. kvgate
// sends whole prompts (Offset 0; see router.Learned); a compact decision,
// whose first Offset blocks the sender's index held on that replica
// already, is applied as well.
type Decision struct {
	Replica string
	Model   string
	Offset  int
	Tokens  int
	Blocks  []uint64
	// Program is the request's program (router.Learned.Program; 0: none):
	// the receivers record the replica as its home, Tokens as its context.
	Program uint64
}

// ReplicaLoad is a gateway's own counts for one replica.
type ReplicaLoad struct {
	Replica string
	Load    router.Load
}

// Batch is what one gateway publishes at once: the decisions since its last
// batch, and its counts for every replica (its heartbeat).
type Batch struct {
	Gateway   string // the sender, unique per process
	Seq       uint64 // the sender's batch number, from 1
	At        time.Time
	Decisions []Decision
	Loads     []ReplicaLoad
}

// DefaultTTL is how long a gateway's load counts stand without a newer
// heartbeat: a gateway that dies leaves no load behind for longer.
const DefaultTTL = 2 * time.Second

// Peers is what one gateway knows of the others: their last heartbeat and
// when it arrived. It applies their batches to the gateway's router.
type Peers struct {
	self string
	ttl  time.Duration
	rt   *router.Router

	mu    sync.Mutex
	peers map[string]*peer
	sum   []router.Load // per slot: the load last set on the router
}

type peer struct {
	seen  time.Time // when its last batch arrived (the receiver's clock)
	loads []router.Load
}

// NewPeers applies the batches of gateways other than self to rt; loads
// older than ttl (0: DefaultTTL) count for nothing.
func NewPeers(rt *router.Router, self string, ttl time.Duration) *Peers {
	if ttl <= 0 {
		ttl = DefaultTTL
	}
	return &Peers{self: self, ttl: ttl, rt: rt, peers: map[string]*peer{}, sum: make([]router.Load, rt.Replicas())}
}

// Apply applies b, received at now: its decisions to the router's index
// and policy (those about replicas this gateway does not know are
// skipped), their programs to its program table, and its loads in place of
// the sender's previous ones. Its own batches are ignored, and so are those
// of a gateway Admit refuses. It returns the decisions applied, and the
// program records the router refused (router.ErrRemoteProgram: their
// decisions are applied without them).
func (p *Peers) Apply(b *Batch, now time.Time) (applied, refused int) {
	if b.Gateway == p.self || !p.Admit(b.Gateway) {
		return 0, 0
	}
	for i := range b.Decisions {
		d := &b.Decisions[i]
		if slot, ok := p.rt.Lookup(d.Replica); ok {
			p.rt.ApplyRemote(slot, d.Model, d.Offset, d.Blocks, d.Tokens, now)
			if p.rt.ApplyRemoteProgram(slot, d.Program, d.Offset+len(d.Blocks), d.Tokens, now) != nil {
				refused++
			}
			applied++
		}
	}
	loads := make([]router.Load, p.rt.Replicas())
	for _, l := range b.Loads {
		if slot, ok := p.rt.Lookup(l.Replica); ok {
			loads[slot] = l.Load
		}
	}
	p.mu.Lock()
	p.peers[b.Gateway] = &peer{seen: now, loads: loads}
	p.mu.Unlock()
	p.Expire(now)
	return applied, refused
}

// Admit reports whether a batch from gateway gw is applied: one already
// live is, a new one only while fewer than maxPeers are. Each costs a load
// per replica until its TTL, and a forger could name a new one per entry.
func (p *Peers) Admit(gw string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.peers[gw]
	return ok || len(p.peers) < maxPeers
}

// Expire forgets the gateways whose last heartbeat is older than the TTL
// at now and sets the router's remote load to the sum of the others'. It
// returns how many gateways are live.
func (p *Peers) Expire(now time.Time) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	// Sized by the router now: replicas join while the gateway runs
	// (discovery), so a peer's loads may name slots p.sum has not seen.
	sum := make([]router.Load, max(len(p.sum), p.rt.Replicas()))
	for gw, pr := range p.peers {
		if now.Sub(pr.seen) > p.ttl {
			delete(p.peers, gw)
			continue
		}
		for i, l := range pr.loads {
			sum[i] = sum[i].Add(l)
		}
	}
	for i := range sum {
		if i >= len(p.sum) || sum[i] != p.sum[i] {
			p.rt.SetRemoteLoad(i, sum[i])
		}
	}
	p.sum = sum
	return len(p.peers)
}

// Live is the number of other gateways with a live heartbeat (as of the
// last Apply or Expire).
func (p *Peers) Live() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.peers)
}

// Loads are the router's own counts for every replica, as a heartbeat.
func Loads(rt *router.Router) []ReplicaLoad {
	out := make([]ReplicaLoad, rt.Replicas())
	for i := range out {
		out[i] = ReplicaLoad{Replica: rt.Name(i), Load: rt.LocalLoad(i)}
	}
	return out
}

// FromLearned is the shared form of a decision the router learnt: the
// whole prompt (see router.Learned), its blocks copied.
func FromLearned(rt *router.Router, l router.Learned) Decision {
	return Decision{Replica: rt.Name(l.Replica), Model: l.Model, Tokens: l.Tokens,
		Blocks: append([]uint64(nil), l.Blocks...), Program: l.Program}
}
