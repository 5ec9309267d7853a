package sim

import (
	"encoding/json"
	"strings"
	"time"

	"github.com/cespare/xxhash/v2"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/prompt"
)

// maxN bounds the choices of one request (n × prompts).
const maxN = 128

// promptIn is one prompt as the engine sees it.
type promptIn struct {
	tokens   int
	hashes   []uint64
	tokenIDs []uint32 // only with KV events (they carry the token ids)
	digest   uint64   // seeds the output text
}

// job is a validated inference request.
type job struct {
	kind         prompt.Kind
	model        string
	adapter      string
	stream       bool
	includeUsage bool
	prompts      []promptIn
	n            int
	maxTokens    int // per choice, after defaults
	ignoreEOS    bool
	minTokens    int
	seed         int64
	priority     int      // vLLM's priority, with --scheduling-policy priority
	kv           kvParams // kv_transfer_params (prefill/decode disaggregation)
	// pull: a remote prefill whose prefill side holds the prompt's blocks
	// (openPull succeeded): the engine pulls them instead of computing.
	pull bool
	// pullBlocks: the leading blocks of the prompt the peer named by
	// kv.source holds (openSource), to pull (engine.Request.PullBlocks).
	pullBlocks int
	// crash: a prompt contains the query of death (Faults.CrashOn).
	crash bool
	// submitted and firstOut are the wall times at which the request went
	// to the engine and its first token was written (streams): the
	// replica's own span in real time (Timing's wall fields).
	submitted, firstOut time.Time
	// hold is the load generator's hold key (HeaderHold), if hasHold.
	hold    uint64
	hasHold bool
}

// parseJob validates a completions or chat body as vLLM does, reading
// every field by its exact key (see body).
func (r *Replica) parseJob(kind prompt.Kind, data []byte) (*job, error) {
	b, err := decodeBody(data)
	if err != nil {
		return nil, err
	}
	x, err := readParams(kind, b)
	if err != nil {
		return nil, err
	}
	kv, err := readKVParams(b)
	if err != nil {
		return nil, err
	}
	if m := b.get("model"); m != nil && m[0] != '"' {
		return nil, badRequest("model", "model must be a string.")
	}
	pk := parseKeys
	if kind == prompt.Messages {
		pk, x.n = messagesKeys, 1 // the Messages API has no n
	}
	p, err := b.parse(kind, pk)
	if err != nil {
		return nil, err
	}
	adapter, err := r.adapterOf(p.Model)
	if err != nil {
		return nil, err
	}
	if choices := x.n * max(p.Prompts, 1); choices > maxN { // x.n ≤ maxN: no overflow
		return nil, badRequest("n", "at most %d choices per request (n × prompts), got %d.", maxN, choices)
	}
	if x.priority != 0 && r.cfg.SchedulingPolicy != SchedulingPriority {
		return nil, badRequest("priority", "Got priority %d but Priority scheduling is not enabled.", x.priority)
	}
	j := &job{kind: kind, model: p.Model, adapter: adapter, stream: x.stream, includeUsage: x.includeUsage,
		n: x.n, ignoreEOS: x.ignoreEOS, seed: x.seed, priority: x.priority, kv: kv}
	if err := r.readPrompts(j, p, b.get("prompt")); err != nil {
		return nil, err
	}
	if err := r.checkKVJob(j); err != nil {
		return nil, err
	}
	return j, r.limits(j, x)
}

// readPrompts tokenizes and hashes the request's prompts into j, and
// looks for the query of death in their text.
func (r *Replica) readPrompts(j *job, p *prompt.Parsed, raw json.RawMessage) error {
	root := prompt.RootOf("engine", prompt.Key{Model: r.cfg.Model, Adapter: j.adapter, Salt: p.CacheSalt})
	mark := r.faults.CrashOn
	if p.Prompts > 1 {
		// A batch of prompts: prompt.Parse kept only the first for routing.
		var texts []string
		var ids [][]uint32
		if p.TokenIDs == nil {
			if err := json.Unmarshal(raw, &texts); err != nil {
				return badRequest("prompt", "%v", err)
			}
		} else if err := json.Unmarshal(raw, &ids); err != nil {
			return badRequest("prompt", "%v", err)
		}
		for i := range p.Prompts {
			if p.TokenIDs == nil {
				j.prompts = append(j.prompts, r.promptOf(texts[i], nil, root))
				j.crash = j.crash || (mark != "" && strings.Contains(texts[i], mark))
			} else {
				j.prompts = append(j.prompts, r.promptOf("", ids[i], root))
			}
		}
	} else {
		j.prompts = append(j.prompts, r.promptOf(p.Text, p.TokenIDs, root))
		j.crash = mark != "" && strings.Contains(p.Text, mark)
	}
	for _, in := range j.prompts {
		if in.tokens == 0 {
			return badRequest("prompt", "The prompt cannot be empty.")
		}
	}
	return nil
}

