package engine

import (
	"testing"
)

// AssumedCached: a cold engine credits the assumed prefix as a hit (whole
// blocks, never the last prompt token), computes only the rest, and caches
// the assumed blocks like computed ones; a longer own hit wins.
func TestAssumedCachedCountsAsAHitAndIsCached(t *testing.T) {
	const bs = 16
	for _, tc := range []struct {
		name            string
		blocks, extra   int
		assumed         int
		wantHit, wantIn int // first output's CachedTokens; tokens computed by the first step
	}{
		{"none", 8, 5, 0, 0, 8*bs + 5},
		{"three blocks", 8, 5, 3 * bs, 3 * bs, 5*bs + 5},
		{"rounded down to blocks", 8, 5, 3*bs + 7, 3 * bs, 5*bs + 5},
		{"whole prompt: the last block is computed", 8, 0, 8 * bs, 7 * bs, bs},
		{"more than the prompt", 8, 5, 100 * bs, 8 * bs, 5},
		{"negative", 8, 5, -4, 0, 8*bs + 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e, err := New(Config{NumBlocks: 64, BlockSize: bs})
			if err != nil {
				t.Fatal(err)
			}
			r := req(1, bs, tc.extra, 2, seg{content: 7, blocks: tc.blocks})
			r.AssumedCached = tc.assumed
			if err := e.Add(r, 0); err != nil {
				t.Fatal(err)
			}
			if b := e.Backlog(); b.Prefill != r.PromptTokens-tc.wantHit || b.Pending != 1 || b.Live != 1 || b.Footprint != r.PromptTokens+2 {
				t.Errorf("backlog before the step %+v, want prefill %d", b, r.PromptTokens-tc.wantHit)
			}
			st := e.Step(0)
			if st.Tokens != tc.wantIn {
				t.Errorf("first step computed %d tokens, want %d", st.Tokens, tc.wantIn)
			}
			if len(st.Outputs) != 1 || !st.Outputs[0].First || st.Outputs[0].CachedTokens != tc.wantHit {
				t.Fatalf("outputs %+v, want a first token with %d cached", st.Outputs, tc.wantHit)
			}
			if b := e.Backlog(); b.Prefill != 0 || b.Pending != 0 || b.Live != 1 {
				t.Errorf("backlog after the first token %+v", b)
			}
			// The assumed blocks are now this engine's own: a repeat hits
			// every full block but the last prompt token's.
			if got, want := e.PeekCached(r.BlockHashes, r.PromptTokens), (r.PromptTokens-1)/bs*bs; got != want {
				t.Errorf("cached after the request: %d tokens, want %d", got, want)
			}
		})
	}
}
