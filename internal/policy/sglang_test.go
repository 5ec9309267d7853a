package policy

import (
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// sgRouted tells p that text went to the replica at position pos at t.
func sgRouted(p Policy, rs []ReplicaView, pos int, text string, at time.Time) {
	req := peerReq(0, text, at)
	peerObserve(p, Event{Kind: Routed, At: at, Req: req, Decision: Decision{Replica: rs[pos].Index}, Replica: rs[pos].Index})
}

// TestSGLangDefaults pins the two sets of defaults: "cli", what the
// smg / sglang-router command line and sglang_router.launch_router give
// (sgl-model-gateway src/main.rs, bindings/python/.../router_args.py), and
// "library", the Rust CacheAwareConfig::default() (src/config/types.rs);
// a parameter given still overrides its own default; hard_cap_chars follows
// max_tree_size unless set.
func TestSGLangDefaults(t *testing.T) {
	cases := []struct {
		name   string
		params map[string]any
		want   sglangParams
	}{
		{"none: cli", nil, sglangParams{Defaults: "cli", CacheThreshold: 0.3, BalanceAbs: 64, BalanceRel: 1.5,
			EvictionIntervalSecs: 120, MaxTreeSize: 1 << 26, HardCapChars: 1<<26 + 1<<24}},
		{"cli named", map[string]any{"defaults": "cli"}, sglangParams{Defaults: "cli", CacheThreshold: 0.3, BalanceAbs: 64,
			BalanceRel: 1.5, EvictionIntervalSecs: 120, MaxTreeSize: 1 << 26, HardCapChars: 1<<26 + 1<<24}},
		{"library", map[string]any{"defaults": "library"}, sglangParams{Defaults: "library", CacheThreshold: 0.5, BalanceAbs: 32,
			BalanceRel: 1.1, EvictionIntervalSecs: 30, MaxTreeSize: 10000, HardCapChars: 10000 + 1<<24}},
		{"library, one override", map[string]any{"defaults": "library", "cache_threshold": 0.3}, sglangParams{Defaults: "library",
			CacheThreshold: 0.3, BalanceAbs: 32, BalanceRel: 1.1, EvictionIntervalSecs: 30, MaxTreeSize: 10000, HardCapChars: 10000 + 1<<24}},
		{"cli, Python's 60 s interval", map[string]any{"eviction_interval_secs": 60}, sglangParams{Defaults: "cli", CacheThreshold: 0.3,
			BalanceAbs: 64, BalanceRel: 1.5, EvictionIntervalSecs: 60, MaxTreeSize: 1 << 26, HardCapChars: 1<<26 + 1<<24}},
		{"hard cap follows max_tree_size", map[string]any{"max_tree_size": 1000}, sglangParams{Defaults: "cli", CacheThreshold: 0.3,
			BalanceAbs: 64, BalanceRel: 1.5, EvictionIntervalSecs: 120, MaxTreeSize: 1000, HardCapChars: 1000 + 1<<24}},
		{"hard cap set", map[string]any{"max_tree_size": 1000, "hard_cap_chars": 1000}, sglangParams{Defaults: "cli", CacheThreshold: 0.3,
			BalanceAbs: 64, BalanceRel: 1.5, EvictionIntervalSecs: 120, MaxTreeSize: 1000, HardCapChars: 1000}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := peerNew(t, "sglang", c.params).(*SGLang).params; got != c.want {
				t.Fatalf("params %+v, want %+v", got, c.want)
			}
		})
	}
	for _, bad := range []map[string]any{
		{"defaults": "lib"}, {"defaults": 1}, {"defaults": ""},
		{"max_tree_size": 1000, "hard_cap_chars": 999},
		{"defaults": "library", "hard_cap_chars": 9999},
	} {
		if _, err := New("sglang", Options{Params: bad}); !errors.Is(err, ErrParam) {
			t.Errorf("%v: err %v, want ErrParam", bad, err)
		}
	}
}

