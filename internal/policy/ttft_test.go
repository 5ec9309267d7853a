package policy

import (
	"errors"
	"maps"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

// ttftReq is a 1,600-token prompt (100 blocks).
func ttftReq(id uint64) *Request {
	return peerReq(id, strings.Repeat("abcd", 1600), peerT0)
}

// The holder of the prefix wins while its queue costs less than the
// prefill it saves; past that the other replica wins. With the default
// profile the saving is ≈1,599 tokens × c1, so the switch happens when the
// holder's queued prefill passes ≈1,600 tokens.
func TestTTFTPrefersHolderUntilQueueOutweighsSaving(t *testing.T) {
	cases := []struct {
		queued int // holder's pending prefill tokens
		want   int // position chosen
	}{
		{0, 0}, {500, 0}, {1400, 0}, // the saving outweighs the queue
		{1900, 1}, {3000, 1}, {20000, 1}, // the queue outweighs the saving
	}
	for _, c := range cases {
		p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "decode_weight": 0, "eviction_weight": 0})
		rs := peerViews(2)
		req := ttftReq(1)
		rs[0].Match = len(req.Blocks)
		rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = c.queued, 1, 1
		pos, d := peerPick(t, p, req, rs)
		if pos != c.want {
			t.Errorf("holder queue %d: chose %d, want %d (scores %v)", c.queued, pos, c.want, d.Scores)
		}
		if d.EstTTFT <= 0 || math.Abs(d.Scores[pos]-float64(d.EstTTFT)/float64(time.Millisecond)) > 1e-6 {
			t.Errorf("EstTTFT %v does not match the chosen score %v", d.EstTTFT, d.Scores[pos])
		}
		if pos == 0 && d.Matched != len(req.Blocks) {
			t.Errorf("holder chosen with %d blocks credited, want %d", d.Matched, len(req.Blocks))
		}
	}
}

// The estimate is the cost model's prefill time for the uncached tokens.
func TestTTFTEstimateMatchesCostModel(t *testing.T) {
	p := peerNew(t, "ttft", nil).(*TTFT)
	req := ttftReq(1)
	v := ReplicaView{Healthy: true, Match: 40} // 640 tokens cached, 960 to compute
	ms, matched := p.Estimate(req, &v, 0)
	want := p.o.Profile.PrefillMs(960, 640, p.o.MaxBatchTokens)
	if matched != 40 || math.Abs(ms-want) > 1e-9 {
		t.Fatalf("estimate %v ms (matched %d), cost model %v ms", ms, matched, want)
	}
	// A fully cached prompt still computes its last token, as vLLM does.
	v.Match = len(req.Blocks)
	if ms, _ := p.Estimate(req, &v, 0); math.Abs(ms-p.o.Profile.PrefillMs(1, 1599, 8192)) > 1e-9 {
		t.Fatalf("fully cached: %v ms", ms)
	}
	// Running decodes slow the prefill steps down.
	busy := ReplicaView{Healthy: true, InFlight: 50, InFlightTokens: 50 * 2000}
	idle := ReplicaView{Healthy: true}
	b, _ := p.Estimate(req, &busy, 0)
	i, _ := p.Estimate(req, &idle, 0)
	if b <= i {
		t.Fatalf("50 decodes did not slow the estimate: %v vs %v", b, i)
	}
}

// The scraped waiting requests count as a queue only for their part the
// gateways' counts do not hold (WaitingUnseen, as the router reads them at
// the scrape): a scrape taken while this gateway's requests waited, read
// after their first tokens, adds nothing; requests another gateway sent
// add a mean prompt each.
func TestTTFTQueuesOnlyTheUnseenWaiting(t *testing.T) {
	p := peerNew(t, "ttft", nil).(*TTFT)
	req := ttftReq(1)
	idle := ReplicaView{Healthy: true, Match: 40}
	stale := ReplicaView{Healthy: true, Match: 40, HaveMetrics: true, Waiting: 3}
	others := stale
	others.WaitingUnseen = 2
	i, _ := p.Estimate(req, &idle, 1000)
	s, _ := p.Estimate(req, &stale, 1000)
	o, _ := p.Estimate(req, &others, 1000)
	if s != i {
		t.Errorf("three waiting, all seen: %v ms against %v idle", s, i)
	}
	if want := p.o.Profile.C1 * 2000; !(o-i >= want) {
		t.Errorf("two waiting unseen: %v ms against %v idle, want at least %v more", o, i, want)
	}
}

