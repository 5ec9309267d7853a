package sim

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"

	"github.com/cespare/xxhash/v2"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/prompt"
)

// maxBody bounds a request body: the longest context (128k tokens of 4
// bytes) in JSON with room to spare.
const maxBody = 32 << 20

// maxN bounds the choices of one request (n × prompts).
const maxN = 128

func (r *Replica) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", r.inference(prompt.Completion))
	mux.HandleFunc("POST /v1/chat/completions", r.inference(prompt.Chat))
	mux.HandleFunc("GET /v1/models", r.models)
	mux.HandleFunc("GET /health", r.health)
	mux.HandleFunc("POST /tokenize", r.tokenize)
	mux.HandleFunc("GET /version", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, map[string]string{"version": "kvgate-sim"})
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(r.metrics.reg, promhttp.HandlerOpts{}))
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if !r.gate.enter() {
			writeError(w, errShuttingDown)
			return
		}
		defer r.gate.leave()
		mux.ServeHTTP(w, req)
	})
}

func writeJSON(w http.ResponseWriter, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(data)
}

func (r *Replica) health(w http.ResponseWriter, _ *http.Request) {
	if r.failed.Load() {
		writeError(w, errFailed)
		return
	}
	w.WriteHeader(http.StatusOK) // vLLM answers an empty 200
}

func (r *Replica) models(w http.ResponseWriter, _ *http.Request) {
	type card struct {
		ID          string  `json:"id"`
		Object      string  `json:"object"`
		Created     int64   `json:"created"`
		OwnedBy     string  `json:"owned_by"`
		Root        string  `json:"root"`
		Parent      *string `json:"parent"`
		MaxModelLen int     `json:"max_model_len"`
	}
	created := r.start.Unix()
	data := []card{{ID: r.cfg.Model, Object: "model", Created: created, OwnedBy: "vllm", Root: r.cfg.Model,
		MaxModelLen: r.cfg.MaxModelLen}}
	for _, a := range r.cfg.Adapters {
		data = append(data, card{ID: a, Object: "model", Created: created, OwnedBy: "vllm", Root: a,
			Parent: &r.cfg.Model, MaxModelLen: r.cfg.MaxModelLen})
	}
	writeJSON(w, map[string]any{"object": "list", "data": data})
}

// adapterOf resolves a requested model name: the base model ("" adapter),
// one of the LoRA adapters, or not served.
func (r *Replica) adapterOf(model string) (string, error) {
	switch {
	case model == r.cfg.Model:
		return "", nil
	case slices.Contains(r.cfg.Adapters, model):
		return model, nil
	}
	return "", modelNotFound(model)
}

