package enginekv

import (
	"reflect"
	"testing"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/kvevents"
)

func TestEvents(t *testing.T) {
	hashes, tokens := []uint64{7, 8}, []uint32{1, 2, 3, 4}
	tests := []struct {
		name string
		in   []engine.KVEvent
		want []kvevents.Event
	}{
		{"none", nil, []kvevents.Event{}},
		{"stored at the root", []engine.KVEvent{{Kind: engine.Stored, BlockHashes: hashes, TokenIDs: tokens, BlockSize: 2}},
			[]kvevents.Event{&kvevents.BlockStored{BlockHashes: hashes, TokenIDs: tokens, BlockSize: 2, Medium: "GPU"}}},
		{"stored after a parent, with an adapter", []engine.KVEvent{{Kind: engine.Stored, BlockHashes: hashes, ParentHash: 6, HasParent: true, TokenIDs: tokens, BlockSize: 2, LoraName: "a"}},
			[]kvevents.Event{&kvevents.BlockStored{BlockHashes: hashes, ParentBlockHash: new(uint64(6)), TokenIDs: tokens, BlockSize: 2, Medium: "GPU", LoraName: "a"}}},
		{"a zero parent is still a parent", []engine.KVEvent{{Kind: engine.Stored, BlockHashes: hashes, HasParent: true, BlockSize: 1}},
			[]kvevents.Event{&kvevents.BlockStored{BlockHashes: hashes, ParentBlockHash: new(uint64(0)), BlockSize: 1, Medium: "GPU"}}},
		{"removed and cleared, in order", []engine.KVEvent{{Kind: engine.Removed, BlockHashes: hashes}, {Kind: engine.Cleared}},
			[]kvevents.Event{&kvevents.BlockRemoved{BlockHashes: hashes, Medium: "GPU"}, &kvevents.AllBlocksCleared{}}},
		{"an unknown kind is skipped", []engine.KVEvent{{Kind: 0, BlockHashes: hashes}, {Kind: engine.Cleared}},
			[]kvevents.Event{&kvevents.AllBlocksCleared{}}},
		{"the host tier's, in the connector's payload", []engine.KVEvent{
			{Kind: engine.Stored, Medium: engine.MediumCPU, BlockHashes: hashes, ParentHash: 6, HasParent: true, TokenIDs: tokens, BlockSize: 2, LoraName: "a"},
			{Kind: engine.Removed, Medium: engine.MediumCPU, BlockHashes: hashes[:1]}},
			[]kvevents.Event{&kvevents.BlockStored{BlockHashes: hashes, BlockSize: 2, Medium: "CPU"},
				&kvevents.BlockRemoved{BlockHashes: hashes[:1], Medium: "CPU"}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := Events(tc.in)
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("Events = %+v, want %+v", got, tc.want)
			}
			// What the sim publishes must be a batch the wire format takes.
			for _, f := range []kvevents.Form{kvevents.FormMap, kvevents.FormArray} {
				b, err := kvevents.Encode(kvevents.Batch{Events: got}, f)
				if err != nil {
					t.Fatalf("%v: %v", f, err)
				}
				back, err := kvevents.Decode(b)
				if err != nil || len(back.Events) != len(got) {
					t.Fatalf("%v: decoded %d events (%v), want %d", f, len(back.Events), err, len(got))
				}
				for i, ev := range back.Events {
					if m, want := medium(ev), medium(got[i]); m != want {
						t.Fatalf("%v: event %d decoded with medium %q, want %q", f, i, m, want)
					}
				}
			}
		})
	}
}

func medium(ev kvevents.Event) string {
	switch e := ev.(type) {
	case *kvevents.BlockStored:
		return e.Medium
	case *kvevents.BlockRemoved:
		return e.Medium
	}
	return ""
}