// Within the margin the deeper match wins; outside it, the faster replica.
func TestTTFTMarginPrefersDeeperMatch(t *testing.T) {
	req := ttftReq(1)
	rs := peerViews(2)
	rs[0].Match = 90 // a little slower (less cached) than replica 1 ...
	rs[1].Match = 100
	rs[1].PendingPrefill, rs[1].PendingCount, rs[1].InFlight = 200, 1, 1 // ... but replica 1 has a queue
	tight := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "decode_weight": 0, "eviction_weight": 0})
	if pos, d := peerPick(t, tight, req, rs); pos != 0 {
		t.Fatalf("no margin: chose %d (scores %v)", pos, d.Scores)
	}
	loose := peerNew(t, "ttft", map[string]any{"margin_rel": 0.5, "margin_ms": 0, "decode_weight": 0, "eviction_weight": 0})
	if pos, d := peerPick(t, loose, req, rs); pos != 1 || !strings.Contains(d.Reason, "deepest") {
		t.Fatalf("wide margin: chose %d (%s)", pos, d.Reason)
	}
}

// In a saturated fleet the margin widens: the same queues, scaled up until
// the best score passes its own prefill by twice saturated_ms, keep the
// request on the deeper match that a fixed margin would have moved it off.
// A long prompt's own prefill is not saturation: on an idle replica its
// score is long, and the margin stays.
func TestTTFTSaturatedMarginKeepsDeeperMatch(t *testing.T) {
	params := map[string]any{"margin_rel": 0.2, "margin_ms": 0, "decode_weight": 0, "eviction_weight": 0, "defer_ms": 0}
	long := peerReq(1, strings.Repeat("abcd", 32000), peerT0) // 32,000 tokens: 1.4 s of prefill alone
	for _, c := range []struct {
		name       string
		req        *Request
		matched    int    // blocks replica 1 holds (replica 0 none)
		queued     [2]int // tokens queued on each replica
		saturated  float64
		want       int
		wantReason string
	}{
		// Scores 0.56 and 1.1 s: below saturated_ms 1000, a margin of 0.2.
		{"not saturated", ttftReq(1), 100, [2]int{12_000, 27_000}, 0.8, 0, "lowest"},
		// Scores 2.4 and 4.6 s, past twice saturated_ms: a margin of 1.2.
		{"saturated", ttftReq(1), 100, [2]int{56_000, 112_000}, 1, 1, "deepest"},
		// The same without the widening: the shallower, faster replica.
		{"saturated, widening off", ttftReq(1), 100, [2]int{56_000, 112_000}, 0, 0, "lowest"},
		// Scores 1.4 s (idle, all 32,000 tokens) and 2.1 s (half held,
		// 35,000 queued): 0.7 s beyond the 0.7 s prefill of the half not
		// held, a margin of 0.2.
		{"a long prompt on an idle replica", long, 1000, [2]int{0, 35_000}, 1, 0, "lowest"},
	} {
		t.Run(c.name, func(t *testing.T) {
			pp := map[string]any{"saturated_ms": 1000, "saturated_rel": c.saturated}
			maps.Copy(pp, params)
			p := peerNew(t, "ttft", pp)
			rs := peerViews(2)
			rs[1].Match = c.matched
			for i := range rs {
				rs[i].PendingPrefill, rs[i].PendingCount, rs[i].InFlight = c.queued[i], 1, 1
			}
			pos, d := peerPick(t, p, c.req, rs)
			if pos != c.want || !strings.Contains(d.Reason, c.wantReason) {
				t.Fatalf("chose %d, want %d (scores %v, %s)", pos, c.want, d.Scores, d.Reason)
			}
		})
	}
	if _, err := New("ttft", Options{Params: map[string]any{"saturated_ms": -1}}); err == nil {
		t.Fatal("a negative saturated_ms is accepted")
	}
}

