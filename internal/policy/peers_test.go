package policy

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/kvgate/kvgate/internal/prompt"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// peerPolicies are the policies of this brief.
var peerPolicies = []string{"session", "prefix_key", "chwbl", "sglang", "dynamo", "llmd", "preble", "score", "precise"}

// peerBase is the slot of the replica at position 0 in peerViews: slots
// differ from positions, so a policy answering a position fails.
const peerBase = 10

var peerT0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func peerViews(n int) []ReplicaView {
	rs := make([]ReplicaView, n)
	for i := range rs {
		rs[i] = ReplicaView{
			Index: peerBase + i, URL: fmt.Sprintf("http://127.0.0.1:%d", 8000+i),
			Healthy: true,
		}
	}
	return rs
}

func peerNew(t testing.TB, name string, params map[string]any) Policy {
	t.Helper()
	p, err := New(name, Options{Seed: 7, Params: params})
	if err != nil {
		t.Fatalf("New(%s, %v): %v", name, params, err)
	}
	return p
}

// peerReq is a request for text as the router builds it (approximate
// tokenizer, 16-token blocks).
func peerReq(id uint64, text string, at time.Time) *Request {
	return &Request{
		ID: id, Now: at, Model: "m", Text: text, KeyText: text,
		Blocks: prompt.ApproxBlockHashes(nil, prompt.Key{Model: "m"}.Root(), text, 16),
		Tokens: prompt.Approx{}.Count(text), MaxTokens: 64,
	}
}

// peerPick picks and checks the Decision's shape; it returns the position.
func peerPick(t testing.TB, p Policy, req *Request, rs []ReplicaView) (int, Decision) {
	t.Helper()
	d, err := p.Pick(req, rs)
	if err != nil {
		t.Fatalf("%s: Pick: %v", p.Name(), err)
	}
	pos := posOf(rs, d.Replica)
	if pos < 0 {
		t.Fatalf("%s: Decision.Replica %d is no replica's Index", p.Name(), d.Replica)
	}
	if !rs[pos].Healthy {
		t.Fatalf("%s: chose unhealthy replica %d", p.Name(), d.Replica)
	}
	if d.Scores != nil && len(d.Scores) != len(rs) {
		t.Fatalf("%s: %d scores for %d replicas", p.Name(), len(d.Scores), len(rs))
	}
	if d.Reason == "" {
		t.Fatalf("%s: empty reason", p.Name())
	}
	return pos, d
}

// peerRoute picks and reports the request Routed where the policy chose.
func peerRoute(t testing.TB, p Policy, req *Request, rs []ReplicaView) int {
	t.Helper()
	pos, d := peerPick(t, p, req, rs)
	peerObserve(p, Event{Kind: Routed, At: req.Now, Req: req, Decision: d, Replica: d.Replica})
	return pos
}

func peerObserve(p Policy, ev Event) {
	if o, ok := p.(Observer); ok {
		o.Observe(ev)
	}
}

// peerText is seeded random text over a small alphabet, with a shared head
// among texts of the same family.
func peerText(r *rand.Rand, family, n int) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "system prompt of family %03d: ", family)
	for sb.Len() < n {
		sb.WriteByte(byte('a' + r.IntN(26)))
		if r.IntN(6) == 0 {
			sb.WriteByte(' ')
		}
	}
	return sb.String()[:n]
}

func TestPeersNoReplica(t *testing.T) {
	down := peerViews(3)
	for i := range down {
		down[i].Healthy = false
	}
	req := peerReq(1, strings.Repeat("x", 300), peerT0)
	req.Session = "s"
	for _, name := range peerPolicies {
		for _, rs := range [][]ReplicaView{nil, down} {
			if _, err := peerNew(t, name, nil).Pick(req, rs); !errors.Is(err, ErrNoReplica) {
				t.Errorf("%s with %d replicas, none healthy: err = %v, want ErrNoReplica", name, len(rs), err)
			}
		}
	}
}

