package gateway

import (
	"bytes"
	"encoding/json"
	"net/http"

	"github.com/kvgate/kvgate/internal/openai"
)

// The Anthropic Messages API (/v1/messages) as vLLM serves it: routed by
// the policy as the chat vLLM converts it to (prompt/messages.go), its
// usage read from the answer in Anthropic's terms.

// errIsolatedMessages refuses an isolate_cache tenant's /v1/messages: vLLM's
// Messages request takes no cache_salt (its handler builds the chat
// request without one), so the gateway cannot keep the tenant's KV apart
// from the others'. Sending the request would share it silently.
var errIsolatedMessages = &apiError{Status: http.StatusForbidden, Type: "invalid_request_error", Code: "cache_isolation_unsupported",
	Message: "this tenant isolates its KV cache (isolate_cache), and vLLM's /v1/messages API takes no cache_salt, " +
		"so the request would share its KV with other tenants; use /v1/chat/completions instead"}

// messagesUsage is the Messages API's usage object. vLLM reports
// input_tokens as the prompt's tokens; since it reports cache use
// (vllm-project/vllm#40912) it follows Anthropic's contract instead:
// input_tokens are the uncached ones, the prompt is input_tokens +
// cache_read_input_tokens + cache_creation_input_tokens, and the cache
// fields are absent when unknown.
type messagesUsage struct {
	InputTokens   int  `json:"input_tokens"`
	OutputTokens  int  `json:"output_tokens"`
	CacheRead     *int `json:"cache_read_input_tokens"`
	CacheCreation *int `json:"cache_creation_input_tokens"`
}

// usage is u in the chat API's terms (no prompt_tokens_details: cached
// not reported). Each count is bounded before they are added (a
// replica's answer is an outside value; boundedUsage bounds the sums).
func (u *messagesUsage) usage() *openai.Usage {
	clamp := func(v int) int { return min(max(v, 0), maxUsageTokens) }
	out := &openai.Usage{PromptTokens: clamp(u.InputTokens), CompletionTokens: clamp(u.OutputTokens)}
	if u.CacheRead != nil {
		read := clamp(*u.CacheRead)
		out.PromptTokens += read
		out.PromptTokensDetails = &openai.PromptTokensDetails{CachedTokens: read}
	}
	if u.CacheCreation != nil {
		out.PromptTokens += clamp(*u.CacheCreation)
	}
	out.TotalTokens = out.PromptTokens + out.CompletionTokens
	return out
}

// merge takes the fields an event's usage reports over the ones an
// earlier event reported: message_start names the input (and, since
// #40912, the cache use), message_delta the output and again the input.
func (u *messagesUsage) merge(next *messagesUsage) {
	if next.InputTokens > 0 {
		u.InputTokens = next.InputTokens
	}
	u.OutputTokens = next.OutputTokens
	if next.CacheRead != nil {
		u.CacheRead = next.CacheRead
	}
	if next.CacheCreation != nil {
		u.CacheCreation = next.CacheCreation
	}
}

// messagesBodyUsage reads the usage of a whole Messages answer from its
// last bytes (nil when absent).
func messagesBodyUsage(tail []byte) *openai.Usage {
	obj, ok := lastUsageValue(tail)
	var u messagesUsage
	if !ok || json.Unmarshal(obj, &u) != nil {
		return nil
	}
	return u.usage()
}

// messagesStream is what a Messages stream told so far.
type messagesStream struct{ usage messagesUsage }

// messagesEvent is what the gateway reads of a Messages stream event.
type messagesEvent struct {
	Type    string         `json:"type"`
	Usage   *messagesUsage `json:"usage"` // message_delta's
	Message *struct {
		Usage *messagesUsage `json:"usage"`
	} `json:"message"` // message_start's
}

// inspectMessages reads one Messages stream event for the first token
// (the first content block), the usage (message_start, message_delta) and
// the end (message_stop: the stream has no [DONE]). The usage is noted at
// message_delta, the answer's end: message_start's alone (no output yet)
// would settle a quota as if nothing were generated.
func (g *Gateway) inspectMessages(data []byte, a *attempt, st *messagesStream, sawEnd *bool) {
	if !a.firstAt.IsZero() && !bytes.Contains(data, []byte(`"usage"`)) && !bytes.Contains(data, []byte("message_stop")) {
		return // nothing left to learn from this event: skip the decoding
	}
	var ev messagesEvent
	if json.Unmarshal(data, &ev) != nil {
		return
	}
	switch ev.Type {
	case "message_start":
		if ev.Message != nil && ev.Message.Usage != nil {
			st.usage.merge(ev.Message.Usage)
		}
	case "content_block_start", "content_block_delta":
		if a.firstAt.IsZero() {
			a.firstAt = g.clock.Now()
			a.tk.FirstToken(a.firstAt)
			traceFirstToken(a)
		}
	case "message_delta":
		if ev.Usage != nil {
			st.usage.merge(ev.Usage)
			a.noteUsage(st.usage.usage())
		}
	case "message_stop":
		*sawEnd = true
	}
}