// A replica answering 3× slower than estimated, beside one answering as
// estimated, is learned: the fleet's correction moves to their mean and the
// slow one's own deviation (beyond the dead band) takes traffic off it.
func TestTTFTCorrectionLearnsFromFirstTokens(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "correction_alpha": 0.1, "replica_alpha": 0.1, "decode_weight": 0, "eviction_weight": 0})
	rs := peerViews(2)
	req := ttftReq(1)
	rs[0].Match = 30 // replica 0 saves 480 of 1,600 tokens: faster on paper
	if pos, _ := peerPick(t, p, req, rs); pos != 0 {
		t.Fatalf("chose %d before any correction", pos)
	}
	obs := p.(Observer)
	for k := range 200 {
		r := ttftReq(uint64(100 + k))
		slot := k % 2
		_, dk := peerPick(t, p, r, rs)
		raw, _ := p.(*TTFT).Estimate(r, &rs[slot], 0)
		routed := Decision{Replica: rs[slot].Index, EstTTFT: time.Duration(dk.Scores[slot] * float64(time.Millisecond))}
		obs.Observe(Event{Kind: Routed, Req: r, Decision: routed, Replica: rs[slot].Index})
		took := raw // replica 1 answers as estimated, replica 0 takes 3× the model
		if slot == 0 {
			took *= 3
		}
		obs.Observe(Event{Kind: FirstToken, Req: r, Replica: rs[slot].Index, TTFT: time.Duration(took * float64(time.Millisecond))})
	}
	pos, d2 := peerPick(t, p, req, rs)
	if pos != 1 {
		t.Fatalf("replica 0 answers 3× slower than estimated, still chosen (scores %v)", d2.Scores)
	}
	tt := p.(*TTFT)
	// The fleet's correction settles near √3 (the two replicas' mean in
	// log space); each replica's deviation, ±√3, less the dead band,
	// leaves c0/c1 = 3/1.2² ≈ 2.08; the EWMAs' lag moves it to about 2.2.
	c0, c1 := tt.corr(rs[0].Index), tt.corr(rs[1].Index)
	t.Logf("corrections %.3f and %.3f (ratio %.3f)", c0, c1, c0/c1)
	if c0/c1 < 1.8 || c0/c1 > 2.4 || c0 < 2 || c0 > 3 || c1 < 1 || c1 > 1.5 {
		t.Fatalf("corrections %v and %v (ratio %v), want about 2.5 and 1.2 (ratio ≈ 2.08)", c0, c1, c0/c1)
	}
}

// Within the ±20% dead band a replica's deviation is not followed: on
// identical replicas, transient estimate errors do not move traffic.
func TestTTFTCorrectionIgnoresSmallDeviations(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"correction_alpha": 0.5, "replica_alpha": 0.5})
	obs := p.(Observer)
	for k := range 20 {
		r := ttftReq(uint64(100 + k))
		slot := k % 2
		c := p.(*TTFT).corr(slot) // the model says 100 ms; the estimate is corrected
		obs.Observe(Event{Kind: Routed, Req: r, Decision: Decision{Replica: slot, EstTTFT: time.Duration(100 * c * float64(time.Millisecond))}, Replica: slot})
		took := 100.0 // slot 0 runs 15% slow, slot 1 as estimated
		if slot == 0 {
			took = 115
		}
		obs.Observe(Event{Kind: FirstToken, Req: r, Replica: slot, TTFT: time.Duration(took * float64(time.Millisecond))})
	}
	tt := p.(*TTFT)
	if c0, c1 := tt.corr(0), tt.corr(1); c0 != c1 || c0 < 1.0 || c0 > 1.15 {
		t.Fatalf("corrections %v and %v, want equal, between 1 and 1.15", c0, c1)
	}
}

// Once the caches are full, the eviction cost keeps a request with the
// holder of its prefix past the queue at which the plain estimate moves it:
// elsewhere it would evict 1,600 tokens of other prefixes, at the holder
// one. While the caches have room, the plain estimate decides.
func TestTTFTEvictionCostKeepsPrefixWithHolder(t *testing.T) {
	for _, c := range []struct {
		name   string
		cached int // blocks held by each replica, of 30,000
		want   int
	}{
		{"caches full", 30000, 0},
		{"caches with room", 1000, 1},
	} {
		p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "decode_weight": 0, "eviction_weight": 2})
		rs := peerViews(2)
		req := ttftReq(1)
		rs[0].Match = len(req.Blocks)
		rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = 3000, 1, 1 // moves it without the eviction cost
		for i := range rs {
			rs[i].HaveMetrics, rs[i].NumBlocks, rs[i].Cached = true, 30000, c.cached
		}
		if pos, d := peerPick(t, p, req, rs); pos != c.want {
			t.Errorf("%s: chose %d, want %d (scores %v)", c.name, pos, c.want, d.Scores)
		}
	}
}