// peerWorkload drives p through n requests over 8 replicas with varied
// loads, matches, metrics and health, and calls check on every decision.
func peerWorkload(t *testing.T, p Policy, seed uint64, n int, check func(rs []ReplicaView, d Decision)) []Decision {
	t.Helper()
	r := rand.New(rand.NewPCG(seed, 1))
	var out []Decision
	for k := range n {
		rs := peerViews(8)
		for i := range rs {
			rs[i].Healthy = r.IntN(3) != 0
			rs[i].InFlight = r.IntN(4) // small range: ties happen
			rs[i].InFlightTokens = rs[i].InFlight * 300
			rs[i].PendingPrefill = r.IntN(2) * 200
			rs[i].HaveMetrics = r.IntN(2) == 0
			rs[i].Waiting = r.IntN(3)
			rs[i].KVUsage = float64(r.IntN(4)) / 4
		}
		req := peerReq(uint64(k), peerText(r, r.IntN(4), 200+r.IntN(600)), peerT0.Add(time.Duration(k)*time.Second))
		if r.IntN(2) == 0 {
			req.Session = fmt.Sprintf("user-%d", r.IntN(5))
		}
		for i := range rs {
			rs[i].Match = r.IntN(len(req.Blocks) + 1)
		}
		d, err := p.Pick(req, rs)
		if errors.Is(err, ErrNoReplica) {
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v", p.Name(), err)
		}
		check(rs, d)
		out = append(out, d)
		peerObserve(p, Event{Kind: Routed, At: req.Now, Req: req, Decision: d, Replica: d.Replica})
		peerObserve(p, Event{Kind: Done, At: req.Now.Add(time.Second), Req: req, Replica: d.Replica, OutputTokens: 50})
	}
	return out
}

func TestPeersChooseOnlyHealthyAndAnswerTheSlot(t *testing.T) {
	for _, name := range peerPolicies {
		t.Run(name, func(t *testing.T) {
			chosen := map[int]bool{}
			ds := peerWorkload(t, peerNew(t, name, nil), 3, 300, func(rs []ReplicaView, d Decision) {
				pos := posOf(rs, d.Replica)
				if pos < 0 || !rs[pos].Healthy {
					t.Fatalf("chose slot %d: position %d, not a healthy replica", d.Replica, pos)
				}
				if d.Scores != nil && len(d.Scores) != len(rs) {
					t.Fatalf("%d scores for %d replicas", len(d.Scores), len(rs))
				}
				chosen[d.Replica] = true
			})
			if len(ds) < 200 {
				t.Fatalf("only %d decisions", len(ds))
			}
			if len(chosen) < 4 {
				t.Errorf("only %d distinct replicas chosen over %d decisions: %v", len(chosen), len(ds), chosen)
			}
		})
	}
}

func TestPeersDeterministicWithSeed(t *testing.T) {
	for _, name := range peerPolicies {
		t.Run(name, func(t *testing.T) {
			run := func(seed uint64) []Decision {
				p, err := New(name, Options{Seed: seed})
				if err != nil {
					t.Fatal(err)
				}
				return peerWorkload(t, p, 11, 150, func([]ReplicaView, Decision) {})
			}
			a, b := run(1), run(1)
			if !reflect.DeepEqual(a, b) {
				t.Fatalf("same seed, different decisions")
			}
		})
	}
	// Where ties are broken at random, another seed breaks them otherwise.
	for _, name := range []string{"dynamo", "llmd", "score", "precise", "preble"} {
		p1, _ := New(name, Options{Seed: 1})
		p2, _ := New(name, Options{Seed: 2})
		rs := peerViews(8)
		req := peerReq(1, "", peerT0)
		same := 0
		for range 50 {
			d1, _ := p1.Pick(req, rs)
			d2, _ := p2.Pick(req, rs)
			if d1.Replica == d2.Replica {
				same++
			}
		}
		if same == 50 {
			t.Errorf("%s: seeds 1 and 2 broke 50 eight-way ties the same way", name)
		}
	}
}

