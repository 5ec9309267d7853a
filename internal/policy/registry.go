package policy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

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
	// Pulls: the replicas pull a prefix from a peer when told to (vLLM's
	// kv_transfer_params.remote_kv_source), so a policy may choose a
	// replica with a pull (Decision.Pull; ttft prices it).
	Pulls bool
	// OffloadBlocks is each replica's host (CPU) tier in blocks, as the
	// router knows it (0: none known).
	OffloadBlocks int
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
// from params, rejecting unknown names and values of the wrong type with
// ErrParam.
func decodeParams(params map[string]any, dst any) error {
	if len(params) == 0 {
		return nil
	}
	raw, err := json.Marshal(params)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrParam, err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(dst); err != nil {
		return fmt.Errorf("%w: %w", ErrParam, err)
	}
	return nil
}
