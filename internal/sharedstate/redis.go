package sharedstate

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// The transport: one Redis Stream of batches per namespace, and the index
// snapshot beside it.
//
//	<ns>:batches        stream; every entry one batch, field "b" (XADD … MAXLEN ~ N)
//	<ns>:snapshot       string; an encoded Snapshot whose Position is a stream ID
//	<ns>:snapshot-lock  string; SET NX PX: the gateway that writes this period's snapshot
//
// Why a stream rather than pub/sub: a stream keeps its tail, so a gateway
// that starts, or one whose connection dropped for a while, reads what it
// missed from the last ID it applied (XREAD), where pub/sub would have lost
// it; the snapshot then only needs to cover what the bounded stream has
// trimmed away. One XADD per batch feeds every gateway, each XREAD returns
// the batches since the reader's last one (readCount at a time, every
// reply bounded by guardConn), and MAXLEN ~ trims in the same command, by
// whole macro nodes, cheaply. Anyone who can write to the Redis can write
// to these keys: the reader checks what it reads (reader.go). Healing a
// stream whose IDs ran ahead of Redis's clock takes a script
// (EVAL/EVALSHA); without them the stream waits for an operator.

// store is the Redis side of a Syncer. Every call is bounded by a timeout:
// Redis down or slow never holds a caller longer.
type store struct {
	c        *redis.Client
	batches  string
	snapshot string
	lock     string
	ns       string
	timeout  time.Duration // per command
	bulk     time.Duration // per snapshot read or write (megabytes)
	maxLen   int64
	ops      atomic.Uint64 // commands sent

	maxSnapshot int64 // the largest snapshot read (the entry cap is guardConn's)
}

// limits are a store's size caps.
type limits struct {
	entry, snapshot int64
}

// readBudget is how many entries' worth of bytes one reply may carry
// (guardConn's reply cap, in entry caps): a read of small entries is far
// below it; one of many large ones takes the careful path (one entry per
// command).
const readBudget = 4

// snapshotChunk is the size of one GETRANGE of a snapshot read: no reply
// carries more, whatever the snapshot's size.
const snapshotChunk = 1 << 20

// fieldBatch is the stream entries' one field.
const fieldBatch = "b"

// ParseURL checks a shared-state URL, redis://[:password@]HOST:PORT[/DB]
// (or rediss:// for TLS), and returns go-redis's options for it.
func ParseURL(raw string) (*redis.Options, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("sharedstate: shared-state URL: %w", err)
	}
	if u.Scheme != "redis" && u.Scheme != "rediss" {
		return nil, fmt.Errorf("sharedstate: shared-state URL %q: scheme %q, want redis://[:password@]HOST:PORT[/DB]", redact(u), u.Scheme)
	}
	if u.Host == "" {
		return nil, fmt.Errorf("sharedstate: shared-state URL %q: no host, want redis://[:password@]HOST:PORT[/DB]", redact(u))
	}
	opt, err := redis.ParseURL(raw)
	if err != nil {
		return nil, fmt.Errorf("sharedstate: shared-state URL %q: %w", redact(u), err)
	}
	return opt, nil
}

func redact(u *url.URL) string { return u.Redacted() }

var quietRedis sync.Once

// quietLogger drops go-redis's own log lines (one per failed dial): the
// Syncer logs the transitions down and up, once each.
type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

