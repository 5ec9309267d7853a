package sharedstate

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/testutil"
)

// A stored response's record written by one gateway is read by another:
// its replica and its owner. A record forged in the Redis (garbage, or
// far over the bound) is refused whole, as corrupt, and read no further
// than the bound; an id out of bounds is not found; with Redis
// down the read fails (the caller must not take it for "no record").
func TestResponseHomesShared(t *testing.T) {
	rd := testutil.NewRedis(t)
	a, b := newGateway(t, rd.URL(), "r", true, nil), newGateway(t, rd.URL(), "r", true, nil)
	ctx := context.Background()
	want := ResponseHome{Replica: "http://10.0.0.1:8000", Tenant: "gold"}
	a.s.NoteResponse("resp_1", want)
	a.s.NoteResponse(strings.Repeat("x", MaxResponseID+1), want) // out of bounds: not queued
	if err := a.s.flushResponses(ctx); err != nil {
		t.Fatal(err)
	}
	if got, ok, err := b.s.ResponseHome(ctx, "resp_1"); err != nil || !ok || got != want {
		t.Fatalf("b reads a's record: %+v %v %v", got, ok, err)
	}
	if _, ok, err := b.s.ResponseHome(ctx, "resp_unknown"); err != nil || ok {
		t.Fatalf("an unknown id: %v %v", ok, err)
	}
	// An id over the bound has no record (none is written): "not found",
	// not an error the caller would take for Redis down (a 503).
	if _, ok, err := b.s.ResponseHome(ctx, strings.Repeat("x", MaxResponseID+1)); ok || err != nil {
		t.Fatalf("an id over the bound: %v %v; want not found", ok, err)
	}
	c := redis.NewClient(&redis.Options{Addr: rd.Addr()})
	defer c.Close()
	if ttl := c.PTTL(ctx, "r:resp:resp_1").Val(); ttl <= 0 || ttl > ResponseKeep {
		t.Fatalf("a record keeps %v", ttl)
	}
	if n := c.Exists(ctx, "r:resp:"+strings.Repeat("x", MaxResponseID+1)).Val(); n != 0 {
		t.Fatal("a record of an id over the bound was written")
	}
	// Anyone who can write to the Redis can write a record.
	for name, v := range map[string]string{
		"garbage": "not a record",
		"huge":    string(appendResponseHome(nil, ResponseHome{Replica: "r", Tenant: strings.Repeat("t", 1<<20)})),
		"long":    string(appendResponseHome(nil, ResponseHome{Replica: "r", Tenant: strings.Repeat("t", MaxNameBytes+1)})),
		"trailer": string(appendResponseHome(nil, want)) + "!",
	} {
		if err := c.Set(ctx, "r:resp:forged", v, 0).Err(); err != nil {
			t.Fatal(err)
		}
		if got, ok, err := b.s.ResponseHome(ctx, "forged"); !errors.Is(err, ErrCorrupt) || ok {
			t.Errorf("%s: read as %+v %v %v, want ErrCorrupt", name, got, ok, err)
		}
	}
	rd.Stop()
	if _, ok, err := b.s.ResponseHome(ctx, "resp_1"); err == nil || ok {
		t.Fatalf("with Redis down: %v %v", ok, err)
	}
}

// A response deleted through one gateway has its record deleted: another
// gateway finds none (not the deleted response's replica and owner). The
// deletion keeps its order with a write queued before it in the same
// flush, and does not touch another response's record.
func TestResponseRecordDeleted(t *testing.T) {
	rd := testutil.NewRedis(t)
	a, b := newGateway(t, rd.URL(), "r", true, nil), newGateway(t, rd.URL(), "r", true, nil)
	ctx := context.Background()
	h := ResponseHome{Replica: "http://10.0.0.1:8000", Tenant: "gold"}
	a.s.NoteResponse("resp_1", h)
	a.s.NoteResponse("resp_2", h)
	if err := a.s.flushResponses(ctx); err != nil {
		t.Fatal(err)
	}
	a.s.ForgetResponse("resp_1")
	a.s.NoteResponse("resp_3", h)
	a.s.ForgetResponse("resp_3") // created and deleted before a flush
	a.s.ForgetResponse(strings.Repeat("x", MaxResponseID+1))
	if err := a.s.flushResponses(ctx); err != nil {
		t.Fatal(err)
	}
	for id, want := range map[string]bool{"resp_1": false, "resp_2": true, "resp_3": false} {
		if _, ok, err := b.s.ResponseHome(ctx, id); err != nil || ok != want {
			t.Errorf("%s: found %v (%v), want %v", id, ok, err, want)
		}
	}
}

// A read the caller gave up on (its client left: the request's context
// ended) says nothing of Redis: it is neither counted as a failed command
// nor takes Redis for unreachable (which logs, and skips Close's last
// write).
func TestResponseHomeCallerGone(t *testing.T) {
	rd := testutil.NewRedis(t)
	g := newGateway(t, rd.URL(), "r", true, nil)
	if _, _, err := g.s.ResponseHome(context.Background(), "resp_1"); err != nil {
		t.Fatal(err)
	}
	errs := g.s.Stats().Errors
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, ok, err := g.s.ResponseHome(ctx, "resp_1"); err == nil || ok {
		t.Fatalf("a read with its context ended: %v %v", ok, err)
	}
	if got := g.s.Stats().Errors; got != errs {
		t.Errorf("a caller gone counted as %d failed Redis commands", got-errs)
	}
	if g.s.reach.Load() != reachUp {
		t.Error("a caller gone took Redis for unreachable")
	}
}

// A stored response's record wakes the publisher to write it at once, and
// only it: the decisions and loads still go out at the publisher's
// interval (here a fake clock's, never reached). Before, each record
// queued also published a batch of the decisions and loads, one stream
// entry per Responses call under load, which every other gateway reads.
func TestResponseRecordKeepsBatching(t *testing.T) {
	rd := testutil.NewRedis(t)
	clk := clock.NewFake(time.Now())
	g := newGateway(t, rd.URL(), "r", true, func(o *Options) { o.Clock = clk })
	before := g.s.Stats().BatchesPublished
	tk := g.route(t, conversation(1)) // a decision queued, a load changed
	defer done(tk)
	c := redis.NewClient(&redis.Options{Addr: rd.Addr()})
	defer c.Close()
	for _, id := range []string{"resp_1", "resp_2"} { // resp_2 written: resp_1's wake-up is over
		g.s.NoteResponse(id, ResponseHome{Replica: "http://r1", Tenant: "a"})
		testutil.Eventually(t, within, "the record written", func() bool {
			return c.Exists(context.Background(), "r:resp:"+id).Val() == 1
		})
	}
	if n := g.s.Stats().BatchesPublished - before; n != 0 {
		t.Fatalf("2 records published %d batches before the interval", n)
	}
}
