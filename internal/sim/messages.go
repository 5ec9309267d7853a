package sim

import (
	"encoding/json"
	"net/http"

	"github.com/kvgate/kvgate/internal/openai"
)

// The Anthropic Messages API (POST /v1/messages) as vLLM serves it
// (vllm/entrypoints/anthropic: AnthropicServingMessages): the request
// converted to a chat completion (prompt.Parse reads it as the chat vLLM
// builds, so the prompt's tokens and blocks are the chat's), and the
// answer converted back. Not streamed: one message, its text one content
// block, its id the chat completion's (chatcmpl-…), stop_reason from the
// finish reason (stop: end_turn, length: max_tokens), the usage in
// Anthropic's terms. Streamed: message_start (the input tokens),
// content_block_start, a content_block_delta (text_delta) per token,
// content_block_stop, message_delta (stop_reason and the usage), then
// message_stop and vLLM's trailing [DONE]. The usage follows Anthropic's
// contract, as vLLM since it reports cache use: input_tokens are the
// prompt's uncached tokens, cache_read_input_tokens the cached ones.

// messagesKeys are the top-level fields of a Messages request handed to
// prompt.Parse by their exact keys (their values whole: content blocks and
// tools have fields of their own).
var messagesKeys = keys{"model": nil, "system": nil, "messages": nil, "tools": nil, "tool_choice": nil,
	"stream": nil, "max_tokens": nil, "metadata": nil}

// stopReasons maps vLLM's finish reasons to Anthropic's stop_reason.
var stopReasons = map[string]string{finishStop: "end_turn", finishLength: "max_tokens"}

// messagesUsage is a Messages answer's usage, with the sim's timing.
type messagesUsage struct {
	InputTokens  int     `json:"input_tokens"`
	OutputTokens int     `json:"output_tokens"`
	CacheRead    *int    `json:"cache_read_input_tokens,omitempty"`
	Timing       *Timing `json:"kvgate_sim,omitempty"`
}

// messagesUsageOf is u in Anthropic's terms.
func messagesUsageOf(u openai.Usage, t *Timing) messagesUsage {
	out := messagesUsage{InputTokens: u.PromptTokens, OutputTokens: u.CompletionTokens, Timing: t}
	if d := u.PromptTokensDetails; d != nil {
		cached := d.CachedTokens
		out.InputTokens, out.CacheRead = u.PromptTokens-cached, &cached
	}
	return out
}

type messageBlock struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// message is a Messages answer (streamed: message_start's, without
// content, stop_reason or output).
type message struct {
	ID           string         `json:"id"`
	Type         string         `json:"type"`
	Role         string         `json:"role"`
	Content      []messageBlock `json:"content"`
	Model        string         `json:"model"`
	StopReason   *string        `json:"stop_reason"`
	StopSequence *string        `json:"stop_sequence"`
	Usage        messagesUsage  `json:"usage"`
}

// respondMessages answers a non-streamed Messages call, finished.
func (r *Replica) respondMessages(w http.ResponseWriter, j *job, cl *call, id string) {
	c := cl.choices[0]
	m := message{ID: id, Type: "message", Role: "assistant", Model: j.model,
		Content: []messageBlock{{Type: "text", Text: string(c.gen.appendText(nil, c.total))}},
		Usage:   messagesUsageOf(j.usage(cl), r.timing(j, cl))}
	if reason, ok := stopReasons[c.reason]; ok {
		m.StopReason = &reason
	}
	writeJSON(w, m)
}

// messagesWriter formats a streamed Messages call's events as vLLM does
// (a chunkWriter).
type messagesWriter struct {
	j       *job
	id      string
	buf     []byte
	started bool // message_start written
	tokens  bool // the last take wrote a token
	reason  string
}

func newMessagesWriter(j *job, id string) *messagesWriter {
	return &messagesWriter{j: j, id: id}
}

// streamEvent is a Messages stream event's data, its type first as
// vLLM's (pydantic's field order) writes it.
type streamEvent struct {
	Type         string         `json:"type"`
	Index        *int           `json:"index,omitempty"`
	Message      *message       `json:"message,omitempty"`
	ContentBlock *messageBlock  `json:"content_block,omitempty"`
	Delta        any            `json:"delta,omitempty"`
	Usage        *messagesUsage `json:"usage,omitempty"`
}

var block0 = new(int) // content block 0: the text

// event appends one SSE event, named by its type.
func (s *messagesWriter) event(v streamEvent) {
	b, _ := json.Marshal(v)
	s.buf = append(s.buf, "event: "...)
	s.buf = append(s.buf, v.Type...)
	s.buf = append(s.buf, "\ndata: "...)
	s.buf = append(s.buf, b...)
	s.buf = append(s.buf, "\n\n"...)
}

// start is message_start, with the prompt's usage (cached: its tokens the
// replica held), and the text block's start: vLLM sends them with its
// first chunk, the role's, which comes with the first token.
func (s *messagesWriter) start(cached int) {
	s.started = true
	u := messagesUsageOf(openai.Usage{PromptTokens: s.j.prompts[0].tokens,
		PromptTokensDetails: &openai.PromptTokensDetails{CachedTokens: cached}}, nil)
	s.event(streamEvent{Type: "message_start", Message: &message{ID: s.id, Type: "message",
		Role: "assistant", Content: []messageBlock{}, Model: s.j.model, Usage: u}})
	s.event(streamEvent{Type: "content_block_start", Index: block0, ContentBlock: &messageBlock{Type: "text"}})
}

func (s *messagesWriter) take(cl *call) (all bool) {
	cl.mu.Lock()
	c := cl.choices[0]
	n, cached := c.pending, c.cached
	c.pending = 0
	all = c.finished
	s.reason = c.reason
	cl.mu.Unlock()
	s.buf, s.tokens = s.buf[:0], n > 0
	if !s.started && (n > 0 || all) {
		s.start(cached)
	}
	for range n {
		s.event(streamEvent{Type: "content_block_delta", Index: block0, Delta: messageBlock{Type: "text_delta", Text: c.gen.next()}})
	}
	return all
}

func (s *messagesWriter) tookTokens() bool { return s.tokens }

func (s *messagesWriter) end(u openai.Usage, t *Timing, _ bool) {
	s.event(streamEvent{Type: "content_block_stop", Index: block0})
	delta := map[string]any{}
	if reason, ok := stopReasons[s.reason]; ok {
		delta["stop_reason"] = reason
	}
	usage := messagesUsageOf(u, t)
	s.event(streamEvent{Type: "message_delta", Delta: delta, Usage: &usage})
	s.event(streamEvent{Type: "message_stop"})
	s.buf = append(s.buf, "data: "+openai.DoneData+"\n\n"...)
}

func (s *messagesWriter) out() []byte { return s.buf }
