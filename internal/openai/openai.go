// Package openai is kvgate's one home for the OpenAI wire format as vLLM and
// SGLang speak it: streamed chunks and non-streamed responses (only what a
// router reads of them), usage with cached prompt tokens, the error body,
// what counts as a generated token, and a server-sent-events reader whose
// line and event lengths are bounded, so that a replica sending a line with
// no end cannot make its reader hold the line whole.
//
// The gateway, bench, chaos and sim all read and write through it, so they
// agree on what a first token is.
package openai

import (
	"bytes"
	"encoding/json"
	"net/http"
)

// DoneData is the data of the event that ends an OpenAI stream.
const DoneData = "[DONE]"

// IsDone reports whether an event's data is the stream's terminator.
func IsDone(data []byte) bool { return bytes.Equal(bytes.TrimSpace(data), []byte(DoneData)) }

// Usage is a response's token accounting.
type Usage struct {
	PromptTokens        int                  `json:"prompt_tokens"`
	CompletionTokens    int                  `json:"completion_tokens"`
	TotalTokens         int                  `json:"total_tokens"`
	PromptTokensDetails *PromptTokensDetails `json:"prompt_tokens_details,omitempty"`
}

// PromptTokensDetails carries the prompt tokens the engine found in its
// prefix cache (vLLM with --enable-prompt-tokens-details, and kvgate sim).
type PromptTokensDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

// Cached is the cached prompt tokens, -1 when the usage does not say.
func (u *Usage) Cached() int {
	if u == nil || u.PromptTokensDetails == nil {
		return -1
	}
	return u.PromptTokensDetails.CachedTokens
}

// Delta is what a chat chunk adds to a choice.
type Delta struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content,omitempty"`
	// ReasoningContent (vLLM's reasoning parsers, DeepSeek's API) and
	// Reasoning (newer vLLM) carry a reasoning model's thinking tokens.
	ReasoningContent string          `json:"reasoning_content,omitempty"`
	Reasoning        string          `json:"reasoning,omitempty"`
	ToolCalls        json.RawMessage `json:"tool_calls,omitempty"`
}

// ChunkChoice is one choice of a streamed chunk (completions use Text,
// chat uses Delta).
type ChunkChoice struct {
	Index        int     `json:"index"`
	Text         string  `json:"text,omitempty"`
	Delta        *Delta  `json:"delta,omitempty"`
	FinishReason *string `json:"finish_reason"`
}

// Chunk is one streamed event's data: a completions or chat chunk.
type Chunk struct {
	ID      string        `json:"id,omitempty"`
	Object  string        `json:"object,omitempty"`
	Created int64         `json:"created,omitempty"`
	Model   string        `json:"model,omitempty"`
	Choices []ChunkChoice `json:"choices"`
	Usage   *Usage        `json:"usage,omitempty"`
}

// HasToken reports whether the chunk carries at least one generated token:
// completion text, chat content, reasoning, or a tool-call delta. A chunk
// with only a role, only a finish reason or only usage carries none. This
// is the single definition of "first token" for TTFT in kvgate.
func (c *Chunk) HasToken() bool {
	for i := range c.Choices {
		ch := &c.Choices[i]
		if ch.Text != "" {
			return true
		}
		if d := ch.Delta; d != nil && (d.Content != "" || d.ReasoningContent != "" || d.Reasoning != "" ||
			hasToolCalls(d.ToolCalls)) {
			return true
		}
	}
	return false
}

func hasToolCalls(raw json.RawMessage) bool {
	t := bytes.TrimSpace(raw)
	return len(t) > 0 && !bytes.Equal(t, []byte("null")) && !bytes.Equal(t, []byte("[]"))
}

// ParseChunk decodes one event's data as a chunk.
func ParseChunk(data []byte) (*Chunk, error) {
	var c Chunk
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, err
	}
	return &c, nil
}

// Response is what a router reads of a non-streamed completions or chat
// response: its usage.
type Response struct {
	Usage *Usage `json:"usage"`
}

// ParseUsage is the usage of a non-streamed response body (nil when it has
// none or is not JSON).
func ParseUsage(body []byte) *Usage {
	var r Response
	if json.Unmarshal(body, &r) != nil {
		return nil
	}
	return r.Usage
}

// Error is the body of an error in OpenAI's shape.
type Error struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    any     `json:"code"`
}

// ErrorBody is {"error": {...}}.
type ErrorBody struct {
	Error Error `json:"error"`
}

// ErrorJSON is the JSON of an error body (param omitted when empty).
func ErrorJSON(message, typ, code, param string) []byte {
	b := ErrorBody{Error: Error{Message: message, Type: typ, Code: code}}
	if param != "" {
		b.Error.Param = &param
	}
	out, _ := json.Marshal(b)
	return out
}

// ParseError reads an error body in OpenAI's shape, or vLLM's older flat
// one ({"object": "error", "message": ...}). ok is false when body is
// neither.
func ParseError(body []byte) (e Error, ok bool) {
	var nested ErrorBody
	if json.Unmarshal(body, &nested) == nil && nested.Error.Message != "" {
		return nested.Error, true
	}
	var flat struct {
		Object string `json:"object"`
		Error
	}
	if json.Unmarshal(body, &flat) == nil && flat.Object == "error" && flat.Message != "" {
		return flat.Error, true
	}
	return Error{}, false
}

// SSEErrorEvent is a stream's error event: "data: {error body}\n\n", what
// vLLM sends when a stream fails after it started.
func SSEErrorEvent(message, typ, code string) []byte {
	var b bytes.Buffer
	b.WriteString("data: ")
	b.Write(ErrorJSON(message, typ, code, ""))
	b.WriteString("\n\n")
	return b.Bytes()
}

// IsEventStream reports whether a response's header announces SSE.
func IsEventStream(h http.Header) bool {
	ct := h.Get("Content-Type")
	return len(ct) >= len("text/event-stream") && ct[:len("text/event-stream")] == "text/event-stream"
}
