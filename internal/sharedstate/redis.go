package sharedstate

import (
	"context"
	"errors"
	"fmt"
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
// every batch since the reader's last one, and MAXLEN ~ trims in the same
// command, by whole macro nodes, cheaply.

// store is the Redis side of a Syncer. Every call is bounded by a timeout:
// Redis down or slow never holds a caller longer.
type store struct {
	c        *redis.Client
	batches  string
	snapshot string
	lock     string
	timeout  time.Duration // per command
	bulk     time.Duration // per snapshot read or write (megabytes)
	maxLen   int64
	ops      atomic.Uint64 // commands sent
}

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

func newStore(opt *redis.Options, ns string, timeout, bulk time.Duration, maxLen int64) *store {
	quietRedis.Do(func() { redis.SetLogger(quietLogger{}) })
	o := *opt
	o.DialTimeout = timeout
	o.DialerRetries = 1 // the Syncer's loops retry, with their own backoff
	o.ReadTimeout = timeout
	o.WriteTimeout = timeout
	o.ContextTimeoutEnabled = true // every call's context deadline bounds its I/O
	o.MaxRetries = -1
	o.PoolSize = 4 // the reader's blocking XREAD, the publisher, the snapshot writer
	o.PoolTimeout = timeout
	o.DisableIdentity = true
	o.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	return &store{c: redis.NewClient(&o), batches: ns + ":batches", snapshot: ns + ":snapshot", lock: ns + ":snapshot-lock",
		timeout: timeout, bulk: bulk, maxLen: maxLen}
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

// getSnapshot is the encoded snapshot, nil when there is none.
func (s *store) getSnapshot(ctx context.Context) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, s.bulk)
	defer cancel()
	s.ops.Add(1)
	b, err := s.c.Get(ctx, s.snapshot).Bytes()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	return b, err
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

// idTime is the Redis time in a stream entry ID ("ms-seq").
func idTime(id string) (time.Time, bool) {
	ms, _, ok := strings.Cut(id, "-")
	if !ok {
		return time.Time{}, false
	}
	n, err := strconv.ParseInt(ms, 10, 64)
	if err != nil || n < 0 {
		return time.Time{}, false
	}
	return time.UnixMilli(n), true
}
