package sim

import (
	"encoding/json"

	"github.com/cespare/xxhash/v2"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/prompt"
)

// maxN bounds the choices of one request (n × prompts).
const maxN = 128

// extraParams are the request fields the sim honours beyond what
// prompt.Parse reads.
type extraParams struct {
	Prompt              json.RawMessage `json:"prompt"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	N                   *int            `json:"n"`
	IgnoreEOS           bool            `json:"ignore_eos"`
	MinTokens           int             `json:"min_tokens"`
	Seed                *int64          `json:"seed"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

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
}

// parseJob validates a completions or chat body.
func (r *Replica) parseJob(kind prompt.Kind, data []byte) (*job, error) {
	p, err := prompt.Parse(kind, data)
	if err != nil {
		return nil, err
	}
	adapter, err := r.adapterOf(p.Model)
	if err != nil {
		return nil, err
	}
	var x extraParams
	if err := json.Unmarshal(data, &x); err != nil {
		return nil, badRequest("", "request body: %v", err)
	}
	j := &job{kind: kind, model: p.Model, adapter: adapter, stream: p.Stream, n: 1,
		ignoreEOS: x.IgnoreEOS, minTokens: x.MinTokens}
	if x.N != nil {
		j.n = *x.N
	}
	if x.Seed != nil {
		j.seed = *x.Seed
	}
	if x.StreamOptions != nil {
		if !p.Stream {
			return nil, badRequest("stream_options", "Stream options can only be defined when `stream=True`.")
		}
		j.includeUsage = x.StreamOptions.IncludeUsage
	}
	switch {
	case j.n < 1:
		return nil, badRequest("n", "n must be at least 1, got %d.", j.n)
	case j.n*max(p.Prompts, 1) > maxN:
		return nil, badRequest("n", "at most %d choices per request, got %d.", maxN, j.n*p.Prompts)
	case j.minTokens < 0:
		return nil, badRequest("min_tokens", "min_tokens must be greater than or equal to 0, got %d.", j.minTokens)
	}
	if j.prompts, err = r.prompts(p, x.Prompt, adapter); err != nil {
		return nil, err
	}
	return j, r.limits(j, p, &x)
}

// prompts tokenizes and hashes the request's prompts.
func (r *Replica) prompts(p *prompt.Parsed, raw json.RawMessage, adapter string) ([]promptIn, error) {
	root := prompt.RootOf("engine", prompt.Key{Model: r.cfg.Model, Adapter: adapter, Salt: p.CacheSalt})
	var out []promptIn
	if p.Prompts > 1 {
		// A batch of prompts: prompt.Parse kept only the first for routing.
		var texts []string
		var ids [][]uint32
		if p.TokenIDs == nil {
			if err := json.Unmarshal(raw, &texts); err != nil {
				return nil, badRequest("prompt", "%v", err)
			}
		} else if err := json.Unmarshal(raw, &ids); err != nil {
			return nil, badRequest("prompt", "%v", err)
		}
		for i := range p.Prompts {
			if p.TokenIDs == nil {
				out = append(out, r.promptOf(texts[i], nil, root))
			} else {
				out = append(out, r.promptOf("", ids[i], root))
			}
		}
	} else {
		out = append(out, r.promptOf(p.Text, p.TokenIDs, root))
	}
	for _, in := range out {
		if in.tokens == 0 {
			return nil, badRequest("prompt", "The prompt cannot be empty.")
		}
	}
	return out, nil
}

// limits sets the job's max_tokens and checks it against the context.
func (r *Replica) limits(j *job, p *prompt.Parsed, x *extraParams) error {
	longest := 0
	for _, in := range j.prompts {
		longest = max(longest, in.tokens)
	}
	switch {
	case p.MaxTokens > 0:
		j.maxTokens = p.MaxTokens
	case x.MaxTokens != nil || x.MaxCompletionTokens != nil:
		// Present and 0 (prompt.Parse rejects negatives).
		return badRequest("max_tokens", "max_tokens must be at least 1, got 0.")
	case j.kind == prompt.Chat:
		j.maxTokens = min(DefaultChatMaxTokens, r.cfg.MaxModelLen-longest)
	default:
		j.maxTokens = DefaultCompletionMaxTokens
	}
	if j.maxTokens < 1 || longest+j.maxTokens > r.cfg.MaxModelLen {
		return contextTooLong(r.cfg.MaxModelLen, longest, max(j.maxTokens, 1), j.kind == prompt.Chat)
	}
	if j.minTokens > j.maxTokens {
		return badRequest("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.",
			j.maxTokens, j.minTokens)
	}
	return nil
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
// prompt × n + k, as vLLM numbers a batch) and their engine requests.
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
				PromptTokens: in.tokens,
				BlockHashes:  in.hashes,
				TokenIDs:     in.tokenIDs,
				MaxTokens:    c.length,
				LoraName:     j.adapter,
			})
		}
	}
	return cl, reqs
}