// TestSGLangBalanceThresholds: affinity is left for the least loaded
// replica exactly when BOTH (max − min) > balance_abs_threshold and max >
// balance_rel_threshold × min, over the healthy replicas (64 and 1.5 from
// the command line; 32 and 1.1 in the library). Replica 0 holds the prompt
// (match rate 1).
func TestSGLangBalanceThresholds(t *testing.T) {
	text := strings.Repeat("the cached system prompt. ", 20)
	lib := map[string]any{"defaults": "library"}
	cases := []struct {
		name   string
		params map[string]any
		loads  []int
		down   int // position of an unhealthy replica, -1 none
		want   int
	}{
		{"balanced", nil, []int{3, 2}, -1, 0},
		{"only abs crossed: 300-210 > 64, 300 < 1.5×210", nil, []int{300, 210}, -1, 0},
		{"only rel crossed: 60 > 1.5×2, 60-2 ≤ 64", nil, []int{60, 2}, -1, 0},
		{"both crossed", nil, []int{200, 100}, -1, 1},
		{"abs exactly 64 is not over", nil, []int{128, 64}, -1, 0},
		{"abs 65, rel crossed", nil, []int{129, 64}, -1, 1},
		{"rel exactly 1.5 is not over", nil, []int{300, 200}, -1, 0},
		{"rel just over", nil, []int{301, 200}, -1, 1},
		{"library thresholds cross where the cli's do not", lib, []int{100, 50}, -1, 1},
		{"library: only abs crossed: 400-367 > 32, 400 < 1.1×367", lib, []int{400, 367}, -1, 0},
		{"library: abs exactly 32 is not over", lib, []int{82, 50}, -1, 0},
		{"library: abs 33, rel crossed", lib, []int{83, 50}, -1, 1},
		{"library: rel exactly 1.1 is not over", lib, []int{374, 340}, -1, 0},
		{"library: rel just over", lib, []int{375, 340}, -1, 1},
		{"an unhealthy idle replica does not count", nil, []int{80, 70, 0}, 2, 0},
		{"imbalanced: the least loaded healthy one", nil, []int{200, 120, 100, 0}, 3, 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "sglang", c.params)
			rs := peerViews(len(c.loads))
			for i, l := range c.loads {
				rs[i].InFlight = l
			}
			if c.down >= 0 {
				rs[c.down].Healthy = false
			}
			sgRouted(p, rs, 0, text, peerT0)
			got, d := peerPick(t, p, peerReq(1, text, peerT0), rs)
			if got != c.want {
				t.Fatalf("loads %v: picked %d (%s), want %d", c.loads, got, d.Reason, c.want)
			}
		})
	}
}

// TestSGLangCacheThreshold: the holder wins only when matched characters /
// prompt characters > cache_threshold (0.3 from the command line, 0.5 in
// the library); else the least loaded (replica 1).
func TestSGLangCacheThreshold(t *testing.T) {
	lib := map[string]any{"defaults": "library"}
	cases := []struct {
		name, stored, prompt string
		params               map[string]any
		want                 int
		rate                 float64 // Scores[0]: bytes matched / bytes
	}{
		{"rate 0.3 is not over 0.3", strings.Repeat("A", 60) + strings.Repeat("B", 40),
			strings.Repeat("A", 30) + strings.Repeat("C", 70), nil, 1, 0.3},
		{"rate 0.31", strings.Repeat("A", 60) + strings.Repeat("B", 40),
			strings.Repeat("A", 31) + strings.Repeat("C", 69), nil, 0, 0.31},
		{"library: rate 0.5 is not over 0.5", strings.Repeat("A", 60) + strings.Repeat("B", 40),
			strings.Repeat("A", 50) + strings.Repeat("C", 50), lib, 1, 0.5},
		{"library: rate 0.51", strings.Repeat("A", 60) + strings.Repeat("B", 40),
			strings.Repeat("A", 51) + strings.Repeat("C", 49), lib, 0, 0.51},
		{"rate 0.3 under a 0.25 threshold", strings.Repeat("A", 30) + "B",
			strings.Repeat("A", 30) + strings.Repeat("C", 70), map[string]any{"cache_threshold": 0.25}, 0, 0.3},
		// 30 of 100 characters, but 60 of 130 bytes: characters count.
		{"characters, not bytes", strings.Repeat("é", 60),
			strings.Repeat("é", 30) + strings.Repeat("x", 70), nil, 1, 60.0 / 130},
		// The match stops inside "é" vs "ê" (same first byte): not a character.
		{"a half character is no match", strings.Repeat("a", 30) + "é",
			strings.Repeat("a", 30) + "ê" + strings.Repeat("z", 69), nil, 1, 31.0 / 101},
		// "é" and "ü" share their first byte: edges are told apart by character.
		{"a shared leading byte is no match", strings.Repeat("é", 40), strings.Repeat("ü", 40), nil, 1, 0},
		{"full match", "prompt", "prompt", nil, 0, 1},
		{"no match", "prompt", "other", nil, 1, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "sglang", c.params)
			rs := peerViews(2)
			rs[0].InFlight = 1
			sgRouted(p, rs, 0, c.stored, peerT0)
			got, d := peerPick(t, p, peerReq(1, c.prompt, peerT0), rs)
			if got != c.want {
				t.Errorf("picked %d (%s), want %d", got, d.Reason, c.want)
			}
			if d.Scores[0] != c.rate || d.Scores[1] != 0 {
				t.Errorf("scores %v, want [%v 0]", d.Scores, c.rate)
			}
		})
	}
}