func newStore(opt *redis.Options, ns string, timeout, bulk time.Duration, maxLen int64, lim limits) *store {
	quietRedis.Do(func() { redis.SetLogger(quietLogger{}) })
	o := *opt
	o.DialTimeout = timeout
	o.DialerRetries = 1 // the Syncer's loops retry, with their own backoff
	// Every call's context deadline bounds its I/O, and only that: a
	// connection-wide read or write timeout would cut the bulk calls
	// (a snapshot of tens of megabytes, an entry Redis takes most of a
	// second to start sending) at the per-command bound.
	o.ReadTimeout, o.WriteTimeout = -1, -1
	o.ContextTimeoutEnabled = true
	o.MaxRetries = -1
	// the reader's blocking XREAD, the publisher, the snapshot writer, the
	// quota sync, and the requests reading a stored response's record
	o.PoolSize = 8
	o.PoolTimeout = timeout
	o.DisableIdentity = true
	o.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	// Every reply is bounded where it arrives (guardConn): no string over
	// the entry cap (a snapshot is read in chunks far below it), no reply
	// over readBudget entries.
	dial := redis.NewDialer(&o)
	maxString, maxReply := max(lim.entry, snapshotChunk), readBudget*max(lim.entry, snapshotChunk)
	o.Dialer = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &guardConn{Conn: c, maxString: maxString, maxReply: maxReply}, nil
	}
	return &store{c: redis.NewClient(&o), batches: ns + ":batches", snapshot: ns + ":snapshot", lock: ns + ":snapshot-lock", ns: ns,
		timeout: timeout, bulk: bulk, maxLen: maxLen, maxSnapshot: lim.snapshot}
}

func (s *store) close() error { return s.c.Close() }

// add appends one encoded batch to the stream, trimming it to about maxLen
// entries, and returns the entry's ID.
func (s *store) add(ctx context.Context, data []byte) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	s.ops.Add(1)
	return s.c.XAdd(ctx, &redis.XAddArgs{Stream: s.batches, MaxLen: s.maxLen, Approx: true, ID: "*",
		Values: []any{fieldBatch, data}}).Result()
}

// read returns up to count entries after the ID after, waiting up to block
// for one to come (block < 0: not at all). None is (nil, nil).
func (s *store) read(ctx context.Context, after string, count int64, block time.Duration) ([]redis.XMessage, error) {
	ctx, cancel := context.WithTimeout(ctx, max(block, 0)+s.timeout)
	defer cancel()
	s.ops.Add(1)
	if block == 0 {
		block = -1 // BLOCK 0 would wait for ever
	}
	res, err := s.c.XRead(ctx, &redis.XReadArgs{Streams: []string{s.batches, after}, Count: count, Block: block}).Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []redis.XMessage
	for _, st := range res {
		out = append(out, st.Messages...)
	}
	return out, nil
}

// now is Redis's clock.
func (s *store) now(ctx context.Context) (time.Time, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	s.ops.Add(1)
	return s.c.Time(ctx).Result()
}

// ErrSnapshotTooLarge is getSnapshot's error for a snapshot over the cap:
// it is refused by its length (STRLEN), before a byte of it is read.
var ErrSnapshotTooLarge = errors.New("sharedstate: the snapshot in Redis is over the size cap")

// getSnapshot is the encoded snapshot, nil when there is none. Its length
// is checked first (STRLEN), and it is read in chunks (GETRANGE) under
// WATCH, so that no reply is large and a snapshot replaced meanwhile by
// another gateway's is read again rather than spliced (at most twice: the
// snapshot changes once a period).
func (s *store) getSnapshot(ctx context.Context) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, s.bulk)
	defer cancel()
	var data []byte
	read := func(tx *redis.Tx) error {
		data = nil
		s.ops.Add(1)
		n, err := tx.StrLen(ctx, s.snapshot).Result()
		if err != nil || n == 0 {
			return err // a missing key has length 0
		}
		if n > s.maxSnapshot {
			return fmt.Errorf("%w: %d bytes, the cap is %d", ErrSnapshotTooLarge, n, s.maxSnapshot)
		}
		buf := make([]byte, 0, n)
		for int64(len(buf)) < n {
			s.ops.Add(1)
			chunk, err := tx.GetRange(ctx, s.snapshot, int64(len(buf)), min(int64(len(buf))+snapshotChunk, n)-1).Result()
			if err != nil {
				return err
			}
			if chunk == "" {
				break // shortened meanwhile: EXEC fails below
			}
			buf = append(buf, chunk...)
		}
		s.ops.Add(1)
		_, err = tx.TxPipelined(ctx, func(p redis.Pipeliner) error { return p.Ping(ctx).Err() })
		data = buf
		return err
	}
	err := s.c.Watch(ctx, read, s.snapshot)
	if errors.Is(err, redis.TxFailedErr) {
		err = s.c.Watch(ctx, read, s.snapshot)
	}
	if err != nil {
		return nil, err
	}
	return data, nil
}

