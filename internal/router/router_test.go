package router

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/testutil"
)

func newRouter(t testing.TB, pol string, n int) *Router {
	t.Helper()
	p, err := policy.New(pol, policy.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	urls := make([]string, n)
	for i := range urls {
		urls[i] = "http://r" + string(rune('a'+i))
	}
	clock := time.Unix(0, 0)
	rt, err := New(Config{Replicas: urls, Policy: p, Now: func() time.Time { return clock }, MaxEntries: 2 << 20, BlocksPerReplica: 1 << 20})
	if err != nil {
		t.Fatal(err)
	}
	return rt
}

func parse(t testing.TB, text string) *prompt.Parsed {
	return &prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: text, KeyText: text, MaxTokens: 16, Prompts: 1}
}

func TestCountersReturnToZero(t *testing.T) {
	rt := newRouter(t, "ttft", 3)
	var tickets []*Ticket
	for i := range 10 {
		req := rt.Prepare(parse(t, strings.Repeat("x", 100*i+64)), "", "")
		tk, err := rt.Route(req)
		if err != nil {
			t.Fatal(err)
		}
		tickets = append(tickets, tk)
	}
	for i, tk := range tickets {
		if i%2 == 0 {
			tk.FirstToken(time.Unix(1, 0))
			tk.FirstToken(time.Unix(1, 0)) // idempotent
		}
		tk.Done(time.Unix(2, 0), Outcome{CachedTokens: -1})
		tk.Done(time.Unix(2, 0), Outcome{CachedTokens: -1})
	}
	for i, r := range rt.reps() {
		if r.inFlight.Load() != 0 || r.inFlightTokens.Load() != 0 || r.pendingPrefill.Load() != 0 || r.pendingCount.Load() != 0 {
			t.Fatalf("replica %d counters not zero: %d %d %d %d", i, r.inFlight.Load(), r.inFlightTokens.Load(), r.pendingPrefill.Load(), r.pendingCount.Load())
		}
	}
}

func TestRouteExcludeAndUnhealthy(t *testing.T) {
	rt := newRouter(t, "least_load", 3)
	rt.SetHealthy(1, false)
	for range 20 {
		tk, err := rt.Route(rt.Prepare(parse(t, "hello"), "", ""), 0)
		if err != nil {
			t.Fatal(err)
		}
		if tk.Replica != 2 {
			t.Fatalf("routed to %d; 0 excluded, 1 unhealthy", tk.Replica)
		}
	}
	if _, err := rt.Route(rt.Prepare(parse(t, "hello"), "", ""), 0, 2); err == nil {
		t.Fatal("no replica left, no error")
	}
}

func TestTTFTKeepsAConversationOnItsReplica(t *testing.T) {
	rt := newRouter(t, "ttft", 4)
	history := strings.Repeat("system prompt shared by the conversation. ", 100)
	first := -1
	for turn := range 8 {
		history += strings.Repeat("turn text ", 30)
		tk, err := rt.Route(rt.Prepare(parse(t, history), "", ""))
		if err != nil {
			t.Fatal(err)
		}
		if first < 0 {
			first = tk.Replica
		} else if tk.Replica != first {
			t.Fatalf("turn %d went to %d, conversation is on %d", turn, tk.Replica, first)
		}
		if turn > 0 && tk.Decision.Matched == 0 {
			t.Fatalf("turn %d credited no match", turn)
		}
		tk.FirstToken(time.Unix(1, 0))
		tk.Done(time.Unix(1, 0), Outcome{CachedTokens: -1})
	}
}

// BenchmarkDecision measures one routing decision as the gateway makes it:
// hash a 32,000-character prompt, match it over 16 replicas in an index of
// 1M blocks, pick with the default policy (ttft).
func BenchmarkDecision(b *testing.B) {
	benchDecision(b, newRouter(b, "ttft", 16), 5, nil)
}

// benchDecision fills rt's index with 2^20 random blocks over 16 replicas,
// gives replica holder the first 300 blocks of a 32,000-character prompt,
// and times its decision (hash, match, pick), checking each with ok when
// set; it reports the median and p99 beside the mean (ns/op): the goal is
// on the median decision.
func benchDecision(b *testing.B, rt *Router, holder int, ok func(policy.Decision) bool) {
	p := benchFill(rt, holder)
	b.ResetTimer()
	var lat []time.Duration
	for b.Loop() {
		t0 := time.Now()
		d, _, err := rt.DryRun(rt.Prepare(p, "", ""))
		if err != nil || (ok != nil && !ok(d)) {
			b.Fatal(d, err)
		}
		lat = append(lat, time.Since(t0))
	}
	reportLatencies(b, lat)
}

