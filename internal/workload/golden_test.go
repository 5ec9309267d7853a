package workload

import (
	"fmt"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// digest folds everything a runner sends of a workload into one hash.
func digest(reqs []Request) uint64 {
	d := xxhash.New()
	for i := range reqs {
		r := &reqs[i]
		fmt.Fprintf(d, "%d|%d|%d|%s|%v|%d|%d|%v\n", r.Index, r.Prev, r.Think, r.Session, r.Chat, r.MaxTokens, r.InputTokens, r.HashIDs)
		_, _ = d.Write(r.AppendText(nil))
	}
	return d.Sum64()
}

// TestGolden pins the bytes: a seed must name the same workload in every
// build and Go release, or results recorded against it (and trace
// replays compared across versions) stop being comparable. A change here is
// a format change: make it on purpose and say so.
func TestGolden(t *testing.T) {
	if got, want := Words(1, 8), "to place. often office project. "; got != want {
		t.Errorf("Words(1, 8) = %q, want %q", got, want)
	}
	var blocks []byte
	for id := range 100 {
		blocks = AppendBlockText(blocks, id)
	}
	if got, want := xxhash.Sum64(blocks), uint64(0x3987eebdee5deae0); got != want {
		t.Errorf("BlockText(0..99) digest %#x, want %#x", got, want)
	}
	want := map[string]uint64{
		"multiturn":         0x7c905d346d87dbfa,
		"shared_prefix":     0xd199eeb1ce29f96e,
		"prefix_repetition": 0x63c88b5b5bb726c2,
		"zipf":              0xc290e9809c975724,
		"random":            0xf1ad92ed30962f1d,
		"agents":            0x69ad2db6188b5f15,
		"rl":                0xbabaddb1752cf1c8,
	}
	for _, name := range synthetic() {
		reqs, err := Generate(Spec{Name: name, Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		if got := digest(reqs); got != want[name] {
			t.Errorf("%s seed 1 digest %#x, want %#x", name, got, want[name])
		}
	}
}
