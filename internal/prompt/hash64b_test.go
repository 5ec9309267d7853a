package prompt

import (
	"testing"

	"github.com/zeebo/xxh3"
	"pgregory.net/rapid"
)

// The fixed-length hash is XXH3 itself: equal to the library's on any 64
// bytes, so block hashes (and everything keyed by them: the indexes, the
// state shared through Redis with gateways of earlier versions) do not
// change.
func TestXXH3Of64MatchesTheLibrary(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		b := rapid.SliceOfN(rapid.Byte(), 64, 64).Draw(t, "block")
		if got, want := xxh3Of64(b), xxh3.Hash(b); got != want {
			t.Fatalf("xxh3Of64 = %#x, xxh3.Hash = %#x", got, want)
		}
	})
	var zero [64]byte
	if xxh3Of64(zero[:]) != xxh3.Hash(zero[:]) {
		t.Fatal("zero block differs")
	}
}

// BlockHashes's 64-byte loop gives the chain Chain defines, block by block.
func TestBlockHashesOf64ByteBlocksAreTheChain(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		b := rapid.SliceOfN(rapid.Byte(), 0, 64*9).Draw(t, "tokens")
		root := rapid.Uint64().Draw(t, "root")
		got := BlockHashes(nil, root, b, 16)
		h, want := root, []uint64(nil)
		for off := 0; off+64 <= len(b); off += 64 {
			h = Chain(h, b[off:off+64])
			want = append(want, h)
		}
		if len(got) != len(want) {
			t.Fatalf("%d hashes, want %d", len(got), len(want))
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("block %d: %#x, want %#x", i, got[i], want[i])
			}
		}
	})
}
