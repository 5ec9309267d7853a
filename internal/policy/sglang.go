package policy

import (
	"encoding/binary"
	"fmt"
	"math/bits"
	"sync"
	"time"
	"unicode/utf8"
)

func init() {
	register("sglang", func(o Options) (Policy, error) {
		base, ok := sglangDefaults[sglangDefaultsName(o.Params)]
		if !ok {
			return nil, fmt.Errorf("%w: defaults must be \"cli\" or \"library\"", ErrParam)
		}
		params := base
		if err := decodeParams(o.Params, &params); err != nil {
			return nil, err
		}
		if _, set := o.Params["hard_cap_chars"]; !set {
			params.HardCapChars = params.MaxTreeSize + sglangHardCapSlack
		}
		if params.CacheThreshold < 0 || params.CacheThreshold > 1 || params.BalanceAbs < 0 || params.BalanceRel < 1 ||
			params.EvictionIntervalSecs < 0 || params.MaxTreeSize < 1 || params.HardCapChars < params.MaxTreeSize {
			return nil, fmt.Errorf("%w: need 0 ≤ cache_threshold ≤ 1, balance_abs_threshold ≥ 0, "+
				"balance_rel_threshold ≥ 1, eviction_interval_secs ≥ 0, max_tree_size ≥ 1, "+
				"hard_cap_chars ≥ max_tree_size", ErrParam)
		}
		return &SGLang{params: params, blockChars: 4 * o.BlockSize, g: newRNG(o.Seed), tree: newSGTree()}, nil
	})
}

// sglangDefaults are the two sets of defaults SGLang's router has, chosen
// by the parameter defaults; each parameter given still overrides its own.
//
//   - "cli": what users get launching the router: the smg / sglang-router
//     binary's flags (sgl-model-gateway src/main.rs: --cache-threshold 0.3,
//     --balance-abs-threshold 64, --balance-rel-threshold 1.5,
//     --eviction-interval 120, --max-tree-size 2^26) and the Python launcher
//     (sglang_router.launch_router, RouterArgs), which has the same values
//     except eviction_interval_secs 60.
//   - "library": the Rust CacheAwareConfig::default() (0.5, 32, 1.1, 30 s,
//     10,000), used only by per-model policies built from worker hints and
//     by upstream's own tests.
var sglangDefaults = map[string]sglangParams{
	"cli": {
		Defaults: "cli", CacheThreshold: 0.3, BalanceAbs: 64, BalanceRel: 1.5,
		EvictionIntervalSecs: 120, MaxTreeSize: 1 << 26,
	},
	"library": {
		Defaults: "library", CacheThreshold: 0.5, BalanceAbs: 32, BalanceRel: 1.1,
		EvictionIntervalSecs: 30, MaxTreeSize: 10000,
	},
}

// sglangHardCapSlack is how far a replica's share may grow past
// max_tree_size between two evictions before kvgate trims it at once
// (hard_cap_chars defaults to max_tree_size + this): 16M characters, about
// what eight replicas' routed text grows by in a 120 s interval at a few
// hundred long prompts a second, so that the bound rarely bites where SGLang
// would not have evicted yet, and memory stays bounded when virtual time
// runs fast.
const sglangHardCapSlack = 1 << 24

// sglangDefaultsName is the defaults parameter ("cli" when absent; "" when
// not a string, which no set is named).
func sglangDefaultsName(params map[string]any) string {
	v, ok := params["defaults"]
	if !ok {
		return "cli"
	}
	s, _ := v.(string)
	return s
}

type sglangParams struct {
	// Defaults names the base set: "cli" (default) or "library".
	Defaults             string  `json:"defaults"`
	CacheThreshold       float64 `json:"cache_threshold"`
	BalanceAbs           int     `json:"balance_abs_threshold"`
	BalanceRel           float64 `json:"balance_rel_threshold"`
	EvictionIntervalSecs float64 `json:"eviction_interval_secs"`
	// MaxTreeSize bounds each replica's share of the tree, in characters.
	MaxTreeSize int `json:"max_tree_size"`
	// HardCapChars bounds a replica's share between two evictions (kvgate's
	// memory bound; SGLang's tree grows unbounded between its evictions).
	// Default max_tree_size + 2^24.
	HardCapChars int `json:"hard_cap_chars"`
	// RandomTies breaks least-load ties at random; SGLang takes the first.
	RandomTies bool `json:"random_ties"`
}

