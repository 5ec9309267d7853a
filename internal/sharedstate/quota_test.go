package sharedstate

import (
	"context"
	"errors"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/testutil"
)

// Two gateways add to one budget per tenant, minute and kind: each reads
// the sum of both back; a forged total is bounded; a sync before Start or
// with Redis down fails without waiting past the timeout.
func TestSyncQuotas(t *testing.T) {
	rd := testutil.NewRedis(t)
	a, b := newGateway(t, rd.URL(), "q", true, nil), newGateway(t, rd.URL(), "q", true, nil)
	ctx := context.Background()
	k := QuotaKey{Tenant: "gold", Minute: 100, Kind: "total"}
	other := QuotaKey{Tenant: "bulk", Minute: 100, Kind: "total"}
	if got, err := a.s.SyncQuotas(ctx, map[QuotaKey]int64{k: 700, other: 5}); err != nil || got[k] != 700 || got[other] != 5 {
		t.Fatalf("a: %v %v", got, err)
	}
	if got, err := b.s.SyncQuotas(ctx, map[QuotaKey]int64{k: 300}); err != nil || got[k] != 1000 {
		t.Fatalf("b: %v %v", got, err)
	}
	if got, _ := a.s.SyncQuotas(ctx, map[QuotaKey]int64{k: -50}); got[k] != 950 {
		t.Fatalf("a's correction: %v", got)
	}
	// Anyone who can write to the Redis can write to the budgets.
	c := redis.NewClient(&redis.Options{Addr: rd.Addr()})
	defer c.Close()
	if err := c.Set(ctx, "q:quota:100:total:gold", "-99", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if got, _ := a.s.SyncQuotas(ctx, map[QuotaKey]int64{k: 0}); got[k] != 0 {
		t.Fatalf("a negative total read as %v", got[k])
	}
	if err := c.Set(ctx, "q:quota:100:total:gold", "9223372036854775000", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if got, _ := a.s.SyncQuotas(ctx, map[QuotaKey]int64{k: 0}); got[k] != MaxQuotaTotal {
		t.Fatalf("a huge total read as %v", got[k])
	}
	if ttl := c.PTTL(ctx, "q:quota:100:total:bulk").Val(); ttl <= 0 || ttl > QuotaKeep {
		t.Fatalf("a budget keeps %v", ttl)
	}
	n := newGateway(t, rd.URL(), "q", false, nil)
	if _, err := n.s.SyncQuotas(ctx, map[QuotaKey]int64{k: 1}); !errors.Is(err, ErrNotStarted) {
		t.Fatalf("before Start: %v", err)
	}
	rd.Stop()
	if _, err := a.s.SyncQuotas(ctx, map[QuotaKey]int64{k: 1}); err == nil {
		t.Fatal("a sync with Redis down succeeded")
	}
	if a.s.LiveGateways() < 1 {
		t.Fatal("live gateways")
	}
}