// limits sets the job's max_tokens and checks prompt + max_tokens against
// the context, as vLLM does before it queues a request: the longest prompt
// must leave room for one token, and a max_tokens the client set must fit
// beside it. Compared as room = MaxModelLen − prompt, so that no client
// number is added to another.
func (r *Replica) limits(j *job, x params) error {
	longest := 0
	for _, in := range j.prompts {
		longest = max(longest, in.tokens)
	}
	maxLen, where := r.cfg.MaxModelLen, promptField(j.kind)
	if longest >= maxLen {
		return promptTooLong(maxLen, longest, where)
	}
	room := maxLen - longest
	switch {
	case x.maxTokens.set:
		if x.maxTokens.v > int64(room) {
			return contextTooLong(maxLen, longest, x.maxTokens.v, where, x.maxField)
		}
		j.maxTokens = int(x.maxTokens.v)
	case j.kind == prompt.Chat:
		j.maxTokens = min(DefaultChatMaxTokens, room)
	case DefaultCompletionMaxTokens > room:
		return contextTooLong(maxLen, longest, DefaultCompletionMaxTokens, where, where)
	default:
		j.maxTokens = DefaultCompletionMaxTokens
	}
	if x.minTokens > int64(j.maxTokens) {
		return badRequest("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.",
			j.maxTokens, x.minTokens)
	}
	j.minTokens = int(x.minTokens)
	return nil
}

func promptField(k prompt.Kind) string {
	if k == prompt.Chat {
		return "messages"
	}
	return "prompt"
}

// promptOf tokenizes one prompt (text, or token ids when ids != nil) and
// hashes its full blocks in the engine's namespace, as a real vLLM hashes
// its own blocks with a function the router cannot reproduce.
func (r *Replica) promptOf(text string, ids []uint32, root uint64) promptIn {
	bs := r.cfg.BlockSize
	if ids != nil {
		tb := prompt.TokenBytes(make([]byte, 0, 4*len(ids)), ids)
		in := promptIn{tokens: len(ids), hashes: prompt.BlockHashes(nil, root, tb, bs), digest: xxhash.Sum64(tb)}
		if r.cfg.KVEvents {
			in.tokenIDs = ids
		}
		return in
	}
	n := prompt.Approx{}.Count(text)
	in := promptIn{tokens: n, hashes: prompt.ApproxBlockHashes(make([]uint64, 0, n/bs), root, text, bs),
		digest: xxhash.Sum64String(text)}
	if r.cfg.KVEvents {
		in.tokenIDs = prompt.Approx{}.Encode(make([]uint32, 0, n), text)
	}
	return in
}

// newCall builds the call's choices (prompt-major: choice index =
// prompt × n + k, as vLLM numbers a batch) and their engine requests. A
// remote decode holds its blocks when it ends at max_tokens (vLLM's
// connector holds them only for a request capped by its length); a remote
// prefill pulls its prompt when j.pull (the prefill side holds it), else
// computes it.
func (r *Replica) newCall(j *job) (*call, []engine.Request) {
	cl := &call{notify: make(chan struct{}, 1), stream: j.stream}
	reqs := make([]engine.Request, 0, len(j.prompts)*j.n)
	for pi, in := range j.prompts {
		for k := range j.n {
			idx := pi*j.n + k
			c := &choice{call: cl, index: idx, gen: newOutputGen(r.cfg.Seed, in.digest, k, j.seed)}
			c.length, c.reason = j.maxTokens, finishLength
			if !j.ignoreEOS {
				if l := max(c.gen.length(r.cfg.OutputMedian, r.cfg.OutputSigma), j.minTokens); l < j.maxTokens {
					c.length, c.reason = l, finishStop
				}
			}
			cl.choices = append(cl.choices, c)
			reqs = append(reqs, engine.Request{
				PromptTokens:  in.tokens,
				BlockHashes:   in.hashes,
				TokenIDs:      in.tokenIDs,
				MaxTokens:     c.length,
				LoraName:      j.adapter,
				RemoteDecode:  j.kv.remoteDecode && c.reason == finishLength,
				RemotePrefill: j.pull,
				Priority:      j.priority,
				PullBlocks:    min(j.pullBlocks, len(in.hashes)),
			})
			if j.pull {
				c.remote = remoteOf(j.kv)
			}
		}
	}
	return cl, reqs
}
