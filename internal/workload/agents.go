package workload

import (
	"fmt"
	"math"
	"strconv"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
)

// Programs: the agents and rl workloads (issue 27). Their requests are
// Timed: a program starts at its own Poisson arrival (program_rate, not
// --rate), and every later request is sent Think after what it waits for
// (Prev, or the previous batch: Batch), so Arrivals leaves them alone.

// The agents workload's shape, from what is measured of coding agents, and
// how it is scaled so that a replay of the default workload on 8 replicas
// takes seconds (8,348 requests, 400 programs and 160 subagents at seed 1):
//
//   - vLLM's AgentX traces: median 43 turns per session, median input
//     142k tokens, output 444, prefix reuse above 96 %, subagents in 44 % of
//     sessions. Here: turns lognormal around a median of 16 (σ 0.5),
//     contexts growing by a tool result (lognormal, median 1,200 tokens,
//     σ 1, at most 8,000) and an answer (256 tokens ± 50 %) per turn from a
//     4,000-token shared system prompt: a median final context of 29k
//     tokens (p90 51k), a mean prompt of 21k, about a fifth of AgentX's, so
//     that about 16 programs at their end fill a default replica's 480k
//     tokens of KV (of AgentX's, about 3 would); subagents in 44 % of
//     programs.
//   - vllm-router #285: 86 % of a program's next calls arrive within 1 s
//     of the previous answer, 95 % within 10 s. Here: a tool pause is
//     log-uniform in [50 ms, 1 s] with probability 0.86, in [1 s, 10 s]
//     with 0.09, in [10 s, 60 s] with 0.05.
//   - compaction (as coding agents do near their context limit): once a
//     context passes compact_at tokens, the next turn starts over from the
//     system prompt, the task and a summary of summary_len tokens.
//   - a subagent is a program of its own (its own id: a subagent's
//     session, as Dynamo's and Claude Code's headers name it), with the
//     shared subagent system prompt, a task from its parent, and turns
//     lognormal around a median of 6; its parent's next turn waits for its
//     last answer and reads it as a tool result.
const (
	agentPause1s   = 0.86 // vllm-router #285: next call within 1 s
	agentPause10s  = 0.95 // … within 10 s
	agentTurnSigma = 0.5
	agentToolSigma = 1.0
	agentToolMax   = 8000
	subagentTurns  = 6
	subagentSystem = 1500 // tokens of the subagents' shared system prompt
	subagentTask   = 200
	subagentResult = 400 // tokens of a subagent's answer its parent reads
)

var agentsGenerator = generator{
	name:   "agents",
	timed:  true,
	doc:    "coding-agent programs: a shared system prompt, a task, then tool results and answers appended each turn, with tool pauses, compaction and subagents",
	domain: 6,
	params: []Param{
		countParam("programs", 400, 1e6, "number of agent programs (subagents come on top); with --requests, programs are made until there are that many"),
		{Name: "program_rate", Default: 1, Min: 1e-6, Max: 1e6, Doc: "Poisson arrival rate of programs per second (--rate does not apply)"},
		countParam("turns", 16, 1000, "median turns of a program (lognormal, σ 0.5, at most 4× this)"),
		lenParam("system_prompt_len", 4000, "tokens of the agents' shared system prompt (and tool definitions)"),
		lenParam("task_len", 300, "mean tokens of a program's task (± 50 %)"),
		lenParam("tool_len", 1200, "median tokens of a tool result (lognormal, σ 1, at most 8,000)"),
		lenParam("output_len", 256, "mean tokens of an answer (± 50 %)"),
		lenParam("compact_at", 60000, "context (tokens) past which the next turn is compacted"),
		lenParam("summary_len", 2000, "tokens of the summary a compacted context keeps"),
		{Name: "subagents", Default: 0.44, Min: 0, Max: 1, Doc: "share of programs that start one subagent (AgentX: 44 %)"},
	},
	plan: planAgents,
}

// agentParams are the agents workload's parameters, resolved.
type agentParams struct {
	programs, turns, sys, task, tool, out, compactAt, summary int
	rate, subagents                                           float64
}

func planAgents(p params, requests int) (plan, error) {
	a := agentParams{programs: p.int("programs"), turns: p.int("turns"), sys: p.int("system_prompt_len"),
		task: p.int("task_len"), tool: p.int("tool_len"), out: p.int("output_len"), compactAt: p.int("compact_at"),
		summary: p.int("summary_len"), rate: p.f("program_rate"), subagents: p.f("subagents")}
	if a.summary >= a.compactAt {
		return plan{}, fmt.Errorf("%w: agents summary_len=%d must be below compact_at=%d", ErrBadParam, a.summary, a.compactAt)
	}
	// The text is sized before it is made by its expectation, twice over
	// (an upper bound of lognormal draws would be a hundred times the
	// text): a typo in a parameter still fails at once, and Generate checks
	// the text made.
	turns := 1.13 * float64(a.turns) * (1 + a.subagents/3) // E[lognormal σ 0.5], subagents' turns
	growth := float64(a.out) + 1.65*float64(a.tool)        // per turn; E[lognormal σ 1] = 1.65 × median
	perReq := 4 * (float64(a.sys+a.task) + min(turns/2*growth, float64(a.compactAt)))
	made := float64(a.programs) * turns
	n := -1 // every program's requests, however many
	if requests > 0 {
		n, made = requests, float64(requests)
	}
	textBytes := 2 * made * perReq
	gen := func(r *rng, n int) []Request { return genAgents(r, a, n) }
	return plan{n: n, made: made, textBytes: textBytes, gen: gen}, nil
}

