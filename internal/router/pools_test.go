package router

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// poolPolicy is a pool's policy that records what it is asked and told:
// the candidates (Healthy views) of each Pick, and the replica of each
// event it observes.
type poolPolicy struct {
	policy.Policy
	candidates map[int]int // replica → times it was a candidate
	picks      int
	observed   map[policy.EventKind][]int
}

func newPoolPolicy(t *testing.T, name string) *poolPolicy {
	t.Helper()
	base, err := policy.New(name, policy.Options{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	return &poolPolicy{Policy: base, candidates: map[int]int{}, observed: map[policy.EventKind][]int{}}
}

func (p *poolPolicy) Pick(req *policy.Request, views []policy.ReplicaView) (policy.Decision, error) {
	p.picks++
	for _, v := range views {
		if v.Healthy {
			p.candidates[v.Index]++
		}
	}
	return p.Policy.Pick(req, views)
}

func (p *poolPolicy) Observe(ev policy.Event) {
	p.observed[ev.Kind] = append(p.observed[ev.Kind], ev.Replica)
	if o, ok := p.Policy.(policy.Observer); ok {
		o.Observe(ev)
	}
}

// twoPools is a router of pools llama (replicas 0, 1) and qwen (replica 2,
// listing an adapter of its base model), with their policies.
func twoPools(t *testing.T) (*Router, *poolPolicy, *poolPolicy) {
	t.Helper()
	llama, qwen := newPoolPolicy(t, "least_load"), newPoolPolicy(t, "ttft")
	top, _ := policy.New("round_robin", policy.Options{})
	rt, err := New(Config{
		Specs: []Spec{{URL: "http://a", Pool: "llama"}, {URL: "http://b", Pool: "llama"}, {URL: "http://c", Pool: "qwen"}},
		Pools: []Pool{
			{Name: "llama", Models: []string{"meta-llama/Llama-3.1-8B-Instruct", "llama-*"}, Policy: llama},
			{Name: "qwen", Models: []string{"Qwen/*"}, Policy: qwen},
		},
		Policy: top, Now: func() time.Time { return time.Unix(0, 0) },
	})
	if err != nil {
		t.Fatal(err)
	}
	rt.Replica(2).SetServed(NewServed([]Model{{ID: "Qwen/Qwen2.5-7B", Root: "Qwen/Qwen2.5-7B"},
		{ID: "support-lora", Parent: "Qwen/Qwen2.5-7B"}}, nil))
	return rt, llama, qwen
}

func request(rt *Router, model, text string) *policy.Request {
	return rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: model, Text: text, KeyText: text, MaxTokens: 8, Prompts: 1}, "", "")
}

func TestPoolsRouteEachModelToItsReplicasByItsPolicy(t *testing.T) {
	rt, llama, qwen := twoPools(t)
	seen := map[string]map[int]bool{}
	for i := range 12 {
		for _, model := range []string{"meta-llama/Llama-3.1-8B-Instruct", "llama-70b", "Qwen/Qwen2.5-7B", "support-lora"} {
			tk, err := rt.Route(request(rt, model, fmt.Sprintf("prompt %d of %s", i, model)))
			if err != nil {
				t.Fatalf("%s: %v", model, err)
			}
			if seen[model] == nil {
				seen[model] = map[int]bool{}
			}
			seen[model][tk.Replica] = true
			tk.FirstToken(time.Unix(1, 0))
			tk.Done(time.Unix(2, 0), Outcome{CachedTokens: -1})
		}
	}
	for model, want := range map[string]string{"meta-llama/Llama-3.1-8B-Instruct": "0 1", "llama-70b": "0 1",
		"Qwen/Qwen2.5-7B": "2", "support-lora": "2"} {
		var got []string
		for _, i := range []int{0, 1, 2} {
			if seen[model][i] {
				got = append(got, fmt.Sprint(i))
			}
		}
		if strings.Join(got, " ") != want {
			t.Errorf("%s went to replicas %v, want %s", model, got, want)
		}
	}
	// Each policy was asked for its pool's requests only, over its pool's
	// replicas only, and heard only its replicas' outcomes.
	if llama.picks != 24 || qwen.picks != 24 {
		t.Fatalf("picks: llama %d, qwen %d; want 24 each", llama.picks, qwen.picks)
	}
	if llama.candidates[2] != 0 || llama.candidates[0] != 24 || qwen.candidates[0]+qwen.candidates[1] != 0 || qwen.candidates[2] != 24 {
		t.Fatalf("candidates: llama %v, qwen %v", llama.candidates, qwen.candidates)
	}
	for _, k := range []policy.EventKind{policy.Routed, policy.FirstToken, policy.Done} {
		if !onlyIn(llama.observed[k], 0, 1) || len(llama.observed[k]) != 24 || !onlyIn(qwen.observed[k], 2) || len(qwen.observed[k]) != 24 {
			t.Fatalf("event %v: llama heard %v, qwen %v", k, llama.observed[k], qwen.observed[k])
		}
	}
	if name, ok := rt.PoolFor("support-lora"); !ok || name != "qwen" {
		t.Fatalf("PoolFor(support-lora) = %q %v, want qwen (its base model's pool)", name, ok)
	}
	if rt.Replica(0).Pool() != "llama" || strings.Join(rt.Pools(), ",") != "llama,qwen" {
		t.Fatalf("replica 0's pool %q, pools %v", rt.Replica(0).Pool(), rt.Pools())
	}
}

