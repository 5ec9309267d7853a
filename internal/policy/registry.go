package policy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"

	"github.com/kvgate/kvgate/internal/costmodel"
)

// Options configure a policy at construction.
type Options struct {
	// Seed seeds the policy's random source (tie breaks, sampling).
	Seed uint64
	// BlockSize is the tokens per block of Request.Blocks.
	BlockSize int
	// Profile is the replicas' latency profile (ttft, preble).
	Profile costmodel.Profile
	// MaxBatchTokens is the replicas' prefill token budget per step.
	MaxBatchTokens int
	// Params are the policy's own parameters (names as in PEERS.md), decoded
	// strictly: an unknown name is an error.
	Params map[string]any
}

func (o Options) withDefaults() Options {
	if o.BlockSize <= 0 {
		o.BlockSize = 16
	}
	if o.Profile.C1 == 0 {
		o.Profile = costmodel.MustLookup(costmodel.Default)
	}
	if o.MaxBatchTokens <= 0 {
		o.MaxBatchTokens = 8192
	}
	return o
}

// Factory builds a policy.
type Factory func(o Options) (Policy, error)

var registry = map[string]Factory{}

func register(name string, f Factory) { registry[name] = f }

// New builds the named policy.
func New(name string, o Options) (Policy, error) {
	f, ok := registry[name]
	if !ok {
		return nil, fmt.Errorf("policy: unknown policy %q (known: %s)", name, strings.Join(Names(), ", "))
	}
	p, err := f(o.withDefaults())
	if err != nil {
		return nil, fmt.Errorf("policy %s: %w", name, err)
	}
	return p, nil
}

// Names lists the registered policies, sorted.
func Names() []string {
	out := make([]string, 0, len(registry))
	for n := range registry {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// Default is the default policy.
const Default = "ttft"

// decodeParams fills dst (a struct with json tags, holding the defaults)
// from params, rejecting unknown names.
func decodeParams(params map[string]any, dst any) error {
	if len(params) == 0 {
		return nil
	}
	raw, err := json.Marshal(params)
	if err != nil {
		return fmt.Errorf("parameters: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return fmt.Errorf("parameters: %w", err)
	}
	return nil
}

// rng is a seeded random source safe for concurrent use.
type rng struct {
	mu sync.Mutex
	r  *rand.Rand
}

func newRNG(seed uint64) *rng {
	return &rng{r: rand.New(rand.NewPCG(seed, 0x6b766761746521))}
}

func (g *rng) IntN(n int) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.r.IntN(n)
}

func (g *rng) Float64() float64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.r.Float64()
}

// healthy returns the positions (in replicas) of healthy replicas.
func healthy(replicas []ReplicaView, buf []int) []int {
	buf = buf[:0]
	for i := range replicas {
		if replicas[i].Healthy {
			buf = append(buf, i)
		}
	}
	return buf
}

// argBest returns the position of the best value among the candidate
// positions (better(a, b) says a beats b strictly), ties broken uniformly at
// random with reservoir sampling.
func argBest(cands []int, val func(int) float64, lower bool, g *rng) int {
	best, seen := -1, 0
	var bv float64
	for _, i := range cands {
		v := val(i)
		switch {
		case best < 0 || (lower && v < bv) || (!lower && v > bv):
			best, bv, seen = i, v, 1
		case v == bv:
			seen++
			if g.IntN(seen) == 0 {
				best = i
			}
		}
	}
	return best
}

// decide builds a Decision for position i.
func decide(replicas []ReplicaView, i int, reason string, matched int, load float64) Decision {
	return Decision{Replica: replicas[i].Index, Reason: reason, Matched: matched, Load: load}
}
