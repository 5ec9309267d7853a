package workload

import (
	"fmt"
	"math"
	"sort"
	"strconv"

	"github.com/kvgate/kvgate/internal/prompt"
)

// Common parameter ranges. Lengths are in tokens (4 bytes of text each).
const (
	maxLen        = 1 << 20
	msgOverhead   = 6 + len("assistant") // "<|" role "|>\n" … "\n", for the longest role
	defaultRandom = 1000                 // vLLM's --num-prompts default
)

func lenParam(name string, def float64, doc string) Param {
	return Param{Name: name, Default: def, Min: 1, Max: maxLen, Integer: true, Doc: doc}
}

func chatParam(def float64) Param {
	return Param{Name: "chat", Default: def, Min: 0, Max: 1, Integer: true,
		Doc: "1: /v1/chat/completions messages; 0: /v1/completions prompt"}
}

func countParam(name string, def, max float64, doc string) Param {
	return Param{Name: name, Default: def, Min: 1, Max: max, Integer: true, Doc: doc}
}

// generators is the registry, in the order Names lists them. Read-only.
var generators = [...]generator{
	{
		name:   "multiturn",
		doc:    "conversations × turns; each turn appends the previous reply and a new user message to its history",
		domain: 1,
		params: []Param{
			countParam("conversations", 32, 1e7, "number of conversations"),
			countParam("turns", 6, 1000, "user turns per conversation"),
			lenParam("system_prompt_len", 1024, "tokens of the system prompt opening every conversation (shared: see system_prompts)"),
			countParam("system_prompts", 1, 1e7, "distinct system prompts, conversation c taking prompt c mod this "+
				"(conversations: each its own, nothing shared between them)"),
			lenParam("user_len_min", 100, "fewest tokens of a user message"),
			lenParam("user_len_max", 200, "most tokens of a user message"),
			lenParam("output_len", 128, "output tokens per turn; the next turn carries a reply of this many"),
			{Name: "think_ms", Default: 300, Min: 0, Max: 3.6e6,
				Doc: "mean think time between a reply and the next turn, uniform in [0.5, 1.5]× this"},
		},
		plan: planMultiturn,
	},
	{
		name:   "shared_prefix",
		doc:    "groups of prompts sharing a long system prompt (SGLang's generated-shared-prefix), shuffled",
		domain: 2,
		params: []Param{
			countParam("groups", 64, 1e7, "number of system prompts"),
			countParam("prompts_per_group", 16, 1e6, "questions per system prompt"),
			lenParam("system_prompt_len", 2048, "tokens of each group's system prompt"),
			lenParam("question_len", 128, "tokens of each question"),
			lenParam("output_len", 256, "output tokens"),
			chatParam(1),
		},
		plan: planSharedPrefix,
	},
	{
		name:   "prefix_repetition",
		doc:    "vLLM's prefix_repetition: num_prefixes random prefixes, each request one of them plus a unique suffix, shuffled",
		domain: 3,
		params: []Param{
			countParam("num_prefixes", 10, 1e6, "number of distinct prefixes, used in turn"),
			lenParam("prefix_len", 256, "tokens of each prefix"),
			lenParam("suffix_len", 256, "tokens of each request's unique suffix"),
			lenParam("output_len", 128, "output tokens"),
			chatParam(0),
		},
		plan: planPrefixRepetition,
	},
	{
		name:   "zipf",
		doc:    "a pool of prefixes drawn with Zipf popularity (heavy head), each request with a unique suffix",
		domain: 4,
		params: []Param{
			countParam("num_prefixes", 64, 1e6, "size of the prefix pool"),
			{Name: "exponent", Default: 1.1, Min: 0, Max: 10, Doc: "Zipf exponent s: P(rank k) ∝ k^-s"},
			lenParam("prefix_len", 1024, "tokens of each prefix"),
			lenParam("suffix_len", 128, "tokens of each request's unique suffix"),
			lenParam("output_len", 128, "output tokens"),
			chatParam(0),
		},
		plan: planZipf,
	},
	{
		name:   "random",
		doc:    "independent random prompts, no sharing (vLLM's random dataset)",
		domain: 5,
		params: []Param{
			lenParam("input_len", 1024, "mean prompt tokens"),
			lenParam("output_len", 128, "output tokens"),
			{Name: "range_ratio", Default: 0, Min: 0, Max: 0.99,
				Doc: "prompt lengths uniform in [input_len·(1−r), input_len·(1+r)]"},
			chatParam(0),
		},
		plan: planRandom,
	},
	agentsGenerator,
	rlGenerator,
}

