package sharedstate

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// Stored responses' homes and owners. vLLM keeps a Responses API call's
// state in the memory of the replica that answered it, and keeps no owner:
// any client that names the id reads, continues, cancels or deletes it. A
// gateway remembers where each response it relayed lives and whose call
// created it (internal/gateway/passthrough_responses.go), but another
// gateway, or the same one after a restart or once its bounded memory
// evicted the id, does not. So each gateway writes, for each response
// created through it,
//
//	<ns>:resp:<id>   'R' record: version 'R' replica tenant; expiring ResponseKeep after its last write
//
// and reads it back for an id it does not know; a response deleted through
// a gateway (DELETE /v1/responses/{id}) has its record deleted. Writes are
// queued and sent by the publisher's loop at once (never on a request's
// path: a client that names the id through another gateway within that
// Redis round trip finds no record yet); a read happens only for an id the
// gateway does not know, which it would otherwise look up by asking the
// replicas in turn. Anyone who can write to the Redis can
// write a record: a read is bounded (GETRANGE, maxResponseRecord) and
// checked (ErrCorrupt), and the gateway checks the names against its own.

// ResponseHome is where a stored response lives and whose it is.
type ResponseHome struct {
	Replica string // the replica's name, as the gateways configure it
	Tenant  string // the tenant whose call created it ("": a client of no tenant)
}

const (
	// MaxResponseID bounds a response id shared: vLLM's are "resp_" and 32
	// hex digits; a longer one is neither written nor read.
	MaxResponseID = 256
	// ResponseKeep is how long a record outlives its last write. vLLM keeps
	// its stored responses until the replica restarts; a day bounds the
	// Redis memory (about 150 bytes a record) for a conversation that
	// pauses a long time.
	ResponseKeep = 24 * time.Hour
	// maxResponseRecord bounds a record read: its two names at MaxNameBytes.
	maxResponseRecord = 2 + 2*(binary.MaxVarintLen16+MaxNameBytes)
	// maxResponsesPending bounds the records queued while Redis is
	// unreachable; beyond it the newest are dropped, and counted.
	maxResponsesPending = 4096
	kindResponse        = 'R'
)

// errResponseID: an id over MaxResponseID, or empty.
var errResponseID = errors.New("sharedstate: response id empty or over MaxResponseID bytes")

// sharedID: a response id a record may be kept under, non-empty within
// MaxResponseID.
func sharedID(id string) bool { return id != "" && len(id) <= MaxResponseID }

// CheckResponseHome bounds response id's record h as every gateway
// writes and reads it: the id non-empty within MaxResponseID, the names
// within MaxNameBytes (a state file's copy is checked alike).
func CheckResponseHome(id string, h ResponseHome) error {
	switch {
	case !sharedID(id):
		return errResponseID
	case len(h.Replica) > MaxNameBytes || len(h.Tenant) > MaxNameBytes:
		return fmt.Errorf("sharedstate: a response's replica or tenant name over %d bytes", MaxNameBytes)
	}
	return nil
}

// appendResponseHome appends h's record to dst.
func appendResponseHome(dst []byte, h ResponseHome) []byte {
	dst = append(dst, codecVersion, kindResponse)
	dst = appendString(dst, h.Replica)
	return appendString(dst, h.Tenant)
}

// decodeResponseHome decodes a record appendResponseHome made; its names
// are bounded by MaxNameBytes.
func decodeResponseHome(p []byte) (ResponseHome, error) {
	d := decoder{p: p}
	d.header(kindResponse)
	h := ResponseHome{Replica: d.string(), Tenant: d.string()}
	if d.err == nil && (len(h.Replica) > MaxNameBytes || len(h.Tenant) > MaxNameBytes) {
		d.fail("a name over %d bytes", MaxNameBytes)
	}
	if err := d.finish(); err != nil {
		return ResponseHome{}, err
	}
	return h, nil
}

// pendingResponse is a record queued for the next write.
type pendingResponse struct {
	id   string
	home ResponseHome
	gone bool // the record is to be deleted (ForgetResponse)
}

// NoteResponse queues the record of response id for the next write and
// returns: it never blocks on Redis. An id out of bounds, or a record
// beyond the queue's bound (Redis unreachable for a while), is dropped
// and counted (kvgate_shared_state_dropped_total{reason="response_queue"}).
func (s *Syncer) NoteResponse(id string, h ResponseHome) {
	if CheckResponseHome(id, h) != nil {
		return
	}
	s.queueResponse(pendingResponse{id: id, home: h})
}

