package policy

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

// replicateViews: three replicas of 3,000 blocks; the first holds 90 of
// the request's 100 blocks and has 700 prompt tokens queued (less than
// the 1,440 its hit saves), the others hold nothing and are idle; their
// caches hold others blocks each.
func replicateViews(others int) []ReplicaView {
	rs := peerViews(3)
	for i := range rs {
		rs[i].NumBlocks, rs[i].Cached = 3000, others
	}
	rs[0].Match, rs[0].Cached = 90, 200
	rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight, rs[0].InFlightTokens = 700, 1, 1, 700
	return rs
}

// heat routes n requests sharing the holder's prefix over the second
// before at, through Pick and Routed as the router does: the prefix's rate
// is n − 1 requests a second.
func heat(t *testing.T, p Policy, n int, at time.Time) {
	for i := range n {
		req := ttftReq(uint64(100 + i))
		req.Now = at.Add(-time.Second + time.Duration(i)*time.Second/time.Duration(n-1))
		rs := replicateViews(200)
		rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight, rs[0].InFlightTokens = 0, 0, 0, 0
		_, d := peerPick(t, p, req, rs)
		peerObserve(p, Event{Kind: Routed, At: req.Now, Req: req, Decision: d, Replica: d.Replica})
	}
}

// A prefix requested twenty times a second gets a second holder while its
// holder is busier than the idle replicas, though the request alone would
// do better on the holder; a prefix nobody else asks for, one whose other
// replicas' caches have no room for a copy, or with the term off
// (replicate_s 0) stays with its holder. Picks that were never routed (dry
// runs) count for nothing.
func TestTTFTReplicatesAHotPrefix(t *testing.T) {
	for _, c := range []struct {
		name   string
		params map[string]any
		hot    bool
		others int // blocks cached on the replicas without the prefix
		dry    bool
		want   bool // moved off the holder
	}{
		{"hot", nil, true, 200, false, true},
		{"cold", nil, false, 200, false, false},
		{"no room for a copy", nil, true, 2500, false, false},
		{"off", map[string]any{"replicate_s": 0}, true, 200, false, false},
		{"dry runs only", nil, true, 200, true, false},
	} {
		params := map[string]any{"margin_rel": 0, "margin_ms": 0, "balance_s": 0} // the replicate term alone
		for k, v := range c.params {
			params[k] = v
		}
		p := peerNew(t, "ttft", params)
		if c.hot && c.dry {
			for i := range 21 {
				req := ttftReq(uint64(100 + i))
				req.Now = peerT0.Add(-time.Second + time.Duration(i)*time.Second/20)
				peerPick(t, p, req, replicateViews(200))
			}
		} else if c.hot {
			heat(t, p, 21, peerT0)
		}
		req := ttftReq(1)
		pos, d := peerPick(t, p, req, replicateViews(c.others))
		if moved := pos != 0; moved != c.want {
			t.Errorf("%s: chose %d (%s), want moved=%v (scores %v)", c.name, pos, d.Reason, c.want, d.Scores)
		}
	}
}

// A prefix's rate: while young, its requests after the first over the
// time since (at least replicate_s); once window_s old, the decayed count
// over window_s; a slot another prefix takes forgets the first.
func TestTTFTPrefixRate(t *testing.T) {
	p := peerNew(t, "ttft", map[string]any{"window_s": 10, "replicate_s": 1}).(*TTFT)
	p.mu.Lock()
	defer p.mu.Unlock()
	const key = 12345
	for i := range 5 { // 5 requests over 2 s
		p.countPrefix(key, peerT0.Add(time.Duration(i)*500*time.Millisecond))
	}
	if r := p.prefixRate(key, peerT0.Add(2*time.Second)); math.Abs(r-2) > 1e-9 {
		t.Fatalf("young: %v requests/s, want 4 over 2 s", r)
	}
	if r := p.prefixRate(key, peerT0.Add(100*time.Millisecond)); math.Abs(r-4) > 1e-9 {
		t.Fatalf("within the horizon: %v, want 4 over 1 s", r)
	}
	at := peerT0.Add(12 * time.Second)
	n := 0.0
	for i := range 5 {
		n += math.Exp(-(12 - 0.5*float64(i)) / 10)
	}
	if r := p.prefixRate(key, at); math.Abs(r-n/10) > 1e-9 {
		t.Fatalf("old: %v requests/s, want %v", r, n/10)
	}
	p.countPrefix(key+ttftPrefixSlots, at) // the same slot
	if r := p.prefixRate(key, at); r != 0 {
		t.Fatalf("a prefix whose slot was taken: %v, want 0", r)
	}
	if r := p.prefixRate(99, at); r != 0 {
		t.Fatalf("a prefix never seen: %v", r)
	}
}