// genAgents makes the programs' requests, program after program (a
// program's requests in the order they depend on one another): the
// programs parameter's count, or, given n > 0 requests, programs until
// there are n (the last one cut).
func genAgents(r *rng, a agentParams, n int) []Request {
	base := r.uint64()
	shared := agentText{system: Words(base, a.sys), subSystem: Words(base^0x5ab, subagentSystem)}
	var reqs []Request
	t := 0.0
	more := func(prog int) bool {
		if n > 0 {
			return len(reqs) < n
		}
		return prog < a.programs
	}
	for prog := 0; more(prog); prog++ {
		if prog > 0 {
			t += r.exp() / a.rate
		}
		start := len(reqs)
		reqs = agentProgram(r, a, &shared, reqs, prog)
		reqs[start].At = seconds(t)
	}
	if n > 0 && len(reqs) > n {
		reqs = reqs[:n:n]
	}
	return reqs
}

// agentText is the text every program shares.
type agentText struct{ system, subSystem string }

// agentConv is a program's conversation as it grows: its messages share
// one backing array, each request taking the prefix it sends. Every
// message is held: an agent re-sends long histories of tool output turn
// after turn, and making them on demand (as multiturn does) would cost
// each turn its whole history's generation again (the golden digest of
// the default programs: 8 s to 15 s under the race detector).
type agentConv struct {
	msgs []Message
	size int // renderLen of them
}

func (c *agentConv) add(m Message) {
	c.msgs = append(c.msgs, m)
	c.size += renderLen(c.msgs[len(c.msgs)-1:])
}

// addWords adds a message of Words(r.uint64(), tokens).
func (c *agentConv) addWords(r *rng, role string, tokens int) {
	c.add(heldMsg(role, Words(r.uint64(), tokens)))
}

// agentProgram appends program prog's requests (and its subagent's) to
// reqs.
func agentProgram(r *rng, a agentParams, shared *agentText, reqs []Request, prog int) []Request {
	turns := lognormTurns(r, a.turns)
	sub := -1 // the turn after which the subagent runs
	if turns > 2 && r.float64() < a.subagents {
		sub = r.between(0, turns-2)
	}
	task := Words(r.uint64(), r.between(max(a.task/2, 1), a.task*3/2))
	c := &agentConv{}
	c.add(heldMsg("system", shared.system))
	c.add(heldMsg("user", task))
	session := "agent-" + strconv.Itoa(prog)
	prev := -1
	for k := 0; k < turns; k++ {
		if c.size > 4*a.compactAt {
			c = compacted(r, shared.system, task, a.summary)
		}
		out := r.between(max(a.out/2, 1), a.out*3/2)
		q := agentRequest(len(reqs), prev, session, prog, c, out)
		if k > 0 {
			q.Think = toolPause(r)
		}
		reqs = append(reqs, q)
		prev = q.Index
		if k == turns-1 {
			break
		}
		c.addWords(r, "assistant", out)
		if k == sub {
			var last int
			reqs, last = subagent(r, a, shared, reqs, prog, prev, task)
			prev = last
			c.addWords(r, "tool", subagentResult)
			continue
		}
		c.add(heldMsg("tool", Words(r.uint64(), toolLen(r, a.tool))))
	}
	return reqs
}

// subagent appends the subagent of program prog, started by its parent's
// request after, and returns its last request's index.
func subagent(r *rng, a agentParams, shared *agentText, reqs []Request, prog, after int, parentTask string) ([]Request, int) {
	turns := lognormTurns(r, subagentTurns)
	c := &agentConv{}
	c.add(heldMsg("system", shared.subSystem))
	task := parentTask[:min(len(parentTask), 4*subagentTask)]
	c.add(heldMsg("user", task))
	session := "agent-" + strconv.Itoa(prog) + ".sub"
	prev := after
	for k := 0; k < turns; k++ {
		if c.size > 4*a.compactAt {
			c = compacted(r, shared.subSystem, task, a.summary)
		}
		out := r.between(max(a.out/2, 1), a.out*3/2)
		q := agentRequest(len(reqs), prev, session, prog, c, out)
		if k > 0 {
			q.Think = toolPause(r)
		}
		reqs = append(reqs, q)
		prev = q.Index
		if k < turns-1 {
			c.addWords(r, "assistant", out)
			c.add(heldMsg("tool", Words(r.uint64(), toolLen(r, a.tool))))
		}
	}
	return reqs, prev
}

