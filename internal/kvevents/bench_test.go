package kvevents

import (
	"fmt"
	"testing"
)

// benchBatch is a batch of n BlockStored events of 16 blocks of 16 tokens,
// the shape a busy replica publishes per scheduler step.
func benchBatch(n int) Batch {
	b := Batch{Timestamp: 1.7e9, DataParallelRank: ptr(0)}
	for i := range n {
		e := &BlockStored{BlockSize: 16, Medium: "GPU", ParentBlockHash: ptr(uint64(i) * 7919)}
		for j := range 16 {
			e.BlockHashes = append(e.BlockHashes, uint64(i*16+j)*0x9e3779b97f4a7c15)
		}
		for j := range 16 * 16 {
			e.TokenIDs = append(e.TokenIDs, uint32(j*31+i)%151000)
		}
		b.Events = append(b.Events, e)
	}
	return b
}

func BenchmarkEncode(b *testing.B) {
	for _, n := range []int{1, 16, 256} {
		for _, f := range []Form{FormMap, FormArray} {
			batch := benchBatch(n)
			b.Run(fmt.Sprintf("events=%d/%s", n, f), func(b *testing.B) {
				for b.Loop() {
					if _, err := Encode(batch, f); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

func BenchmarkDecode(b *testing.B) {
	for _, n := range []int{1, 16, 256} {
		for _, f := range []Form{FormMap, FormArray} {
			wire, err := Encode(benchBatch(n), f)
			if err != nil {
				b.Fatal(err)
			}
			b.Run(fmt.Sprintf("events=%d/%s", n, f), func(b *testing.B) {
				b.SetBytes(int64(len(wire)))
				for b.Loop() {
					if _, err := Decode(wire); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