// The parameters are checked where they enter.
func TestTTFTReplicateParams(t *testing.T) {
	for _, bad := range []map[string]any{
		{"replicate_s": -1}, {"replicate_s": 1e6}, {"replicate_room": -0.1}, {"replicate_room": 1.5},
		{"balance_s": -1}, {"balance_s": 1e6}, {"replicate_warmup": -1}, {"replicate_warmup": 2e6},
	} {
		if _, err := New("ttft", Options{Params: bad}); !errors.Is(err, ErrParam) {
			t.Errorf("%v: %v, want ErrParam", bad, err)
		}
	}
}

// A hot prefix's request goes, among holders placed alike, to the one that
// has had less work lately: a replica carries balance_s × its work rate's
// excess over the healthy replicas' mean; so does a program's first
// request. A prefix nobody else asks for (a chat's turn), a request that
// continues a program (it stays with its context), or balance_s 0, leaves
// the holders' scores equal.
func TestTTFTBalancesAHotPrefixByRecentWork(t *testing.T) {
	for _, c := range []struct {
		name     string
		balanceS float64
		hot      bool
		program  Program
		want     bool // the holder with the recent work scores higher
	}{
		{"hot", 3, true, Program{}, true},
		{"a program's first request", 3, true, Program{ID: 7, Home: -1}, true},
		{"a program's next request", 3, true, Program{ID: 7, Home: -1, Continues: true, Turns: 1}, false},
		{"cold", 3, false, Program{}, false},
		{"off", 0, true, Program{}, false},
	} {
		// The price of the future reads the same flows: off, to see this term alone.
		p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "future_weight": 0,
			"wait_weight": 0, "balance_s": c.balanceS}).(*TTFT)
		if c.hot {
			heat(t, p, 21, peerT0)
		}
		p.mu.Lock()
		p.addFlow(peerBase, peerT0, 1000, 0) // 1,000 blocks written on the first holder lately
		var w [3]float64
		for i := range w {
			blocks, _ := p.rates(peerBase+i, peerT0)
			w[i] = blocks * float64(p.o.BlockSize) * p.o.Profile.C1
		}
		p.mu.Unlock()
		rs := peerViews(3)
		for i := range rs {
			rs[i].NumBlocks, rs[i].Cached = 3000, 200
		}
		rs[0].Match, rs[1].Match = 90, 90 // the prefix heat made hot
		req := ttftReq(1)
		req.Program = c.program
		pos, d := peerPick(t, p, req, rs)
		diff := d.Scores[0] - d.Scores[1]
		if !c.want {
			if diff != 0 {
				t.Errorf("%s: holders' scores %v, want equal", c.name, d.Scores)
			}
			continue
		}
		mean := (w[0] + w[1] + w[2]) / 3
		want := c.balanceS * (w[0] - mean) // the second holder is below the mean: nothing
		if pos != 1 || w[1] >= mean || math.Abs(diff-want) > 1e-9*want {
			t.Errorf("%s: chose %d, scores %v (difference %v, want %v; work rates %v ms/s)", c.name, pos, d.Scores, diff, want, w)
		}
	}
}

