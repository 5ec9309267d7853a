package sharedstate

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/kvgate/kvgate/internal/prefixindex"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// What a peer may send. Anyone who can write to the Redis can write an
// entry, so every value read from it is checked here before anything
// reaches the router: an entry with one value out of bounds is dropped
// whole (and counted by reason), never clamped into a plausible lie.
//
// The bounds are those of a real gateway, with room: a gateway clamps its
// own values to them before it publishes (a count that dips below zero for
// an instant goes out as 0), so a live peer's entries always pass.
const (
	// MaxDecisionBlocks bounds one decision's blocks (Offset + len(Blocks)):
	// 2,097,152 tokens of 16-token blocks, beyond any model's context, and
	// 1 MiB of hashes. A longer prompt is shared by its first
	// MaxDecisionBlocks blocks: its prefix is what routing matches.
	MaxDecisionBlocks = 1 << 17
	// MaxDecisionTokens bounds a decision's prompt length in tokens.
	MaxDecisionTokens = 1 << 26
	// MaxLoadCount bounds the requests in flight and pending in one
	// gateway's load for one replica: no engine holds a million requests.
	MaxLoadCount = 1 << 20
	// MaxLoadTokens bounds the tokens in flight and pending prefill in one
	// gateway's load for one replica: MaxLoadCount requests of 16M tokens.
	// The sum over maxPeers gateways (2^54) cannot overflow an int64.
	MaxLoadTokens = MaxLoadCount << 24
	// MaxProgramTokens bounds a program's context (a decision's Tokens
	// when it names a program): the longest prompt a request may carry
	// (prompt.MaxTokensLimit). A receiving router also refuses a context
	// its blocks do not back (router.ApplyRemoteProgram).
	MaxProgramTokens = prompt.MaxTokensLimit
	// MaxNameBytes bounds a gateway, replica or model name.
	MaxNameBytes = 2048
	// MaxClockSkew bounds how far a batch's At (the sender's clock) may be
	// from the time in its entry's ID (Redis's clock when it was added).
	MaxClockSkew = time.Hour
	// MaxIDAhead is how far an entry's ID may be ahead of Redis's clock
	// (TIME) before the reader refuses it: Redis numbers entries by its own
	// clock, so only an ID written by hand, or a clock stepped back, is
	// ahead of it.
	MaxIDAhead = time.Minute
	// maxPeers bounds the other gateways a Peers tracks at once: each costs
	// a load per replica, and a forger could name a new one per entry.
	maxPeers = 1024
)

// The size caps. A publisher splits its batches at maxBatchBytes, so the
// largest entry a live gateway writes is maxBatchBytes, plus one decision
// at MaxDecisionBlocks (1 MiB of hashes and its names), plus the loads of
// its busy replicas (about 300 bytes each with a long URL: 0.3 MiB for a
// thousand) — about 2.3 MiB. DefaultMaxEntryBytes is 3.5 times that.
const (
	maxBatchBytes        = 1 << 20
	DefaultMaxEntryBytes = 8 << 20
	// snapshotNames is the room a snapshot's cap leaves for replica names
	// and counts: 4,000 replicas with 250-byte URLs.
	snapshotNames = 1 << 20
)

// SnapshotBytesFor is the cap on a snapshot read from Redis for an index
// of at most maxEntries (block, replica) entries (0: the index's default):
// twice the largest snapshot such an index writes (8 bytes per entry, plus
// the names), so that a peer configured with a somewhat larger index is
// still read.
func SnapshotBytesFor(maxEntries int) int64 {
	if maxEntries <= 0 {
		maxEntries = prefixindex.DefaultMaxEntries
	}
	return 2 * (8*int64(maxEntries) + snapshotNames)
}

// ErrInvalid is what Check returns for an entry with a value out of
// bounds (as an *InvalidError, which names the reason).
var ErrInvalid = errors.New("sharedstate: value out of bounds")

// InvalidError is an entry refused by Check; Reason is the metric label of
// kvgate_shared_state_dropped_total.
type InvalidError struct {
	Reason string // "load", "decision", "program", "name" or "time"
	Detail string
}

func (e *InvalidError) Error() string {
	return fmt.Sprintf("%v: %s: %s", ErrInvalid, e.Reason, e.Detail)
}

// Is makes errors.Is(err, ErrInvalid) hold.
func (e *InvalidError) Is(target error) bool { return target == ErrInvalid }

func invalid(reason, format string, args ...any) error {
	return &InvalidError{Reason: reason, Detail: fmt.Sprintf(format, args...)}
}

// Check reports the first value of b a peer may not send. sent is the
// entry's time on Redis's clock (the time in its ID; zero: At is not
// checked).
func (b *Batch) Check(sent time.Time) error {
	if len(b.Gateway) == 0 || len(b.Gateway) > MaxNameBytes {
		return invalid("name", "gateway name of %d bytes", len(b.Gateway))
	}
	if len(b.Decisions) > maxBatchDecisions {
		return invalid("decision", "%d decisions in one batch, at most %d", len(b.Decisions), maxBatchDecisions)
	}
	if !sent.IsZero() && !b.At.IsZero() {
		if d := b.At.Sub(sent); d > MaxClockSkew || d < -MaxClockSkew {
			return invalid("time", "sent at %v, added to the stream at %v", b.At.UTC(), sent.UTC())
		}
	}
	for i := range b.Loads {
		l := &b.Loads[i]
		if len(l.Replica) > MaxNameBytes {
			return invalid("name", "replica name of %d bytes", len(l.Replica))
		}
		if err := checkLoad(l.Load); err != nil {
			return err
		}
	}
	for i := range b.Decisions {
		if err := b.Decisions[i].check(); err != nil {
			return err
		}
	}
	return nil
}