// tokenize is vLLM's POST /tokenize: a completions prompt or chat messages
// in, {"count", "max_model_len", "tokens"} out, under the Approx tokenizer.
func (r *Replica) tokenize(w http.ResponseWriter, req *http.Request) {
	data, err := io.ReadAll(http.MaxBytesReader(w, req.Body, maxBody))
	if err != nil {
		writeError(w, err)
		return
	}
	var b struct {
		Model    string          `json:"model"`
		Prompt   json.RawMessage `json:"prompt"`
		Messages json.RawMessage `json:"messages"`
	}
	if err := json.Unmarshal(data, &b); err != nil {
		writeError(w, badRequest("", "request body is not valid JSON: %v", err))
		return
	}
	if b.Model == "" {
		b.Model = r.cfg.Model // optional in vLLM's tokenize
	} else if _, err := r.adapterOf(b.Model); err != nil {
		writeError(w, err)
		return
	}
	// Render through prompt.Parse so that the count is the one the chat and
	// completions endpoints (and the router) compute.
	kind, body := prompt.Completion, map[string]json.RawMessage{"prompt": b.Prompt}
	if len(b.Messages) > 0 {
		kind, body = prompt.Chat, map[string]json.RawMessage{"messages": b.Messages}
	}
	model, _ := json.Marshal(b.Model)
	body["model"] = model
	raw, _ := json.Marshal(body)
	p, err := prompt.Parse(kind, raw)
	if err != nil {
		writeError(w, err)
		return
	}
	ids := p.TokenIDs
	if ids == nil {
		ids = prompt.Approx{}.Encode(make([]uint32, 0, prompt.Approx{}.Count(p.Text)), p.Text)
	}
	writeJSON(w, struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint32 `json:"tokens"`
		TokenStrs   []string `json:"token_strs"`
	}{len(ids), r.cfg.MaxModelLen, ids, nil})
}

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
	root := prompt.RootOf("engine", prompt.Key{Model: r.cfg.Model, Adapter: adapter, Salt: p.CacheSalt})
	if p.Prompts > 1 {
		// A batch of prompts: prompt.Parse kept only the first for routing.
		var texts []string
		var ids [][]uint32
		if p.TokenIDs == nil {
			if err := json.Unmarshal(x.Prompt, &texts); err != nil {
				return nil, badRequest("prompt", "%v", err)
			}
		} else if err := json.Unmarshal(x.Prompt, &ids); err != nil {
			return nil, badRequest("prompt", "%v", err)
		}
		for i := range p.Prompts {
			if p.TokenIDs == nil {
				j.prompts = append(j.prompts, r.promptOf(texts[i], nil, root))
			} else {
				j.prompts = append(j.prompts, r.promptOf("", ids[i], root))
			}
		}
	} else {
		j.prompts = append(j.prompts, r.promptOf(p.Text, p.TokenIDs, root))
	}
	longest := 0
	for _, in := range j.prompts {
		if in.tokens == 0 {
			return nil, badRequest("prompt", "The prompt cannot be empty.")
		}
		longest = max(longest, in.tokens)
	}
	switch {
	case p.MaxTokens > 0:
		j.maxTokens = p.MaxTokens
	case x.MaxTokens != nil || x.MaxCompletionTokens != nil:
		// Present and 0 (prompt.Parse rejects negatives).
		return nil, badRequest("max_tokens", "max_tokens must be at least 1, got 0.")
	case kind == prompt.Chat:
		j.maxTokens = min(DefaultChatMaxTokens, r.cfg.MaxModelLen-longest)
	default:
		j.maxTokens = DefaultCompletionMaxTokens
	}
	if j.maxTokens < 1 || longest+j.maxTokens > r.cfg.MaxModelLen {
		return nil, contextTooLong(r.cfg.MaxModelLen, longest, max(j.maxTokens, 1), kind == prompt.Chat)
	}
	if j.minTokens > j.maxTokens {
		return nil, badRequest("min_tokens", "min_tokens must be less than or equal to max_tokens=%d, got %d.",
			j.maxTokens, j.minTokens)
	}
	return j, nil
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

// draw makes the per-request fault draws.
func (r *Replica) draw() (fail, stall, die bool) {
	f := r.faults
	if f.ErrorRate == 0 && f.StallRate == 0 && f.DieRate == 0 {
		return false, false, false
	}
	r.frngMu.Lock()
	defer r.frngMu.Unlock()
	return r.frng.Float64() < f.ErrorRate, r.frng.Float64() < f.StallRate, r.frng.Float64() < f.DieRate
}

// inference serves /v1/completions and /v1/chat/completions.
func (r *Replica) inference(kind prompt.Kind) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		ctx := req.Context()
		if fa := r.faults.FailAfter; fa > 0 && r.served.Add(1) > int64(fa) {
			r.failed.Store(true)
			writeError(w, errFailed)
			return
		}
		fail, stall, die := r.draw()
		if fail {
			writeError(w, errInjected)
			return
		}
		if stall {
			t := r.clock.NewTimer(r.faults.Stall)
			select {
			case <-t.C():
			case <-ctx.Done():
				t.Stop()
				return
			case <-r.done:
				t.Stop()
				return
			}
		}
		data, err := io.ReadAll(http.MaxBytesReader(w, req.Body, maxBody))
		if err != nil {
			writeError(w, err)
			return
		}
		j, err := r.parseJob(kind, data)
		if err != nil {
			writeError(w, err)
			return
		}
		cl, reqs := r.newCall(j)
		if err := r.submit(cl, reqs); err != nil {
			if errors.Is(err, engine.ErrTooLong) {
				err = contextTooLong(r.cfg.MaxModelLen, j.prompts[0].tokens, j.maxTokens, kind == prompt.Chat)
			}
			writeError(w, err)
			return
		}
		if j.stream {
			r.streamCall(w, req, j, cl, die)
		} else {
			r.respondCall(w, req, j, cl, die)
		}
	}
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

