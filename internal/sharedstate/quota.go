package sharedstate

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Token budgets shared by the gateways in front of one fleet: one counter
// per tenant, minute and kind (total, prompt, output) in Redis,
//
//	<ns>:quota:<minute>:<kind>:<tenant>   integer; INCRBY, expiring QuotaKeep after its last write
//
// to which each gateway adds the tokens it admitted (and the corrections
// the usage brought) every sync, reading the totals back in the same round
// trip. The gateways' quota keepers (internal/gateway/quota.go) decide
// admissions on those totals plus their own tokens not yet added; what
// one gateway admits between two syncs is what the others do not see yet,
// the error bound the gateway documents. Anyone who can write to the Redis
// can write to these keys: a total read is bounded (MaxQuotaTotal).

// QuotaKey names one budget: a tenant's tokens of one kind in one minute
// (Unix time / 60).
type QuotaKey struct {
	Tenant string
	Minute int64
	Kind   string
}

// Bounds of the quota budgets.
const (
	// MaxQuotaTotal bounds a total read back: a forged or wrapped value
	// counts as this (the tenant then waits for the next minute).
	MaxQuotaTotal = 1 << 50
	// QuotaKeep is how long a budget outlives its last write: the minute
	// and the one after, which weighs it, and a margin for clocks.
	QuotaKeep = 3 * time.Minute
	// MaxQuotaKeys bounds one sync's budgets.
	MaxQuotaKeys = 1 << 14
)

// ErrNotStarted: the Syncer has no Redis connection yet (Start not called).
var ErrNotStarted = errors.New("sharedstate: not started")

// SyncQuotas adds each delta to its budget and returns every budget's
// total after it (a delta of 0 reads the total), in one round trip bounded
// by the Syncer's timeout. Totals are clamped to [0, MaxQuotaTotal].
func (s *Syncer) SyncQuotas(ctx context.Context, deltas map[QuotaKey]int64) (map[QuotaKey]int64, error) {
	st := s.stp.Load()
	if st == nil {
		return nil, ErrNotStarted
	}
	if len(deltas) > MaxQuotaKeys {
		return nil, errors.New("sharedstate: too many quota budgets in one sync")
	}
	out, err := st.quota(ctx, s.o.Namespace, deltas)
	if err != nil {
		s.failed("quota", err)
		return nil, err
	}
	s.ok()
	return out, nil
}

// LiveGateways is the gateways with a live heartbeat, this one included.
func (s *Syncer) LiveGateways() int { return int(s.live.Load()) + 1 }

// quota is SyncQuotas' Redis side: a pipeline of INCRBY and PEXPIRE.
func (st *store) quota(ctx context.Context, ns string, deltas map[QuotaKey]int64) (map[QuotaKey]int64, error) {
	ctx, cancel := context.WithTimeout(ctx, st.timeout)
	defer cancel()
	keys := make([]QuotaKey, 0, len(deltas))
	cmds := make([]*redis.IntCmd, 0, len(deltas))
	pipe := st.c.Pipeline()
	for k, d := range deltas {
		name := ns + ":quota:" + strconv.FormatInt(k.Minute, 10) + ":" + k.Kind + ":" + k.Tenant
		keys = append(keys, k)
		cmds = append(cmds, pipe.IncrBy(ctx, name, d))
		pipe.PExpire(ctx, name, QuotaKeep)
	}
	st.ops.Add(uint64(2 * len(keys)))
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, err
	}
	out := make(map[QuotaKey]int64, len(keys))
	for i, k := range keys {
		out[k] = min(max(cmds[i].Val(), 0), MaxQuotaTotal)
	}
	return out, nil
}
