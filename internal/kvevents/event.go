package kvevents

import (
	"errors"
	"fmt"
)

// Form selects how Encode writes the events of a batch. The batch envelope is
// a positional array in both forms, as in vLLM.
type Form int

const (
	// FormMap writes each event as a msgpack map keyed by field name with the
	// tag under "type" (vLLM since PR #42892). It is the default.
	FormMap Form = iota
	// FormArray writes each event as a positional array, tag first (vLLM
	// before PR #42892).
	FormArray
)

// String returns "map" or "array".
func (f Form) String() string {
	switch f {
	case FormMap:
		return "map"
	case FormArray:
		return "array"
	}
	return fmt.Sprintf("Form(%d)", int(f))
}

// ErrUnknownForm is returned for a Form value or name that is neither map
// nor array.
var ErrUnknownForm = errors.New("kvevents: unknown event form")

// ParseForm parses "map" or "array" (the spelling of a command-line flag).
func ParseForm(s string) (Form, error) {
	switch s {
	case "map":
		return FormMap, nil
	case "array":
		return FormArray, nil
	}
	return 0, fmt.Errorf("%w %q (want map or array)", ErrUnknownForm, s)
}

// Event tags: msgspec's tag=True uses the class name.
const (
	TagBlockStored      = "BlockStored"
	TagBlockRemoved     = "BlockRemoved"
	TagAllBlocksCleared = "AllBlocksCleared"
)

// Event is one KV-cache event: *BlockStored, *BlockRemoved or
// *AllBlocksCleared. Only these three implement it, so a type switch over
// them is exhaustive.
type Event interface{ kind() string }

// Kind returns the wire tag of e ("BlockStored", ...).
func Kind(e Event) string { return e.kind() }

// BlockStored reports full blocks that entered a replica's prefix cache.
// BlockHashes[i] is the hash of block i of a chain whose first block's parent
// is ParentBlockHash (nil when the chain starts at the root), and TokenIDs
// holds the tokens of all those blocks, len(BlockHashes)*BlockSize of them.
type BlockStored struct {
	BlockHashes     []uint64
	ParentBlockHash *uint64
	TokenIDs        []uint32
	BlockSize       int
	LoraID          *int   // deprecated in vLLM in favour of LoraName; nil = none
	Medium          string // "GPU", "CPU", ...; "" = not reported (nil on the wire)
	LoraName        string // "" = none (nil on the wire)
}

// BlockRemoved reports blocks evicted from a replica's prefix cache.
type BlockRemoved struct {
	BlockHashes []uint64
	Medium      string // "" = not reported (nil on the wire)
}

// AllBlocksCleared reports that a replica dropped its whole prefix cache
// (reset_prefix_cache, or a restart).
type AllBlocksCleared struct{}

func (*BlockStored) kind() string      { return TagBlockStored }
func (*BlockRemoved) kind() string     { return TagBlockRemoved }
func (*AllBlocksCleared) kind() string { return TagAllBlocksCleared }

// Batch is one published message: the events a replica's scheduler produced
// in one step.
type Batch struct {
	Timestamp        float64 // seconds since the Unix epoch (Python time.time())
	Events           []Event
	DataParallelRank *int // nil = not sent
}

// Message is one received batch with its transport envelope.
type Message struct {
	Topic string
	Seq   uint64
	Batch Batch
}
