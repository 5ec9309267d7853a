package sharedstate

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/clock"
)

// The reader follows the stream from the last entry it moved past (its
// cursor). Anyone who can write to the Redis can write to the stream, so
// what it reads is bounded and checked before anything reaches the router:
//
//   - Size. No reply holds a string over MaxEntryBytes, nor more than
//     readBudget of them (guardConn refuses it as it arrives). A read that
//     trips the guard is done again carefully (readCarefully: one entry
//     per command), and an entry over the cap is skipped, counted and
//     logged: one huge entry costs one skip, where it used to wedge every
//     reader.
//   - Content. An entry that does not decode, or has a value out of bounds
//     (Batch.Check), is dropped whole and counted by reason.
//   - IDs. An entry whose ID is more than MaxIDAhead ahead of Redis's clock
//     is not applied and the cursor stays before it: a cursor there would
//     stop reading for good once the stream is recreated.
//   - Continuity. The publisher's own entries are the probe: one numbered
//     far ahead of Redis's clock means every later one will be, and the
//     stream is deleted (healed); one numbered at or before the cursor
//     means the stream went back behind it (recreated), and it is read
//     again from its start. A cursor older than the stream's first entry
//     (checkTrim) means entries were trimmed before they were read: the
//     snapshot is restored. Each is a resync: counted, logged, the
//     snapshot reloaded.

// readNext reads the entries after the cursor (waiting up to block for
// one) and returns those that may be applied: all, or those before the
// first whose ID is ahead of Redis's clock (stalled).
func (s *Syncer) readNext(ctx context.Context, block time.Duration) (msgs []redis.XMessage, stalled bool, err error) {
	after := s.lastApplied()
	msgs, err = s.st.read(ctx, after, readCount, block)
	if errors.Is(err, errReplyTooLarge) || isTimeout(err) && ctx.Err() == nil {
		msgs, err = s.readCarefully(ctx, after)
	}
	if err != nil {
		return nil, false, err
	}
	n, err := s.beforeFuture(ctx, msgs)
	if err != nil {
		return nil, false, err
	}
	return msgs[:n], n < len(msgs), nil
}

// readCarefully is a read whose plain XREAD was over the caps, or timed
// out (Redis takes most of a second to start replying with a 400 MiB
// entry: the header had not come), done again one entry per command
// (XRANGE COUNT 1, under the bulk bound), up to readCount. An entry over
// the cap comes back without its values (Values nil), for applyOne to
// skip: the guard's error names it. A reply over the caps that names no
// entry after the cursor ends the read (tried again next time).
func (s *Syncer) readCarefully(ctx context.Context, after string) ([]redis.XMessage, error) {
	out := make([]redis.XMessage, 0, readCount)
	for len(out) < readCount {
		m, err := s.st.first(ctx, nextID(after))
		var big *replyTooLarge
		switch {
		case errors.As(err, &big) && idBefore(after, big.first):
			m = &redis.XMessage{ID: big.first}
		case err != nil:
			return nil, err
		case m == nil:
			return out, nil
		}
		out = append(out, *m)
		after = m.ID
	}
	return out, nil
}

// beforeFuture is how many of msgs come before the first whose ID is more
// than MaxIDAhead ahead of Redis's clock. The estimate of that clock (this
// gateway's plus the offset last measured) only raises the question; a
// fresh TIME answers it. Such an entry is counted once.
func (s *Syncer) beforeFuture(ctx context.Context, msgs []redis.XMessage) (int, error) {
	for i, m := range msgs {
		if !idAhead(m.ID, s.redisNow()) {
			continue
		}
		rnow, err := s.syncClock(ctx)
		if err != nil {
			return 0, err
		}
		if !idAhead(m.ID, rnow) {
			continue
		}
		if m.ID != s.future {
			s.future = m.ID
			s.drop("future_id", "id", m.ID, "redis_time", rnow.UTC())
		}
		return i, nil
	}
	return len(msgs), nil
}