// reportLatencies reports the median and p99 of lat beside the mean.
func reportLatencies(b *testing.B, lat []time.Duration) {
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	b.ReportMetric(float64(lat[len(lat)/2].Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
}

// benchFill is benchDecision's index and prompt: 2^20 random blocks over
// 16 replicas, and replica holder with the prompt's first 300 blocks.
func benchFill(rt *Router, holder int) *prompt.Parsed {
	rng := rand.New(rand.NewPCG(1, 2))
	hs := make([]uint64, 500)
	for i := 0; rt.Index().Len() < 1<<20; i++ {
		for j := range hs {
			hs[j] = rng.Uint64()
		}
		_ = rt.Index().Insert(i%16, hs)
	}
	text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 32000/45+1)[:32000]
	p := parse(nil, text)
	rt.Index().Insert(holder, rt.Prepare(p, "", "").Blocks[:300])
	return p
}

// BenchmarkDecisionScale measures the decision at fleet scale beside the
// hash it cannot avoid: 256 replicas, a 512,000-character prompt (128k
// tokens, 8,000 blocks) in an index of 4M blocks, and the same prompt
// hashed alone, timed alternately in one loop so that both see the same
// load (the machine's, the garbage collector's). The decision is the
// request path's, as the gateway makes it: Prepare (the hash) and Route
// (views, match, pick, commit), learning at Accept; the ticket is ended
// untimed. It reports both medians and their ratio, decision-x-hash (the
// goal: at most 1.5), and DryRun's (/debug/route, which returns the views
// it allocates); the 16-replica, 32,000-character case beside it.
func BenchmarkDecisionScale(b *testing.B) {
	for _, c := range []struct{ replicas, chars, blocks int }{{16, 32000, 1 << 20}, {256, 512000, 4 << 20}} {
		b.Run(fmt.Sprintf("%dx%dkchars", c.replicas, c.chars/1000), func(b *testing.B) {
			p, err := policy.New("ttft", policy.Options{Seed: 1})
			if err != nil {
				b.Fatal(err)
			}
			// A virtual clock, 10 s a decision (a 128k-token prefill takes
			// seconds): ttft's recent-flow rates decay between decisions as
			// under real traffic, instead of piling onto the holders.
			now := time.Unix(0, 0)
			rt, err := New(Config{Replicas: replicaURLs(c.replicas), Policy: p, Now: func() time.Time { return now },
				MaxEntries: c.blocks, BlocksPerReplica: 1 << 20, ConfirmOnAccept: true})
			if err != nil {
				b.Fatal(err)
			}
			text := fillScale(b, rt, c.replicas, c.chars, c.blocks)
			benchScale(b, rt, parse(b, text), func() { now = now.Add(10 * time.Second) })
		})
	}
}

func replicaURLs(n int) []string {
	urls := make([]string, n)
	for i := range urls {
		urls[i] = fmt.Sprintf("http://r%d", i)
	}
	return urls
}

// fillScale fills rt's index with random 500-block prompts spread over
// the replicas up to 7/8 of blocks entries, and returns a prompt of chars
// characters of which every fourth replica r holds the first
// (r+1)·n/(2·replicas) of its n blocks: holders at every depth, the
// deepest holding half, so that the match resolves many lengths.
func fillScale(b *testing.B, rt *Router, replicas, chars, blocks int) string {
	rng := rand.New(rand.NewPCG(1, 2))
	hs := make([]uint64, 500)
	for i := 0; rt.Index().Len() < blocks-blocks/8; i++ {
		for j := range hs {
			hs[j] = rng.Uint64()
		}
		_ = rt.Index().Insert(i%replicas, hs)
	}
	text := strings.Repeat("The quick brown fox jumps over the lazy dog. ", chars/45+1)[:chars]
	full := rt.Prepare(parse(b, text), "", "").Blocks
	for r := 0; r < replicas; r += 4 {
		_ = rt.Index().Insert(r, full[:(r+1)*len(full)/(2*replicas)])
	}
	return text
}

// benchScale times, alternately, p's hash alone (prompt.Parsed.Blocks),
// rt's decision on p (Prepare and Route) and its dry run (Prepare and
// DryRun), calling tick between decisions.
func benchScale(b *testing.B, rt *Router, p *prompt.Parsed, tick func()) {
	root := prompt.Key{Model: p.Model}.Root()
	var hashes, decisions, dry []time.Duration
	for b.Loop() {
		t0 := time.Now()
		_, hs := p.Blocks(nil, rt.tok, root, rt.cfg.BlockSize)
		t1 := time.Now()
		tk, err := rt.Route(rt.Prepare(p, "", ""))
		t2 := time.Now()
		if err != nil || len(hs) == 0 || tk.Decision.Matched == 0 {
			b.Fatal(tk, err)
		}
		tk.Done(time.Unix(0, 0), Outcome{CachedTokens: -1})
		tick()
		t3 := time.Now()
		if _, _, err := rt.DryRun(rt.Prepare(p, "", "")); err != nil {
			b.Fatal(err)
		}
		hashes, decisions, dry = append(hashes, t1.Sub(t0)), append(decisions, t2.Sub(t1)), append(dry, time.Since(t3))
	}
	h, d := median(hashes), median(decisions)
	b.ReportMetric(float64(d.Nanoseconds()), "p50-ns")
	b.ReportMetric(float64(h.Nanoseconds()), "hash-p50-ns")
	b.ReportMetric(float64(d)/float64(h), "decision-x-hash")
	b.ReportMetric(float64(median(dry))/float64(h), "dryrun-x-hash")
}

func median(ds []time.Duration) time.Duration {
	slices.Sort(ds)
	return ds[len(ds)/2]
}

// recorder is a policy that records the events it observes.
type recorder struct {
	policy.Policy
	kinds []policy.EventKind
	evs   []policy.Event
}

func (r *recorder) Observe(ev policy.Event) {
	r.kinds = append(r.kinds, ev.Kind)
	r.evs = append(r.evs, ev)
}

func TestPrefillDoneFreesTheQueueWithoutAnObservation(t *testing.T) {
	base, _ := policy.New("least_load", policy.Options{})
	rec := &recorder{Policy: base}
	rt, err := New(Config{Replicas: []string{"a"}, Policy: rec, Now: func() time.Time { return time.Unix(0, 0) }})
	if err != nil {
		t.Fatal(err)
	}
	tk, err := rt.Route(rt.Prepare(parse(t, strings.Repeat("x", 400)), "", ""))
	if err != nil {
		t.Fatal(err)
	}
	if rt.Pending(0) != 100 || tk.UncachedTokens() != 100 {
		t.Fatalf("pending %d, uncached %d", rt.Pending(0), tk.UncachedTokens())
	}
	tk.PrefillDone()
	tk.FirstToken(time.Unix(1, 0)) // too late: the prefill was already counted done
	if rt.Pending(0) != 0 || rt.InFlight(0) != 1 {
		t.Fatalf("pending %d in flight %d", rt.Pending(0), rt.InFlight(0))
	}
	tk.Done(time.Unix(2, 0), Outcome{CachedTokens: -1})
	if rt.InFlight(0) != 0 {
		t.Fatal("in flight after Done")
	}
	want := []policy.EventKind{policy.Routed, policy.Done}
	if len(rec.kinds) != 2 || rec.kinds[0] != want[0] || rec.kinds[1] != want[1] {
		t.Fatalf("observed %v, want %v (no FirstToken without a first token)", rec.kinds, want)
	}
}

// The view carries each replica's KV capacity in the router's blocks (a
// vLLM with 32-token blocks holds twice as many of the index's 16-token
// ones) and how many blocks the index believes it holds.
func TestViewsCapacityInRouterBlocks(t *testing.T) {
	rt := newRouter(t, "ttft", 2)
	if vs := rt.Views(rt.Prepare(parse(t, "hello"), "", "")); vs[0].NumBlocks != 1<<20 {
		t.Fatalf("before a scrape: capacity %d, want the configured %d", vs[0].NumBlocks, 1<<20)
	}
	got := rt.SetMetrics(0, Metrics{NumBlocks: 1000, BlockSize: 32}, time.Unix(0, 0))
	rt.SetMetrics(1, Metrics{NumBlocks: 1000, BlockSize: 16}, time.Unix(0, 0))
	if got.NumBlocks != 2000 || got.BlockSize != 16 {
		t.Fatalf("stored %+v, want 2000 blocks of 16", got)
	}
	p := parse(t, strings.Repeat("abcd", 1600)) // 100 blocks
	req := rt.Prepare(p, "", "")
	if err := rt.Index().Insert(1, req.Blocks[:30]); err != nil {
		t.Fatal(err)
	}
	vs := rt.Views(req)
	if vs[0].NumBlocks != 2000 || vs[1].NumBlocks != 1000 {
		t.Fatalf("capacities %d and %d, want 2000 and 1000", vs[0].NumBlocks, vs[1].NumBlocks)
	}
	if vs[0].Cached != 0 || vs[1].Cached != 30 || vs[1].Match != 30 {
		t.Fatalf("cached %d and %d (match %d), want 0 and 30 (30)", vs[0].Cached, vs[1].Cached, vs[1].Match)
	}
}

// Finding 8: with ConfirmOnAccept the index credits a request once it is
// sent (Credit: a burst routed before the first answer sees it) but keeps
// it only once the replica took it: a rejection, or an end without Accept,
// forgets what the request added, and other gateways hear it only at
// Accept.
func TestIndexConfirmsOnAcceptForgetsOtherwise(t *testing.T) {
	p, _ := policy.New("least_load", policy.Options{Seed: 1})
	var shared []Learned
	rt, err := New(Config{Replicas: []string{"a", "b"}, Policy: p, ConfirmOnAccept: true, BlocksPerReplica: 1 << 10,
		OnLearn: func(l Learned) { shared = append(shared, l) }})
	if err != nil {
		t.Fatal(err)
	}
	prompt := strings.Repeat("s", 64*16)
	warm := rt.Prepare(parse(t, prompt), "", "")
	tk, _ := rt.Route(warm)
	if n := rt.Index().ReplicaLen(tk.Replica); n != 0 {
		t.Fatalf("routed, not sent: %d blocks credited, want 0", n)
	}
	tk.Credit()
	held := rt.Index().ReplicaLen(tk.Replica)
	if held != len(warm.Blocks) || len(shared) != 0 {
		t.Fatalf("sent: %d blocks credited (want %d), %d shared (want 0 before Accept)", held, len(warm.Blocks), len(shared))
	}
	tk.Accept()
	tk.Done(time.Unix(1, 0), Outcome{CachedTokens: -1})
	if rt.Index().ReplicaLen(tk.Replica) != held || len(shared) != 1 {
		t.Fatalf("accepted: %d blocks held (want %d), %d shared (want 1)", rt.Index().ReplicaLen(tk.Replica), held, len(shared))
	}
	// A longer prompt on the same replica is rejected after it was
	// accepted (a 4xx after the first byte): its own blocks go, the shared
	// ones stay.
	long := rt.Prepare(parse(t, prompt+strings.Repeat("j", 64*16)), "", "")
	tk2, _ := rt.Route(long, 1-tk.Replica)
	tk2.Accept()
	if rt.Index().ReplicaLen(tk.Replica) != len(long.Blocks) {
		t.Fatalf("second request not learnt: %d", rt.Index().ReplicaLen(tk.Replica))
	}
	tk2.Reject()
	tk2.Done(time.Unix(2, 0), Outcome{CachedTokens: -1})
	if got := rt.Index().ReplicaLen(tk.Replica); got != held {
		t.Fatalf("after the rejection %d blocks held, want the %d shared ones", got, held)
	}
	// Tickets the replica never took: rejected before Accept, or ended
	// without one (a refusal, the client gone before the answer began):
	// the index returns to what it held, and no gateway heard them.
	before, sharedBefore := rt.Index().Len(), len(shared)
	tk3, _ := rt.Route(rt.Prepare(parse(t, strings.Repeat("z", 64*16)), "", ""))
	tk4, _ := rt.Route(rt.Prepare(parse(t, strings.Repeat("y", 64*16)), "", ""))
	tk3.Credit()
	tk4.Credit()
	if rt.Index().Len() == before {
		t.Fatal("routed requests not credited")
	}
	tk3.Reject()
	tk3.Done(time.Unix(3, 0), Outcome{CachedTokens: -1})
	tk3.Accept() // after Done: ignored
	tk4.Done(time.Unix(3, 0), Outcome{CachedTokens: -1, Err: errors.New("refused")})
	tk4.Accept() // after Done: ignored
	if rt.Index().Len() != before || len(shared) != sharedBefore {
		t.Fatalf("index %d entries (%d before), %d shared (%d before): requests never taken were kept",
			rt.Index().Len(), before, len(shared), sharedBefore)
	}
}

// Finding 4: candidates are the replicas that serve the request's model
// or adapter; none → ErrModelNotServed.
func TestRouteOnlyToReplicasServingTheModel(t *testing.T) {
	rt := newRouter(t, "round_robin", 3)
	for i := range 3 {
		ms := []Model{{ID: "m"}}
		if i == 2 {
			ms = append(ms, Model{ID: "sql-lora", Parent: "m"})
		}
		rt.Replica(i).SetServed(NewServed(ms, nil))
	}
	for range 12 {
		req := rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "sql-lora", Text: "q"}, "", "")
		tk, err := rt.Route(req)
		if err != nil || tk.Replica != 2 {
			t.Fatalf("adapter routed to %v (%v)", tk, err)
		}
		tk.Done(time.Unix(1, 0), Outcome{CachedTokens: -1})
	}
	_, err := rt.Route(rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "nope", Text: "q"}, "", ""))
	if !errors.Is(err, ErrModelNotServed) {
		t.Fatalf("unserved model: %v", err)
	}
	// The only replica serving the adapter is out of rotation: no healthy
	// replica, not "not served".
	rt.SetHealthy(2, false)
	_, err = rt.Route(rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "sql-lora", Text: "q"}, "", ""))
	if !errors.Is(err, policy.ErrNoReplica) {
		t.Fatalf("adapter with its replica down: %v", err)
	}
}