// Among replicas within the margin with equal matches, the lowest score
// wins; only exactly equal scores are drawn at random.
func TestTTFTTieBreaksOnScoreThenRandom(t *testing.T) {
	req := ttftReq(1)
	for seed := range uint64(8) {
		p := peerNewSeed(t, "ttft", map[string]any{"margin_rel": 0.5, "margin_ms": 0, "eviction_weight": 0}, seed)
		rs := peerViews(3)
		rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = 300, 1, 1 // within the margin, but slower
		rs[2].PendingPrefill, rs[2].PendingCount, rs[2].InFlight = 200, 1, 1
		if pos, d := peerPick(t, p, req, rs); pos != 1 {
			t.Fatalf("seed %d: chose %d, want the lowest score (scores %v)", seed, pos, d.Scores)
		}
	}
	seen := map[int]bool{}
	for seed := range uint64(32) {
		p := peerNewSeed(t, "ttft", map[string]any{"eviction_weight": 0}, seed)
		pos, _ := peerPick(t, p, req, peerViews(3)) // three idle replicas: equal scores
		seen[pos] = true
	}
	if len(seen) != 3 {
		t.Fatalf("equal scores drew only %v in 32 seeds", seen)
	}
}

// The eviction cost is the share of the request's own blocks that do not
// fit in the replica's free space: all of them when the cache is full or
// its size unknown, half when half fit, none when all fit.
func TestTTFTEvictionCostScalesWithFullness(t *testing.T) {
	req := ttftReq(1) // 100 blocks, none cached anywhere
	cost := func(numBlocks, cached int) float64 {
		t.Helper()
		var s [2]float64
		for k, w := range []float64{0, 1} {
			p := peerNew(t, "ttft", map[string]any{"decode_weight": 0, "eviction_weight": w})
			rs := peerViews(1)
			rs[0].NumBlocks, rs[0].Cached = numBlocks, cached
			_, d := peerPick(t, p, req, rs)
			s[k] = d.Scores[0]
		}
		return s[1] - s[0]
	}
	full := cost(1000, 1000)
	own := peerNew(t, "ttft", nil).(*TTFT).o.Profile.PrefillMs(1600, 0, 8192) // its own prefill, ms
	if math.Abs(full-own) > 1e-6 {
		t.Fatalf("full cache: eviction cost %v ms, want its prefill time %v ms", full, own)
	}
	for _, c := range []struct {
		name              string
		numBlocks, cached int
		want              float64
	}{
		{"unknown size", 0, 0, full},
		{"half fits", 1000, 950, full / 2},
		{"all fits", 1000, 900, 0},
		{"empty", 1000, 0, 0},
	} {
		if got := cost(c.numBlocks, c.cached); math.Abs(got-c.want) > 1e-6 {
			t.Errorf("%s: eviction cost %v ms, want %v", c.name, got, c.want)
		}
	}
}

// The decode cost spreads load: an idle replica beats one decoding many
// requests when neither holds the prefix.
func TestTTFTDecodeCostSpreadsLoad(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0})
	rs := peerViews(3)
	rs[0].InFlight, rs[0].InFlightTokens = 40, 40*1700
	rs[1].InFlight, rs[1].InFlightTokens = 10, 10*1700
	if pos, d := peerPick(t, p, ttftReq(1), rs); pos != 2 {
		t.Fatalf("chose %d over the idle replica (scores %v)", pos, d.Scores)
	}
}