// idAhead reports whether the ID is more than MaxIDAhead ahead of now.
func idAhead(id string, now time.Time) bool {
	x, ok := parseID(id)
	return ok && x.ms > uint64(max(now.Add(MaxIDAhead).UnixMilli(), 0))
}

// redisNow is the estimate of Redis's clock.
func (s *Syncer) redisNow() time.Time { return s.clk.Now().Add(time.Duration(s.rclock.Load())) }

// syncClock reads Redis's clock (TIME) and keeps its offset from this
// gateway's.
func (s *Syncer) syncClock(ctx context.Context) (time.Time, error) {
	rnow, err := s.st.now(ctx)
	if err != nil {
		return time.Time{}, err
	}
	s.rclock.Store(int64(rnow.Sub(s.clk.Now())))
	return rnow, nil
}

// readLoop applies the stream as it grows: XREAD BLOCK from the last entry
// applied. After an outage it resumes from there (what Redis kept of the
// gap); a gateway that could not warm-load at Start warm-loads first. It
// resyncs when the publisher found the stream healed or reset, and checks
// for a trim after an outage and while it is behind (a full read, at most
// once a second). Stalled on an entry ahead of Redis's clock, it polls
// every Heartbeat rather than read the same entry in a loop.
func (s *Syncer) readLoop(ctx context.Context) {
	var bo backoff
	var recovered bool
	var checked time.Time
	for ctx.Err() == nil {
		if !s.warmed.Load() {
			if err := s.warm(ctx); err != nil {
				if ctx.Err() != nil {
					return
				}
				s.failed("warm", err)
				clock.Sleep(s.clk, bo.next(), ctx.Done())
				continue
			}
			bo.reset()
		}
		s.resyncWanted(ctx)
		msgs, stalled, err := s.readNext(ctx, readBlock)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			s.failed("read", err)
			recovered = true
			clock.Sleep(s.clk, bo.next(), ctx.Done())
			continue
		}
		s.ok()
		bo.reset()
		s.apply(msgs, time.Time{}, false)
		if behind := len(msgs) == readCount && s.clk.Since(checked) >= time.Second; recovered || behind {
			checked, recovered = s.clk.Now(), false
			if err := s.checkTrim(ctx); err != nil && ctx.Err() == nil {
				s.fault("check", err)
			}
		}
		if stalled {
			clock.Sleep(s.clk, s.o.Heartbeat, ctx.Done())
		}
	}
}

// Resyncs the publisher asks the reader for (Syncer.want, a bit set).
const (
	wantHealed = 1 << iota
	wantReset
)

// errStreamAhead is publish's error for a batch Redis numbered far ahead
// of its clock: readers refuse it, and healing deletes it, so its
// decisions stay queued for the next batch.
var errStreamAhead = errors.New("sharedstate: the stream's IDs run ahead of Redis's clock")

// checkOwn looks at the ID Redis gave this gateway's own entry, added
// after the reader's cursor was before. Numbered far ahead of Redis's
// clock, the stream is healed (healScript) and read again from its start,
// and the entry counts as not published (errStreamAhead). Numbered at or
// before the cursor, the stream went back behind the reader (recreated,
// or Redis replaced) and is read again from its start. The publisher runs
// it; the reader resyncs.
func (s *Syncer) checkOwn(ctx context.Context, before, id string) error {
	if idAhead(id, s.redisNow()) {
		rnow, err := s.syncClock(ctx)
		if err != nil {
			return err
		}
		if !idAhead(id, rnow) {
			return nil
		}
		healed, err := s.st.heal(ctx, id)
		if err != nil {
			s.fault("heal", err)
		} else if healed {
			s.want.Or(wantHealed)
		}
		return errStreamAhead
	}
	if before != "" && before != "0-0" && !idBefore(before, id) {
		s.want.Or(wantReset)
		s.resetSeen.Store(&[2]string{before, id})
	}
	return nil
}