func (s *store) putSnapshot(ctx context.Context, data []byte) error {
	ctx, cancel := context.WithTimeout(ctx, s.bulk)
	defer cancel()
	s.ops.Add(1)
	return s.c.Set(ctx, s.snapshot, data, 0).Err()
}

// tryLock takes the snapshot lock for hold unless another gateway holds it.
func (s *store) tryLock(ctx context.Context, owner string, hold time.Duration) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	s.ops.Add(1)
	err := s.c.SetArgs(ctx, s.lock, owner, redis.SetArgs{Mode: "NX", TTL: hold}).Err()
	if errors.Is(err, redis.Nil) {
		return false, nil
	}
	return err == nil, err
}

// first reads the first entry from start on (XRANGE start + COUNT 1; none:
// nil, nil). With a single entry in the reply, the first string of it is
// the entry's ID: when the entry is over the caps, the error (a
// *replyTooLarge) still names it, so that the reader can skip past it.
// Its bound is the bulk one: Redis takes most of a second to start the
// reply of a 400 MiB entry (it copies the entry first), and the header
// must arrive for the entry to be named.
func (s *store) first(ctx context.Context, start string) (*redis.XMessage, error) {
	ctx, cancel := context.WithTimeout(ctx, s.bulk)
	defer cancel()
	s.ops.Add(1)
	msgs, err := s.c.XRangeN(ctx, s.batches, start, "+", 1).Result()
	if err != nil || len(msgs) == 0 {
		return nil, err
	}
	return &msgs[0], nil
}

// healScript deletes the stream if the entry ARGV[1] is still in it: the
// caller added it and Redis numbered it far ahead of its clock. Redis
// numbers an entry added with "*" after the stream's last ID even when
// that is ahead of its clock, so one entry written with a far-future ID
// puts every later one there too, and the readers, which refuse such IDs,
// would wait for ever. Reading that one entry (the caller's own, small)
// and deleting are one script: a stream another gateway healed meanwhile
// (the entry gone with it) is left alone.
var healScript = redis.NewScript(`
if #redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1]) == 0 then return 0 end
redis.call('DEL', KEYS[1])
return 1`)

// heal deletes the stream if the entry id is still in it; it reports
// whether it did.
func (s *store) heal(ctx context.Context, id string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	s.ops.Add(1)
	n, err := healScript.Run(ctx, s.c, []string{s.batches}, id).Int()
	return n == 1, err
}

// streamID is a stream entry's ID, "ms-seq": Redis's clock in milliseconds
// when the entry was added, and a sequence within the millisecond.
type streamID struct{ ms, seq uint64 }

// parseID parses a complete stream ID.
func parseID(id string) (streamID, bool) {
	a, b, ok := strings.Cut(id, "-")
	if !ok {
		return streamID{}, false
	}
	ms, err1 := strconv.ParseUint(a, 10, 64)
	seq, err2 := strconv.ParseUint(b, 10, 64)
	if err1 != nil || err2 != nil {
		return streamID{}, false
	}
	return streamID{ms, seq}, true
}

// nextID is the first ID after id (XRANGE's start is inclusive; its "("
// needs Redis 6.2).
func nextID(id string) string {
	x, ok := parseID(id)
	switch {
	case !ok:
		return "0-0"
	case x.seq < math.MaxUint64:
		x.seq++
	default:
		x.ms, x.seq = x.ms+1, 0
	}
	return strconv.FormatUint(x.ms, 10) + "-" + strconv.FormatUint(x.seq, 10)
}

func (x streamID) less(y streamID) bool { return x.ms < y.ms || x.ms == y.ms && x.seq < y.seq }

// idBefore reports whether the ID a is before b (false when either does
// not parse).
func idBefore(a, b string) bool {
	x, ok1 := parseID(a)
	y, ok2 := parseID(b)
	return ok1 && ok2 && x.less(y)
}

// idTime is the Redis time in a stream entry ID ("ms-seq").
func idTime(id string) (time.Time, bool) {
	x, ok := parseID(id)
	if !ok || x.ms > math.MaxInt64 {
		return time.Time{}, false
	}
	return time.UnixMilli(int64(x.ms)), true
}
