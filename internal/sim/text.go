package sim

import (
	"encoding/binary"
	"math"
	"math/rand/v2"

	"github.com/cespare/xxhash/v2"
)

// pieces are the output tokens: a space and three letters, 4 bytes each, so
// that the Approx tokenizer (4 bytes per token) counts exactly one token per
// piece and a client re-tokenizing the answer (the next turn of a
// conversation) gets the same count the sim reported. They contain nothing
// JSON needs to escape, so SSE chunks are written without an encoder.
var pieces = [...]string{
	" the", " and", " for", " you", " not", " are", " was", " but",
	" his", " can", " had", " her", " one", " all", " out", " day",
	" get", " has", " him", " how", " man", " new", " now", " old",
	" see", " two", " way", " who", " boy", " did", " its", " let",
	" put", " say", " she", " too", " use", " map", " sky", " sea",
	" red", " fox", " run", " big", " art", " end", " far", " few",
	" got", " job", " key", " low", " met", " may", " own", " set",
	" sun", " top", " war", " yes", " air", " ask", " car", " dog",
}

// outputGen produces one choice's output: its length and its words. It is
// seeded by the sim seed, the prompt's content, the choice index and the
// request's own seed, not by the replica or the arrival order, so the same
// request gets the same answer on any replica, as a real model at
// temperature 0 would: a multi-turn benchmark then sends the same
// conversation whichever policy routes it.
type outputGen struct {
	rng *rand.Rand
}

func newOutputGen(simSeed uint64, promptDigest uint64, choice int, reqSeed int64) outputGen {
	var b [24]byte
	binary.LittleEndian.PutUint64(b[0:], simSeed)
	binary.LittleEndian.PutUint64(b[8:], uint64(choice))
	binary.LittleEndian.PutUint64(b[16:], uint64(reqSeed))
	return outputGen{rng: rand.New(rand.NewPCG(promptDigest, xxhash.Sum64(b[:])))}
}

// length draws the number of tokens until the model would stop (EOS): a
// log-normal with the given median and log-space sigma, the usual fit of
// chat answer lengths (ShareGPT-like traces are right-skewed with a long
// tail), at least 1.
func (g outputGen) length(median int, sigma float64) int {
	x := float64(median) * math.Exp(sigma*g.rng.NormFloat64())
	if !(x < 1<<30) {
		return 1 << 30
	}
	return max(1, int(math.Round(x)))
}

// next is the text of the next output token.
func (g outputGen) next() string { return pieces[g.rng.IntN(len(pieces))] }

// appendText appends n tokens of text.
func (g outputGen) appendText(dst []byte, n int) []byte {
	for range n {
		dst = append(dst, g.next()...)
	}
	return dst
}