// A replica whose KV events are not in sync (joined late, or after a gap)
// is credited with what its events did report, when that is more than the
// approximate index knows: positive knowledge is true at once.
func TestUnsyncedPreciseCreditsReportedBlocks(t *testing.T) {
	p, _ := policy.New("least_load", policy.Options{Seed: 1})
	rt, err := New(Config{Replicas: []string{"a", "b"}, Policy: p, Precise: true, BlocksPerReplica: 1 << 10})
	if err != nil {
		t.Fatal(err)
	}
	req := rt.Prepare(parse(t, strings.Repeat("w", 64*16)), "", "")
	if err := rt.Precise().Index().Insert(1, req.Blocks[:10]); err != nil {
		t.Fatal(err)
	}
	v := rt.Views(req)
	if v[1].Match != 10 || v[0].Match != 0 {
		t.Fatalf("unsynced replica's reported blocks not credited: %d %d", v[0].Match, v[1].Match)
	}
	if err := rt.Index().Insert(1, req.Blocks); err != nil { // the approximate index knows more
		t.Fatal(err)
	}
	if v := rt.Views(req); v[1].Match != len(req.Blocks) {
		t.Fatalf("the larger match must stand: %d", v[1].Match)
	}
	rt.FollowKV(1, KVMessage{Seq: 0}, time.Unix(0, 0), nil) // followed from the start: in sync, the precise index alone
	if v := rt.Views(req); v[1].Match != 10 {
		t.Fatalf("synced replica: %d, want the precise 10", v[1].Match)
	}
}

