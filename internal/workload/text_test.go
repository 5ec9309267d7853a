package workload

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/prompt"
	"pgregory.net/rapid"
)

var vocabSet = func() map[string]bool {
	m := map[string]bool{}
	for _, w := range vocab {
		m[w] = true
	}
	return m
}()

// checkWords fails unless text is words of vocab separated by " ", ", " or
// ". ", ASCII only.
func checkWords(t interface {
	Helper()
	Fatalf(string, ...any)
}, text string) {
	t.Helper()
	for i := 0; i < len(text); i++ {
		c := text[i]
		if !(c >= 'a' && c <= 'z' || c == ' ' || c == ',' || c == '.') {
			t.Fatalf("byte %d is %q, want lowercase letters, space, comma or full stop", i, c)
		}
	}
	for _, f := range strings.Fields(text) {
		w := strings.TrimRight(f, ",.")
		if len(f)-len(w) > 1 || !vocabSet[w] {
			t.Fatalf("%q is not a vocabulary word with at most one punctuation mark (in %.80q…)", f, text)
		}
	}
}

func TestVocabularyTables(t *testing.T) {
	inTable := map[string]int{}
	for i, w := range wordTable {
		if w == "" {
			t.Fatalf("table slot %d empty", i)
		}
		inTable[w]++
		if string(wordSlots[i][:wordLens[i]]) != w {
			t.Fatalf("slot %d holds %q, table says %q", i, wordSlots[i][:wordLens[i]], w)
		}
	}
	for _, w := range vocab {
		if inTable[w] == 0 {
			t.Errorf("vocab word %q has no table slot: it would appear only as a closing word", w)
		}
	}
	if len(inTable) != len(vocab) {
		t.Errorf("duplicate vocab words: %d distinct of %d", len(inTable), len(vocab))
	}
	for l := 1; l <= maxWordLen; l++ {
		if len(byLength[l]) == 0 {
			t.Errorf("no word of length %d", l)
		}
	}
	// Zipf-like frequencies: "the" the most frequent, around 7 %.
	if share := float64(inTable["the"]) / tableSize; share < 0.04 || share > 0.10 {
		t.Errorf(`"the" holds %.3f of the table, want 0.04–0.10`, share)
	}
}

func TestBlockText(t *testing.T) {
	ids := []int{0, 1, 2, 7, 8, 511, 512, 182789, 1 << 40, -1, math.MaxInt64}
	seen := map[string]int{}
	for _, id := range ids {
		t.Run(fmt.Sprint(id), func(t *testing.T) {
			b := BlockText(id)
			if len(b) != BlockBytes {
				t.Fatalf("len %d, want %d", len(b), BlockBytes)
			}
			if n := (prompt.Approx{}).Count(b); n != BlockTokens {
				t.Fatalf("%d tokens, want %d", n, BlockTokens)
			}
			if b != BlockText(id) {
				t.Fatal("not deterministic")
			}
			if !strings.HasSuffix(b, ". ") || b[0] < 'a' || b[0] > 'z' {
				t.Fatalf("block should start with a word and end with \". \": %.20q … %q", b, b[len(b)-20:])
			}
			checkWords(t, b)
			if prev, dup := seen[b[:64]]; dup {
				t.Fatalf("the first 64 bytes equal those of id %d", prev)
			}
			seen[b[:64]] = id
		})
	}
}

// English-looking: the statistics of a long text are those of prose.
func TestWordsStatistics(t *testing.T) {
	text := Words(42, 1<<18) // 1 MiB
	checkWords(t, text)
	words := strings.Fields(text)
	letters, the, stops := 0, 0, 0
	for _, f := range words {
		w := strings.TrimRight(f, ",.")
		letters += len(w)
		if w == "the" {
			the++
		}
		if strings.HasSuffix(f, ".") {
			stops++
		}
	}
	n := float64(len(words))
	if mean := float64(letters) / n; mean < 3.5 || mean > 6 {
		t.Errorf("mean word length %.2f, want 3.5–6", mean)
	}
	if share := float64(the) / n; share < 0.04 || share > 0.10 {
		t.Errorf(`"the" is %.3f of words, want 0.04–0.10`, share)
	}
	if perSentence := n / float64(stops); perSentence < 10 || perSentence > 25 {
		t.Errorf("%.1f words per sentence, want 10–25", perSentence)
	}
}

func TestWordsExactLength(t *testing.T) {
	for _, tokens := range []int{0, 1, 2, 3, 4, 5, 7, 13, 16, 100, 511, 512, 513, 4096} {
		for _, seed := range []uint64{0, 1, 1 << 63} {
			w := Words(seed, tokens)
			if len(w) != 4*tokens || (prompt.Approx{}).Count(w) != tokens {
				t.Fatalf("Words(%d, %d): %d bytes, want %d", seed, tokens, len(w), 4*tokens)
			}
			if tokens > 0 && !strings.HasSuffix(w, ". ") {
				t.Fatalf("Words(%d, %d) = %q does not end a sentence", seed, tokens, w)
			}
			checkWords(t, w)
			if w != Words(seed, tokens) {
				t.Fatal("not deterministic")
			}
		}
	}
	if Words(1, 64) == Words(2, 64) {
		t.Fatal("different seeds, same text")
	}
	if Words(5, -3) != "" {
		t.Fatal("negative tokens should give empty text")
	}
	rapid.Check(t, func(t *rapid.T) {
		seed := rapid.Uint64().Draw(t, "seed")
		tokens := rapid.IntRange(0, 3000).Draw(t, "tokens")
		w := Words(seed, tokens)
		if len(w) != 4*tokens {
			t.Fatalf("%d bytes for %d tokens", len(w), tokens)
		}
		checkWords(t, w)
		pre := []byte("xyz")
		if got := AppendWords(pre, seed, tokens); string(got) != "xyz"+w {
			t.Fatal("AppendWords differs from Words")
		}
	})
}