func onlyIn(got []int, allowed ...int) bool {
	for _, g := range got {
		if !containsInt(allowed, g) {
			return false
		}
	}
	return true
}

func TestPoolsUnmatchedModelIsNotServed(t *testing.T) {
	rt, llama, qwen := twoPools(t)
	req := request(rt, "mistral-7b", "hello")
	if _, err := rt.Route(req); !errors.Is(err, ErrModelNotServed) {
		t.Fatalf("Route: %v, want ErrModelNotServed", err)
	}
	if _, _, err := rt.Submit(req); !errors.Is(err, ErrModelNotServed) {
		t.Fatalf("Submit: %v, want ErrModelNotServed", err)
	}
	if _, err := rt.RoutePD(req); !errors.Is(err, ErrModelNotServed) {
		t.Fatalf("RoutePD: %v, want ErrModelNotServed", err)
	}
	if _, _, err := rt.DryRun(req); !errors.Is(err, ErrModelNotServed) {
		t.Fatalf("DryRun: %v, want ErrModelNotServed", err)
	}
	if rt.Serves("mistral-7b") || !rt.Serves("llama-3") || !rt.Serves("Qwen/Qwen2.5-7B") {
		t.Fatal("Serves: want only the pools' models")
	}
	// A Qwen model the qwen pool matches but its replica does not list.
	if _, err := rt.Route(request(rt, "Qwen/Qwen3-32B", "hello")); !errors.Is(err, ErrModelNotServed) {
		t.Fatalf("a model the pool's replicas do not serve: %v, want ErrModelNotServed", err)
	}
	if llama.picks+qwen.picks != 0 {
		t.Fatal("a policy was asked about a request no pool serves")
	}
	for i := range rt.Replicas() {
		if rt.InFlight(i) != 0 {
			t.Fatalf("replica %d counts a request never routed", i)
		}
	}
}

func TestPoolsRouteWithAndPDStayInThePool(t *testing.T) {
	rt, llama, _ := twoPools(t)
	byLoad, _ := policy.New("least_load", policy.Options{})
	// The qwen pool's replica is the emptiest: a load policy imposed by the
	// caller still sees only the llama pool's replicas, and llama's
	// observer hears the request.
	for range 4 {
		tk, err := rt.RouteWith(byLoad, request(rt, "llama-8b", "no prompt"))
		if err != nil || tk.Replica == 2 {
			t.Fatalf("RouteWith: replica %v, %v", tk, err)
		}
	}
	if len(llama.observed[policy.Routed]) != 4 {
		t.Fatalf("llama's observer heard %d Routed, want 4", len(llama.observed[policy.Routed]))
	}
	pd, err := rt.RoutePD(request(rt, "Qwen/Qwen2.5-7B", "a prompt"))
	if err != nil || pd.Decode.Replica != 2 || pd.Prefill != nil {
		t.Fatalf("RoutePD: %+v, %v; want replica 2 alone", pd, err)
	}
	d, views, err := rt.DryRun(request(rt, "llama-8b", "a prompt"))
	if err != nil || d.Replica == 2 || views[2].Healthy {
		t.Fatalf("DryRun: %+v, view of the other pool's replica healthy %v, %v", d, views[2].Healthy, err)
	}
}

func TestPoolsRemoteDecisionReachesThePoolsObserver(t *testing.T) {
	rt, llama, qwen := twoPools(t)
	rt.ApplyRemote(2, "Qwen/Qwen2.5-7B", 0, []uint64{1, 2}, 32, time.Unix(1, 0))
	rt.ApplyRemote(1, "llama-8b", 0, []uint64{3}, 16, time.Unix(1, 0))
	if fmt.Sprint(qwen.observed[policy.Routed]) != "[2]" || fmt.Sprint(llama.observed[policy.Routed]) != "[1]" {
		t.Fatalf("remote Routed: qwen heard %v, llama %v", qwen.observed[policy.Routed], llama.observed[policy.Routed])
	}
}