func TestTTFTUnhealthyAndErrors(t *testing.T) {
	p := peerNew(t, "ttft", nil)
	rs := peerViews(2)
	req := ttftReq(1)
	rs[0].Match = len(req.Blocks)
	rs[0].Healthy = false
	if pos, d := peerPick(t, p, req, rs); pos != 1 || d.Scores[0] != -1 {
		t.Fatalf("chose %d, scores %v", pos, d.Scores)
	}
	rs[1].Healthy = false
	if _, err := p.Pick(req, rs); !errors.Is(err, ErrNoReplica) {
		t.Fatalf("no healthy replica: %v", err)
	}
	for _, bad := range []map[string]any{{"margin_rel": -1}, {"correction_alpha": 2}, {"decode_weight": -1}, {"nope": 1}} {
		if _, err := New("ttft", Options{Params: bad}); err == nil {
			t.Errorf("params %v accepted", bad)
		}
	}
}

func peerNewSeed(t testing.TB, name string, params map[string]any, seed uint64) Policy {
	t.Helper()
	p, err := New(name, Options{Seed: seed, Params: params})
	if err != nil {
		t.Fatalf("New(%s, %v): %v", name, params, err)
	}
	return p
}

// Observe learns from a Pick's estimate with the correction that Pick
// applied, even when a first token moved the correction between the Pick
// and Routed (requests routed concurrently in a live gateway), and a dry
// run's Pick in between does not disturb it.
func TestTTFTRoutedLearnsWithThePicksCorrection(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"correction_alpha": 0.5}).(*TTFT)
	rs := peerViews(2)
	a, b, dry := ttftReq(1), ttftReq(2), ttftReq(3)
	_, da := peerPick(t, p, a, rs)
	before := p.corr(da.Replica)
	_, db := peerPick(t, p, b, rs) // b is routed and answers 3× slower than estimated
	p.Observe(Event{Kind: Routed, At: peerT0, Req: b, Decision: db, Replica: db.Replica})
	p.Observe(Event{Kind: FirstToken, At: peerT0, Req: b, Decision: db, Replica: db.Replica, TTFT: 3 * db.EstTTFT})
	if p.corr(da.Replica) == before {
		t.Fatal("the first token taught no correction")
	}
	peerPick(t, p, dry, rs)
	p.Observe(Event{Kind: Routed, At: peerT0, Req: a, Decision: da, Replica: da.Replica})
	want := float64(da.EstTTFT) / float64(time.Millisecond) / before
	if got := p.pending[a.ID].raw; got != want {
		t.Fatalf("raw estimate learnt from %v ms, want %v ms (the estimate without the correction it was made with)", got, want)
	}
}

// Late binding (defer_ms): the request waits in the router while every
// replica's queue ahead would take longer than the bound, and is routed at
// once when one replica's is short, when told not to wait, or when off.
func TestTTFTDefersWhileEveryQueueIsLong(t *testing.T) {
	cases := []struct {
		name    string
		queued  [2]int // pending prefill tokens of the two replicas
		deferMs float64
		noDefer bool
		want    error
	}{
		{"both queues long", [2]int{60000, 60000}, 100, false, ErrDefer},
		{"one queue short", [2]int{60000, 500}, 100, false, nil},
		{"both empty", [2]int{0, 0}, 100, false, nil},
		{"told not to wait", [2]int{60000, 60000}, 100, true, nil},
		{"off", [2]int{60000, 60000}, 0, false, nil},
		{"a bound above the queues", [2]int{60000, 60000}, 1e6, false, nil},
	}
	for _, c := range cases {
		p := peerNew(t, "ttft", map[string]any{"defer_ms": c.deferMs})
		rs := peerViews(2)
		for i, q := range c.queued {
			if q > 0 {
				rs[i].PendingPrefill, rs[i].PendingCount, rs[i].InFlight = q, 4, 4
			}
		}
		req := ttftReq(1)
		req.NoDefer = c.noDefer
		_, err := p.Pick(req, rs)
		if !errors.Is(err, c.want) && !(c.want == nil && err == nil) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
}

// KV admission counts a prefix the requests in flight share once: a holder
// running 30 requests on one 1,600-token prompt holds about one prompt and
// their own tokens (InFlightKV), not 30 prompts (InFlightTokens), and keeps
// the next request on the prompt; once their own tokens overflow its KV,
// the wait sends it away.
func TestTTFTKVWaitCountsSharedPrefixesOnce(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "decode_weight": 0, "eviction_weight": 0})
	req := ttftReq(1)
	req.MaxTokens = 128
	views := func(kv int, usage float64) []ReplicaView {
		rs := peerViews(2)
		for i := range rs {
			rs[i].NumBlocks = 1500 // 24,000 tokens
		}
		rs[0].Match, rs[0].Cached = len(req.Blocks), len(req.Blocks)
		rs[0].InFlight, rs[0].InFlightTokens, rs[0].InFlightKV = 30, 30*(1600+128), kv
		rs[0].HaveMetrics, rs[0].KVUsage = usage > 0, usage
		return rs
	}
	for _, c := range []struct {
		name  string
		kv    int
		usage float64
		want  int
	}{
		{"a shared prompt held once", 30 * (1 + 128), 0, 0},
		{"scraped usage agrees", 30 * (1 + 128), 0.25, 0},
		{"their own tokens overflow the cache", 36000, 0, 1},
	} {
		if pos, d := peerPick(t, p, req, views(c.kv, c.usage)); pos != c.want {
			t.Errorf("%s: chose %d, want %d (scores %v)", c.name, pos, c.want, d.Scores)
		}
	}
}