// TestTicketHeld: a ticket says what its replica held of the prompt and
// the most any candidate held, whichever the policy chose.
func TestTicketHeld(t *testing.T) {
	rt := newRouter(t, "round_robin", 2)
	text := strings.Repeat("a shared prefix of some length ", 20)
	var tks []*Ticket
	for range 3 {
		tk, err := rt.Route(rt.Prepare(parse(t, text), "", ""))
		if err != nil {
			t.Fatal(err)
		}
		tks = append(tks, tk)
	}
	n := len(tks[0].Request().Blocks)
	if n == 0 {
		t.Fatal("the prompt has no full block")
	}
	want := [][2]int{{0, 0}, {0, n}, {n, n}} // a miss, then spilled by round robin, then held
	for i, tk := range tks {
		if got := [2]int{tk.Held, tk.BestHeld}; got != want[i] {
			t.Errorf("request %d on replica %d: held, best held = %v, want %v", i, tk.Replica, got, want[i])
		}
	}
	// The holder excluded (a retry): nobody else holds it.
	rt.SetHealthy(1, false)
	tk, err := rt.Route(rt.Prepare(parse(t, text), "", ""), 0)
	if err == nil {
		t.Fatalf("routed to %d with every replica excluded or unhealthy", tk.Replica)
	}
	rt.SetHealthy(1, true)
	tk, err = rt.Route(rt.Prepare(parse(t, text), "", ""), 0)
	if err != nil {
		t.Fatal(err)
	}
	if tk.Replica != 1 || tk.Held != n || tk.BestHeld != n {
		t.Errorf("replica 0 excluded: routed to %d, held %d, best %d; want 1, %d, %d", tk.Replica, tk.Held, tk.BestHeld, n, n)
	}
}