// responseID is a unique, seed-determined id in vLLM's style.
func (r *Replica) responseID(prefix string) string {
	var b [24]byte
	binary.LittleEndian.PutUint64(b[0:], r.cfg.Seed)
	binary.LittleEndian.PutUint64(b[8:], uint64(r.idx))
	binary.LittleEndian.PutUint64(b[16:], r.calls.Add(1))
	h1 := xxhash.Sum64(b[:])
	b[0] ^= 0xff
	h2 := xxhash.Sum64(b[:])
	out := make([]byte, 0, len(prefix)+32)
	out = append(out, prefix...)
	out = appendHex16(out, h1)
	out = appendHex16(out, h2)
	return string(out)
}

func appendHex16(dst []byte, v uint64) []byte {
	s := strconv.FormatUint(v, 16)
	for range 16 - len(s) {
		dst = append(dst, '0')
	}
	return append(dst, s...)
}

// usage of a finished call: prompt tokens once per prompt, the cached hit
// of each prompt's first choice (vLLM reports the request's
// num_cached_tokens), completion tokens over all choices.
func (j *job) usage(cl *call) usageJSON {
	u := usageJSON{}
	cached := 0
	for pi, in := range j.prompts {
		u.PromptTokens += in.tokens
		cached += cl.choices[pi*j.n].cached
	}
	for _, c := range cl.choices {
		u.CompletionTokens += c.total
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	u.PromptTokensDetails = &promptTokensDetails{CachedTokens: cached}
	return u
}

type usageJSON struct {
	PromptTokens        int                  `json:"prompt_tokens"`
	TotalTokens         int                  `json:"total_tokens"`
	CompletionTokens    int                  `json:"completion_tokens"`
	PromptTokensDetails *promptTokensDetails `json:"prompt_tokens_details"`
}

type promptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// wait blocks until the call is poked; false when the client or the
// replica went away (the call is then aborted).
func (r *Replica) wait(req *http.Request, cl *call) bool {
	select {
	case <-cl.notify:
		return true
	case <-req.Context().Done():
		r.abort(cl)
		return false
	case <-r.done:
		return false
	}
}

// respondCall answers a non-streamed request once every choice finished.
func (r *Replica) respondCall(w http.ResponseWriter, req *http.Request, j *job, cl *call, die bool) {
	for {
		if !r.wait(req, cl) {
			return
		}
		cl.mu.Lock()
		done := true
		for _, c := range cl.choices {
			done = done && c.finished
		}
		cl.mu.Unlock()
		if done {
			break
		}
	}
	if die {
		// The connection dies with the work done and no byte answered.
		panic(http.ErrAbortHandler)
	}
	// The driver wrote the choices last before its final poke, under cl.mu,
	// which this goroutine took since: their fields are visible.
	id, created := r.responseID(idPrefix(j.kind)), r.clock.Now().Unix()
	u := j.usage(cl)
	if j.kind == prompt.Chat {
		type message struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		}
		type chatChoice struct {
			Index        int       `json:"index"`
			Message      message   `json:"message"`
			Logprobs     *struct{} `json:"logprobs"`
			FinishReason string    `json:"finish_reason"`
		}
		out := struct {
			ID      string       `json:"id"`
			Object  string       `json:"object"`
			Created int64        `json:"created"`
			Model   string       `json:"model"`
			Choices []chatChoice `json:"choices"`
			Usage   usageJSON    `json:"usage"`
		}{ID: id, Object: "chat.completion", Created: created, Model: j.model, Usage: u}
		for _, c := range cl.choices {
			out.Choices = append(out.Choices, chatChoice{Index: c.index,
				Message:      message{Role: "assistant", Content: string(c.gen.appendText(nil, c.total))},
				FinishReason: c.reason})
		}
		writeJSON(w, out)
		return
	}
	type textChoice struct {
		Index        int       `json:"index"`
		Text         string    `json:"text"`
		Logprobs     *struct{} `json:"logprobs"`
		FinishReason string    `json:"finish_reason"`
		StopReason   *string   `json:"stop_reason"`
	}
	out := struct {
		ID      string       `json:"id"`
		Object  string       `json:"object"`
		Created int64        `json:"created"`
		Model   string       `json:"model"`
		Choices []textChoice `json:"choices"`
		Usage   usageJSON    `json:"usage"`
	}{ID: id, Object: "text_completion", Created: created, Model: j.model, Usage: u}
	for _, c := range cl.choices {
		out.Choices = append(out.Choices, textChoice{Index: c.index,
			Text: string(c.gen.appendText(nil, c.total)), FinishReason: c.reason})
	}
	writeJSON(w, out)
}

func idPrefix(k prompt.Kind) string {
	if k == prompt.Chat {
		return "chatcmpl-"
	}
	return "cmpl-"
}
