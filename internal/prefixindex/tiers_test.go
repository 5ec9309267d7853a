package prefixindex

import (
	"errors"
	"testing"

	"github.com/kvgate/kvgate/internal/prompt"
)

// The host tier's events feed the host index: the connector's stores carry
// hashes only, resolved through the GPU's events, and a block stays known
// while either tier holds it; a self-describing store needs no GPU event;
// Cleared empties both tiers.
func TestPreciseTiers(t *testing.T) {
	gpu, _ := New(Config{Replicas: 2})
	host, _ := New(Config{Replicas: 2})
	p := NewPrecise(gpu, "m", 4)
	p.SetHost(host)
	text := "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ!@#$" // 16 tokens, 4 blocks of 4
	ids := prompt.Approx{}.Encode(nil, text)
	want := prompt.ApproxBlockHashes(nil, prompt.Key{Model: "m"}.Root(), text, 4)
	e := []uint64{101, 102, 103, 104}
	if err := p.Stored(1, "", e, nil, ids[:16], 4, ""); err != nil {
		t.Fatal(err)
	}
	// The connector's payload: hashes, no tokens, no parent; 999 was never on the GPU.
	if err := p.StoredTier(1, TierHost, "", []uint64{101, 102, 103, 999}, nil, nil, 4, ""); !errors.Is(err, ErrUnknownBlock) {
		t.Fatalf("host store with an unknown block: %v", err)
	}
	match := func() (int, int) { return gpu.Match(want, nil)[1], host.Match(want, nil)[1] }
	if g, h := match(); g != 4 || h != 3 {
		t.Fatalf("gpu %d host %d, want 4 and 3", g, h)
	}
	// Evicted from the GPU: the host tier still holds three, and can be
	// removed from later by hash.
	if err := p.Removed(1, e); err != nil {
		t.Fatal(err)
	}
	if g, h := match(); g != 0 || h != 3 {
		t.Fatalf("after the GPU's removal: gpu %d host %d", g, h)
	}
	if err := p.RemovedTier(1, TierHost, []uint64{103}); err != nil {
		t.Fatal(err)
	}
	if g, h := match(); g != 0 || h != 2 {
		t.Fatalf("after the host's removal: gpu %d host %d", g, h)
	}
	if _, ok := p.engine[1][103]; ok {
		t.Fatal("an engine hash no tier holds is still mapped")
	}
	// A self-describing host store (token ids and parent) on replica 0.
	if err := p.StoredTier(0, TierHost, "", e[:2], nil, ids[:8], 4, ""); err != nil {
		t.Fatal(err)
	}
	if h := host.Match(want, nil)[0]; h != 2 {
		t.Fatalf("self-describing host store: %d", h)
	}
	_ = p.Cleared(1)
	if g, h := match(); g != 0 || h != 0 {
		t.Fatalf("after clear: gpu %d host %d", g, h)
	}
	// Without a host index, host events are ignored.
	q := NewPrecise(gpu, "m", 4)
	if err := q.StoredTier(0, TierHost, "", e, nil, nil, 4, ""); err != nil || q.HostIndex() != nil {
		t.Fatalf("host event without a host index: %v", err)
	}
}