// TestSGLangMissGoesToLeastLoaded: under the threshold, current upstream
// (cache_aware.rs, select_worker_with_text: min_by_key on load) takes the
// least loaded replica, not the one with the smallest tree as older
// sgl-router versions did: here replica 0 holds much text and is idle,
// replica 1 holds nothing and is busier.
func TestSGLangMissGoesToLeastLoaded(t *testing.T) {
	p := peerNew(t, "sglang", nil).(*SGLang)
	rs := peerViews(3)
	rs[1].InFlight, rs[2].InFlight = 1, 2
	for k := range 5 {
		sgRouted(p, rs, 0, strings.Repeat(string(rune('a'+k)), 500), peerT0)
	}
	sgRouted(p, rs, 2, "x", peerT0)
	if p.tree.chars[rs[0].Index] != 2500 || p.tree.chars[rs[1].Index] != 0 {
		t.Fatalf("tree sizes %v", p.tree.chars)
	}
	got, d := peerPick(t, p, peerReq(1, "a brand new prompt", peerT0), rs)
	if got != 0 || d.Reason != "match rate under the threshold: least loaded" {
		t.Fatalf("picked %d (%s), want 0, the least loaded", got, d.Reason)
	}
}

// TestSGLangDeepestHolder: the deepest matched node decides; among its
// holders the least loaded; unhealthy holders are skipped.
func TestSGLangDeepestHolder(t *testing.T) {
	a := strings.Repeat("a", 100)
	b := strings.Repeat("b", 100)
	cases := []struct {
		name    string
		stored  [][2]any // (position, text)
		loads   []int
		down    int
		want    int
		matched int // Decision.Matched: chars / 64
	}{
		{"deeper holder wins over a less loaded shallower one", [][2]any{{0, a}, {1, a + b}}, []int{0, 5, 0}, -1, 1, 200 / 64},
		{"two holders: the less loaded", [][2]any{{0, a + b}, {2, a + b}}, []int{5, 0, 3}, -1, 2, 200 / 64},
		{"two holders, equal load: the first", [][2]any{{2, a + b}, {0, a + b}}, []int{4, 0, 4}, -1, 0, 200 / 64},
		{"deepest holder down: the next deepest", [][2]any{{0, a + b[:60]}, {1, a + b}}, []int{0, 0, 0}, 1, 0, 160 / 64},
		{"split edge credits the partial match", [][2]any{{0, a + b + b}}, []int{1, 0, 0}, -1, 0, 200 / 64},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "sglang", nil)
			rs := peerViews(len(c.loads))
			for i, l := range c.loads {
				rs[i].InFlight = l
			}
			for k, st := range c.stored {
				sgRouted(p, rs, st[0].(int), st[1].(string), peerT0.Add(time.Duration(k)*time.Second))
			}
			if c.down >= 0 {
				rs[c.down].Healthy = false
			}
			got, d := peerPick(t, p, peerReq(1, a+b+"ccccc", peerT0), rs)
			if got != c.want || d.Matched != c.matched {
				t.Fatalf("picked %d matched %d (%s, scores %v), want %d matched %d", got, d.Matched, d.Reason, d.Scores, c.want, c.matched)
			}
		})
	}
}

// TestSGLangTies: the miss path takes the first least-loaded replica, as
// SGLang does; random_ties spreads them.
func TestSGLangTies(t *testing.T) {
	for _, c := range []struct {
		random   bool
		distinct int
	}{{false, 1}, {true, 4}} {
		p := peerNew(t, "sglang", map[string]any{"random_ties": c.random})
		rs := peerViews(4)
		seen := map[int]int{}
		for k := range 100 {
			pos, _ := peerPick(t, p, peerReq(uint64(k), "never seen", peerT0), rs)
			seen[pos]++
		}
		if len(seen) != c.distinct || (!c.random && seen[0] != 100) {
			t.Errorf("random_ties %v: choices %v, want %d distinct", c.random, seen, c.distinct)
		}
	}
}

