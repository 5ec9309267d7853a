package enginekv

import (
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/kvevents"
)

// Events converts one step's events of kvgate's engine model to vLLM's
// events, as a replica on GPU reports them: what `kvgate sim` publishes and
// what the replay's router follows. The events share the engine's slices.
func Events(evs []engine.KVEvent) []kvevents.Event {
	out := make([]kvevents.Event, 0, len(evs))
	for _, ev := range evs {
		switch ev.Kind {
		case engine.Stored:
			s := &kvevents.BlockStored{
				BlockHashes: ev.BlockHashes,
				TokenIDs:    ev.TokenIDs,
				BlockSize:   ev.BlockSize,
				Medium:      "GPU",
				LoraName:    ev.LoraName,
			}
			if ev.HasParent {
				p := ev.ParentHash
				s.ParentBlockHash = &p
			}
			out = append(out, s)
		case engine.Removed:
			out = append(out, &kvevents.BlockRemoved{BlockHashes: ev.BlockHashes, Medium: "GPU"})
		case engine.Cleared:
			out = append(out, &kvevents.AllBlocksCleared{})
		}
	}
	return out
}
