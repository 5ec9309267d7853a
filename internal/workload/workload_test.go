package workload

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
)

var root = prompt.Key{Model: "m"}.Root()

func hashes(text string) []uint64 {
	return prompt.ApproxBlockHashes(nil, root, text, prompt.DefaultBlockSize)
}

// sharedBlocks is the number of leading kvgate blocks two texts share.
func sharedBlocks(a, b string) int {
	ha, hb := hashes(a), hashes(b)
	n := 0
	for n < min(len(ha), len(hb)) && ha[n] == hb[n] {
		n++
	}
	return n
}

func gen(t *testing.T, name string, seed uint64, requests int, params map[string]float64) []Request {
	t.Helper()
	reqs, err := Generate(Spec{Name: name, Seed: seed, Requests: requests, Params: params})
	if err != nil {
		t.Fatalf("Generate %s: %v", name, err)
	}
	return reqs
}

// small makes each synthetic workload quick to generate and check.
var small = map[string]map[string]float64{
	"multiturn":         {"conversations": 5, "turns": 4, "system_prompt_len": 200, "user_len_min": 10, "user_len_max": 40, "output_len": 20},
	"shared_prefix":     {"groups": 4, "prompts_per_group": 5, "system_prompt_len": 300, "question_len": 30, "output_len": 7},
	"prefix_repetition": {"num_prefixes": 3, "prefix_len": 64, "suffix_len": 32, "output_len": 9},
	"zipf":              {"num_prefixes": 8, "prefix_len": 64, "suffix_len": 16, "output_len": 11},
	"random":            {"input_len": 100, "range_ratio": 0.5, "output_len": 13},
	"agents": {"programs": 6, "turns": 5, "system_prompt_len": 100, "task_len": 20, "tool_len": 30, "output_len": 16,
		"compact_at": 400, "summary_len": 50, "subagents": 0.5},
	"rl": {"batches": 3, "prompts": 4, "samples": 3, "system_prompt_len": 50, "prompt_len": 40, "output_len": 20},
}

// chatOnly are the workloads without a chat parameter (always chat);
// variableOutput those whose answers vary around output_len, within
// [1, 2 × output_len].
var (
	chatOnly       = map[string]bool{"multiturn": true, "agents": true}
	variableOutput = map[string]bool{"agents": true, "rl": true}
)

func synthetic() []string { return Names()[:len(Names())-1] }

func TestNamesAndParams(t *testing.T) {
	want := []string{"multiturn", "shared_prefix", "prefix_repetition", "zipf", "random", "agents", "rl", "trace"}
	if !slices.Equal(Names(), want) {
		t.Fatalf("Names() = %v", Names())
	}
	for _, n := range want {
		ps, err := ParamsOf(n)
		if err != nil || len(ps) == 0 {
			t.Fatalf("ParamsOf(%s): %v, %d params", n, err, len(ps))
		}
		for _, p := range ps {
			if p.Default < p.Min || p.Default > p.Max || p.Doc == "" {
				t.Errorf("%s.%s: default %g outside [%g, %g] or undocumented", n, p.Name, p.Default, p.Min, p.Max)
			}
		}
	}
	if _, err := ParamsOf("nope"); !errors.Is(err, ErrUnknownWorkload) {
		t.Fatalf("ParamsOf(nope) = %v", err)
	}
}

func TestParse(t *testing.T) {
	cases := []struct {
		in        string
		name      string
		path      string
		errSubstr string
	}{
		{in: "multiturn", name: "multiturn"},
		{in: " shared_prefix ", name: "shared_prefix"},
		{in: "prefix_repetition", name: "prefix_repetition"},
		{in: "zipf", name: "zipf"},
		{in: "random", name: "random"},
		{in: "trace:../x/y.jsonl", name: "trace", path: "../x/y.jsonl"},
		{in: "trace:C:/a:b.jsonl", name: "trace", path: "C:/a:b.jsonl"},
		{in: "trace:", errSubstr: "needs a file"},
		{in: "trace", errSubstr: "trace:PATH"},
		{in: "sharegpt", errSubstr: "want one of multiturn, shared_prefix, prefix_repetition, zipf, random, agents, rl, trace:FILE"},
		{in: "", errSubstr: "want one of"},
		{in: "Multiturn", errSubstr: "want one of"},
	}
	for _, c := range cases {
		t.Run(c.in, func(t *testing.T) {
			s, err := Parse(c.in)
			if c.errSubstr != "" {
				if !errors.Is(err, ErrUnknownWorkload) || !strings.Contains(err.Error(), c.errSubstr) {
					t.Fatalf("Parse(%q) = %v, want ErrUnknownWorkload containing %q", c.in, err, c.errSubstr)
				}
				return
			}
			if err != nil || s.Name != c.name || s.Path != c.path {
				t.Fatalf("Parse(%q) = %+v, %v", c.in, s, err)
			}
		})
	}
}