// closeText fills every remainder the generator can leave with whole words.
func TestCloseText(t *testing.T) {
	for rest := 0; rest <= maxSegment+2; rest++ {
		buf := make([]byte, rest)
		closeText(buf, newRNG(uint64(rest), 9))
		if rest >= 3 {
			if !strings.HasSuffix(string(buf), ". ") {
				t.Fatalf("rest %d: %q", rest, buf)
			}
			checkWords(t, string(buf))
		}
		if strings.IndexByte(string(buf), 0) >= 0 {
			t.Fatalf("rest %d left a zero byte: %q", rest, buf)
		}
	}
}

func TestTraceText(t *testing.T) {
	cases := []struct {
		ids []int
		in  int
	}{
		{nil, 0},
		{[]int{5}, 1},
		{[]int{5}, 511},
		{[]int{5}, 512},
		{[]int{5, 6}, 513},
		{[]int{0, 1, 2}, 1500},
		{[]int{0, 0, 0}, 1536},
		{make([]int, 24), 12000},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%d-ids-%d-tokens", len(c.ids), c.in), func(t *testing.T) {
			text := TraceText(c.ids, c.in)
			if len(text) != 4*c.in || (prompt.Approx{}).Count(text) != c.in {
				t.Fatalf("len %d, want %d", len(text), 4*c.in)
			}
			var want strings.Builder
			for _, id := range c.ids {
				want.WriteString(BlockText(id))
			}
			if !strings.HasPrefix(want.String(), text) {
				t.Fatal("not the blocks' text cut at input_length")
			}
			if string(AppendTraceText([]byte("p"), c.ids, c.in)) != "p"+text {
				t.Fatal("AppendTraceText differs")
			}
		})
	}
}

func TestTraceTextPanicsOnMismatch(t *testing.T) {
	for _, c := range []struct {
		ids []int
		in  int
	}{{[]int{1}, 513}, {[]int{1, 2}, 512}, {nil, 1}, {[]int{1}, -1}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("TraceText(%v, %d) did not panic", c.ids, c.in)
				}
			}()
			TraceText(c.ids, c.in)
		}()
	}
}

// Equal leading hash ids give equal leading text, and so equal kvgate block
// hashes; the first differing id starts a differing block.
func TestTraceTextPrefixSharing(t *testing.T) {
	root := prompt.Key{Model: "m"}.Root()
	rapid.Check(t, func(t *rapid.T) {
		common := rapid.SliceOfN(rapid.IntRange(0, 1000), 0, 6).Draw(t, "common")
		a := append(append([]int(nil), common...), rapid.SliceOfN(rapid.IntRange(1001, 2000), 1, 4).Draw(t, "a")...)
		b := append(append([]int(nil), common...), rapid.SliceOfN(rapid.IntRange(2001, 3000), 1, 4).Draw(t, "b")...)
		inA := (len(a)-1)*BlockTokens + rapid.IntRange(1, BlockTokens).Draw(t, "lastA")
		inB := (len(b)-1)*BlockTokens + rapid.IntRange(1, BlockTokens).Draw(t, "lastB")
		ta, tb := TraceText(a, inA), TraceText(b, inB)
		k := len(common) * BlockBytes
		if ta[:k] != tb[:k] {
			t.Fatal("shared ids, different text")
		}
		ha := prompt.ApproxBlockHashes(nil, root, ta, prompt.DefaultBlockSize)
		hb := prompt.ApproxBlockHashes(nil, root, tb, prompt.DefaultBlockSize)
		shared := 0
		for shared < min(len(ha), len(hb)) && ha[shared] == hb[shared] {
			shared++
		}
		want := min(k/64, len(ha), len(hb))
		if shared != want {
			t.Fatalf("%d kvgate blocks shared, want %d (%d common ids)", shared, want, len(common))
		}
		// A request ending inside a block shares it with one holding all of it.
		short := (len(a)-1)*BlockTokens + 1
		if ts := TraceText(a, short); !strings.HasPrefix(ta, ts) {
			t.Fatal("a shorter last block is not a prefix of the longer")
		}
	})
}

func TestAppendTraceTextNoAlloc(t *testing.T) {
	ids := []int{3, 1, 4, 1, 5, 9, 2, 6}
	buf := make([]byte, 0, 8*BlockBytes)
	if n := testing.AllocsPerRun(20, func() { buf = AppendTraceText(buf[:0], ids, 7*512+100) }); n != 0 {
		t.Fatalf("%v allocations into a buffer with room", n)
	}
}

func BenchmarkTraceText(b *testing.B) {
	for _, tokens := range []int{512, 12000, 100000} {
		b.Run(fmt.Sprint(tokens), func(b *testing.B) {
			ids := make([]int, (tokens+BlockTokens-1)/BlockTokens)
			for i := range ids {
				ids[i] = 1000 + i*7
			}
			b.SetBytes(int64(4 * tokens))
			var buf []byte
			for b.Loop() {
				buf = AppendTraceText(buf[:0], ids, tokens)
			}
		})
	}
}

func BenchmarkTraceTextAlloc(b *testing.B) {
	ids := make([]int, 24)
	for i := range ids {
		ids[i] = i
	}
	b.SetBytes(4 * 12000)
	for b.Loop() {
		_ = TraceText(ids, 12000)
	}
}

func BenchmarkWords(b *testing.B) {
	b.SetBytes(4 * 2048)
	var buf []byte
	seed := uint64(0)
	for b.Loop() {
		seed++
		buf = AppendWords(buf[:0], seed, 2048)
	}
}
