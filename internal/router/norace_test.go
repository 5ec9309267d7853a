//go:build !race

package router

// raceDetector: the race detector is on (race_test.go).
const raceDetector = false