// KV admission counts the requests queued ahead: the scraped usage holds
// only the requests admitted when it was read, and those still waiting for
// their first token take their uncached prompts and outputs before the
// next request gets its blocks. A full holder with a burst queued is
// priced its turnover; at most ttftMaxKVTurns of them.
func TestTTFTKVWaitCountsTheQueueAhead(t *testing.T) {
	p := peerNew(t, "ttft", nil).(*TTFT)
	const own, out = 1000, 128.0
	view := func(pending, pendingTokens int, metrics bool) *ReplicaView {
		v := &peerViews(1)[0]
		v.NumBlocks = 1500 // 24,000 tokens
		v.InFlight, v.InFlightTokens, v.InFlightKV = 20, 20*2600, 16000
		v.PendingCount, v.PendingPrefill = pending, pendingTokens
		v.HaveMetrics, v.KVUsage, v.Running = metrics, 0.9, 20-pending
		return v
	}
	wait := func(v *ReplicaView) (float64, float64) {
		var l ttftLoad
		p.load(&l, v, 1000)
		return p.kvWaitMs(v, &l, own, out), l.stepMs
	}
	if ms, _ := wait(view(0, 0, true)); ms != 0 {
		t.Errorf("room for the request beside the 21,600 tokens held: waits %.1f ms, want 0", ms)
	}
	// 21,600 held + 3,000 + 3×128 queued + 1,128 its own: 2,112 over 24,000.
	ms, step := wait(view(3, 3000, true))
	if want := 2112.0 / 21600 * out * step; math.Abs(ms-want) > 1e-9 || ms == 0 {
		t.Errorf("three requests queued ahead: waits %.3f ms, want %.3f", ms, want)
	}
	ms, step = wait(view(20, 200000, true))
	if want := ttftMaxKVTurns * out * step; ms != want {
		t.Errorf("a queue of 200,000 tokens: waits %.1f ms, want the bound %.1f", ms, want)
	}
	// Unscraped, the gateway's own count (it holds the queued requests too):
	// 16,000 + 1,128 fits.
	if ms, _ := wait(view(3, 3000, false)); ms != 0 {
		t.Errorf("unscraped, 17,128 of 24,000: waits %.1f ms, want 0", ms)
	}
}

// BenchmarkTTFTPick is ttft's pick alone over 16 replicas (the routing
// decision's part after the hash and the match): loads, metrics and
// matches spread over the fleet, a 32,000-character prompt, a learnt
// flow on every replica (the future terms' rates), no allocation but the
// scores it returns.
func BenchmarkTTFTPick(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	p := peerNew(b, "ttft", nil)
	rs := peerViews(16)
	for i := range rs {
		rs[i].InFlight, rs[i].InFlightTokens, rs[i].InFlightKV = i%5, 8000*(i%5), 6000*(i%5)
		rs[i].PendingPrefill, rs[i].PendingCount = 1000*(i%3), i%3
		rs[i].HaveMetrics, rs[i].Waiting, rs[i].Running, rs[i].KVUsage = true, i%3, i%5, float64(i%4)/4
		rs[i].WaitingUnseen = max(rs[i].Waiting-rs[i].PendingCount, 0)
		rs[i].NumBlocks, rs[i].Cached = 30000, 20000+i*700
	}
	for k := range 64 {
		req := peerReq(uint64(k), peerText(r, 1, 32000), peerT0)
		d, err := p.Pick(req, rs)
		if err != nil {
			b.Fatal(err)
		}
		peerObserve(p, Event{Kind: Routed, At: peerT0, Req: req, Decision: d, Replica: d.Replica})
	}
	req := peerReq(1000, peerText(r, 1, 32000), peerT0)
	for i := range rs {
		rs[i].Match = (i % 3) * len(req.Blocks) / 4
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := p.Pick(req, rs); err != nil {
			b.Fatal(err)
		}
	}
}