func TestPoolsQueuesAreIndependent(t *testing.T) {
	now := time.Unix(0, 0)
	def, free := &deferring{}, newPoolPolicy(t, "least_load")
	top, _ := policy.New("round_robin", policy.Options{})
	rt, err := New(Config{Specs: []Spec{{URL: "a", Pool: "busy"}, {URL: "b", Pool: "free"}},
		Pools:  []Pool{{Name: "busy", Models: []string{"m"}, Policy: def}, {Name: "free", Models: []string{"n"}, Policy: free}},
		Policy: top, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	first, w, err := rt.Submit(request(rt, "m", "first"))
	if err != nil || w != nil {
		t.Fatalf("first: %v %v", w, err)
	}
	_, w2, err := rt.Submit(request(rt, "m", "second"))
	if err != nil || w2 == nil {
		t.Fatalf("second was not queued behind the first's prefill: %v", err)
	}
	// The other pool routes at once while the busy pool's queue waits.
	tk, w3, err := rt.Submit(request(rt, "n", "other"))
	if err != nil || w3 != nil || tk.Replica != 1 {
		t.Fatalf("the free pool's request: %v %v %v", tk, w3, err)
	}
	if rt.Queued() != 1 {
		t.Fatalf("queued %d, want 1", rt.Queued())
	}
	// deferring counts every view's pending prefill, the other pool's too.
	tk.Done(now, Outcome{CachedTokens: -1})
	first.FirstToken(now) // releases the queue, synchronously
	select {
	case <-w2.Done():
	default:
		t.Fatal("the first token did not release the busy pool's queue")
	}
	if tk2, err := w2.Result(); err != nil || tk2.Replica != 0 {
		t.Fatalf("released: %v %v", tk2, err)
	}
}

func TestPoolsMembership(t *testing.T) {
	rt, _, qwen := twoPools(t)
	ch, err := rt.SetReplicas([]Spec{{URL: "http://a", Pool: "llama"}, {URL: "http://b", Pool: "llama"},
		{URL: "http://c", Pool: "qwen"}, {URL: "http://d", Pool: "qwen"}})
	if err != nil || len(ch.Added) != 1 {
		t.Fatalf("SetReplicas: %+v %v", ch, err)
	}
	rt.Replica(3).SetServed(NewServed([]Model{{ID: "Qwen/Qwen2.5-7B"}}, nil))
	for i := range 8 {
		if _, err := rt.Route(request(rt, "Qwen/Qwen2.5-7B", fmt.Sprint("q", i))); err != nil {
			t.Fatal(err)
		}
	}
	if qwen.candidates[3] == 0 || qwen.candidates[0] != 0 {
		t.Fatalf("the added qwen replica is no candidate of qwen, or llama's is: %v", qwen.candidates)
	}
	for _, bad := range [][]Spec{{{URL: "http://e", Pool: "mistral"}}, {{URL: "http://e"}}} {
		if _, err := rt.SetReplicas(bad); !errors.Is(err, ErrPool) {
			t.Fatalf("SetReplicas(%+v): %v, want ErrPool", bad, err)
		}
	}
	if rt.Replicas() != 4 {
		t.Fatal("a refused list changed the membership")
	}
}

func TestPoolsConfigErrors(t *testing.T) {
	p, _ := policy.New("least_load", policy.Options{})
	for name, cfg := range map[string]Config{
		"duplicate":    {Specs: []Spec{{URL: "a", Pool: "x"}}, Pools: []Pool{{Name: "x", Models: []string{"m"}, Policy: p}, {Name: "x", Models: []string{"n"}, Policy: p}}},
		"no models":    {Specs: []Spec{{URL: "a", Pool: "x"}}, Pools: []Pool{{Name: "x", Policy: p}}},
		"no name":      {Specs: []Spec{{URL: "a"}}, Pools: []Pool{{Models: []string{"m"}, Policy: p}}},
		"no policy":    {Specs: []Spec{{URL: "a", Pool: "x"}}, Pools: []Pool{{Name: "x", Models: []string{"m"}}}},
		"unknown pool": {Specs: []Spec{{URL: "a", Pool: "y"}}, Pools: []Pool{{Name: "x", Models: []string{"m"}, Policy: p}}},
		"no pool":      {Specs: []Spec{{URL: "a"}}, Pools: []Pool{{Name: "x", Models: []string{"m"}, Policy: p}}},
		"pool unset":   {Specs: []Spec{{URL: "a", Pool: "x"}}},
	} {
		cfg.Policy = p
		if _, err := New(cfg); !errors.Is(err, ErrPool) {
			t.Errorf("%s: %v, want ErrPool", name, err)
		}
	}
}

func TestGlob(t *testing.T) {
	for _, c := range []struct {
		pattern, s string
		want       bool
	}{
		{"Qwen/*", "Qwen/Qwen2.5-7B", true},
		{"Qwen/*", "qwen/x", false},
		{"llama-*", "llama-3/8b", true},
		{"*-instruct", "llama-3-instruct", true},
		{"*-instruct", "llama-3-base", false},
		{"a*b*c", "axxbyyc", true},
		{"a*b*c", "acb", false},
		{"ab*ba", "aba", false},
		{"*", "", true},
		{"m", "m", true},
	} {
		if got := glob(c.pattern, c.s); got != c.want {
			t.Errorf("glob(%q, %q) = %v", c.pattern, c.s, got)
		}
	}
}

// BenchmarkDecisionPools is BenchmarkDecision's decision (16 replicas, a
// 32,000-character prompt, an index of 2^20 entries) with the replicas in
// two pools of 8, the request's matched by a pattern after an exact name
// of the other pool: the pools' cost on the request path.
func BenchmarkDecisionPools(b *testing.B) {
	pa, _ := policy.New("ttft", policy.Options{Seed: 1})
	pb, _ := policy.New("ttft", policy.Options{Seed: 2})
	specs := make([]Spec, 16)
	for i := range specs {
		specs[i] = Spec{URL: "http://r" + string(rune('a'+i)), Pool: map[bool]string{true: "a", false: "b"}[i < 8]}
	}
	rt, err := New(Config{Specs: specs, Policy: pa, Now: func() time.Time { return time.Unix(0, 0) }, MaxEntries: 2 << 20, BlocksPerReplica: 1 << 20,
		Pools: []Pool{{Name: "a", Models: []string{"other"}, Policy: pa}, {Name: "b", Models: []string{"x-*", "m*"}, Policy: pb}}})
	if err != nil {
		b.Fatal(err)
	}
	benchDecision(b, rt, 13, func(d policy.Decision) bool { return d.Replica >= 8 })
}

// A ticket names the policy that decided it: its pool's, never the
// top-level one; RouteWith's own when given one.
func TestTicketNamesThePolicyThatDecided(t *testing.T) {
	rt, _, _ := twoPools(t)
	for model, want := range map[string]string{"llama-70b": "least_load", "Qwen/Qwen2.5-7B": "ttft", "support-lora": "ttft"} {
		tk, err := rt.Route(request(rt, model, "a prompt"))
		if err != nil {
			t.Fatal(err)
		}
		if tk.Policy() != want {
			t.Errorf("%s: decided by %q, want %q", model, tk.Policy(), want)
		}
		tk.Done(time.Unix(1, 0), Outcome{CachedTokens: -1})
	}
	rr, _ := policy.New("random", policy.Options{Seed: 1})
	tk, err := rt.RouteWith(rr, request(rt, "llama-70b", "by another policy"))
	if err != nil || tk.Policy() != "random" {
		t.Fatalf("RouteWith(random): %v, decided by %q", err, tk.Policy())
	}
	tk.Done(time.Unix(1, 0), Outcome{CachedTokens: -1})
}

// A prepared request carries its model's resolution (Request.Pool): it is
// routed in the pool it was resolved to, without looking its model up
// again, even when the listing that resolved it has changed since.
func TestPreparedRequestCarriesItsPool(t *testing.T) {
	rt, _, qwen := twoPools(t)
	m := rt.Resolve("support-lora") // an adapter: the pool of its base model
	if pool, ok := m.Pool(); !ok || pool != "qwen" || !m.Served() || m.Policy() != qwen {
		t.Fatalf("resolved to pool %q %v, served %v", pool, ok, m.Served())
	}
	req := rt.PrepareIn(m, &prompt.Parsed{Kind: prompt.Completion, Model: "support-lora", Text: "x", Prompts: 1}, "")
	// The listing changes: the adapter is now listed as a llama model's.
	rt.Replica(2).SetServed(NewServed([]Model{{ID: "Qwen/Qwen2.5-7B", Root: "Qwen/Qwen2.5-7B"},
		{ID: "support-lora", Parent: "llama-70b"}}, nil))
	if pool, _ := rt.PoolFor("support-lora"); pool != "llama" {
		t.Fatalf("a fresh lookup finds pool %q, want llama", pool)
	}
	tk, err := rt.Route(req)
	if err != nil || tk.Replica != 2 || tk.Policy() != "ttft" {
		t.Fatalf("routed %v, %v: want qwen's replica 2, as resolved", tk, err)
	}
	tk.Done(time.Unix(1, 0), Outcome{CachedTokens: -1})
	none := rt.Resolve("mistral-7b")
	if _, ok := none.Pool(); ok || none.Served() || none.Policy() != nil {
		t.Fatal("a model no pool routes resolved to one")
	}
	if _, err := rt.Route(rt.PrepareIn(none, &prompt.Parsed{Kind: prompt.Completion, Model: "mistral-7b", Text: "x", Prompts: 1}, "")); !errors.Is(err, ErrModelNotServed) {
		t.Fatalf("routing a model no pool routes: %v", err)
	}
}