// TestSGLangImbalancedStillInserts: the balance path's choice learns the text.
func TestSGLangImbalancedStillInserts(t *testing.T) {
	p := peerNew(t, "sglang", nil)
	rs := peerViews(2)
	text := strings.Repeat("hot prefix ", 30)
	sgRouted(p, rs, 0, text, peerT0)
	rs[0].InFlight = 100
	req := peerReq(1, text, peerT0)
	if got := peerRoute(t, p, req, rs); got != 1 {
		t.Fatalf("imbalanced: %d, want 1", got)
	}
	rs[0].InFlight, rs[1].InFlight = 3, 2
	if got, d := peerPick(t, p, req, rs); got != 1 || d.Scores[1] != 1 {
		t.Fatalf("balanced again: %d %v, want 1 holding the text", got, d.Scores)
	}
}

// TestSGLangPartitions: a text cached under another adapter is no match.
func TestSGLangPartitions(t *testing.T) {
	p := peerNew(t, "sglang", nil)
	rs := peerViews(2)
	rs[0].InFlight = 1
	text := strings.Repeat("adapter prompt ", 10)
	sgRouted(p, rs, 0, text, peerT0)
	req := peerReq(1, text, peerT0)
	req.Adapter = "lora-1"
	if got, d := peerPick(t, p, req, rs); got != 1 || d.Scores[0] != 0 {
		t.Fatalf("other adapter: %d %v, want 1 with no match", got, d.Scores)
	}
}

// TestSGLangCharCounts: a tenant's count is the characters of the nodes it
// holds; shared edges count once per tenant.
func TestSGLangCharCounts(t *testing.T) {
	p := peerNew(t, "sglang", nil).(*SGLang)
	rs := peerViews(2)
	pre := strings.Repeat("P", 30)
	sgRouted(p, rs, 0, pre+"xxxxxxxxxx", peerT0)
	sgRouted(p, rs, 0, pre+"yyyyyyyyyy", peerT0)
	sgRouted(p, rs, 1, pre+"xxxxx", peerT0)
	sgRouted(p, rs, 0, pre+"xxxxxxxxxx", peerT0) // again: nothing new
	if got, want := p.tree.chars[rs[0].Index], 50; got != want {
		t.Errorf("replica 0: %d chars, want %d", got, want)
	}
	if got, want := p.tree.chars[rs[1].Index], 35; got != want {
		t.Errorf("replica 1: %d chars, want %d", got, want)
	}
}

// TestSGLangEviction: once the interval has passed (event time), a tenant
// over max_tree_size loses its least recently used leaves until it fits; a
// tenant over hard_cap_chars is trimmed at once.
func TestSGLangEviction(t *testing.T) {
	texts := make([]string, 8)
	for i := range 6 {
		texts[i] = string(rune('A'+i)) + strings.Repeat("-", 39) // 40 chars, distinct first char
	}
	texts[6] = strings.Repeat("é", 40) // 40 chars, 80 bytes
	texts[7] = strings.Repeat("ü", 40)
	sec := func(s float64) time.Time { return peerT0.Add(time.Duration(s * float64(time.Second))) }
	type ins struct {
		text int
		at   float64
	}
	cases := []struct {
		name   string
		params map[string]any
		ins    []ins
		kept   []int // texts still matched afterwards
		chars  int
	}{
		// The command line's interval: 120 s.
		{"under the interval: nothing evicted", map[string]any{"max_tree_size": 100},
			[]ins{{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 119}}, []int{0, 1, 2, 3, 4}, 200},
		{"interval passed: oldest leaves go", map[string]any{"max_tree_size": 100},
			[]ins{{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 121}}, []int{3, 4}, 80},
		{"a re-routed text is recent again", map[string]any{"max_tree_size": 100},
			[]ins{{0, 0}, {1, 1}, {2, 2}, {3, 3}, {0, 4}, {4, 121}}, []int{0, 4}, 80},
		// The library's: 30 s.
		{"library: 29 s, nothing evicted", map[string]any{"defaults": "library", "max_tree_size": 100},
			[]ins{{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 29}}, []int{0, 1, 2, 3, 4}, 200},
		{"library: 31 s, oldest leaves go", map[string]any{"defaults": "library", "max_tree_size": 100},
			[]ins{{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 31}}, []int{3, 4}, 80},
		// Characters, not bytes: 40 "é" are 40 characters (80 bytes).
		{"characters counted", map[string]any{"max_tree_size": 100},
			[]ins{{6, 0}, {7, 1}, {0, 2}}, []int{6, 7, 0}, 120},
		{"characters counted, trimmed", map[string]any{"max_tree_size": 100},
			[]ins{{6, 0}, {7, 1}, {0, 2}, {1, 121}}, []int{0, 1}, 80},
		{"over the hard cap: trimmed at once", map[string]any{"max_tree_size": 100, "eviction_interval_secs": 1000, "hard_cap_chars": 200},
			[]ins{{0, 0}, {1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 5}}, []int{4, 5}, 80},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "sglang", c.params).(*SGLang)
			rs := peerViews(2)
			rs[1].InFlight = 1
			for _, in := range c.ins {
				sgRouted(p, rs, 0, texts[in.text], sec(in.at))
			}
			if got := p.tree.chars[rs[0].Index]; got != c.chars {
				t.Errorf("chars %d, want %d", got, c.chars)
			}
			for i, text := range texts {
				_, d := peerPick(t, p, peerReq(1, text, sec(200)), rs)
				held := d.Scores[0] == 1
				want := false
				for _, k := range c.kept {
					want = want || k == i
				}
				if held != want {
					t.Errorf("text %d held %v, want %v", i, held, want)
				}
			}
		})
	}
}