// Among holders of the same prefix, a replica whose last request is still
// waiting for its first token costs more than its decode count says: that
// request decodes beside this one, and its prefill step runs first. One
// holder has a request still in its prefill, the other one already
// decoding: with pending_weight 0 the first looks idle and wins; with the
// default the second does. A deeper match within the margin still wins
// over an equal one without requests pending (the tie-break is among equals).
func TestTTFTPendingPrefillAmongEqualHolders(t *testing.T) {
	req := ttftReq(1)
	views := func() []ReplicaView {
		rs := peerViews(3)
		rs[0].Match, rs[1].Match = len(req.Blocks), len(req.Blocks)
		rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight, rs[0].InFlightTokens = 64, 1, 1, 1664
		rs[1].InFlight, rs[1].InFlightTokens = 1, 1664
		return rs
	}
	for _, c := range []struct {
		weight float64
		want   int
	}{{0, 0}, {1, 1}} {
		p := peerNew(t, "ttft", map[string]any{"pending_weight": c.weight})
		if pos, d := peerPick(t, p, req, views()); pos != c.want {
			t.Errorf("pending_weight %v: chose %d, want %d (scores %v)", c.weight, pos, c.want, d.Scores)
		}
	}
	rs := views()
	// Replica 1 now holds one block less: replica 0 is the deepest match.
	rs[1].Match = len(req.Blocks) - 1
	if pos, d := peerPick(t, peerNew(t, "ttft", nil), req, rs); pos != 0 {
		t.Errorf("deeper match with a request pending: chose %d, want 0 (scores %v)", pos, d.Scores)
	}
}