// SGLang is the SGLang router's cache_aware policy, as in sgl-model-gateway
// v0.3 (the sglang repository's sgl-model-gateway/src/policies/
// cache_aware.rs and tree.rs; the same rule as lightseekorg/smg's
// src/policies/cache_aware.rs before smg made max_tree_size a budget shared
// by all replicas and added its spill gate), with the defaults of its
// command line (see sglangDefaults: parameter defaults, "cli" unless
// "library").
//
// It keeps one approximate radix tree (sgTree, in sglang_tree.go: a
// compressed trie over the characters of the routed texts) shared by all
// replicas: each node records,
// per tenant (replica slot) holding it, the last time a request routed there
// passed through it. Because a routed text is inserted along its whole path,
// a tenant holding a node holds all its ancestors, and eviction (least
// recently used leaves first) keeps that true. Routing, over the healthy
// replicas (SGLang's router hands its policy the available workers only):
//
//   - imbalanced, i.e. (max load − min load) > balance_abs_threshold AND
//     max load > min load × balance_rel_threshold: the least loaded replica;
//   - else the longest prefix of the text in the tree, match rate = its
//     characters / the text's characters: if the rate is over
//     cache_threshold, the replica holding the deepest matched node (the
//     least loaded if several do); else the least loaded replica. That is
//     what upstream's code does; the comment at the top of its
//     cache_aware.rs still says "smallest tree size", which older sgl-router
//     versions did (Tree::get_smallest_tenant).
//
// SGLang picks the tenant of the deepest node in its map's iteration order
// (in effect arbitrary); kvgate takes the least loaded holder, as smg's
// later matched_tenants selection does. Load ties go to the first replica in
// order, as SGLang's min_by_key does (random_ties: at random). The text is
// inserted for the chosen replica when the request is Routed, whichever path
// chose it. SGLang's router evicts from a background thread every eviction
// interval, trimming each tenant's least recently used leaves until it holds
// at most max_tree_size characters; here eviction runs lazily from Observe
// once the interval has passed in event time, and also at once when a
// tenant grows past hard_cap_chars (max_tree_size + 2^24 unless set), so
// that memory stays bounded however fast (virtual) time runs between two
// evictions. Between evictions the tree keeps everything, as SGLang's does.
//
// Trees are kept per cache partition (model, adapter, salt), as SGLang keeps
// one per model: a prefix cached under another adapter is no hit.
type SGLang struct {
	params     sglangParams
	blockChars int
	g          *rng

	mu        sync.RWMutex
	tree      sgTree
	lastEvict time.Time
	started   bool
}

var _ Policy = (*SGLang)(nil)
var _ Observer = (*SGLang)(nil)

func (*SGLang) Name() string { return "sglang" }

func partitionOf(req *Request) sgPartition { return sgPartition{req.Model, req.Adapter, req.Salt} }

// countRunes counts the characters of UTF-8 text: the bytes that are not
// continuation bytes (10xxxxxx), 32 bytes at a time (SWAR: bit 7 set and
// bit 6 clear, then a population count; all-ASCII words skipped). It equals
// utf8.RuneCountInString on valid UTF-8 and is several times faster on long
// prompts.
func countRunes(s string) int {
	b := strBytes(s)
	const hi = 0x8080808080808080
	cont, i := 0, 0
	for ; i+32 <= len(b); i += 32 {
		w0 := binary.LittleEndian.Uint64(b[i:])
		w1 := binary.LittleEndian.Uint64(b[i+8:])
		w2 := binary.LittleEndian.Uint64(b[i+16:])
		w3 := binary.LittleEndian.Uint64(b[i+24:])
		if (w0|w1|w2|w3)&hi == 0 {
			continue
		}
		cont += bits.OnesCount64(w0&^(w0<<1)&hi) + bits.OnesCount64(w1&^(w1<<1)&hi) +
			bits.OnesCount64(w2&^(w2<<1)&hi) + bits.OnesCount64(w3&^(w3<<1)&hi)
	}
	for ; i < len(b); i++ {
		if b[i]&0xC0 == 0x80 {
			cont++
		}
	}
	return len(s) - cont
}

// runeBoundary backs a byte offset into s off to a character boundary, so
// that a match ending inside a multi-byte character does not count it.
func runeBoundary(s string, n int) int {
	for n > 0 && n < len(s) && !utf8.RuneStart(s[n]) {
		n--
	}
	return n
}

