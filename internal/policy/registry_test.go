package policy

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// TestFactoriesRejectBadParams: every registered policy's factory answers a
// bad parameter (an unknown name, a value of the wrong type, one out of its
// range) with an error wrapping ErrParam, and builds with its defaults.
func TestFactoriesRejectBadParams(t *testing.T) {
	unknown := map[string]any{"no_such_param": 1}
	bad := map[string][]map[string]any{
		"round_robin":  {unknown},
		"random":       {unknown},
		"least_load":   {unknown},
		"p2c":          {unknown},
		"session":      {unknown, {"vnodes": 0}, {"vnodes": "many"}},
		"prefix_key":   {unknown, {"key": "user"}, {"prefix_chars": 0}},
		"lru_affinity": {unknown, {"cache_capacity": 0}, {"prefix_tokens": 0}},
		"chwbl":        {unknown, {"load_factor": 0.5}, {"vnodes": 0}},
		"sglang":       {unknown, {"balance_rel_threshold": 0.9}, {"cache_threshold": 1.5}, {"max_tree_size": 0}},
		"dynamo":       {unknown, {"temperature": -1}, {"overlap_score_weight": -1}},
		"llmd":         {unknown, {"block_size_chars": 0}, {"queue_weight": -1}},
		"preble":       {unknown, {"window_secs": 0}, {"rebalance_ratio": 0.5}},
		"score":        {unknown, {"cache_weight": -1}},
		"precise":      {unknown, {"prefix_weight": -3}},
		"ttft": {unknown, {"margin_rel": -0.1}, {"correction_alpha": 2}, {"max_correction": 0.5},
			{"eviction_weight": -1}, {"decode_weight": "heavy"}},
	}
	for _, name := range Names() {
		t.Run(name, func(t *testing.T) {
			cases, ok := bad[name]
			if !ok {
				t.Fatalf("no bad parameters listed for %s", name)
			}
			for _, params := range cases {
				_, err := New(name, Options{Params: params})
				if !errors.Is(err, ErrParam) {
					t.Errorf("params %v: err = %v, want ErrParam", params, err)
				}
				if _, isUnknown := params["no_such_param"]; isUnknown && (err == nil || !strings.Contains(err.Error(), "no_such_param")) {
					t.Errorf("unknown parameter: err = %v, want one naming it", err)
				}
			}
			p, err := New(name, Options{})
			if err != nil || p.Name() != name {
				t.Fatalf("New(%s) = %v, %v", name, p, err)
			}
		})
	}
}

// queueOrderer prices a request's prefill in the router's queue as told.
type queueOrderer struct {
	Policy
	ms float64
}

func (q queueOrderer) QueuePrefillMs(int) float64 { return q.ms }

// QueuePrefillMs is bounded where the router reads it: a negative or NaN
// estimate counts as none, a huge one as a day; a policy that does not
// price it gets 0; ttft's is its profile's c1 a token.
func TestQueuePrefillMsBounded(t *testing.T) {
	for _, c := range []struct {
		ms, want float64
	}{{-5, 0}, {math.NaN(), 0}, {math.Inf(1), maxQueuePrefillMs}, {1e300, maxQueuePrefillMs}, {12.5, 12.5}} {
		if got := QueuePrefillMs(queueOrderer{ms: c.ms}, 100); got != c.want {
			t.Errorf("%v: %v, want %v", c.ms, got, c.want)
		}
	}
	if got := QueuePrefillMs(peerNew(t, "dynamo", nil), 1000); got != 0 {
		t.Errorf("dynamo: %v, want 0 (first come first served)", got)
	}
	p := peerNew(t, "ttft", nil).(*TTFT)
	if got, want := QueuePrefillMs(p, 1000), 1000*p.o.Profile.C1; got != want || !(got > 0) {
		t.Errorf("ttft: %v, want %v", got, want)
	}
}