// copy_inflight: the deepest match yields to a shallower replica as fast
// when the blocks it holds beyond that one are queued for prefill there,
// are not a program's own context (a request still computes them there,
// or they end at a prefix shared at a rate) and the other replica's cache
// has room for them; and only then. A request starting a program stays
// in the warm-up.
func TestTTFTCopyInflight(t *testing.T) {
	req := ttftReq(1) // 100 blocks
	views := func(queued, decodes int) []ReplicaView {
		rs := peerViews(2)
		rs[0].Match, rs[1].Match = len(req.Blocks), 50 // 800 tokens beyond replica 1's match
		rs[0].PendingPrefill, rs[0].PendingCount = queued, 1
		rs[0].InFlight, rs[0].InFlightTokens = 1+decodes, (1+decodes)*1600
		for i := range rs {
			rs[i].NumBlocks, rs[i].Cached = 3000, 200
		}
		return rs
	}
	for _, c := range []struct {
		name            string
		params          map[string]any
		queued, decodes int
		altDecodes      int  // replica 1's, slowing its steps
		writer          int  // the match credited to a request sharing the blocks routed to replica 0 (-1: none)
		firstToken      bool // the writer has its first token: its blocks are computed
		altCached       int  // replica 1's cached blocks (0: 200)
		program         bool // req starts a program
		hot             bool // requests with this deepest match came at 2 a second
		want            int
	}{
		{"off: the deepest match", map[string]any{"copy_inflight": false}, 900, 0, 0, 0, false, 0, false, false, 0},
		{"its blocks still computed there: a copy", nil, 900, 0, 0, 0, false, 0, false, false, 1},
		{"their writer credited beyond the other's match: it stays", nil, 900, 0, 0, 60, false, 0, false, false, 0},
		{"their writer has its first token: it stays", nil, 900, 0, 0, 0, true, 0, false, false, 0},
		{"no writer (a history computed a turn ago): it stays", nil, 900, 0, 0, -1, false, 0, false, false, 0},
		{"no room for a copy: it stays", nil, 900, 0, 0, 0, false, 850, false, false, 0},
		{"slower but its queue shorter than the blocks: it stays", nil, 700, 200, 0, 0, false, 0, false, false, 0},
		{"its blocks queued but faster: it stays", nil, 900, 0, 200, 0, false, 0, false, false, 0},
		{"a program's first turn in the warm-up: it stays", nil, 900, 0, 0, 0, false, 0, true, false, 0},
		{"a program's first turn, warm-up off: a copy", map[string]any{"replicate_warmup": 0}, 900, 0, 0, 0, false, 0, true, false, 1},
		{"no writer but a hot prefix: a copy", nil, 900, 0, 0, -1, false, 0, false, true, 1},
	} {
		params := map[string]any{"decode_weight": 0, "eviction_weight": 0}
		for k, v := range c.params {
			params[k] = v
		}
		p := peerNew(t, "ttft", params)
		hot := 0
		if c.hot {
			hot = 3
		}
		for i := range hot { // counted at Routed, as the router does
			h := ttftReq(uint64(10 + i))
			h.Now = peerT0.Add(-time.Second + time.Duration(i)*time.Second/2)
			_, d := peerPick(t, p, h, views(0, 0))
			peerObserve(p, Event{Kind: Routed, At: h.Now, Req: h, Decision: d, Replica: d.Replica})
		}
		if c.writer >= 0 {
			w := ttftReq(2) // the same blocks
			d := Decision{Replica: views(0, 0)[0].Index, Matched: c.writer}
			peerObserve(p, Event{Kind: Routed, At: peerT0, Req: w, Decision: d, Replica: d.Replica})
			if c.firstToken {
				peerObserve(p, Event{Kind: FirstToken, At: peerT0, Req: w, Decision: d, Replica: d.Replica, TTFT: time.Millisecond})
			}
		}
		rs := views(c.queued, c.decodes)
		rs[1].InFlight, rs[1].InFlightTokens = c.altDecodes, c.altDecodes*1600
		if c.altCached > 0 {
			rs[1].Cached = c.altCached
		}
		r := *req
		if c.program {
			r.Program = Program{ID: 9, Home: -1}
		}
		pos, d := peerPick(t, p, &r, rs)
		if pos != c.want || strings.Contains(d.Reason, "a copy") != (c.want == 1) {
			t.Errorf("%s: chose %d (%q), want %d (scores %v)", c.name, pos, d.Reason, c.want, d.Scores)
		}
	}
	// A prefix another replica holds already (busy, outside the margin):
	// a copy would make a third holder, which is the replicate term's to
	// weigh, not copy_inflight's.
	for _, second := range []bool{false, true} {
		p := peerNew(t, "ttft", map[string]any{"decode_weight": 0, "eviction_weight": 0})
		w := ttftReq(2)
		d := Decision{Replica: peerViews(3)[0].Index}
		peerObserve(p, Event{Kind: Routed, At: peerT0, Req: w, Decision: d, Replica: d.Replica})
		rs := peerViews(3)
		rs[0].Match, rs[1].Match = len(req.Blocks), 50
		rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight, rs[0].InFlightTokens = 900, 1, 1, 1600
		rs[2].PendingPrefill, rs[2].PendingCount, rs[2].InFlight, rs[2].InFlightTokens = 40000, 8, 8, 40000
		if second {
			rs[2].Match = len(req.Blocks)
		}
		for i := range rs {
			rs[i].NumBlocks, rs[i].Cached = 3000, 200
		}
		r := *req
		pos, dd := peerPick(t, p, &r, rs)
		if want := map[bool]int{false: 1, true: 0}[second]; pos != want {
			t.Errorf("a second holder %v: chose %d (%q), want %d (scores %v)", second, pos, dd.Reason, want, dd.Scores)
		}
	}
	if _, err := New("ttft", Options{Params: map[string]any{"copy_inflight": 1}}); !errors.Is(err, ErrParam) {
		t.Errorf("copy_inflight 1: %v, want ErrParam", err)
	}
}