func (s *SGLang) Pick(req *Request, rs []ReplicaView) (Decision, error) {
	var buf [scratchLen]int
	c := healthy(rs, &buf)
	if len(c) == 0 {
		return Decision{}, ErrNoReplica
	}
	minL, maxL := rs[c[0]].InFlight, rs[c[0]].InFlight
	for _, i := range c[1:] {
		minL, maxL = min(minL, rs[i].InFlight), max(maxL, rs[i].InFlight)
	}

	// depth[pos]: bytes of the text's head that replica pos holds.
	var dbuf [scratchLen]int
	depth := scratch(&dbuf, len(rs))
	s.mu.RLock()
	s.tree.match(partitionOf(req), req.Text, func(tenant, d int) {
		if i := posOf(rs, tenant); i >= 0 {
			depth[i] = d // deeper than its ancestors, visited before
		}
	})
	s.mu.RUnlock()
	deepest := 0
	for _, i := range c {
		deepest = max(deepest, depth[i])
	}
	// The match rate counts characters, as SGLang's chars().count() does.
	rate := 0.0
	if len(req.Text) > 0 {
		head := runeBoundary(req.Text, deepest)
		n := countRunes(req.Text[:head])
		rate = float64(n) / float64(n+countRunes(req.Text[head:]))
	}

	var i int
	var reason string
	switch {
	case float64(maxL-minL) > float64(s.params.BalanceAbs) && float64(maxL) > float64(minL)*s.params.BalanceRel:
		i, reason = s.leastLoaded(rs, c, depth, -1), "imbalanced: least loaded"
	case rate > s.params.CacheThreshold:
		i, reason = s.leastLoaded(rs, c, depth, deepest), "match rate over the threshold: holder of the deepest match"
	default:
		i, reason = s.leastLoaded(rs, c, depth, -1), "match rate under the threshold: least loaded"
	}
	// Scores: the fraction of the text (in bytes) each replica holds.
	scores := make([]float64, len(rs))
	if len(req.Text) > 0 {
		for k := range scores {
			scores[k] = float64(depth[k]) / float64(len(req.Text))
		}
	}
	// Characters to blocks through the approximate tokenizer (4 characters
	// per token): an estimate, the tree knows no tokens.
	d := decide(rs, i, reason, depth[i]/s.blockChars, float64(rs[i].InFlight))
	d.Scores = scores
	return d, nil
}

// leastLoaded returns the least loaded candidate among c (those holding
// exactly want bytes when want ≥ 0): the first in order, as SGLang's
// min_by_key, or one at random with random_ties.
func (s *SGLang) leastLoaded(rs []ReplicaView, c []int, depth []int, want int) int {
	best, seen := -1, 0
	for _, i := range c {
		if want >= 0 && depth[i] != want {
			continue
		}
		switch {
		case best < 0 || rs[i].InFlight < rs[best].InFlight:
			best, seen = i, 1
		case rs[i].InFlight == rs[best].InFlight && s.params.RandomTies:
			seen++
			if s.g.IntN(seen) == 0 {
				best = i
			}
		}
	}
	return best
}

// Observe inserts the text of a routed request for the replica it went to.
//
// A remote decision (another gateway's) carries no text, so its tree does
// not learn it: SGLang's tree is of characters.
func (s *SGLang) Observe(ev Event) {
	if ev.Kind != Routed || ev.Req == nil || ev.Replica < 0 || ev.Remote {
		return
	}
	at := ev.At.UnixNano()
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.started {
		s.started, s.lastEvict = true, ev.At
	}
	s.tree.insert(partitionOf(ev.Req), ev.Req.Text, ev.Replica, at)
	interval := time.Duration(s.params.EvictionIntervalSecs * float64(time.Second))
	if ev.At.Sub(s.lastEvict) >= interval || s.tree.chars[ev.Replica] > s.params.HardCapChars {
		s.tree.evict(s.params.MaxTreeSize)
		s.lastEvict = ev.At
	}
}

var _ PairPicker = (*SGLang)(nil)

// PickPair is SGLang's PD router (sgl-model-gateway
// src/routers/http/pd_router.rs, select_pd_pair): the prefill worker is
// picked by the prefill policy among the prefill workers and the decode
// worker by the decode policy among the decode workers, each by its own
// rule (--prefill-policy and --decode-policy, both --policy by default:
// cache_aware here, each side's tree and loads its own workers'), and the
// request always goes through both (the router has no decode-only path).
func (s *SGLang) PickPair(req *Request, prefill, decode []ReplicaView) (PairDecision, error) {
	p, err := s.Pick(req, prefill)
	if err != nil {
		return PairDecision{}, err
	}
	d, err := s.Pick(req, decode)
	if err != nil {
		return PairDecision{}, err
	}
	return Pair(p, d, "SGLang PD router: prefill and decode worker each by the policy"), nil
}