// A hot prefix gets a second holder only where its family's share of the
// fleet's requests asks for one: in the warm-up for any request, and for
// a program's request the whole run, on the share less its noise.
//   - 21 requests of the hot prefix and 63 of three other families (share
//     21/(84+4) of 3 replicas, 0.72 holders) leave it with its holder
//     while the warm-up lasts (replicate_warmup 1,000); past it (50) or
//     with it off (0), and alone (its share 21/(21+4), 2.5 holders), it
//     gets its copy.
//   - 20 and 36 (decayed: about 1.1 holders, about 0.85 less one standard
//     deviation) leave a program's first turn with the holder, past the
//     warm-up as in it; a request without a program copies on the share
//     itself past the warm-up; so does a program of the only family (2.5
//     holders, 1.96 less its noise), and every program with the gate off.
func TestTTFTFamilyShareGatesACopy(t *testing.T) {
	for _, c := range []struct {
		name    string
		warmup  float64
		others  int // requests of other families routed before
		program bool
		want    bool
	}{
		{"a family among four", 1000, 63, false, false},
		{"past the warm-up", 50, 63, false, true},
		{"warm-up off", 0, 63, false, true},
		{"the only family", 1000, 0, false, true},
		{"a program of a family among four", 50, 36, true, false},
		{"a program in the warm-up", 1000, 36, true, false},
		{"a request without a program", 50, 36, false, true},
		{"a program of the only family", 50, 0, true, true},
		{"a program, gate off", 0, 36, true, true},
	} {
		p := peerNew(t, "ttft", map[string]any{"margin_rel": 0, "margin_ms": 0, "replicate_warmup": c.warmup, "balance_s": 0})
		for i := range c.others {
			req := peerReq(uint64(1000+i), fmt.Sprintf("family %d: %s", i%3, strings.Repeat("wxyz", 400)), peerT0.Add(-2*time.Second))
			_, d := peerPick(t, p, req, peerViews(3))
			peerObserve(p, Event{Kind: Routed, At: req.Now, Req: req, Decision: d, Replica: d.Replica})
		}
		heat(t, p, 21, peerT0)
		req := ttftReq(1)
		if c.program {
			req.Program = Program{ID: 7, Home: -1}
		}
		pos, d := peerPick(t, p, req, replicateViews(200))
		if moved := pos != 0; moved != c.want {
			t.Errorf("%s: chose %d (%s), want moved=%v (scores %v)", c.name, pos, d.Reason, c.want, d.Scores)
		}
	}
}

// The family table keeps the families that count: a hot family whose set
// other families pass through keeps its count (one way a set reset it at
// each of their requests), and a newcomer takes the way counted least.
func TestTTFTFamilyTableKeepsTheHotFamily(t *testing.T) {
	tt := peerNew(t, "ttft", nil).(*TTFT)
	sets := uint64(ttftFamilySlots / ttftFamilyWays)
	hot := uint64(12345)
	count := func(key uint64, at time.Time) {
		tt.countFamily(&Request{Blocks: []uint64{key}}, at)
	}
	value := func(key uint64, at time.Time) float64 {
		if c := tt.family(key); c != nil {
			return tt.value(c, at)
		}
		return 0
	}
	at := peerT0
	for i := range 40 {
		count(hot, at)
		if i%2 == 1 { // a rare family of hot's set, new each time
			count(hot+sets*uint64(1+i), at)
		}
	}
	if v := value(hot, at); math.Abs(v-40) > 1e-9 {
		t.Fatalf("hot family's count %v after 40 requests among 20 rare families of its set, want 40", v)
	}
	// The set now holds hot and three rare families of one request each;
	// three more families of two requests push those three out, hot stays.
	for k := uint64(100); k < 103; k++ {
		count(hot+sets*k, at)
		count(hot+sets*k, at)
	}
	for k := uint64(100); k < 103; k++ {
		if v := value(hot+sets*k, at); v != 2 {
			t.Errorf("family %d: count %v, want 2", k, v)
		}
	}
	if v := value(hot, at); math.Abs(v-40) > 1e-9 {
		t.Errorf("hot family's count %v, want 40", v)
	}
	if v := value(hot+sets*40, at); v != 0 {
		t.Errorf("a rare family pushed out still counts %v", v)
	}
}

