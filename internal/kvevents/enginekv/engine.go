package enginekv

import (
	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/kvevents"
)

// Events converts one step's events of kvgate's engine model to vLLM's
// events, as a replica reports them: what `kvgate sim` publishes and what
// the replay's router follows. The events share the engine's slices.
//
// The GPU's events carry everything vLLM's block pool puts in them. The
// host tier's (engine.MediumCPU) are vLLM's OffloadingConnector's as it
// sends them by default (its scheduler's take_events): medium "CPU", the
// block hashes and block size only, no parent, no token ids, no adapter
// (its self_describing_kv_events option, off by default, fills them).
func Events(evs []engine.KVEvent) []kvevents.Event {
	out := make([]kvevents.Event, 0, len(evs))
	for _, ev := range evs {
		switch ev.Kind {
		case engine.Stored:
			out = append(out, stored(ev))
		case engine.Removed:
			out = append(out, &kvevents.BlockRemoved{BlockHashes: ev.BlockHashes, Medium: ev.Medium.String()})
		case engine.Cleared:
			out = append(out, &kvevents.AllBlocksCleared{})
		}
	}
	return out
}

func stored(ev engine.KVEvent) *kvevents.BlockStored {
	s := &kvevents.BlockStored{BlockHashes: ev.BlockHashes, BlockSize: ev.BlockSize, Medium: ev.Medium.String()}
	if ev.Medium != engine.MediumGPU {
		return s
	}
	s.TokenIDs, s.LoraName = ev.TokenIDs, ev.LoraName
	if ev.HasParent {
		p := ev.ParentHash
		s.ParentBlockHash = &p
	}
	return s
}
