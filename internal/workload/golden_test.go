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

// TestGoldenMessages pins what a runner sends of larger chat workloads,
// message by message: the digests were taken when every message's text
// was made up front (before Message made it on demand), so a request's
// text made on demand is the text made eagerly before.
func TestGoldenMessages(t *testing.T) {
	for _, c := range []struct {
		spec Spec
		want uint64
	}{
		{Spec{Name: "multiturn", Requests: 3000, Seed: 7, Params: map[string]float64{"system_prompts": 4}}, 0x71eebb54551f4c9e},
		{Spec{Name: "multiturn", Requests: 1000, Seed: 3, Params: map[string]float64{"conversations": 200, "turns": 5}}, 0x5cd080681c7a6320},
		{Spec{Name: "agents", Requests: 500, Seed: 2}, 0xd8ff4c3a61f2e114},
	} {
		reqs, err := Generate(c.spec)
		if err != nil {
			t.Fatal(err)
		}
		d := xxhash.New()
		for i := range reqs {
			r := &reqs[i]
			fmt.Fprintf(d, "%d|%d|%d|%s|%v|%d|%d\n", r.Index, r.Prev, r.Think, r.Session, r.Chat, r.MaxTokens, r.InputTokens)
			if r.Chat {
				roles, contents := parts(r)
				for j := range roles {
					fmt.Fprintf(d, "%s|%s\n", roles[j], contents[j])
				}
			}
			_, _ = d.Write(r.AppendText(nil))
		}
		if got := d.Sum64(); got != c.want {
			t.Errorf("%s: digest %#x, want %#x", c.spec, got, c.want)
		}
	}
}

// TestSystemPromptsHeldOrMade: past the held budget, system prompts are
// made on demand, and their text is the held one's.
func TestSystemPromptsHeldOrMade(t *testing.T) {
	held, made := systemPrompts(5, 9, 100, heldSystemBytes), systemPrompts(5, 9, 100, 0)
	for j := range 9 {
		h, m := held(j), made(j)
		if h.Text == "" || m.Text != "" || m.Tokens != 100 {
			t.Fatalf("prompt %d: held %+v, made %+v", j, h, m)
		}
		if h.Content() != m.Content() || h.Len() != m.Len() || h.Content() != Words(5+uint64(j)*0x9e3779b97f4a7c15, 100) {
			t.Fatalf("prompt %d: held and made texts differ", j)
		}
	}
}