// ForgetResponse queues the deletion of response id's record (the
// response was deleted), in order with the writes queued before it, and
// returns at once as NoteResponse does.
func (s *Syncer) ForgetResponse(id string) {
	if !sharedID(id) {
		return // no gateway writes such a record
	}
	s.queueResponse(pendingResponse{id: id, gone: true})
}

func (s *Syncer) queueResponse(r pendingResponse) {
	s.rmu.Lock()
	full := len(s.responses) >= maxResponsesPending
	if !full {
		s.responses = append(s.responses, r)
	}
	s.rmu.Unlock()
	// The publisher writes it at once, not at its next tick: the client may
	// name the id through another gateway next.
	select {
	case s.kick <- struct{}{}:
	default:
	}
	if full { // no peer's doing: counted, not logged as a peer's record is
		s.dropped.Add(1)
		s.m.dropped.WithLabelValues("response_queue").Inc()
	}
}

// flushResponses writes the queued records in one pipeline; on an error
// they stay queued for the next round. One flush at a time (rflush): the
// records written are the queue's first len(queued).
func (s *Syncer) flushResponses(ctx context.Context) error {
	s.rflush.Lock()
	defer s.rflush.Unlock()
	s.rmu.Lock()
	queued := s.responses
	s.rmu.Unlock()
	if len(queued) == 0 {
		return nil
	}
	if err := s.st.putResponses(ctx, queued); err != nil {
		if ctx.Err() == nil {
			s.failed("responses", err)
		}
		return err
	}
	s.ok()
	s.rmu.Lock()
	s.responses = append(s.responses[:0], s.responses[len(queued):]...)
	s.rmu.Unlock()
	return nil
}

// ResponseHome reads the record of response id: found false when there is
// none (never written, expired, or the id out of bounds); an error when
// Redis did not answer, ctx ended, or the record is not one a gateway
// writes (ErrCorrupt: refused whole, and counted).
func (s *Syncer) ResponseHome(ctx context.Context, id string) (ResponseHome, bool, error) {
	st := s.stp.Load()
	if st == nil {
		return ResponseHome{}, false, ErrNotStarted
	}
	if !sharedID(id) {
		return ResponseHome{}, false, nil // no gateway writes such a record
	}
	p, err := st.getResponse(ctx, id)
	if err != nil {
		if ctx.Err() == nil { // a caller gone (its client left) says nothing of Redis
			s.failed("responses", err)
		}
		return ResponseHome{}, false, err
	}
	s.ok()
	if p == nil {
		return ResponseHome{}, false, nil
	}
	h, err := decodeResponseHome(p)
	if err != nil {
		s.drop("response", "id", id, "err", err)
		return ResponseHome{}, false, err
	}
	return h, true, nil
}

// responseKey is the record's key.
func (st *store) responseKey(id string) string { return st.ns + ":resp:" + id }

// putResponses writes records, and deletes those gone, in one pipeline of
// SET PX and DEL, in their order.
func (st *store) putResponses(ctx context.Context, rs []pendingResponse) error {
	ctx, cancel := context.WithTimeout(ctx, st.timeout)
	defer cancel()
	pipe := st.c.Pipeline()
	var buf []byte
	for _, r := range rs {
		if r.gone {
			pipe.Del(ctx, st.responseKey(r.id))
			continue
		}
		buf = appendResponseHome(buf[:0], r.home)
		pipe.Set(ctx, st.responseKey(r.id), string(buf), ResponseKeep)
	}
	st.ops.Add(uint64(len(rs)))
	_, err := pipe.Exec(ctx)
	return err
}

// getResponse reads a record's first maxResponseRecord+1 bytes (GETRANGE:
// never more, whatever was written there); nil when there is none.
func (st *store) getResponse(ctx context.Context, id string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, st.timeout)
	defer cancel()
	st.ops.Add(1)
	v, err := st.c.GetRange(ctx, st.responseKey(id), 0, maxResponseRecord).Result()
	if errors.Is(err, redis.Nil) || err == nil && v == "" {
		return nil, nil // GETRANGE answers "" for a missing key
	}
	if err != nil {
		return nil, err
	}
	if len(v) > maxResponseRecord {
		return []byte{0}, nil // over the bound: decodes as corrupt
	}
	return []byte(v), nil
}
