package sim

import (
	"encoding/binary"
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/cespare/xxhash/v2"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/prompt"
)

// respondCall answers a non-streamed request once every choice finished.
func (r *Replica) respondCall(w http.ResponseWriter, req *http.Request, j *job, cl *call, die bool) {
	if !r.waitFinished(req, cl) {
		return
	}
	if die {
		// The connection dies with the work done and no byte answered.
		panic(http.ErrAbortHandler)
	}
	// The driver wrote the choices last before its final poke, under cl.mu,
	// which this goroutine took since: their fields are visible.
	id, created := r.responseID(idPrefix(j.kind)), r.clock.Now().Unix()
	kv, timing := r.kvTransferParams(j, cl), r.timing(j, cl)
	if j.hasHold && j.kv.remoteDecode {
		// A prefill step's answer: model time waits for the decode step.
		r.tl.Hold(j.hold+2, r.tl.Now())
	}
	if j.kind == prompt.Messages {
		r.respondMessages(w, j, cl, id)
		return
	}
	if j.kind == prompt.Chat {
		writeJSON(w, newResponse(j, cl, id, created, "chat.completion", kv, timing, func(c *choice, text string) chatChoice {
			return chatChoice{Index: c.index, Message: chatMessage{Role: "assistant", Content: text},
				FinishReason: c.reason}
		}))
		return
	}
	writeJSON(w, newResponse(j, cl, id, created, "text_completion", kv, timing, func(c *choice, text string) textChoice {
		return textChoice{Index: c.index, Text: text, FinishReason: c.reason}
	}))
}

// waitFinished waits until every choice of the call finished; false when
// the client or the replica went away.
func (r *Replica) waitFinished(req *http.Request, cl *call) bool {
	for {
		if !r.wait(req, cl) {
			return false
		}
		cl.mu.Lock()
		done := true
		for _, c := range cl.choices {
			done = done && c.finished
		}
		cl.mu.Unlock()
		if done {
			return true
		}
	}
}

// response is a non-streamed completions (C = textChoice) or chat
// (C = chatChoice) response.
type response[C any] struct {
	ID      string   `json:"id"`
	Object  string   `json:"object"`
	Created int64    `json:"created"`
	Model   string   `json:"model"`
	Choices []C      `json:"choices"`
	Usage   usageOut `json:"usage"`
	// KVTransferParams is vLLM's top-level kv_transfer_params, present
	// when the request carried kv_transfer_params (see kvTransferParams).
	KVTransferParams json.RawMessage `json:"kv_transfer_params,omitempty"`
}

func newResponse[C any](j *job, cl *call, id string, created int64, object string, kv json.RawMessage, timing *Timing,
	choiceOf func(c *choice, text string) C) response[C] {
	out := response[C]{ID: id, Object: object, Created: created, Model: j.model, Usage: usageOut{Usage: j.usage(cl), Timing: timing},
		Choices: make([]C, 0, len(cl.choices)), KVTransferParams: kv}
	for _, c := range cl.choices {
		out.Choices = append(out.Choices, choiceOf(c, string(c.gen.appendText(nil, c.total))))
	}
	return out
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type chatChoice struct {
	Index        int         `json:"index"`
	Message      chatMessage `json:"message"`
	Logprobs     *struct{}   `json:"logprobs"`
	FinishReason string      `json:"finish_reason"`
}

type textChoice struct {
	Index        int       `json:"index"`
	Text         string    `json:"text"`
	Logprobs     *struct{} `json:"logprobs"`
	FinishReason string    `json:"finish_reason"`
	StopReason   *string   `json:"stop_reason"`
}

// usage of a finished call: prompt tokens once per prompt, the cached hit
// of each prompt's first choice (vLLM reports the request's
// num_cached_tokens), completion tokens over all choices.
func (j *job) usage(cl *call) openai.Usage {
	u := openai.Usage{}
	cached := 0
	for pi, in := range j.prompts {
		u.PromptTokens += in.tokens
		cached += cl.choices[pi*j.n].cached
	}
	for _, c := range cl.choices {
		u.CompletionTokens += c.total
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	u.PromptTokensDetails = &openai.PromptTokensDetails{CachedTokens: cached}
	return u
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

func idPrefix(k prompt.Kind) string {
	if k == prompt.Chat || k == prompt.Messages { // vLLM's Messages answer takes its chat completion's id
		return "chatcmpl-"
	}
	return "cmpl-"
}
