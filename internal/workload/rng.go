package workload

import (
	"math"
	"math/bits"
	"math/rand/v2"
)

// rng is the one source of randomness of every generator: PCG-DXSM from
// math/rand/v2, whose output is specified bit for bit. The derived draws
// (bounded integers, floats, exponentials, shuffles) are written here rather
// than taken from rand.Rand so that a seed names the same workload in every
// Go release, not only the same PCG stream.
type rng struct{ pcg rand.PCG }

// mix64 is SplitMix64's finaliser (Steele, Lea, Flood 2014). Seeds are passed
// through it so that adjacent seeds (block ids 7 and 8, say) start PCG from
// unrelated states; PCG's first outputs from nearby states are correlated.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// seed sets the stream for (seed, domain): different domains give
// independent streams from the same user seed.
func (r *rng) seed(seed, domain uint64) {
	r.pcg.Seed(mix64(seed^mix64(domain)), mix64(seed+0x9e3779b97f4a7c15*(domain|1)))
}

func newRNG(seed, domain uint64) *rng {
	r := new(rng)
	r.seed(seed, domain)
	return r
}

func (r *rng) uint64() uint64 { return r.pcg.Uint64() }

// intn returns a uniform integer in [0, n) by Lemire's multiply-shift (the
// high word of x·n). Without the rejection step the bias is below n/2^64,
// far under anything a workload can show. n must be > 0.
func (r *rng) intn(n int) int {
	hi, _ := bits.Mul64(r.pcg.Uint64(), uint64(n))
	return int(hi)
}

// between returns a uniform integer in [lo, hi].
func (r *rng) between(lo, hi int) int {
	if hi <= lo {
		return lo
	}
	return lo + r.intn(hi-lo+1)
}

// float64 returns a uniform float in [0, 1) from the top 53 bits.
func (r *rng) float64() float64 {
	return float64(r.pcg.Uint64()>>11) * (1.0 / (1 << 53))
}

// exp returns a standard exponential variate by inversion, −ln(1−U); 1−U is
// in (0, 1], so the logarithm is finite.
func (r *rng) exp() float64 {
	return -math.Log(1 - r.float64())
}

// norm returns a standard normal variate by the Box–Muller transform of
// two uniforms (1−U in (0, 1], so the logarithm is finite).
func (r *rng) norm() float64 {
	u1, u2 := 1-r.float64(), r.float64()
	return math.Sqrt(-2*math.Log(u1)) * math.Cos(2*math.Pi*u2)
}

// shuffle is the Fisher–Yates shuffle.
func (r *rng) shuffle(n int, swap func(i, j int)) {
	for i := n - 1; i > 0; i-- {
		swap(i, r.intn(i+1))
	}
}