// compacted is a conversation started over from its system prompt, its
// task and a summary.
func compacted(r *rng, system, task string, summary int) *agentConv {
	c := &agentConv{}
	c.add(heldMsg("system", system))
	c.add(heldMsg("user", task))
	c.addWords(r, "user", summary)
	return c
}

// agentRequest is the request sending conversation c as it is now.
func agentRequest(idx, prev int, session string, prog int, c *agentConv, out int) Request {
	n := len(c.msgs)
	return Request{Index: idx, Prev: prev, Session: session, Program: prog + 1, Chat: true, Timed: true,
		Messages: c.msgs[:n:n], MaxTokens: out,
		InputTokens: ceilDiv(c.size, prompt.TokenBytesPer)}
}

// lognormTurns draws a turn count: lognormal around median (σ
// agentTurnSigma), in [2, 4·median].
func lognormTurns(r *rng, median int) int {
	t := int(math.Round(float64(median) * math.Exp(agentTurnSigma*r.norm())))
	return min(max(t, 2), 4*median)
}

// toolLen draws a tool result's tokens: lognormal around median (σ
// agentToolSigma), in [1, agentToolMax].
func toolLen(r *rng, median int) int {
	t := int(math.Round(float64(median) * math.Exp(agentToolSigma*r.norm())))
	return min(max(t, 1), agentToolMax)
}

// toolPause draws a pause between an answer and the program's next call:
// log-uniform within [50 ms, 1 s], [1 s, 10 s] or [10 s, 60 s] with the
// probabilities vllm-router #285 measured.
func toolPause(r *rng) time.Duration {
	lo, hi := 0.05, 1.0
	switch u := r.float64(); {
	case u >= agentPause10s:
		lo, hi = 10, 60
	case u >= agentPause1s:
		lo, hi = 1, 10
	}
	return seconds(lo * math.Exp(r.float64()*math.Log(hi/lo)))
}

// The rl workload: GRPO-style rollouts. A batch is prompts distinct
// prompts (a shared system prompt and a task of prompt_len ± 50 % tokens),
// each sent samples times at once, identical (the n samples of one prompt,
// as a trainer sends them to a vLLM server); the next batch starts when the
// last answer of the batch before has come (Request.Batch). Answers vary
// in length (output_len × [0.25, 1.75], uniform): the longest decides a
// batch's makespan, as stragglers do in RL rollouts.
var rlGenerator = generator{
	name:   "rl",
	timed:  true,
	doc:    "RL rollouts: batches of prompts × n identical samples, the next batch when the last answer of the one before has come",
	domain: 7,
	params: []Param{
		countParam("batches", 8, 1e5, "rollout batches, one after another"),
		countParam("prompts", 32, 1e5, "distinct prompts per batch"),
		countParam("samples", 8, 1024, "identical samples per prompt (GRPO's group size n)"),
		lenParam("system_prompt_len", 500, "tokens of the system prompt every prompt shares"),
		lenParam("prompt_len", 3000, "mean tokens of a prompt's task (± 50 %)"),
		lenParam("output_len", 600, "mean tokens of an answer (× [0.25, 1.75])"),
		chatParam(1),
	},
	plan: planRL,
}

func planRL(p params, requests int) (plan, error) {
	prompts, samples := p.int("prompts"), p.int("samples")
	sys, pl, out, chat := p.int("system_prompt_len"), p.int("prompt_len"), p.int("output_len"), p.int("chat") == 1
	per := prompts * samples
	b, n, err := groupsFor(p, "batches", per, requests)
	if err != nil {
		return plan{}, err
	}
	made := float64(b) * float64(per)
	gen := func(r *rng, n int) []Request {
		system := Words(r.uint64(), sys)
		reqs := make([]Request, 0, n)
		for bi := 0; bi < b && len(reqs) < n; bi++ {
			for pi := 0; pi < prompts && len(reqs) < n; pi++ {
				task := heldMsg("user", Words(r.uint64(), r.between(max(pl/2, 1), pl*3/2)))
				msgs := []Message{heldMsg("system", system), task} // shared by the samples
				for s := 0; s < samples && len(reqs) < n; s++ {
					q := Request{Index: len(reqs), Prev: -1, Batch: bi + 1, Timed: true,
						MaxTokens: r.between(max(out/4, 1), max(out*7/4, 1))}
					if chat {
						q.Chat, q.Messages = true, msgs
						q.InputTokens = ceilDiv(renderLen(q.Messages), prompt.TokenBytesPer)
					} else {
						q.Prompt = system + task.Text
						q.InputTokens = ceilDiv(len(q.Prompt), prompt.TokenBytesPer)
					}
					reqs = append(reqs, q)
				}
			}
		}
		return reqs
	}
	return plan{n: n, made: made, textBytes: made * float64(4*(sys+pl*3/2)+2*msgOverhead), gen: gen}, nil
}
