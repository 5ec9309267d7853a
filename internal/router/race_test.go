//go:build race

package router

// raceDetector: the race detector is on. Its sync.Pool drops a share of
// what is put back, on purpose, so allocation counts do not hold.
const raceDetector = true
