package sharedstate

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/testutil"
)

// Whoever can write to the Redis, as the red team did (#22): forged
// entries and snapshots, written with go-redis straight into the keys.

func adminClient(t *testing.T, url string) *redis.Client {
	t.Helper()
	opt, err := ParseURL(url)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// counted is a counter's value on reg by name and one label's value (0
// when there is no such series).
func counted(t *testing.T, reg *prometheus.Registry, name, label, value string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == value {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func dropped(t *testing.T, reg *prometheus.Registry, reason string) float64 {
	return counted(t, reg, "kvgate_shared_state_dropped_total", "reason", reason)
}

func withRegistry(reg *prometheus.Registry, more func(*Options)) func(*Options) {
	return func(o *Options) {
		o.Registerer = reg
		if more != nil {
			more(o)
		}
	}
}

// The red team's forged load (finding 1): -1,000,000 in flight on one
// replica. It is dropped at the door, whole (its decision too), and
// counted; a peer's good batch after it applies.
func TestForgedLoadIsDroppedAtTheDoor(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	reg := prometheus.NewRegistry()
	b := newGateway(t, url, "t", true, withRegistry(reg, nil))
	forged := ghostBatch("forger", "http://r1", -1_000_000, 7)
	forged.Loads[0].Load.PendingCount = 0
	ghost(t, url, "t", "", forged)
	ghost(t, url, "t", "", ghostBatch("honest", "http://r2", 2, 8))
	testutil.Eventually(t, within, "the honest peer's load", func() bool { return b.rt.RemoteLoad(2).InFlight == 2 })
	if got := b.rt.RemoteLoad(1); got != (router.Load{}) {
		t.Fatalf("the forged load reached the router: %+v", got)
	}
	if b.rt.Index().Holds(1, 7) {
		t.Fatal("the forged batch's decision was applied")
	}
	if !b.rt.Index().Holds(2, 8) {
		t.Fatal("the honest batch's decision was not applied")
	}
	if n := dropped(t, reg, "load"); n != 1 {
		t.Fatalf("kvgate_shared_state_dropped_total{reason=load} = %v, want 1", n)
	}
}

// Every value a peer sends is checked; each out of bounds drops the entry
// with its reason, at the door of a live gateway.
func TestOutOfBoundsEntriesAreDropped(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	reg := prometheus.NewRegistry()
	b := newGateway(t, url, "t", true, withRegistry(reg, nil))
	long := strings.Repeat("x", MaxNameBytes+1)
	for _, c := range []struct {
		reason string
		mut    func(*Batch)
	}{
		{"load", func(b *Batch) { b.Loads[0].Load.InFlightTokens = MaxLoadTokens + 1 }},
		{"load", func(b *Batch) { b.Loads[0].Load.PendingPrefill = -1 }},
		{"decision", func(b *Batch) { b.Decisions[0].Tokens = MaxDecisionTokens + 1 }},
		{"decision", func(b *Batch) { b.Decisions[0].Offset = MaxDecisionBlocks }},
		{"name", func(b *Batch) { b.Gateway = long }},
		{"name", func(b *Batch) { b.Decisions[0].Model = long }},
		{"time", func(b *Batch) { b.At = time.Now().Add(2 * MaxClockSkew) }},
	} {
		bad := ghostBatch("bad", "http://r0", 1, 99)
		c.mut(&bad)
		ghost(t, url, "t", "", bad)
	}
	ghost(t, url, "t", "", ghostBatch("honest", "http://r2", 2, 8))
	testutil.Eventually(t, within, "the honest peer's decision", func() bool { return b.rt.Index().Holds(2, 8) })
	if b.rt.Index().Holds(0, 99) || b.rt.RemoteLoad(0) != (router.Load{}) {
		t.Fatal("a bad batch reached the router")
	}
	for reason, want := range map[string]float64{"load": 2, "decision": 2, "name": 2, "time": 1} {
		if n := dropped(t, reg, reason); n != want {
			t.Errorf("dropped{reason=%s} = %v, want %v", reason, n, want)
		}
	}
}

// Finding 7: an entry over the cap is skipped, counted, and the reader
// goes on: one skip, not a wedge. The caps are small here (the entry is
// megabytes, the red team's was 400 MiB), and the huge entry sits between
// two good ones in one read, at the warm load and live.
func TestOversizedEntryIsSkipped(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	rc := adminClient(t, url)
	huge := func() {
		if err := rc.XAdd(context.Background(), &redis.XAddArgs{Stream: "t:batches", Values: []any{fieldBatch, strings.Repeat("\x01", 3<<20)}}).Err(); err != nil {
			t.Fatal(err)
		}
	}
	ghost(t, url, "t", "", ghostBatch("p", "http://r0", 1, 10))
	huge()
	ghost(t, url, "t", "", ghostBatch("p", "http://r1", 1, 11))
	reg := prometheus.NewRegistry()
	b := newGateway(t, url, "t", true, withRegistry(reg, func(o *Options) { o.MaxEntryBytes = 1 << 20 }))
	if !b.rt.Index().Holds(0, 10) || !b.rt.Index().Holds(1, 11) {
		t.Fatal("the warm load did not apply the good entries around the huge one")
	}
	ghost(t, url, "t", "", ghostBatch("p", "http://r0", 1, 20))
	huge()
	ghost(t, url, "t", "", ghostBatch("p", "http://r2", 1, 22))
	testutil.Eventually(t, within, "the entry after the second huge one", func() bool { return b.rt.Index().Holds(2, 22) })
	if !b.rt.Index().Holds(0, 20) {
		t.Fatal("the entry before the second huge one was not applied")
	}
	if n := dropped(t, reg, "entry_size"); n != 2 {
		t.Fatalf("dropped{reason=entry_size} = %v, want 2", n)
	}
	if st := b.s.Stats(); st.BytesReceived > 1<<20 {
		t.Fatalf("%d bytes received: the huge entries were read", st.BytesReceived)
	}
}

// Finding 14: a snapshot over the cap is refused by its length, never read
// (no GET, no GETRANGE); the gateway warms from the stream instead. One
// under the cap but larger than a read chunk is read in chunks and restored.
func TestSnapshotCap(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	rc := adminClient(t, url)
	ctx := context.Background()
	big := Snapshot{Position: "0-1", Replicas: []ReplicaBlocks{{Replica: "http://r0", Blocks: make([]uint64, 3*snapshotChunk/8)}}}
	for i := range big.Replicas[0].Blocks {
		big.Replicas[0].Blocks[i] = uint64(i + 1)
	}
	data := AppendSnapshot(nil, &big) // 3 MiB
	if err := rc.Set(ctx, "t:snapshot", data, 0).Err(); err != nil {
		t.Fatal(err)
	}
	ghost(t, url, "t", "", ghostBatch("p", "http://r2", 1, 5))
	if err := rc.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	a := newGateway(t, url, "t", true, withRegistry(reg, func(o *Options) { o.MaxSnapshotBytes = 1 << 20 }))
	if st := a.s.Stats(); st.Restored != 0 || st.SnapshotsRead != 0 {
		t.Fatalf("a snapshot over the cap was restored: %+v", st)
	}
	if !a.rt.Index().Holds(2, 5) {
		t.Fatal("the stream was not read after the refused snapshot")
	}
	if n := dropped(t, reg, "snapshot_size"); n != 1 {
		t.Fatalf("dropped{reason=snapshot_size} = %v, want 1", n)
	}
	calls := commandCalls(t, rc)
	if calls["get"]+calls["getrange"] != 0 {
		t.Fatalf("the snapshot over the cap was read: %v", calls)
	}

	if err := rc.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	c := newGateway(t, url, "t", true, func(o *Options) { o.MaxSnapshotBytes = 4 << 20 })
	if st := c.s.Stats(); st.Restored != len(big.Replicas[0].Blocks) {
		t.Fatalf("restored %d of %d blocks", st.Restored, len(big.Replicas[0].Blocks))
	}
	if calls := commandCalls(t, rc); calls["getrange"] < 3 || calls["get"] != 0 {
		t.Fatalf("the snapshot was not read in chunks: %v", calls)
	}
}

// commandCalls is Redis's count of each command since CONFIG RESETSTAT.
func commandCalls(t *testing.T, rc *redis.Client) map[string]int {
	t.Helper()
	info, err := rc.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]int{}
	for _, line := range strings.Split(info, "\n") {
		name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
		if !ok {
			continue
		}
		var n int
		_, _ = fmt.Sscanf(rest, "%d", &n)
		calls[strings.TrimPrefix(name, "cmdstat_")] = n
	}
	return calls
}

// A snapshot whose position is far ahead of Redis's clock would put the
// warm load's cursor past every entry to come: the position is dropped and
// the stream read from its start.
func TestSnapshotPositionAheadOfRedis(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	rc := adminClient(t, url)
	s := Snapshot{Position: "99999999999999-0", Replicas: []ReplicaBlocks{{Replica: "http://r0", Blocks: []uint64{1, 2}}}}
	if err := rc.Set(context.Background(), "t:snapshot", AppendSnapshot(nil, &s), 0).Err(); err != nil {
		t.Fatal(err)
	}
	ghost(t, url, "t", "", ghostBatch("p", "http://r1", 1, 7))
	a := newGateway(t, url, "t", true, nil)
	if !a.rt.Index().Holds(0, 2) {
		t.Fatal("the snapshot's blocks were not restored")
	}
	if !a.rt.Index().Holds(1, 7) {
		t.Fatalf("the stream was not read: position %s", a.s.Stats().LastID)
	}
	if idAhead(a.s.Stats().LastID, time.Now()) {
		t.Fatalf("the cursor %s is ahead of the clock", a.s.Stats().LastID)
	}
}

// Finding 7's second half: an entry with a far-future ID, then the stream
// lost (deleted, recreated by the next XADD). The reader never moved its
// cursor to the far-future ID, so it reads the new stream.
func TestFarFutureIDThenLostStream(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	rc := adminClient(t, url)
	reg := prometheus.NewRegistry()
	a := newGateway(t, url, "t", true, withRegistry(reg, nil))
	b := newGateway(t, url, "t", true, nil)
	const future = "99999999999999-0"
	ghost(t, url, "t", future, ghostBatch("forger", "http://r0", 1, 5))
	testutil.Eventually(t, within, "a reading or refusing the far-future entry", func() bool {
		return a.s.Stats().LastID == future || dropped(t, reg, "future_id") > 0
	})
	if err := rc.Del(context.Background(), "t:batches").Err(); err != nil {
		t.Fatal(err)
	}
	tk := b.route(t, conversation(1))
	testutil.Eventually(t, within, "b's decision at a after the stream was lost", func() bool { return a.holds(b, tk) })
	if a.rt.Index().Holds(0, 5) {
		t.Fatal("the far-future entry was applied")
	}
	if id := a.s.Stats().LastID; idAhead(id, time.Now()) {
		t.Fatalf("a's cursor %s is ahead of the clock", id)
	}
	done(tk)
}

// One far-future entry puts every later one there too (Redis numbers an
// entry after the stream's last ID): the readers refuse them all, so the
// first gateway whose own entry lands there deletes the stream (heals it)
// and sharing goes on in a new one. A decision published into the
// far-future stream is published again, not lost with it.
func TestFarFutureStreamIsHealed(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	a := newGateway(t, url, "t", true, withRegistry(regA, nil))
	b := newGateway(t, url, "t", true, withRegistry(regB, nil))
	ghost(t, url, "t", "99999999999999-0", ghostBatch("forger", "http://r0", 1, 5))
	tk := b.route(t, conversation(2))
	testutil.Eventually(t, within, "b's decision at a", func() bool { return a.holds(b, tk) })
	healed := func(reg *prometheus.Registry) float64 {
		return counted(t, reg, "kvgate_shared_state_resyncs_total", "reason", "healed")
	}
	// The publisher heals the stream and its reader counts the resync
	// when it next runs: a may hold b's re-published decision before b's
	// reader has counted it (a busy host).
	testutil.Eventually(t, within, "the stream healed", func() bool { return healed(regA)+healed(regB) >= 1 })
	if a.rt.Index().Holds(0, 5) {
		t.Fatal("the far-future entry was applied")
	}
	if n := dropped(t, regA, "future_id"); n > 1 {
		t.Errorf("dropped{reason=future_id} = %v: one entry counted more than once", n)
	}
	done(tk)
}

// The least privilege the README gives the gateways' Redis user (its
// namespace's keys, the commands kvgate sends) is enough for all of it:
// sharing, the snapshot, the warm load, healing.
func TestLeastPrivilegeACL(t *testing.T) {
	t.Parallel()
	srv := testutil.NewRedis(t)
	rc := adminClient(t, srv.URL())
	ctx := context.Background()
	acl := "on >pw resetkeys ~kvgate:* resetchannels -@all +hello +ping +select +time +xadd +xread +xrange +set +strlen +getrange +watch +unwatch +multi +exec +evalsha +eval +del"
	args := []any{"ACL", "SETUSER", "kvgate"}
	for _, a := range strings.Fields(acl) {
		args = append(args, a)
	}
	if err := rc.Do(ctx, args...).Err(); err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("redis://kvgate:pw@%s/0", srv.Addr())
	reg := prometheus.NewRegistry()
	a := newGateway(t, url, "kvgate", true, withRegistry(reg, nil))
	b := newGateway(t, url, "kvgate", true, nil)
	tk := a.route(t, conversation(1))
	testutil.Eventually(t, within, "a's decision at b", func() bool { return b.holds(a, tk) })
	testutil.Eventually(t, within, "a reading", func() bool { return a.s.Stats().LastID != "0-0" })
	if err := a.s.WriteSnapshot(ctx); err != nil || a.s.Stats().Snapshots != 1 {
		t.Fatalf("the snapshot: %v", err)
	}
	c := newGateway(t, url, "kvgate", true, nil)
	if st := c.s.Stats(); st.SnapshotsRead != 1 || !c.holds(a, tk) {
		t.Fatalf("c's warm load from the snapshot: %+v", st)
	}
	ghost(t, srv.URL(), "kvgate", "99999999999999-0", ghostBatch("forger", "http://r0", 1, 5))
	tk2 := b.route(t, conversation(2))
	testutil.Eventually(t, within, "b's decision at a, the stream healed", func() bool { return a.holds(b, tk2) })
	if n := counted(t, reg, "kvgate_shared_state_errors_total", "op", "heal"); n != 0 {
		t.Fatalf("%v heal errors", n)
	}
	done(tk)
	done(tk2)
}

// A stream that goes back behind the reader (recreated while its IDs were
// ahead of Redis's clock, within MaxIDAhead: a clock stepped back, a
// failover) is detected: the reader starts it over from its start.
func TestStreamResetIsDetected(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	rc := adminClient(t, url)
	reg := prometheus.NewRegistry()
	a := newGateway(t, url, "t", true, withRegistry(reg, nil))
	b := newGateway(t, url, "t", true, nil)
	ahead := fmt.Sprintf("%d-0", time.Now().Add(MaxIDAhead*3/4).UnixMilli())
	ghost(t, url, "t", ahead, ghostBatch("p", "http://r0", 1, 5))
	testutil.Eventually(t, within, "a reading the entry ahead", func() bool { return a.rt.Index().Holds(0, 5) })
	if err := rc.Del(context.Background(), "t:batches").Err(); err != nil {
		t.Fatal(err)
	}
	tk := b.route(t, conversation(3))
	testutil.Eventually(t, within, "b's decision at a in the new stream", func() bool { return a.holds(b, tk) })
	if n := counted(t, reg, "kvgate_shared_state_resyncs_total", "reason", "reset"); n < 1 {
		t.Fatalf("resyncs{reason=reset} = %v", n)
	}
	done(tk)
}

// A reader whose position is older than the stream's first entry after
// trimming lost the entries in between: it restores the snapshot (once per
// deleted ID) and reads on from where it was.
func TestTrimmedStreamResyncsFromTheSnapshot(t *testing.T) {
	t.Parallel()
	url := testutil.StartRedis(t)
	rc := adminClient(t, url)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	s, err := New(Options{URL: url, Namespace: "t", ShareDecisions: true, Log: quiet(), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	s.rt = testRouter(t, replicaNames...)
	s.peers = NewPeers(s.rt, s.o.Gateway, s.o.TTL)
	s.st = newStore(s.ro, "t", s.o.Timeout, time.Second, 0, limits{entry: s.o.MaxEntryBytes, snapshot: s.o.MaxSnapshotBytes})
	defer s.st.close()
	var ids []string
	for i := range 10 {
		id, err := rc.XAdd(ctx, &redis.XAddArgs{Stream: "t:batches", Values: []any{fieldBatch, AppendBatch(nil, ptr(ghostBatch("p", "http://r1", 1, uint64(100+i))))}}).Result()
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	snap := Snapshot{Position: ids[6], Replicas: []ReplicaBlocks{{Replica: "http://r1", Blocks: []uint64{106, 105, 104, 103}}}}
	if err := rc.Set(ctx, "t:snapshot", AppendSnapshot(nil, &snap), 0).Err(); err != nil {
		t.Fatal(err)
	}
	s.setLastID(ids[2]) // read up to 102
	if err := rc.XTrimMaxLen(ctx, "t:batches", 3).Err(); err != nil {
		t.Fatal(err)
	}
	for range 2 { // the second check finds the same trim: no second resync
		if err := s.checkTrim(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if n := counted(t, reg, "kvgate_shared_state_resyncs_total", "reason", "trimmed"); n != 1 {
		t.Fatalf("resyncs{reason=trimmed} = %v, want 1", n)
	}
	for h := uint64(103); h <= 106; h++ {
		if !s.rt.Index().Holds(1, h) {
			t.Fatalf("block %d, trimmed before it was read, is not restored from the snapshot", h)
		}
	}
	msgs, stalled, err := s.readNext(ctx, -1)
	if err != nil || stalled || len(msgs) != 3 || msgs[0].ID != ids[7] {
		t.Fatalf("read after the resync: %d entries, stalled %v, err %v", len(msgs), stalled, err)
	}
}

func ptr[T any](v T) *T { return &v }

// kvgate_shared_state_up means receiving: a reader that is connected and
// reads without error but can no longer follow the stream (every entry is
// ahead of Redis's clock, and it may not heal it: no scripts for its Redis
// user) shows 0 once the TTL passes without an entry (a fake clock), and 1
// again once the stream is repaired.
func TestUpMeansReceiving(t *testing.T) {
	t.Parallel()
	srv := testutil.NewRedis(t)
	rc := adminClient(t, srv.URL())
	ctx := context.Background()
	if err := rc.Do(ctx, "ACL", "SETUSER", "gw", "on", ">pw", "~*", "&*", "+@all", "-@scripting").Err(); err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("redis://gw:pw@%s/0", srv.Addr())
	clk := clock.NewFake(time.Now())
	reg := prometheus.NewRegistry()
	a := newGateway(t, url, "t", true, withRegistry(reg, func(o *Options) { o.Clock = clk }))
	if !clk.WaitTimers(3, within) {
		t.Fatalf("%d timers armed", clk.Timers())
	}
	clk.Advance(DefaultInterval) // a's first heartbeat
	testutil.Eventually(t, within, "a receiving its heartbeat", func() bool { return a.s.Stats().Up })
	up := func() float64 { return value(a.s.m.up) }
	if up() != 1 {
		t.Fatal("kvgate_shared_state_up is not 1 while receiving")
	}
	ghost(t, url, "t", "99999999999999-0", ghostBatch("forger", "http://r0", 1, 5))
	testutil.Eventually(t, within, "a refusing the far-future entry", func() bool {
		return a.s.Stats().LastID == "99999999999999-0" || dropped(t, reg, "future_id") == 1
	})
	clk.Advance(DefaultTTL + time.Second)
	if a.s.Stats().Up || up() != 0 {
		t.Fatalf("a reader stuck behind the far-future entry shows up %v", up())
	}
	if err := rc.Del(ctx, "t:batches").Err(); err != nil { // the operator repairs the stream
		t.Fatal(err)
	}
	testutil.Eventually(t, within, "a receiving again", func() bool {
		clk.Advance(DefaultInterval)
		return a.s.Stats().Up
	})
}