func TestSetParam(t *testing.T) {
	cases := []struct {
		workload, kv string
		name         string
		val          float64
		err          error
	}{
		{"multiturn", "conversations=64", "conversations", 64, nil},
		{"multiturn", " think_ms = 0 ", "think_ms", 0, nil},
		{"zipf", "exponent=0.8", "exponent", 0.8, nil},
		{"trace", "speedup=2.5", "speedup", 2.5, nil},
		{"multiturn", "conversation=64", "", 0, ErrUnknownParam},
		{"random", "prefix_len=5", "", 0, ErrUnknownParam},
		{"multiturn", "conversations=0", "", 0, ErrBadParam},
		{"multiturn", "conversations=1.5", "", 0, ErrBadParam},
		{"multiturn", "conversations=NaN", "", 0, ErrBadParam},
		{"multiturn", "conversations=1e9", "", 0, ErrBadParam},
		{"multiturn", "conversations", "", 0, ErrBadParam},
		{"multiturn", "=3", "", 0, ErrBadParam},
		{"multiturn", "turns=six", "", 0, ErrBadParam},
		{"random", "range_ratio=1", "", 0, ErrBadParam},
		{"trace", "speedup=0", "", 0, ErrBadParam},
		{"nope", "x=1", "", 0, ErrUnknownWorkload},
	}
	for _, c := range cases {
		t.Run(c.workload+"/"+c.kv, func(t *testing.T) {
			s := Spec{Name: c.workload}
			err := s.SetParam(c.kv)
			if c.err != nil {
				if !errors.Is(err, c.err) {
					t.Fatalf("SetParam(%q) = %v, want %v", c.kv, err, c.err)
				}
				return
			}
			if err != nil || s.Params[c.name] != c.val {
				t.Fatalf("SetParam(%q) = %v, params %v", c.kv, err, s.Params)
			}
		})
	}
	s := Spec{Name: "multiturn", Seed: 7, Requests: 10}
	_ = s.SetParam("turns=3")
	_ = s.SetParam("conversations=4")
	if got := s.String(); got != "multiturn conversations=4 turns=3 requests=10 seed=7" {
		t.Fatalf("String() = %q", got)
	}
}

// Same seed, same requests byte for byte; another seed, other text.
func TestDeterminism(t *testing.T) {
	for _, name := range synthetic() {
		t.Run(name, func(t *testing.T) {
			a := gen(t, name, 11, 0, small[name])
			b := gen(t, name, 11, 0, small[name])
			if !reflect.DeepEqual(a, b) {
				t.Fatal("same seed, different requests")
			}
			for i := range a {
				if a[i].Text() != b[i].Text() {
					t.Fatalf("request %d text differs", i)
				}
			}
			c := gen(t, name, 12, 0, small[name])
			same := 0
			for i := range a {
				if a[i].Text() == c[i].Text() {
					same++
				}
			}
			if same != 0 {
				t.Fatalf("seeds 11 and 12 give %d identical texts of %d", same, len(a))
			}
		})
	}
}