// TestPeersPickDoesNotMutate: Pick leaves its inputs and the policy's state
// alone: repeated Picks agree; only Observe(Routed) moves sglang, llmd and
// preble to another replica.
func TestPeersPickDoesNotMutate(t *testing.T) {
	for _, name := range peerPolicies {
		t.Run(name, func(t *testing.T) {
			p := peerNew(t, name, nil)
			peerWorkload(t, p, 5, 60, func([]ReplicaView, Decision) {})
			rs := peerViews(4)
			for i := range rs {
				rs[i].InFlight, rs[i].Match = i%2, 3+i
			}
			req := peerReq(99, peerText(rand.New(rand.NewPCG(9, 9)), 1, 2000), peerT0.Add(time.Hour))
			req.Session = "user-1"
			rs0 := append([]ReplicaView(nil), rs...)
			req0 := *req
			req0.Blocks = append([]uint64(nil), req.Blocks...)
			_, d0 := peerPick(t, p, req, rs)
			for range 5 {
				_, d := peerPick(t, p, req, rs)
				// Ties may break otherwise; what Pick computed may not change.
				if !reflect.DeepEqual(d.Scores, d0.Scores) || (d.Replica == d0.Replica && !reflect.DeepEqual(d, d0)) {
					t.Fatalf("repeated Pick changed: %+v then %+v", d0, d)
				}
				if deterministic := name != "dynamo" && name != "llmd" && name != "preble" && name != "score" && name != "precise"; deterministic && d.Replica != d0.Replica {
					t.Fatalf("repeated Pick moved from %d to %d", d0.Replica, d.Replica)
				}
			}
			if !reflect.DeepEqual(rs, rs0) || !reflect.DeepEqual(*req, req0) {
				t.Fatal("Pick modified its inputs")
			}
		})
	}
	// Without ties the answer itself repeats, until a Routed event:
	// sglang's tree and llmd's index learn that replica 1 holds the text;
	// preble's window learns that replica 0 did a large prefill.
	for _, name := range []string{"sglang", "llmd", "preble"} {
		t.Run(name+"/observe", func(t *testing.T) {
			p := peerNew(t, name, nil)
			rs := peerViews(2)
			rs[1].InFlight = 1                                    // sglang: replica 0 is least loaded
			rs[0].HaveMetrics, rs[1].HaveMetrics = true, true     // llmd: replica 0 wins the queue score
			rs[1].Waiting = 1                                     //
			small := peerReq(1, strings.Repeat("s", 100), peerT0) // preble: replica 1 carries a little work
			peerObserve(p, Event{Kind: Routed, At: peerT0, Req: small, Decision: Decision{Replica: rs[1].Index}, Replica: rs[1].Index})
			req := peerReq(2, strings.Repeat("shared prefix ", 100), peerT0)
			for range 4 {
				if pos, _ := peerPick(t, p, req, rs); pos != 0 {
					t.Fatalf("Pick chose %d, want 0 every time (no event between)", pos)
				}
			}
			to, want := 1, 1
			if name == "preble" {
				to = 0
			}
			_, d := peerPick(t, p, req, rs)
			peerObserve(p, Event{Kind: Routed, At: peerT0, Req: req, Decision: d, Replica: rs[to].Index})
			if pos, _ := peerPick(t, p, req, rs); pos != want {
				t.Fatalf("after Routed to %d: picked %d, want %d", to, pos, want)
			}
		})
	}
}

func TestPeersConcurrentPickObserve(t *testing.T) {
	for _, name := range peerPolicies {
		t.Run(name, func(t *testing.T) {
			p := peerNew(t, name, map[string]any(nil))
			var wg sync.WaitGroup
			errs := make(chan error, 4)
			for g := range 4 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(g), 2))
					for k := range 150 {
						rs := peerViews(6)
						for i := range rs {
							rs[i].InFlight = r.IntN(5)
							rs[i].Match = r.IntN(8)
						}
						at := peerT0.Add(time.Duration(k) * 100 * time.Millisecond)
						req := peerReq(uint64(g*1000+k), peerText(r, r.IntN(3), 300+r.IntN(300)), at)
						d, err := p.Pick(req, rs)
						if err != nil {
							errs <- err
							return
						}
						peerObserve(p, Event{Kind: Routed, At: at, Req: req, Decision: d, Replica: d.Replica})
						peerObserve(p, Event{Kind: FirstToken, At: at, Req: req, Replica: d.Replica, TTFT: time.Millisecond})
						peerObserve(p, Event{Kind: Done, At: at, Req: req, Replica: d.Replica, OutputTokens: 10})
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
		})
	}
}

// benchPrompt is a 32,000-character prompt; the policies' own structures
// hold 64 earlier prompts sharing its first half, spread over the replicas.
func BenchmarkPeersPick(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	head := peerText(r, 0, 16000)
	for _, name := range peerPolicies {
		b.Run(name, func(b *testing.B) {
			p := peerNew(b, name, nil)
			rs := peerViews(16)
			for i := range rs {
				rs[i].InFlight, rs[i].InFlightTokens = i%5, 8000*(i%5)
				rs[i].HaveMetrics, rs[i].Waiting, rs[i].KVUsage = true, i%3, float64(i%4)/4
			}
			for k := range 64 {
				req := peerReq(uint64(k), head+peerText(r, 1, 16000), peerT0)
				d, err := p.Pick(req, rs)
				if err != nil {
					b.Fatal(err)
				}
				peerObserve(p, Event{Kind: Routed, At: peerT0, Req: req, Decision: d, Replica: d.Replica})
			}
			req := peerReq(1000, head+peerText(r, 1, 16000), peerT0)
			req.Session = "user-1"
			for i := range rs {
				rs[i].Match = (i % 3) * len(req.Blocks) / 4
			}
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				if _, err := p.Pick(req, rs); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