// resyncWanted resyncs as the publisher asked.
func (s *Syncer) resyncWanted(ctx context.Context) {
	switch w := s.want.Swap(0); {
	case w&wantHealed != 0:
		s.resync(ctx, "healed", "0-0", "the stream's IDs ran ahead of Redis's clock: deleted it; every gateway starts it again")
	case w&wantReset != 0:
		var at [2]string
		if p := s.resetSeen.Load(); p != nil {
			at = *p
		}
		s.resync(ctx, "reset", "0-0", "the stream went back behind this gateway's position (recreated, or Redis replaced): reading it from its start",
			"position", at[0], "own_entry", at[1])
	}
}

// checkTrim resyncs when the cursor is older than the stream's first
// entry: the entries after the cursor were trimmed before the reader read
// them (most likely: a reader that keeps up is never near the trimmed
// end). At most once per SnapshotEvery, as the snapshot it restores
// changes no more often; loads-only gateways have none to restore, and
// their heartbeats come back on their own.
func (s *Syncer) checkTrim(ctx context.Context) error {
	cursor := s.lastApplied()
	if !s.o.ShareDecisions || cursor == "" || cursor == "0-0" ||
		(!s.trimmedAt.IsZero() && s.clk.Since(s.trimmedAt) < s.o.SnapshotEvery) {
		return nil
	}
	m, err := s.st.first(ctx, "-")
	var big *replyTooLarge
	first := ""
	switch {
	case errors.As(err, &big):
		first = big.first
	case err != nil:
		return err
	case m != nil:
		first = m.ID
	}
	if first != "" && idBefore(cursor, first) {
		s.trimmedAt = s.clk.Now()
		s.resync(ctx, "trimmed", cursor, "the stream was trimmed past this gateway's position before it read on: restoring the snapshot",
			"first_id", first, "position", cursor)
	}
	return nil
}

// resync restarts reading from cursor and restores the snapshot, at most
// once per SnapshotEvery (a snapshot does not change more often). It is
// counted each time and logged at most once a minute per reason: whoever
// writes to the Redis can make the stream go back as often as it likes.
func (s *Syncer) resync(ctx context.Context, reason, cursor, msg string, args ...any) {
	s.resyncs.Add(1)
	s.m.resyncs.WithLabelValues(reason).Inc()
	if n, ok := s.logs.allow("resync "+reason, s.clk.Now()); ok {
		s.log.Warn("shared state: "+msg, append(args, "resyncs_since_last_line", n)...)
	}
	s.setLastID(cursor)
	if !s.o.ShareDecisions || (!s.snapRead.IsZero() && s.clk.Since(s.snapRead) < s.o.SnapshotEvery) {
		return
	}
	rnow, err := s.syncClock(ctx)
	var snap Snapshot
	ok := false
	if err == nil {
		snap, ok, err = s.loadSnapshot(ctx, rnow)
	}
	if err != nil {
		if ctx.Err() == nil {
			s.failed("resync", err)
		}
		return
	}
	if ok {
		s.restored.Add(int64(snap.Restore(s.rt)))
	}
}

// ---- warm load ----

// warm loads the shared state: the snapshot (with ShareDecisions), then
// the stream after the snapshot's position, or the whole retained stream
// without a snapshot; loads-only gateways read just the last TTL of the
// stream. It is bounded by WarmTimeout; the tail it had no time for the
// reader applies next.
func (s *Syncer) warm(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, s.o.WarmTimeout)
	defer cancel()
	rnow, err := s.syncClock(ctx)
	if err != nil {
		return err
	}
	s.ok()
	from := "0-0"
	if s.o.ShareDecisions {
		snap, ok, err := s.loadSnapshot(ctx, rnow)
		if err != nil {
			return err // Redis failed: the warm load is tried again
		}
		if ok {
			s.restored.Store(int64(snap.Restore(s.rt)))
			if snap.Position != "" {
				from = snap.Position
			}
		}
	} else {
		from = fmt.Sprintf("%d-0", max(rnow.Add(-s.o.TTL).UnixMilli(), 0))
	}
	s.setLastID(from)
	s.warmed.Store(true)
	// The tail: entries' ages on Redis's clock (now − the time in their
	// ID), so that loads older than the TTL stand for nothing.
	t0 := s.clk.Now()
	for ctx.Err() == nil {
		msgs, stalled, err := s.readNext(ctx, -1)
		if err != nil {
			if ctx.Err() != nil {
				break // out of time: the reader goes on from lastID
			}
			return err
		}
		s.apply(msgs, rnow.Add(s.clk.Since(t0)), true)
		if stalled || len(msgs) < readCount {
			break
		}
	}
	s.setLive(s.peers.Expire(s.clk.Now()))
	s.log.Info("shared state: warm load", "restored_blocks", s.restored.Load(), "batches", s.warmN.Load(), "position", s.lastApplied())
	return nil
}