// The invariants every workload keeps: exact token counts, indexes,
// Prev links backwards, MaxTokens from the parameters.
func TestRequestInvariants(t *testing.T) {
	for _, name := range synthetic() {
		for _, chat := range []float64{0, 1} {
			params := map[string]float64{}
			for k, v := range small[name] {
				params[k] = v
			}
			if !chatOnly[name] {
				params["chat"] = chat
			} else if chat == 0 {
				continue
			}
			t.Run(fmt.Sprintf("%s/chat=%v", name, chat), func(t *testing.T) {
				reqs := gen(t, name, 3, 0, params)
				for i := range reqs {
					r := &reqs[i]
					text := r.Text()
					if r.Index != i {
						t.Fatalf("request %d has Index %d", i, r.Index)
					}
					if r.InputTokens != (prompt.Approx{}).Count(text) {
						t.Fatalf("request %d: InputTokens %d, text has %d", i, r.InputTokens, (prompt.Approx{}).Count(text))
					}
					if string(r.AppendText([]byte("x"))) != "x"+text {
						t.Fatalf("request %d: AppendText differs from Text", i)
					}
					if r.Chat != (chat == 1) {
						t.Fatalf("request %d: Chat %v with chat=%v", i, r.Chat, chat)
					}
					if r.Chat && text != prompt.RenderChat(parts(r)) || !r.Chat && text != r.Prompt {
						t.Fatalf("request %d: Text is not its prompt or rendered chat", i)
					}
					if r.Prev >= i || r.Prev < -1 {
						t.Fatalf("request %d: Prev %d", i, r.Prev)
					}
					if out := int(params["output_len"]); r.MaxTokens != out && (!variableOutput[name] || r.MaxTokens < 1 || r.MaxTokens > 2*out) {
						t.Fatalf("request %d: MaxTokens %d, want %v", i, r.MaxTokens, params["output_len"])
					}
					if r.HashIDs != nil {
						t.Fatalf("request %d: HashIDs set on a synthetic workload", i)
					}
					// Spec.Timed tells a load generator to send each request
					// when due (an open loop): it must say what the requests are.
					if r.Timed != (Spec{Name: name}).Timed() {
						t.Fatalf("request %d: Timed %v, Spec.Timed() %v", i, r.Timed, !r.Timed)
					}
				}
			})
		}
	}
}

func TestSizes(t *testing.T) {
	cases := []struct {
		name     string
		requests int
		params   map[string]float64
		want     int
	}{
		{"multiturn", 0, nil, 32 * 6},
		{"shared_prefix", 0, nil, 64 * 16},
		{"prefix_repetition", 0, nil, 1000},
		{"zipf", 0, nil, 1000},
		{"random", 0, nil, 1000},
		{"multiturn", 100, nil, 100},                                // 17 conversations, two cut short
		{"multiturn", 5, map[string]float64{"conversations": 8}, 5}, // only first turns
		{"shared_prefix", 37, nil, 37},
		{"shared_prefix", 20, map[string]float64{"groups": 2}, 20},
		{"prefix_repetition", 7, nil, 7},
		{"zipf", 3, nil, 3},
		{"random", 1, nil, 1},
	}
	for _, c := range cases {
		t.Run(fmt.Sprint(c.name, "/", c.requests, c.params), func(t *testing.T) {
			reqs := gen(t, c.name, 1, c.requests, c.params)
			if len(reqs) != c.want {
				t.Fatalf("%d requests, want %d", len(reqs), c.want)
			}
			for i, r := range reqs {
				if r.Index != i || r.Prev >= i || r.Prev < -1 {
					t.Fatalf("request %d: Index %d Prev %d", i, r.Index, r.Prev)
				}
				if r.Prev >= 0 && reqs[r.Prev].Session != r.Session {
					t.Fatalf("request %d follows %d of another session", i, r.Prev)
				}
			}
		})
	}
}