func checkLoad(l router.Load) error {
	for _, f := range []struct {
		name  string
		v, hi int64
	}{{"in flight", l.InFlight, MaxLoadCount}, {"in-flight tokens", l.InFlightTokens, MaxLoadTokens},
		{"pending prefill", l.PendingPrefill, MaxLoadTokens}, {"pending count", l.PendingCount, MaxLoadCount}} {
		if f.v < 0 || f.v > f.hi {
			return invalid("load", "%s %d outside [0, %d]", f.name, f.v, f.hi)
		}
	}
	return nil
}

func (d *Decision) check() error {
	if len(d.Replica) > MaxNameBytes || len(d.Model) > MaxNameBytes {
		return invalid("name", "replica or model name of %d bytes", max(len(d.Replica), len(d.Model)))
	}
	if d.Offset < 0 || d.Offset > MaxDecisionBlocks-len(d.Blocks) {
		return invalid("decision", "offset %d and %d blocks: more than %d", d.Offset, len(d.Blocks), MaxDecisionBlocks)
	}
	if d.Tokens < 0 || d.Tokens > MaxDecisionTokens {
		return invalid("decision", "%d tokens outside [0, %d]", d.Tokens, MaxDecisionTokens)
	}
	if d.Program == 0 {
		return nil
	}
	// A program's record reserves its context on the replica for every
	// receiver: its size is bounded, and its blocks (whole blocks of its
	// prompt, one token each at the least) cannot outnumber its tokens.
	if d.Tokens > MaxProgramTokens {
		return invalid("program", "a program's context of %d tokens, at most %d", d.Tokens, MaxProgramTokens)
	}
	if d.Offset+len(d.Blocks) > d.Tokens {
		return invalid("program", "%d blocks for a context of %d tokens", d.Offset+len(d.Blocks), d.Tokens)
	}
	return nil
}

// clampLoad is a gateway's own load as it publishes it: within the bounds
// every reader checks.
func clampLoad(l router.Load) router.Load {
	c := func(v, hi int64) int64 { return min(max(v, 0), hi) }
	return router.Load{InFlight: c(l.InFlight, MaxLoadCount), InFlightTokens: c(l.InFlightTokens, MaxLoadTokens),
		PendingPrefill: c(l.PendingPrefill, MaxLoadTokens), PendingCount: c(l.PendingCount, MaxLoadCount)}
}

// shareable is a decision as a gateway publishes it: a prompt longer than
// MaxDecisionBlocks by its first blocks, its tokens within the bound; a
// program whose record the receivers would refuse (its context past
// MaxProgramTokens, or not backed by the blocks sent) is not named.
func shareable(d Decision) Decision {
	if len(d.Blocks) > MaxDecisionBlocks {
		d.Blocks = d.Blocks[:MaxDecisionBlocks]
		d.Program = 0
	}
	d.Tokens = min(max(d.Tokens, 0), MaxDecisionTokens)
	if d.Tokens > MaxProgramTokens || d.Offset+len(d.Blocks) > d.Tokens {
		d.Program = 0
	}
	return d
}

// decisionBytes is an upper bound of d's encoded size in a batch (names at
// their full length: the string table may share them).
func decisionBytes(d *Decision) int {
	return len(d.Replica) + len(d.Model) + 8*len(d.Blocks) + 5*binaryMaxVarint + 8
}

const binaryMaxVarint = 10

// Check reports the first value of s a peer may not write: a name too
// long, or a position that is not a stream ID.
func (s *Snapshot) Check() error {
	if s.Position != "" {
		if _, ok := parseID(s.Position); !ok {
			return invalid("snapshot", "position %.40q is not a stream ID", s.Position)
		}
	}
	for _, r := range s.Replicas {
		if len(r.Replica) > MaxNameBytes {
			return invalid("name", "replica name of %d bytes", len(r.Replica))
		}
	}
	return nil
}

// fit cuts s to at most maxBytes encoded, so that the gateways reading it
// (with the same cap) do not refuse it: each replica keeps the same share
// of its most recent blocks (the lists are most recent first).
func (s *Snapshot) fit(maxBytes int64) {
	size, total := s.encodedSize(), int64(s.Len())
	if size <= maxBytes {
		return
	}
	// Everything but the hashes, which cutting blocks never lengthens.
	names := size - 8*total
	keep := max(maxBytes-names, 0) / 8 // blocks, over all replicas
	for i := range s.Replicas {
		b := s.Replicas[i].Blocks
		s.Replicas[i].Blocks = b[:int64(len(b))*keep/total]
	}
}

// encodedSize is the length of AppendSnapshot's encoding of s.
func (s *Snapshot) encodedSize() int64 {
	uv := func(n int) int64 { return int64(len(binary.AppendUvarint(nil, uint64(n)))) }
	size := 2 + uv(len(s.Position)) + int64(len(s.Position)) + int64(len(appendTime(nil, s.At))) + uv(len(s.Replicas))
	for _, r := range s.Replicas {
		size += uv(len(r.Replica)) + int64(len(r.Replica)) + uv(len(r.Blocks)) + 8*int64(len(r.Blocks))
	}
	return size
}
