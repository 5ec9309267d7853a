package policy

import (
	"fmt"
	"strconv"
	"sync"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// Affinity is the seed function (kvgate's issue 000): per replica an LRU of
// prefix hashes of bounded capacity. A request goes to the least loaded
// replica holding its prefix hash (a hit, which makes the hash most recent
// there), else to the least loaded replica, which then inserts the hash,
// evicting its least recent one when full. Ties go to the lowest index.
//
// `kvgate route` runs it with load = requests assigned so far; the
// lru_affinity policy with load = requests in flight.
type Affinity struct {
	capacity int
	lrus     []*simplelru.LRU[string, struct{}]
}

// NewAffinity returns the state for replicas LRUs of capacity entries each
// (capacity 0: nothing is ever remembered).
func NewAffinity(replicas, capacity int) (*Affinity, error) {
	if replicas < 1 {
		return nil, fmt.Errorf("num_replicas must be at least 1, got %d", replicas)
	}
	if capacity < 0 {
		return nil, fmt.Errorf("cache_capacity must be at least 0, got %d", capacity)
	}
	a := &Affinity{capacity: capacity, lrus: make([]*simplelru.LRU[string, struct{}], replicas)}
	if capacity > 0 {
		for i := range a.lrus {
			a.lrus[i], _ = simplelru.NewLRU[string, struct{}](capacity, nil)
		}
	}
	return a, nil
}

// Holds reports whether replica r holds key, without touching recency.
func (a *Affinity) Holds(r int, key string) bool {
	return a.capacity > 0 && r >= 0 && r < len(a.lrus) && a.lrus[r].Contains(key)
}

// Choose applies the rule over the candidate replicas (ascending indexes)
// with their loads; it reports the choice and whether it is a hit.
func (a *Affinity) Choose(key string, cands []int, load func(int) int) (int, bool) {
	best, hit := -1, false
	for _, r := range cands {
		if a.Holds(r, key) && (best < 0 || load(r) < load(best)) {
			best, hit = r, true
		}
	}
	if hit {
		return best, true
	}
	for _, r := range cands {
		if best < 0 || load(r) < load(best) {
			best = r
		}
	}
	return best, false
}

// Record makes key the most recent entry of replica r, inserting it
// (evicting the least recent when full) if absent.
func (a *Affinity) Record(r int, key string) {
	if a.capacity > 0 && r >= 0 && r < len(a.lrus) {
		a.lrus[r].Add(key, struct{}{})
	}
}

// RouteResult is the seed function's answer.
type RouteResult struct {
	Assignments []int
	CacheHits   int
	HitRatio    float64
}

// Route runs the seed function over prefix hashes, exactly.
func Route(prefixHashes []string, replicas, capacity int) (RouteResult, error) {
	a, err := NewAffinity(replicas, capacity)
	if err != nil {
		return RouteResult{}, err
	}
	loads := make([]int, replicas)
	cands := make([]int, replicas)
	for i := range cands {
		cands[i] = i
	}
	res := RouteResult{Assignments: make([]int, 0, len(prefixHashes))}
	for _, h := range prefixHashes {
		r, hit := a.Choose(h, cands, func(i int) int { return loads[i] })
		if hit {
			res.CacheHits++
		}
		loads[r]++
		a.Record(r, h)
		res.Assignments = append(res.Assignments, r)
	}
	if n := len(prefixHashes); n > 0 {
		res.HitRatio = Round4(float64(res.CacheHits) / float64(n))
	}
	return res, nil
}

// Round4 rounds to 4 decimals as Python's round(x, 4) does: correctly
// rounded from the exact binary value, ties to even.
func Round4(x float64) float64 {
	v, _ := strconv.ParseFloat(strconv.FormatFloat(x, 'f', 4, 64), 64)
	return v
}

// LRUAffinity is the seed function as a live policy: the prefix hash is the
// chained hash of the prompt's first prefix_tokens tokens (the deepest full
// block within them; the text itself when the prompt has no full block), and
// load is requests in flight.
type LRUAffinity struct {
	blockSize int
	prefix    int // blocks
	mu        sync.Mutex
	a         *Affinity
	capacity  int
}

var _ Policy = (*LRUAffinity)(nil)
var _ Observer = (*LRUAffinity)(nil)

type lruAffinityParams struct {
	CacheCapacity int `json:"cache_capacity"`
	PrefixTokens  int `json:"prefix_tokens"`
}

func init() {
	register("lru_affinity", func(o Options) (Policy, error) {
		params := lruAffinityParams{CacheCapacity: 1024, PrefixTokens: 256}
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if params.CacheCapacity < 1 || params.PrefixTokens < 1 {
			return nil, fmt.Errorf("%w: cache_capacity and prefix_tokens must be at least 1", ErrParam)
		}
		prefix := max(1, params.PrefixTokens/o.BlockSize)
		return &LRUAffinity{blockSize: o.BlockSize, prefix: prefix, capacity: params.CacheCapacity}, nil
	})
}

func (*LRUAffinity) Name() string { return "lru_affinity" }

func (p *LRUAffinity) key(req *Request) string {
	if n := min(len(req.Blocks), p.prefix); n > 0 {
		return strconv.FormatUint(req.Blocks[n-1], 16)
	}
	return "t:" + req.Model + "\x00" + req.Text
}

func (p *LRUAffinity) state(n int) *Affinity {
	if p.a == nil || len(p.a.lrus) < n {
		old := p.a
		p.a, _ = NewAffinity(n, p.capacity)
		if old != nil {
			copy(p.a.lrus, old.lrus)
		}
	}
	return p.a
}

func (p *LRUAffinity) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	key := p.key(req)
	p.mu.Lock()
	defer p.mu.Unlock()
	a := p.state(maxIndex(rs) + 1)
	// Affinity is indexed by replica slot; candidates are slots.
	slots := make([]int, len(c))
	pos := make(map[int]int, len(c))
	for k, i := range c {
		slots[k] = rs[i].Index
		pos[rs[i].Index] = i
	}
	r, hit := a.Choose(key, slots, func(s int) int { return rs[pos[s]].InFlight })
	reason := "least loaded (prefix not held)"
	matched := 0
	if hit {
		reason, matched = "least loaded holder of the prefix", min(len(req.Blocks), p.prefix)
	}
	return decide(rs, pos[r], reason, matched, float64(rs[pos[r]].InFlight)), nil
}

func (p *LRUAffinity) Observe(ev Event) {
	if ev.Kind != Routed || ev.Req == nil || ev.Replica < 0 {
		return
	}
	key := p.key(ev.Req)
	if ev.Remote {
		var ok bool
		if key, ok = p.remoteKey(ev.Req); !ok {
			return
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.state(ev.Replica+1).Record(ev.Replica, key)
}

// remoteKey is the key of a remote decision, which carries the prompt's
// blocks from Req.BlockOffset on; false when the key block is not among
// them (the sender's replica held it already).
func (p *LRUAffinity) remoteKey(req *Request) (string, bool) {
	n := min(req.BlockOffset+len(req.Blocks), p.prefix)
	if n <= req.BlockOffset {
		return "", false
	}
	return strconv.FormatUint(req.Blocks[n-1-req.BlockOffset], 16), true
}

func maxIndex(rs []ReplicaView) int {
	m := -1
	for i := range rs {
		m = max(m, rs[i].Index)
	}
	return m
}