func TestMultiturn(t *testing.T) {
	params := map[string]float64{"conversations": 7, "turns": 5, "user_len_min": 30, "user_len_max": 60,
		"output_len": 25, "think_ms": 200, "system_prompt_len": 256}
	reqs := gen(t, "multiturn", 5, 0, params)
	if len(reqs) != 35 {
		t.Fatalf("%d requests", len(reqs))
	}
	turn := map[string]int{}
	inOrder := true
	for i := range reqs {
		r := &reqs[i]
		if r.Session != "conv-"+strconv.Itoa(i%7) {
			inOrder = false
		}
		k := turn[r.Session]
		turn[r.Session]++
		roles, contents := parts(r)
		if len(contents) != 2*k+2 || roles[0] != "system" || roles[len(roles)-1] != "user" {
			t.Fatalf("request %d (turn %d): roles %v", i, k, roles)
		}
		if u := len(contents[len(contents)-1]) / 4; u < 30 || u > 60 {
			t.Fatalf("request %d: user message of %d tokens", i, u)
		}
		if k == 0 {
			if r.Prev != -1 || r.Think != 0 {
				t.Fatalf("first turn %d: Prev %d Think %v", i, r.Prev, r.Think)
			}
			continue
		}
		p := &reqs[r.Prev]
		// Each round of 7 holds one turn of every conversation, in a shuffled order.
		if p.Session != r.Session || turn[p.Session] == 0 || r.Prev/7 != i/7-1 {
			t.Fatalf("request %d: Prev %d is not its conversation's previous turn", i, r.Prev)
		}
		if r.Think < 100*time.Millisecond || r.Think >= 300*time.Millisecond {
			t.Fatalf("request %d: think %v outside [100ms, 300ms)", i, r.Think)
		}
		reply := contents[len(contents)-2]
		if roles[len(roles)-2] != "assistant" || len(reply) != 4*25 {
			t.Fatalf("request %d: reply %q of %d bytes", i, roles[len(roles)-2], len(reply))
		}
		// Turn k+1 extends turn k's text with the reply and the next question.
		prev, cur := p.Text(), r.Text()
		withReply := prev + "<|assistant|>\n" + reply + "\n"
		if !strings.HasPrefix(cur, withReply) {
			t.Fatalf("request %d does not extend turn %d's text and reply", i, r.Prev)
		}
		if got, want := sharedBlocks(prev, cur), len(prev)/64; got != want {
			t.Fatalf("request %d shares %d blocks with its previous turn, want all %d", i, got, want)
		}
	}
	// One system prompt for all conversations: the first turns share its blocks.
	sys := len("<|system|>\n"+reqs[0].Messages[0].Content()) / 64
	if got := sharedBlocks(reqs[0].Text(), reqs[1].Text()); got < sys || got > sys+1 {
		t.Fatalf("conversations share %d blocks, want the system prompt's %d", got, sys)
	}
	if inOrder {
		t.Fatal("conversations are not interleaved within rounds: request i is always conversation i mod 7")
	}
}

func TestSharedPrefix(t *testing.T) {
	for _, chat := range []float64{1, 0} {
		t.Run(fmt.Sprint("chat=", chat), func(t *testing.T) {
			params := map[string]float64{"groups": 6, "prompts_per_group": 4, "system_prompt_len": 512,
				"question_len": 40, "chat": chat}
			reqs := gen(t, "shared_prefix", 9, 0, params)
			bySession := map[string][]string{}
			for i := range reqs {
				bySession[reqs[i].Session] = append(bySession[reqs[i].Session], reqs[i].Text())
			}
			if len(bySession) != 6 {
				t.Fatalf("%d groups", len(bySession))
			}
			sysBlocks := 512 * 4 / 64 // the system prompt's text is 2,048 bytes, 32 blocks
			var firsts []string
			for s, texts := range bySession {
				if len(texts) != 4 {
					t.Fatalf("group %s has %d prompts", s, len(texts))
				}
				for _, x := range texts[1:] {
					if got := sharedBlocks(texts[0], x); got < sysBlocks || got > sysBlocks+1 {
						t.Fatalf("group %s: prompts share %d blocks, want the system prompt's %d", s, got, sysBlocks)
					}
				}
				firsts = append(firsts, texts[0])
			}
			for i := range firsts {
				for j := i + 1; j < len(firsts); j++ {
					if got := sharedBlocks(firsts[i], firsts[j]); got != 0 {
						t.Fatalf("two groups share %d blocks", got)
					}
				}
			}
			// Shuffled: a group's prompts are not all adjacent.
			adjacent := 0
			for i := 1; i < len(reqs); i++ {
				if reqs[i].Session == reqs[i-1].Session {
					adjacent++
				}
			}
			if adjacent > len(reqs)/2 {
				t.Fatalf("%d of %d neighbours in the same group: not shuffled", adjacent, len(reqs))
			}
		})
	}
}