// copy_inflight's writes in flight: kept per replica from Routed until the
// request's first token or its end, at most ttftMaxWrites (the oldest
// forgotten), never a remote decision's or a request credited its whole
// prompt, and none at all with copy_inflight off.
func TestTTFTWritesInFlight(t *testing.T) {
	writes := func(p Policy, replica int) []ttftWrite {
		tt := p.(*TTFT)
		tt.mu.Lock()
		defer tt.mu.Unlock()
		if sl := tt.slot(replica); sl != nil {
			return slices.Clone(sl.writes)
		}
		return nil
	}
	routed := func(p Policy, id uint64, matched int, remote bool) *Request {
		req := ttftReq(id)
		d := Decision{Replica: 2, Matched: matched}
		peerObserve(p, Event{Kind: Routed, At: peerT0, Req: req, Decision: d, Replica: 2, Remote: remote})
		return req
	}
	p := peerNew(t, "ttft", nil)
	a, b := routed(p, 1, 10, false), routed(p, 2, 0, false)
	routed(p, 3, len(a.Blocks), false) // credited its whole prompt: writes nothing
	routed(p, 4, 0, true)              // another gateway's
	if w := writes(p, 2); len(w) != 2 || w[0].id != 1 || w[0].from != 10 || w[1].id != 2 {
		t.Fatalf("writes %+v, want requests 1 (from 10) and 2", w)
	}
	peerObserve(p, Event{Kind: FirstToken, At: peerT0, Req: a, Replica: 2, TTFT: time.Millisecond})
	peerObserve(p, Event{Kind: Done, At: peerT0, Req: b, Replica: 2, Err: errors.New("reset")})
	if w := writes(p, 2); len(w) != 0 {
		t.Fatalf("writes %+v after a first token and an end, want none", w)
	}
	for i := range ttftMaxWrites + 10 {
		routed(p, uint64(100+i), 0, false)
	}
	if w := writes(p, 2); len(w) != ttftMaxWrites || w[0].id != 110 {
		t.Fatalf("%d writes from %d, want %d from 110", len(w), w[0].id, ttftMaxWrites)
	}
	off := peerNew(t, "ttft", map[string]any{"copy_inflight": false})
	routed(off, 1, 0, false)
	if w := writes(off, 2); len(w) != 0 {
		t.Fatalf("copy_inflight off: writes %+v, want none", w)
	}
}

// In the warm-up, a program's first turn reads the prefill under way on
// a holder for the part still to compute: the holder of its prefix,
// 90 % through the first request's prefill with a 200-token hit queued
// behind, keeps it, where the whole queue read moves it to an idle
// replica as a miss. A request of no program, one routed as the first
// prefill starts, one past the warm-up (replicate_warmup 0), or with
// copy_inflight off (no writes kept) still reads the whole queue.
func TestTTFTWarmupCountsThePrefillUnderWay(t *testing.T) {
	full := 74.3 // ms: the idle prefill of the first request's 1,600 tokens (c0 + c1 and c2 terms)
	for _, c := range []struct {
		name    string
		params  map[string]any
		program bool
		after   float64 // ms since the first request was routed
		want    int
	}{
		{"a program's first turn", nil, true, 0.9 * full, 0},
		{"no program", nil, false, 0.9 * full, 1},
		{"as the prefill starts", nil, true, 0, 1},
		{"past the warm-up", map[string]any{"replicate_warmup": 0}, true, 0.9 * full, 1},
		{"copy_inflight off", map[string]any{"copy_inflight": false}, true, 0.9 * full, 1},
	} {
		params := map[string]any{"margin_rel": 0, "margin_ms": 0, "balance_s": 0} // the replicate term alone
		for k, v := range c.params {
			params[k] = v
		}
		p := peerNew(t, "ttft", params)
		first := ttftReq(1)
		peerObserve(p, Event{Kind: Routed, At: peerT0, Req: first, Decision: Decision{Replica: peerBase}, Replica: peerBase})
		req := ttftReq(2)
		req.Now = peerT0.Add(time.Duration(c.after * float64(time.Millisecond)))
		if c.program {
			req.Program = Program{ID: 7}
		}
		rs := peerViews(3)
		for i := range rs {
			rs[i].NumBlocks = 30000
		}
		rs[0].Match, rs[0].Cached = len(req.Blocks), len(req.Blocks)
		rs[0].PendingPrefill, rs[0].PendingCount, rs[0].InFlight = 1800, 2, 2
		pos, d := peerPick(t, p, req, rs)
		if pos != c.want {
			t.Errorf("%s: chose %d (%s), want %d (scores %v)", c.name, pos, d.Reason, c.want, d.Scores)
		}
	}
}