var traceParams = []Param{
	{Name: "speedup", Default: 1, Min: 1e-3, Max: 1e6, Doc: "arrival times are the trace's timestamps divided by this"},
	{Name: "spread", Default: 0, Min: 0, Max: 3600, Doc: "seconds: each arrival moves to a seeded uniform instant this long after its " +
		"timestamp (before speedup), for traces whose timestamps are coarse (the Mooncake conversation trace: ~10 requests per instant)"},
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// groupsFor sizes a grouped workload: groups of size each. With a request
// count, the group count follows from it unless the user set it, in which
// case the groups must hold that many requests.
func groupsFor(p params, groupParam string, size, requests int) (groups, n int, err error) {
	groups = p.int(groupParam)
	if requests == 0 {
		return groups, groups * size, nil
	}
	if !p.set[groupParam] {
		return ceilDiv(requests, size), requests, nil
	}
	if groups*size < requests {
		return 0, 0, fmt.Errorf("%w: %d requests but %s=%d hold only %d; raise %s or drop it",
			ErrBadParam, requests, groupParam, groups, groups*size, groupParam)
	}
	return groups, requests, nil
}

// oneOrChat builds a single-prompt request: a completion of text or a chat
// whose one user message is text.
func oneOrChat(chat bool, text string) Request {
	if chat {
		m := []Message{heldMsg("user", text)}
		return Request{Prev: -1, Chat: true, Messages: m, InputTokens: ceilDiv(renderLen(m), prompt.TokenBytesPer)}
	}
	return Request{Prev: -1, Prompt: text, InputTokens: ceilDiv(len(text), prompt.TokenBytesPer)}
}

// planMultiturn: conversation c's turn k is request k·C + c (turn-major), so
// that every conversation is under way at once, as with many users, and a
// cut to the first Requests keeps whole early turns. Turn k's messages are
// the shared system prompt, then user/assistant pairs, then user k; the
// assistant replies are generated here, so the sequence does not depend on
// what replicas answer, and turn k+1's text extends turn k's.
func planMultiturn(p params, requests int) (plan, error) {
	t := p.int("turns")
	sys, umin, umax, out := p.int("system_prompt_len"), p.int("user_len_min"), p.int("user_len_max"), p.int("output_len")
	if umax < umin {
		return plan{}, fmt.Errorf("%w: multiturn user_len_max=%d is below user_len_min=%d", ErrBadParam, umax, umin)
	}
	c, n, err := groupsFor(p, "conversations", t, requests)
	if err != nil {
		return plan{}, err
	}
	// Σ len(Text()): the whole conversations, or n last turns, whichever is less.
	ft := float64(t)
	perConv := ft*float64(4*sys+msgOverhead) + ft*(ft+1)/2*float64(4*umax+msgOverhead) +
		ft*(ft-1)/2*float64(4*out+msgOverhead)
	lastTurn := float64(4*sys+msgOverhead) + ft*float64(4*umax+msgOverhead) + (ft-1)*float64(4*out+msgOverhead)
	textBytes := min(float64(c)*perConv, float64(n)*lastTurn)
	think := p.f("think_ms")
	systems := p.int("system_prompts")
	gen := func(r *rng, n int) []Request {
		// Prompt j's words are seeded from the first's seed, so that one
		// system prompt (the default) draws what it always drew.
		base := r.uint64()
		system := systemPrompts(base, systems, sys, heldSystemBytes)
		reqs := make([]Request, n)
		for conv := 0; conv < c && conv < n; conv++ {
			turns := min(t, ceilDiv(n-conv, c)) // turns of this conversation within the first n
			// The turns share one array of messages, each its prefix; the
			// user messages and replies are seeds, their text made when a
			// turn is sent.
			msgs := make([]Message, 2*turns)
			msgs[0] = system(conv % systems)
			size := renderLen(msgs[:1])
			session := "conv-" + strconv.Itoa(conv)
			for k := 0; k < turns; k++ {
				seed := r.uint64()
				msgs[2*k+1] = wordsMsg("user", seed, r.between(umin, umax))
				size += renderLen(msgs[2*k+1 : 2*k+2])
				idx := k*c + conv
				req := Request{Index: idx, Prev: -1, Session: session, Program: conv + 1, Chat: true,
					Messages: msgs[: 2*k+2 : 2*k+2], MaxTokens: out, InputTokens: ceilDiv(size, prompt.TokenBytesPer)}
				if k > 0 {
					req.Prev = idx - c
					req.Think = seconds(think * (0.5 + r.float64()) / 1000)
				}
				reqs[idx] = req
				if k+1 < turns {
					msgs[2*k+2] = wordsMsg("assistant", r.uint64(), out)
					size += renderLen(msgs[2*k+2 : 2*k+3])
				}
			}
		}
		return interleave(r, reqs, c)
	}
	return plan{n: n, made: float64(n), textBytes: textBytes, gen: gen}, nil
}

// heldSystemBytes bounds the system prompts' text a generator holds: up to
// it each distinct prompt is made once and shared by every request that
// sends it; past it (a prompt per conversation, say) each is made on
// demand like the rest of the conversation.
const heldSystemBytes = 64 << 20

// systemPrompts returns system prompt j of n, each of tokens tokens: prompt
// 0 is Words(base, tokens), prompt j Words(base + j·φ·2⁶⁴, tokens); held
// when all n fit in limit bytes (heldSystemBytes), else made on demand.
func systemPrompts(base uint64, n, tokens, limit int) func(j int) Message {
	seed := func(j int) uint64 { return base + uint64(j)*0x9e3779b97f4a7c15 }
	if n*tokens*prompt.TokenBytesPer > limit {
		return func(j int) Message { return wordsMsg("system", seed(j), tokens) }
	}
	held := make([]string, n)
	return func(j int) Message {
		if held[j] == "" {
			held[j] = Words(seed(j), tokens)
		}
		return heldMsg("system", held[j])
	}
}

// interleave puts the conversations of each round of c requests (one turn
// of every conversation) in a seeded random order and renumbers Index and
// Prev to match. Without it conversation i's turns would all sit at index
// i modulo c, and round robin over a replica count dividing c would keep
// every conversation on one replica by accident, which real traffic never
// does.
func interleave(r *rng, reqs []Request, c int) []Request {
	n := len(reqs)
	pos := make([]int, n) // old index → new index
	for start := 0; start < n; start += c {
		end := min(start+c, n)
		order := make([]int, end-start)
		for j := range order {
			order[j] = start + j
		}
		r.shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
		for j, old := range order {
			pos[old] = start + j
		}
	}
	out := make([]Request, n)
	for old, q := range reqs {
		q.Index = pos[old]
		if q.Prev >= 0 {
			q.Prev = pos[q.Prev]
		}
		out[q.Index] = q
	}
	return out
}

// planSharedPrefix: groups × prompts_per_group prompts, each a group's
// system prompt and a unique question, shuffled (Fisher–Yates) so that a
// group's prompts arrive spread over the run, as SGLang's benchmark does.
func planSharedPrefix(p params, requests int) (plan, error) {
	per := p.int("prompts_per_group")
	sys, q, out, chat := p.int("system_prompt_len"), p.int("question_len"), p.int("output_len"), p.int("chat") == 1
	g, n, err := groupsFor(p, "groups", per, requests)
	if err != nil {
		return plan{}, err
	}
	made := float64(g) * float64(per)
	gen := func(r *rng, n int) []Request {
		all := make([]Request, 0, g*per)
		for gi := 0; gi < g; gi++ {
			system := Words(r.uint64(), sys)
			session := "group-" + strconv.Itoa(gi)
			for j := 0; j < per; j++ {
				question := r.uint64() // the seed of its words
				req := Request{Prev: -1, Session: session, MaxTokens: out}
				if chat {
					req.Chat, req.Messages = true, []Message{heldMsg("system", system), wordsMsg("user", question, q)}
					req.InputTokens = ceilDiv(renderLen(req.Messages), prompt.TokenBytesPer)
				} else {
					req.Prompt = system + Words(question, q)
					req.InputTokens = ceilDiv(len(req.Prompt), prompt.TokenBytesPer)
				}
				all = append(all, req)
			}
		}
		r.shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
		return index(all[:n:n])
	}
	return plan{n: n, made: made, textBytes: made * float64(4*(sys+q)+2*msgOverhead), gen: gen}, nil
}

// planPrefixRepetition is vLLM's PrefixRepetitionRandomDataset: num_prefixes
// prefixes, request i uses prefix i mod num_prefixes (so every count is
// exact, where vLLM drops the remainder) with its own suffix, then shuffled.
func planPrefixRepetition(p params, requests int) (plan, error) {
	np, pl, sl, out, chat := p.int("num_prefixes"), p.int("prefix_len"), p.int("suffix_len"), p.int("output_len"), p.int("chat") == 1
	n := requests
	if n == 0 {
		n = defaultRandom
	}
	used := min(np, n)
	gen := func(r *rng, n int) []Request {
		prefixes := make([]string, used)
		for i := range prefixes {
			prefixes[i] = Words(r.uint64(), pl)
		}
		reqs := make([]Request, n)
		for i := range reqs {
			k := i % used
			reqs[i] = oneOrChat(chat, prefixes[k]+Words(r.uint64(), sl))
			reqs[i].Session = "prefix-" + strconv.Itoa(k)
			reqs[i].MaxTokens = out
		}
		r.shuffle(n, func(i, j int) { reqs[i], reqs[j] = reqs[j], reqs[i] })
		return index(reqs)
	}
	return plan{n: n, made: float64(n), textBytes: float64(n) * float64(4*(pl+sl)+msgOverhead), gen: gen}, nil
}

// planZipf draws each request's prefix from a pool of num_prefixes with
// P(rank k) ∝ k^-s (Zipf), by inverse transform sampling: a uniform draw
// searched in the normalised cumulative weights. A prefix's text is made the
// first time it is drawn, so an unpopular tail costs nothing.
func planZipf(p params, requests int) (plan, error) {
	np, pl, sl, out, chat := p.int("num_prefixes"), p.int("prefix_len"), p.int("suffix_len"), p.int("output_len"), p.int("chat") == 1
	s := p.f("exponent")
	n := requests
	if n == 0 {
		n = defaultRandom
	}
	gen := func(r *rng, n int) []Request {
		cdf := zipfCDF(np, s)
		seeds := make([]uint64, np)
		for i := range seeds {
			seeds[i] = r.uint64()
		}
		prefixes := make([]string, np)
		reqs := make([]Request, n)
		for i := range reqs {
			k := sort.SearchFloat64s(cdf, r.float64()) // first k with cdf[k] ≥ u
			k = min(k, np-1)                           // u beyond a rounded-down total
			if prefixes[k] == "" {
				prefixes[k] = Words(seeds[k], pl)
			}
			reqs[i] = oneOrChat(chat, prefixes[k]+Words(r.uint64(), sl))
			reqs[i].Index = i
			reqs[i].Session = "prefix-" + strconv.Itoa(k)
			reqs[i].MaxTokens = out
		}
		return reqs
	}
	return plan{n: n, made: float64(n), textBytes: float64(n) * float64(4*(pl+sl)+msgOverhead), gen: gen}, nil
}

// zipfCDF returns the cumulative Zipf weights k^-s, k = 1..n, normalised so
// that the last is 1.
func zipfCDF(n int, s float64) []float64 {
	cdf := make([]float64, n)
	sum := 0.0
	for k := range cdf {
		sum += math.Pow(float64(k+1), -s)
		cdf[k] = sum
	}
	for k := range cdf {
		cdf[k] /= sum
	}
	return cdf
}

// planRandom is vLLM's random dataset: independent prompts of
// input_len·[1−r, 1+r] tokens, nothing shared beyond chance.
func planRandom(p params, requests int) (plan, error) {
	in, out, rr, chat := p.f("input_len"), p.int("output_len"), p.f("range_ratio"), p.int("chat") == 1
	lo, hi := max(1, int(in*(1-rr))), max(1, int(in*(1+rr)))
	n := requests
	if n == 0 {
		n = defaultRandom
	}
	gen := func(r *rng, n int) []Request {
		reqs := make([]Request, n)
		for i := range reqs {
			reqs[i] = oneOrChat(chat, Words(r.uint64(), r.between(lo, hi)))
			reqs[i].Index = i
			reqs[i].MaxTokens = out
		}
		return reqs
	}
	return plan{n: n, made: float64(n), textBytes: float64(n) * float64(4*hi+msgOverhead), gen: gen}, nil
}

// index numbers requests by position.
func index(reqs []Request) []Request {
	for i := range reqs {
		reqs[i].Index = i
	}
	return reqs
}