func TestPrefixRepetition(t *testing.T) {
	reqs := gen(t, "prefix_repetition", 4, 50, map[string]float64{"num_prefixes": 5, "prefix_len": 128, "suffix_len": 64})
	count := map[string]int{}
	first := map[string]string{}
	for i := range reqs {
		r := &reqs[i]
		count[r.Session]++
		if f, ok := first[r.Session]; ok {
			if got := sharedBlocks(f, r.Text()); got < 128/16 || got > 128/16+1 {
				t.Fatalf("same prefix, %d shared blocks, want %d", got, 128/16)
			}
		} else {
			for s, f := range first {
				if sharedBlocks(f, r.Text()) != 0 {
					t.Fatalf("prefixes %s and %s share blocks", s, r.Session)
				}
			}
			first[r.Session] = r.Text()
		}
	}
	for s, n := range count {
		if n != 10 {
			t.Fatalf("prefix %s used %d times, want 50/5 = 10", s, n)
		}
	}
}

func TestZipf(t *testing.T) {
	const n, np, s = 20000, 64, 1.1
	reqs := gen(t, "zipf", 8, n, map[string]float64{"num_prefixes": np, "exponent": s, "prefix_len": 16, "suffix_len": 16})
	count := map[string]int{}
	text := map[string]string{}
	for i := range reqs {
		r := &reqs[i]
		count[r.Session]++
		if prev, ok := text[r.Session]; ok && sharedBlocks(prev, r.Text()) != 1 {
			t.Fatalf("request %d: same prefix, not one shared block", i)
		}
		text[r.Session] = r.Text()
	}
	h := 0.0
	for k := 1; k <= np; k++ {
		h += math.Pow(float64(k), -s)
	}
	for _, k := range []int{1, 2, 3, 10} {
		p := math.Pow(float64(k), -s) / h
		got := float64(count[fmt.Sprint("prefix-", k-1)]) / n
		if tol := 5 * math.Sqrt(p*(1-p)/n); math.Abs(got-p) > tol {
			t.Errorf("rank %d drawn %.4f of the time, want %.4f ± %.4f", k, got, p, tol)
		}
	}
	// A heavy head: the top eighth of prefixes takes most requests.
	top := 0
	for k := 0; k < np/8; k++ {
		top += count[fmt.Sprint("prefix-", k)]
	}
	if share := float64(top) / n; share < 0.5 {
		t.Errorf("top %d prefixes take %.2f of requests, want > 0.5", np/8, share)
	}
	// Exponent 0 is uniform.
	flat := gen(t, "zipf", 8, 4000, map[string]float64{"num_prefixes": 4, "exponent": 0, "prefix_len": 16, "suffix_len": 16})
	fc := map[string]int{}
	for _, r := range flat {
		fc[r.Session]++
	}
	for s, c := range fc {
		if c < 900 || c > 1100 {
			t.Errorf("exponent 0: %s drawn %d of 4000", s, c)
		}
	}
}

func TestRandomNoSharing(t *testing.T) {
	reqs := gen(t, "random", 2, 2000, map[string]float64{"input_len": 64, "range_ratio": 0.5})
	firstBlock := map[uint64]int{}
	for i := range reqs {
		r := &reqs[i]
		if r.InputTokens < 32 || r.InputTokens > 96 {
			t.Fatalf("request %d: %d tokens outside [32, 96]", i, r.InputTokens)
		}
		h := hashes(r.Text())[0]
		if j, dup := firstBlock[h]; dup {
			t.Fatalf("requests %d and %d share their first block", j, i)
		}
		firstBlock[h] = i
		if r.Session != "" || r.Prev != -1 {
			t.Fatalf("request %d: session %q prev %d", i, r.Session, r.Prev)
		}
	}
}

