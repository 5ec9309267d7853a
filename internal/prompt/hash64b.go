package prompt

import (
	"encoding/binary"
	"math/bits"
)

// xxh3Of64 is XXH3-64 (seed 0, the default secret) of exactly 64 bytes,
// equal to xxh3.Hash(b[:64]) (TestXXH3Of64MatchesTheLibrary): a block of the
// default 16 tokens. The library's Hash switches on the length on every
// call and is not inlined; with the length fixed, the 17–128-byte path of
// the XXH3 specification is four 64×64→128 multiplies folded and summed,
// then the avalanche, and a prompt's blocks run through a loop the compiler
// keeps in registers. Hashing is most of a routing decision.
func xxh3Of64(b []byte) uint64 {
	_ = b[63]
	// The 17–128-byte path for length 64: acc = len·P64_1, plus a folded
	// product per 16-byte lane (in the order 16, 32–1, 0, 64–1 of the
	// specification: addition commutes), each lane xored with 16 bytes of
	// the secret taken at 0, 16, 32, 48.
	acc := uint64(xxhLen64) // 64·P64_1 mod 2^64
	acc += fold(binary.LittleEndian.Uint64(b[0:])^xxhKey000, binary.LittleEndian.Uint64(b[8:])^xxhKey008)
	acc += fold(binary.LittleEndian.Uint64(b[48:])^xxhKey016, binary.LittleEndian.Uint64(b[56:])^xxhKey024)
	acc += fold(binary.LittleEndian.Uint64(b[16:])^xxhKey032, binary.LittleEndian.Uint64(b[24:])^xxhKey040)
	acc += fold(binary.LittleEndian.Uint64(b[32:])^xxhKey048, binary.LittleEndian.Uint64(b[40:])^xxhKey056)
	// XXH3's avalanche.
	acc ^= acc >> 37
	acc *= 0x165667919e3779f9
	return acc ^ acc>>32
}

// fold is the 128-bit product of x and y folded to 64 bits (high ⊕ low).
func fold(x, y uint64) uint64 {
	hi, lo := bits.Mul64(x, y)
	return hi ^ lo
}

// 64 times XXH3's first prime (modulo 2^64) and the first 64 bytes of its default secret
// (kSecret), as little-endian words.
const (
	xxhLen64  = 0x9e3779b185ebca87 * 64 % (1 << 64)
	xxhKey000 = 0xbe4ba423396cfeb8
	xxhKey008 = 0x1cad21f72c81017c
	xxhKey016 = 0xdb979083e96dd4de
	xxhKey024 = 0x1f67b3b7a4a44072
	xxhKey032 = 0x78e5c0cc4ee679cb
	xxhKey040 = 0x2172ffcc7dd05a82
	xxhKey048 = 0x8e2443f7744608b8
	xxhKey056 = 0x4c263a81e69035e0
)