// loadSnapshot reads the snapshot from Redis and checks it: over the cap
// it is refused unread, and one that does not decode, or has a value out
// of bounds, is dropped; a position ahead of Redis's clock (rnow) is
// dropped from it (the stream is then read from its start). ok is false
// when there is none to restore; err is Redis's failure.
func (s *Syncer) loadSnapshot(ctx context.Context, rnow time.Time) (snap Snapshot, ok bool, err error) {
	s.snapRead = s.clk.Now()
	data, err := s.st.getSnapshot(ctx)
	switch {
	case errors.Is(err, ErrSnapshotTooLarge):
		s.drop("snapshot_size", "err", err)
		return Snapshot{}, false, nil
	case err != nil || data == nil:
		return Snapshot{}, false, err
	}
	snap, err = DecodeSnapshot(data)
	if err == nil {
		err = snap.Check()
	}
	if err != nil {
		s.drop(reasonOf(err, "snapshot"), "err", err)
		return Snapshot{}, false, nil
	}
	if idAhead(snap.Position, rnow) {
		s.drop("future_id", "snapshot_position", snap.Position, "redis_time", rnow.UTC())
		snap.Position = ""
	}
	s.snapshotsRead.Add(1)
	return snap, true, nil
}

// ---- applying ----

// apply applies stream entries: other gateways' batches through Peers. An
// entry's age is taken on Redis's clock: ref (Redis's now at a warm load;
// else the newest entry read) less the time in its ID. It is applied as
// received that long ago on this gateway's clock, so that Peers' TTL
// counts from when it was sent and a backlog read late stands for no
// longer than it would have live. Moving past an entry, applied or
// dropped, is what receiving means (kvgate_shared_state_up).
func (s *Syncer) apply(msgs []redis.XMessage, ref time.Time, warm bool) {
	if len(msgs) == 0 {
		return
	}
	if !warm {
		if t, ok := idTime(msgs[len(msgs)-1].ID); ok {
			ref = t
		}
	}
	now := s.clk.Now()
	for _, m := range msgs {
		s.applyOne(m, ref, now, warm)
		s.setLastID(m.ID)
	}
	s.received.Store(s.clk.Now().UnixNano())
	s.setLive(s.peers.Expire(s.clk.Now()))
}

// applyOne applies one entry, or drops it: over the size cap (Values nil:
// readCarefully skipped its values), not a batch, out of bounds, or from
// one more gateway than Peers tracks.
func (s *Syncer) applyOne(m redis.XMessage, ref, now time.Time, warm bool) {
	if m.Values == nil {
		s.drop("entry_size", "id", m.ID, "max_bytes", s.o.MaxEntryBytes)
		return
	}
	raw, ok := m.Values[fieldBatch].(string)
	if !ok {
		s.drop("decode", "id", m.ID, "err", "no batch field")
		return
	}
	s.batReceived.Add(1)
	s.bytReceived.Add(uint64(len(raw)))
	s.m.batReceived.Inc()
	s.m.bytReceived.Add(float64(len(raw)))
	sent, _ := idTime(m.ID)
	b, err := DecodeBatch([]byte(raw))
	if err == nil {
		err = b.Check(sent)
	}
	if err != nil {
		s.drop(reasonOf(err, "decode"), "id", m.ID, "err", err)
		return
	}
	if !s.o.ShareDecisions {
		b.Decisions = nil
	}
	at := now
	if age := ref.Sub(sent); age > 0 && !sent.IsZero() {
		at = now.Add(-age)
	}
	if b.Gateway == s.o.Gateway {
		s.applyOwn(&b, at, warm)
		return
	}
	if !s.peers.Admit(b.Gateway) {
		s.drop("peers", "id", m.ID, "gateway", b.Gateway, "max_peers", maxPeers)
		return
	}
	n, refused := s.peers.Apply(&b, at)
	s.applied(n, warm)
	if refused > 0 {
		s.dropN("program", refused, "id", m.ID, "gateway", b.Gateway, "programs_refused", refused)
	}
	if !warm && !b.At.IsZero() {
		s.m.lag.Set(s.clk.Now().Sub(b.At).Seconds())
	}
}