func TestGenerateErrors(t *testing.T) {
	cases := []struct {
		name string
		spec Spec
		err  error
	}{
		{"unknown workload", Spec{Name: "sharegpt"}, ErrUnknownWorkload},
		{"unknown param", Spec{Name: "multiturn", Params: map[string]float64{"groups": 2}}, ErrUnknownParam},
		{"below min", Spec{Name: "random", Params: map[string]float64{"input_len": 0}}, ErrBadParam},
		{"not integer", Spec{Name: "zipf", Params: map[string]float64{"num_prefixes": 2.5}}, ErrBadParam},
		{"NaN", Spec{Name: "zipf", Params: map[string]float64{"exponent": math.NaN()}}, ErrBadParam},
		{"user range", Spec{Name: "multiturn", Params: map[string]float64{"user_len_min": 50, "user_len_max": 10}}, ErrBadParam},
		{"negative requests", Spec{Name: "random", Requests: -1}, ErrBadParam},
		{"groups too few", Spec{Name: "shared_prefix", Requests: 100, Params: map[string]float64{"groups": 2}}, ErrBadParam},
		{"too many requests", Spec{Name: "random", Requests: MaxRequests + 1}, ErrTooLarge},
		{"too many conversations", Spec{Name: "multiturn", Params: map[string]float64{"conversations": 1e7, "turns": 1000}}, ErrTooLarge},
		{"too much text", Spec{Name: "random", Requests: 3000, Params: map[string]float64{"input_len": 1 << 20}}, ErrTooLarge},
		{"too much shared text", Spec{Name: "shared_prefix", Params: map[string]float64{"groups": 1e5, "system_prompt_len": 1e5}}, ErrTooLarge},
		{"trace without file", Spec{Name: "trace"}, ErrBadParam},
		{"trace bad speedup", Spec{Name: "trace", Path: "x", Params: map[string]float64{"speedup": -1}}, ErrBadParam},
		{"trace param", Spec{Name: "trace", Path: "x", Params: map[string]float64{"rate": 1}}, ErrUnknownParam},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			reqs, err := Generate(c.spec)
			if !errors.Is(err, c.err) || reqs != nil {
				t.Fatalf("Generate(%+v) = %d requests, %v; want %v", c.spec, len(reqs), err, c.err)
			}
		})
	}
}

func TestArrivals(t *testing.T) {
	const n, rate = 20000, 50.0
	reqs := make([]Request, n)
	Arrivals(reqs, rate, 1)
	if reqs[0].At != 0 {
		t.Fatalf("first arrival at %v", reqs[0].At)
	}
	var sum, sum2 float64
	for i := 1; i < n; i++ {
		gap := (reqs[i].At - reqs[i-1].At).Seconds()
		if gap < 0 {
			t.Fatalf("arrival %d before %d", i, i-1)
		}
		sum += gap
		sum2 += gap * gap
	}
	mean := sum / (n - 1)
	sd := math.Sqrt(sum2/(n-1) - mean*mean)
	// The mean of n exponential gaps has relative sd 1/√n ≈ 0.7 %.
	if math.Abs(mean*rate-1) > 0.03 {
		t.Errorf("mean gap %.5f s, want %.5f ± 3 %%", mean, 1/rate)
	}
	// Exponential gaps: sd equals the mean (a fixed gap would give 0).
	if cv := sd / mean; cv < 0.95 || cv > 1.05 {
		t.Errorf("gap coefficient of variation %.3f, want ≈ 1", cv)
	}
	again := make([]Request, n)
	Arrivals(again, rate, 1)
	other := make([]Request, n)
	Arrivals(other, rate, 2)
	if !reflect.DeepEqual(reqs, again) || reflect.DeepEqual(reqs, other) {
		t.Fatal("arrivals not a function of the seed")
	}

	// Closed loop and trace requests.
	mixed := []Request{{At: time.Second}, {At: 5 * time.Second, HashIDs: []int{1}}, {At: time.Hour}}
	for _, rate := range []float64{0, -1, math.NaN()} {
		Arrivals(mixed, rate, 1)
		if mixed[0].At != 0 || mixed[2].At != 0 || mixed[1].At != 5*time.Second {
			t.Fatalf("rate %v: %v %v %v", rate, mixed[0].At, mixed[1].At, mixed[2].At)
		}
	}
	Arrivals(mixed, 1e-300, 1)
	if mixed[1].At != 5*time.Second || mixed[2].At <= 0 {
		t.Fatalf("tiny rate: %v %v (want the trace request kept and saturation, not overflow)", mixed[1].At, mixed[2].At)
	}
}

func BenchmarkGenerate(b *testing.B) {
	for _, name := range synthetic() {
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				if _, err := Generate(Spec{Name: name, Seed: 1}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// parts is a chat request's roles and contents, each content checked
// against its message's own.
func parts(r *Request) (roles, contents []string) {
	roles, contents = r.ChatParts(r.Text(), nil, nil)
	for i := range r.Messages {
		if contents[i] != r.Messages[i].Content() {
			panic(fmt.Sprintf("message %d: ChatParts gives %q, Content %q", i, contents[i], r.Messages[i].Content()))
		}
	}
	return roles, contents
}