// TestSGLangEvictionKeepsSharedPrefix: evicting one branch leaves the
// shared edge for the other; evicting the tenant entirely empties the tree.
func TestSGLangEvictionKeepsSharedPrefix(t *testing.T) {
	p := peerNew(t, "sglang", map[string]any{"max_tree_size": 60, "eviction_interval_secs": 10}).(*SGLang)
	rs := peerViews(2)
	pre := strings.Repeat("P", 40)
	sgRouted(p, rs, 0, pre+strings.Repeat("x", 20), peerT0)
	sgRouted(p, rs, 0, pre+strings.Repeat("y", 20), peerT0.Add(time.Second))
	sgRouted(p, rs, 1, "other", peerT0.Add(11*time.Second)) // runs the eviction
	if got := p.tree.chars[rs[0].Index]; got != 60 {
		t.Fatalf("chars %d, want 60 (the x leaf evicted)", got)
	}
	_, d := peerPick(t, p, peerReq(1, pre+strings.Repeat("y", 20), peerT0), rs)
	if d.Scores[0] != 1 {
		t.Fatalf("y branch: score %v, want 1", d.Scores[0])
	}
	_, d = peerPick(t, p, peerReq(1, pre+strings.Repeat("x", 20), peerT0), rs)
	if d.Scores[0] != 40.0/60 {
		t.Fatalf("x branch: score %v, want 40/60 (the shared edge)", d.Scores[0])
	}

	q := peerNew(t, "sglang", map[string]any{"max_tree_size": 1, "eviction_interval_secs": 0}).(*SGLang)
	sgRouted(q, rs, 0, "abcdef", peerT0)
	if len(q.tree.roots) != 0 || len(q.tree.chars) != 0 {
		t.Fatalf("after evicting everything: %d roots, chars %v", len(q.tree.roots), q.tree.chars)
	}
}

func TestCountRunes(t *testing.T) {
	for _, s := range []string{"", "a", "abcdefgh", "abcdefghi", "é", "ééééééééé", "a€b𝄞c" + strings.Repeat("ü", 13), "日本語のテキスト、それと English."} {
		if got, want := countRunes(s), utf8.RuneCountInString(s); got != want {
			t.Errorf("countRunes(%q) = %d, want %d", s, got, want)
		}
	}
}

func TestCommonPrefix(t *testing.T) {
	cases := []struct {
		a, b string
		want int
	}{
		{"", "", 0}, {"abc", "", 0}, {"abc", "abd", 2}, {"abcdefgh", "abcdefgh", 8},
		{"abcdefghijklmnop", "abcdefghijklmnoX", 15}, {"abcdefghij", "abcdefgh", 8},
		{"abcdefgXijklmnop", "abcdefghijklmnop", 7}, {strings.Repeat("z", 100) + "a", strings.Repeat("z", 100) + "b", 100},
	}
	for _, c := range cases {
		if got := commonPrefix(c.a, c.b); got != c.want {
			t.Errorf("commonPrefix(%q, %q) = %d, want %d", c.a, c.b, got, c.want)
		}
	}
}