// A decision allocates nothing per replica but the scores its policy
// returns (8 bytes a replica): the views, the index's matches and ttft's
// scratch are reused (at 256 replicas the views alone were 40 KiB a
// request, a third of a decision's cost beside the hash).
func TestRouteAllocatesNothingPerReplica(t *testing.T) {
	if testutil.RaceEnabled { // its sync.Pool drops a share of what is put back, on purpose
		t.Skip("the race detector's sync.Pool drops buffers on purpose")
	}
	perRoute := func(n int) float64 {
		p, err := policy.New("ttft", policy.Options{Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		rt, err := New(Config{Replicas: replicaURLs(n), Policy: p, Now: func() time.Time { return time.Unix(0, 0) }, ConfirmOnAccept: true})
		if err != nil {
			t.Fatal(err)
		}
		req := rt.Prepare(parse(t, strings.Repeat("a prompt of some blocks ", 40)), "", "")
		route := func() {
			tk, err := rt.Route(req)
			if err != nil {
				t.Fatal(err)
			}
			tk.Done(time.Unix(0, 0), Outcome{CachedTokens: -1})
		}
		route() // the first decision makes the buffers
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		const routes = 200
		for range routes {
			route()
		}
		runtime.ReadMemStats(&after)
		return float64(after.TotalAlloc-before.TotalAlloc) / routes
	}
	small, large := perRoute(16), perRoute(256)
	if perReplica := (large - small) / 240; perReplica > 16 {
		t.Fatalf("a decision allocates %.0f bytes at 16 replicas, %.0f at 256: %.1f bytes a replica, want ≤ 16 (the scores)", small, large, perReplica)
	}
}

// A replica's scraped waiting requests are read against the gateway's
// requests waiting for a first token when that scrape arrived, not now: a
// scrape taken while two of this gateway's requests waited, read after
// their first tokens, holds one request another sent (WaitingUnseen 1), not
// three; a request routed after the scrape is not in it; the next scrape
// that holds only this gateway's requests holds none. Another gateway's
// requests count as unseen until its shared loads hold them; a scrape
// delivered late is read against the count when it was taken.
func TestWaitingUnseenIsReadAtTheScrape(t *testing.T) {
	ll, _ := policy.New("least_load", policy.Options{Seed: 1})
	now := time.Unix(0, 0)
	rt, err := New(Config{Replicas: []string{"http://ra", "http://rb"}, Policy: ll, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	route := func(text string) *Ticket {
		tk, err := rt.Route(rt.Prepare(parse(t, text), "", ""), 1)
		if err != nil || tk.Replica != 0 {
			t.Fatalf("routed to %v, %v", tk, err)
		}
		tk.Accept()
		return tk
	}
	unseen := func(want int, when string) {
		t.Helper()
		v := rt.Views(rt.Prepare(parse(t, "probe"), "", ""))[0]
		if !v.HaveMetrics || v.WaitingUnseen != want {
			t.Errorf("%s: waiting %d, pending %d, unseen %d (metrics %v): want unseen %d", when, v.Waiting,
				v.PendingCount, v.WaitingUnseen, v.HaveMetrics, want)
		}
	}
	a, b := route("first request"), route("second request")
	rt.SetMetrics(0, Metrics{Waiting: 3}, now)
	unseen(1, "two of three waiting are this gateway's")
	now = now.Add(100 * time.Millisecond)
	a.FirstToken(now)
	b.FirstToken(now)
	unseen(1, "after their first tokens")
	c := route("third request")
	unseen(1, "a request routed after the scrape")
	rt.SetMetrics(0, Metrics{Waiting: 1}, now)
	unseen(0, "a scrape holding only this gateway's request")
	// Another gateway's two requests: waiting in the scrape before its
	// loads say so they are unseen; once its loads say so, they are its
	// pending requests, counted once.
	rt.SetMetrics(0, Metrics{Waiting: 3}, now)
	unseen(2, "another gateway's requests before its loads")
	rt.SetRemoteLoad(0, Load{InFlight: 2, PendingPrefill: 2000, PendingCount: 2})
	unseen(0, "another gateway's requests in its loads")
	// A scrape delivered late reads this gateway's requests when it was
	// taken: c, without a first token then, had one by its arrival.
	c.FirstToken(now)
	rt.SetMetricsSeen(0, Metrics{Waiting: 4}, now, 1)
	unseen(1, "a late scrape: its own request then, and the other gateway's two")
	rt.SetRemoteLoad(0, Load{})
	for _, tk := range []*Ticket{a, b, c} {
		tk.Done(now, Outcome{})
	}
}