// applyOwn applies a batch under this gateway's own name: one of its own
// is already in its index; one a previous process under the same name sent
// before this one started (read by the warm load) has decisions this one
// restarts with, and loads that died with it.
func (s *Syncer) applyOwn(b *Batch, at time.Time, warm bool) {
	if !warm || !b.At.Before(s.startedAt) {
		return
	}
	n := 0
	for i := range b.Decisions {
		d := &b.Decisions[i]
		if slot, ok := s.rt.Lookup(d.Replica); ok {
			s.rt.ApplyRemote(slot, d.Model, d.Offset, d.Blocks, d.Tokens, at)
			n++
		}
	}
	s.applied(n, warm)
}

func (s *Syncer) applied(n int, warm bool) {
	s.decApplied.Add(uint64(n))
	s.m.decApplied.Add(float64(n))
	if warm {
		s.warmN.Add(1)
	}
}

// reasonOf is the drop reason of a decoding or checking error: an
// InvalidError's own, else def.
func reasonOf(err error, def string) string {
	var ie *InvalidError
	if errors.As(err, &ie) {
		return ie.Reason
	}
	return def
}

// fault counts a failed command that says nothing of whether Redis is
// reachable (the stream check: a Redis user without scripts fails it
// every time), and logs it at most once a minute.
func (s *Syncer) fault(op string, err error) {
	s.errs.Add(1)
	s.m.errors.WithLabelValues(op).Inc()
	if n, ok := s.logs.allow("fault "+op, s.clk.Now()); ok {
		s.log.Warn("shared state: "+op+" failed", "err", err, "failed_since_last_line", n)
	}
}

// drop counts an entry (or snapshot) refused, by reason, and logs it at
// most once a minute per reason, with how many went unlogged.
func (s *Syncer) drop(reason string, args ...any) { s.dropN(reason, 1, args...) }

// dropN is drop for n things refused at once (the program records of one
// entry, whose decisions are applied without them).
func (s *Syncer) dropN(reason string, n int, args ...any) {
	s.dropped.Add(uint64(n))
	s.m.dropped.WithLabelValues(reason).Add(float64(n))
	if skipped, ok := s.logs.allow(reason, s.clk.Now()); ok {
		s.log.Warn("shared state: dropped what a peer wrote to Redis", append([]any{"reason", reason, "dropped_since_last_line", skipped}, args...)...)
	}
}

// logLimit lets a log line through at most once per logEvery per key, and
// counts the ones it held back: a peer writing garbage in a loop costs a
// counter, not a log line per entry.
type logLimit struct {
	mu   sync.Mutex
	keys map[string]*logKey
}

type logKey struct {
	last time.Time
	held int
}

const logEvery = time.Minute

// allow reports whether a line under key may go out at now, and how many
// were held back since the last one that did.
func (l *logLimit) allow(key string, now time.Time) (held int, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys == nil {
		l.keys = map[string]*logKey{}
	}
	k := l.keys[key]
	if k == nil {
		k = &logKey{}
		l.keys[key] = k
	} else if now.Sub(k.last) < logEvery {
		k.held++
		return 0, false
	}
	held, k.held, k.last = k.held, 0, now
	return held, true
}

// isTimeout reports whether err is a command's timeout (its context's or
// the connection's).
func isTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout()
}
