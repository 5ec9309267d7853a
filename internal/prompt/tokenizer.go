package prompt

import "encoding/binary"

// Tokenizer turns text into token ids. The router only needs ids that are
// equal for equal text prefixes; a replica's own tokenizer (remote mode) gives
// the exact ids the engine caches.
type Tokenizer interface {
	// Encode appends the token ids of text to dst.
	Encode(dst []uint32, text string) []uint32
	// Count is len(Encode(nil, text)), without allocating.
	Count(text string) int
}

// Approx is kvgate's default tokenizer: every 4 bytes of UTF-8 text are one
// token, whose id is those bytes read little-endian (the last token zero
// padded). That is about 4 characters per token on English text, as with
// BPE tokenizers of Llama-3's kind, and equal text prefixes give equal token
// prefixes exactly. It needs no vocabulary, runs at memory speed and lets
// block hashes be computed over the text in place. The simulated replicas
// use it too, so the gateway and the sim agree on every count.
type Approx struct{}

var _ Tokenizer = Approx{}

// Count returns ceil(len(text)/4).
func (Approx) Count(text string) int { return (len(text) + TokenBytesPer - 1) / TokenBytesPer }

// Encode appends the ids of text.
func (Approx) Encode(dst []uint32, text string) []uint32 {
	i := 0
	for ; i+4 <= len(text); i += 4 {
		dst = append(dst, binary.LittleEndian.Uint32([]byte(text[i:i+4])))
	}
	if i < len(text) {
		var pad [4]byte
		copy(pad[:], text[i:])
		dst = append(dst, binary.LittleEndian.Uint32(pad[:]))
	}
	return dst
}

// ApproxBlockHashes appends the chained block hashes of text under the Approx
// tokenizer, hashing the text in place. It equals
// BlockHashes(dst, root, TokenBytes(nil, Approx{}.Encode(nil, text)), blockSize).
func ApproxBlockHashes(dst []uint64, root uint64, text string, blockSize int) []uint64 {
	if blockSize <= 0 {
		blockSize = DefaultBlockSize
	}
	step := blockSize * TokenBytesPer
	full := len(text) / step * step
	n0 := len(dst)
	dst = BlockHashes(dst, root, unsafeBytes(text[:full]), blockSize)
	// A block whose last token is partial (zero padded) is still a full block of tokens.
	if rest := text[full:]; (Approx{}).Count(rest) >= blockSize {
		buf := make([]byte, step)
		copy(buf, rest)
		h := root
		if len(dst) > n0 {
			h = dst[len(dst)-1]
		}
		dst = append(dst, Chain(h, buf))
	}
	return dst
}
