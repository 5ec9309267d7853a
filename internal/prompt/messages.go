package prompt

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// The Anthropic Messages API (/v1/messages and /v1/messages/count_tokens),
// as vLLM serves it (vllm/entrypoints/anthropic): vLLM converts the request
// to a chat completion and runs that. So routing reads it as that chat:
// the converted messages are rendered as a chat's (RenderMessage), system
// first, and one conversation's next turn extends the previous turn's text
// and shares its blocks. The conversion follows vLLM's
// _convert_anthropic_to_openai_request:
//
//   - system (a string, or text blocks) and the system messages inside
//     messages are joined with "" into one system message, leaving out the
//     text blocks starting with billingHeader (Claude Code's per-request
//     hash, which would defeat prefix caching);
//   - roles ctx and msg (Claude Code ≥ 2.1.154) are user's;
//   - a message's text blocks are its content, images image_url parts,
//     thinking its reasoning, tool_use blocks its tool_calls (arguments:
//     the input as Python's json.dumps writes it), and a user's
//     tool_result a "tool" message of its own, ahead of the message (its
//     images a user message after it); a user message left without
//     content is dropped.

// billingHeader starts the system text block Claude Code adds to each
// request (x-anthropic-billing-header: …, a hash that changes per request).
const billingHeader = "x-anthropic-billing-header"

// anthropicBlockTypes are the content block types vLLM's
// AnthropicContentBlock takes; any other is refused (as vLLM does, 400).
var anthropicBlockTypes = map[string]bool{"text": true, "image": true, "tool_use": true, "tool_result": true,
	"tool_reference": true, "thinking": true, "redacted_thinking": true}

// anthropicBlock is one content block of a Messages request.
type anthropicBlock struct {
	Type      string          `json:"type"`
	Text      *string         `json:"text"`
	Source    json.RawMessage `json:"source"`
	ID        string          `json:"id"`
	ToolUseID string          `json:"tool_use_id"`
	Name      string          `json:"name"`
	Input     json.RawMessage `json:"input"`
	Content   json.RawMessage `json:"content"`
	Thinking  *string         `json:"thinking"`
}

// ChatMessage is one chat message of a converted Messages request, in the
// chat API's shape (a replica's /tokenize takes it so).
type ChatMessage struct {
	Role       string     `json:"role"`
	Content    any        `json:"content,omitempty"` // a string, or []chatPart
	Reasoning  string     `json:"reasoning,omitempty"`
	ToolCalls  []ToolCall `json:"tool_calls,omitempty"`
	ToolCallID *string    `json:"tool_call_id,omitempty"`
}

// ToolCall is a chat message's tool call.
type ToolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// chatPart is one part of a chat message's content: text or an image.
type chatPart struct {
	Type     string `json:"type"`
	Text     string `json:"text,omitempty"`
	ImageURL *struct {
		URL string `json:"url"`
	} `json:"image_url,omitempty"`
}

// fromAnthropic reads a Messages request (count: a count_tokens one,
// which generates nothing and has no max_tokens).
func (p *Parsed) fromAnthropic(count bool, b *body) error {
	// vLLM's Messages request takes no cache_salt: a client's never
	// reaches the engine, so it does not partition the routing key. (Nor
	// priority: a client's orders the gateway's own queue only.)
	p.CacheSalt = ""
	if !count {
		if b.MaxTokens == nil {
			return invalid("max_tokens", "you must provide max_tokens")
		}
		if *b.MaxTokens < 1 {
			return invalid("max_tokens", "must be at least 1, got %d", *b.MaxTokens)
		}
	}
	if err := p.anthropicMetadata(b.raw); err != nil {
		return err
	}
	msgs, err := AnthropicChat(b.raw, b.Messages)
	if err != nil {
		return err
	}
	tools, err := anthropicTools(b.Tools)
	if err != nil {
		return err
	}
	var sb strings.Builder
	if tools != nil {
		sb.WriteString("<|tools|>\n") // ahead of the conversation, as a chat's
		sb.Write(bytes.TrimSpace(b.Tools))
		sb.WriteString("\n")
	}
	for i := range msgs {
		m := &msgs[i]
		text := m.text()
		p.noteMessage(i, m.Role, text)
		RenderMessage(&sb, m.Role, text)
		if len(m.ToolCalls) > 0 {
			calls, _ := json.Marshal(m.ToolCalls) // strings only: cannot fail
			sb.Write(calls)
			sb.WriteString("\n")
		}
	}
	p.Text = sb.String()
	p.finishChat()
	return nil
}

// anthropicMetadata reads metadata.user_id: the request's user, and the
// session Claude Code names in it (its program, as prompt_cache_key names
// one): "user_<hash>_account_<uuid>_session_<uuid>", or, in later
// versions, a JSON object with session_id. Its subagents (and its side
// calls: a title, a summary) send the same session: SessionShared.
func (p *Parsed) anthropicMetadata(raw members) error {
	v, ok := raw.get("metadata")
	if !ok || isNull(v) {
		return nil
	}
	var md map[string]json.RawMessage
	if json.Unmarshal(v, &md) != nil || md == nil {
		return invalid("metadata", "must be an object")
	}
	u := md["user_id"]
	if len(u) == 0 || isNull(u) {
		return nil
	}
	if json.Unmarshal(u, &p.User) != nil {
		return invalid("metadata.user_id", "must be a string")
	}
	if i := strings.LastIndex(p.User, "_session_"); i >= 0 {
		p.PromptCacheKey = p.User[i+len("_session_"):]
		p.SessionShared = p.PromptCacheKey != "" // an empty one names none
		return nil
	}
	var o struct {
		SessionID string `json:"session_id"`
	}
	if strings.HasPrefix(p.User, "{") && json.Unmarshal([]byte(p.User), &o) == nil {
		p.PromptCacheKey, p.SessionShared = o.SessionID, o.SessionID != ""
	}
	return nil
}

// AnthropicChat converts a Messages request (its members raw, its messages
// msgs) into the chat messages vLLM makes of it; a client's fault is a
// *RequestError naming the field.
func AnthropicChat(raw members, msgs []Message) ([]ChatMessage, error) {
	if len(msgs) == 0 {
		return nil, invalid("messages", "you must provide at least one message")
	}
	system, err := anthropicSystem(raw.val("system"), msgs)
	if err != nil {
		return nil, err
	}
	out := make([]ChatMessage, 0, len(msgs)+1)
	if system != "" {
		out = append(out, ChatMessage{Role: "system", Content: system})
	}
	for i := range msgs {
		if out, err = appendAnthropic(out, i, &msgs[i]); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// AnthropicChatOf is AnthropicChat of a whole request body, with its
// tools in the chat API's shape (nil: none), as vLLM converts them. The
// body is a client's: its nesting is bounded before any decoder recurses
// into it, as Parse bounds it (PyJSON recurses too).
func AnthropicChatOf(data []byte) ([]ChatMessage, []ChatTool, error) {
	if err := checkNesting(data, MaxNesting); err != nil {
		return nil, nil, err
	}
	b, err := decodeBody(data)
	if err != nil {
		return nil, nil, err
	}
	msgs, err := AnthropicChat(b.raw, b.Messages)
	if err != nil {
		return nil, nil, err
	}
	tools, err := anthropicTools(b.Tools)
	if err != nil {
		return nil, nil, err
	}
	out := make([]ChatTool, len(tools))
	for i, t := range tools {
		out[i] = ChatTool{Type: "function", Function: ChatFunction{Name: t.Name, Description: t.Description}}
		if len(t.InputSchema) > 0 && !isNull(t.InputSchema) {
			out[i].Function.Parameters = t.InputSchema
		}
	}
	return msgs, out, nil
}

// anthropicTools reads a Messages request's tools (nil: none): each an
// object with a name and an input_schema object, as vLLM requires.
func anthropicTools(raw json.RawMessage) ([]anthropicTool, error) {
	var tools []anthropicTool
	if t := bytes.TrimSpace(raw); len(t) == 0 || isNull(t) {
		return nil, nil
	}
	if err := json.Unmarshal(raw, &tools); err != nil {
		return nil, invalid("tools", "must be a list of tools: %s", jsonTypeError(err))
	}
	for i := range tools {
		if s := bytes.TrimSpace(tools[i].InputSchema); tools[i].Name == "" || len(s) == 0 || s[0] != '{' {
			return nil, invalid(fmt.Sprintf("tools[%d]", i), "a tool needs a name and an input_schema object")
		}
	}
	return tools, nil
}

// anthropicTool is a Messages request's tool definition.
type anthropicTool struct {
	Name        string          `json:"name"`
	Description *string         `json:"description"`
	InputSchema json.RawMessage `json:"input_schema"`
}

// ChatTool is a tool definition in the chat API's shape: vLLM makes a
// Messages tool's input_schema the function's parameters.
type ChatTool struct {
	Type     string       `json:"type"`
	Function ChatFunction `json:"function"`
}

// ChatFunction is a chat tool's function.
type ChatFunction struct {
	Name        string          `json:"name"`
	Description *string         `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
}

// anthropicRole is a message's role as vLLM reads it ("" for one it refuses).
func anthropicRole(role string) string {
	switch role {
	case "user", "assistant", "system":
		return role
	case "ctx", "msg":
		return "user"
	}
	return ""
}

// anthropicSystem is the system prompt: the system field's text and the
// system messages', joined with "", billing headers left out.
func anthropicSystem(sys json.RawMessage, msgs []Message) (string, error) {
	var sb strings.Builder
	if err := systemText(&sb, "system", sys); err != nil {
		return "", err
	}
	for i := range msgs {
		if anthropicRole(msgs[i].Role) == "system" {
			if err := systemText(&sb, fmt.Sprintf("messages[%d].content", i), msgs[i].Content); err != nil {
				return "", err
			}
		}
	}
	return sb.String(), nil
}

// systemText appends the text of a system content (a string, or blocks).
func systemText(sb *strings.Builder, param string, raw json.RawMessage) error {
	s, blocks, err := anthropicContent(param, raw, true)
	if err != nil {
		return err
	}
	sb.WriteString(s)
	for _, bl := range blocks {
		if bl.Type == "text" && bl.Text != nil && !strings.HasPrefix(*bl.Text, billingHeader) {
			sb.WriteString(*bl.Text)
		}
	}
	return nil
}

// anthropicContent reads a content: a string, or a list of blocks, each
// of a type vLLM takes. optional: absent or null is no content (the
// system field); a message's content is required.
func anthropicContent(param string, raw json.RawMessage, optional bool) (string, []anthropicBlock, error) {
	raw = bytes.TrimSpace(raw)
	switch {
	case len(raw) == 0 || isNull(raw):
		if optional {
			return "", nil, nil
		}
		return "", nil, invalid(param, "a message needs a content")
	case raw[0] == '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", nil, invalid(param, "%v", err)
		}
		return s, nil, nil
	case raw[0] != '[':
		return "", nil, invalid(param, "must be a string or a list of content blocks")
	}
	var blocks []anthropicBlock
	if err := json.Unmarshal(raw, &blocks); err != nil {
		return "", nil, invalid(param, "must be a list of content blocks: %s", jsonTypeError(err))
	}
	if len(blocks) == 0 && !optional {
		return "", nil, invalid(param, "must not be empty") // as vLLM refuses it
	}
	for j := range blocks {
		if !anthropicBlockTypes[blocks[j].Type] {
			return "", nil, invalid(fmt.Sprintf("%s[%d].type", param, j), "unknown content block type %q", blocks[j].Type)
		}
		if in := bytes.TrimSpace(blocks[j].Input); len(in) > 0 && in[0] != '{' && !isNull(in) {
			return "", nil, invalid(fmt.Sprintf("%s[%d].input", param, j), "a tool_use block's input must be an object")
		}
	}
	return "", blocks, nil
}

// appendAnthropic appends the chat messages message i converts to.
func appendAnthropic(out []ChatMessage, i int, m *Message) ([]ChatMessage, error) {
	role := anthropicRole(m.Role)
	if role == "" {
		return nil, invalid(fmt.Sprintf("messages[%d].role", i), "must be user or assistant, got %q", m.Role)
	}
	param := fmt.Sprintf("messages[%d].content", i)
	s, blocks, err := anthropicContent(param, m.Content, false)
	if err != nil || role == "system" {
		return out, err // a system message went into the system prompt
	}
	if blocks == nil {
		return append(out, ChatMessage{Role: role, Content: s}), nil
	}
	cm := ChatMessage{Role: role}
	var parts []chatPart
	var reasoning strings.Builder
	for j := range blocks {
		bl := &blocks[j]
		switch bl.Type {
		case "text":
			if bl.Text != nil && *bl.Text != "" {
				parts = append(parts, chatPart{Type: "text", Text: *bl.Text})
			}
		case "image":
			if len(bl.Source) > 0 && !isNull(bl.Source) {
				parts = append(parts, imagePart(bl.Source))
			}
		case "thinking":
			if bl.Thinking != nil {
				reasoning.WriteString(*bl.Thinking)
			}
		case "tool_use":
			cm.ToolCalls = append(cm.ToolCalls, toolCallOf(bl))
		case "tool_result":
			if role == "user" {
				out = appendToolResult(out, bl)
			} else {
				parts = append(parts, chatPart{Type: "text", Text: "Tool result: " + string(bytes.TrimSpace(bl.Content))})
			}
		}
	}
	cm.Reasoning = reasoning.String()
	switch {
	case len(parts) == 1 && parts[0].Type == "text":
		cm.Content = parts[0].Text
	case len(parts) > 0:
		cm.Content = parts
	}
	if role == "user" && cm.Content == nil {
		return out, nil // only tool results: vLLM drops the message
	}
	return append(out, cm), nil
}

// imagePart is an image block's chat part: a URL source's URL, else a
// data URI of its base64 data.
func imagePart(src json.RawMessage) chatPart {
	var s struct {
		Type      string `json:"type"`
		URL       string `json:"url"`
		MediaType string `json:"media_type"`
		Data      string `json:"data"`
	}
	_ = json.Unmarshal(src, &s) // a source of another shape: an empty data URI, as vLLM makes
	url := s.URL
	if s.Type != "url" {
		mt := s.MediaType
		if mt == "" {
			mt = "image/jpeg"
		}
		url = "data:" + mt + ";base64," + s.Data
	}
	pt := chatPart{Type: "image_url", ImageURL: &struct {
		URL string `json:"url"`
	}{url}}
	return pt
}

// toolCallOf is a tool_use block's tool call.
func toolCallOf(bl *anthropicBlock) ToolCall {
	tc := ToolCall{ID: bl.ID, Type: "function"}
	tc.Function.Name = bl.Name
	in := bytes.TrimSpace(bl.Input)
	if len(in) == 0 || isNull(in) {
		in = []byte("{}")
	}
	tc.Function.Arguments = PyJSON(in)
	return tc
}

// appendToolResult appends a user's tool_result as vLLM does: a "tool"
// message of its text (text items joined with "\n"), then a user message
// of its images, if any.
func appendToolResult(out []ChatMessage, bl *anthropicBlock) []ChatMessage {
	id := bl.ToolUseID
	var text string
	var images []chatPart
	c := bytes.TrimSpace(bl.Content)
	switch {
	case len(c) > 0 && c[0] == '"':
		_ = json.Unmarshal(c, &text)
	case len(c) > 0 && c[0] == '[':
		var items []anthropicBlock
		_ = json.Unmarshal(c, &items) // items of another shape are skipped, as vLLM skips them
		var texts []string
		for k := range items {
			switch items[k].Type {
			case "text":
				texts = append(texts, deref(items[k].Text))
			case "image":
				images = append(images, imagePart(items[k].Source))
			}
		}
		text = strings.Join(texts, "\n")
	}
	out = append(out, ChatMessage{Role: "tool", ToolCallID: &id, Content: text})
	if len(images) > 0 {
		out = append(out, ChatMessage{Role: "user", Content: images})
	}
	return out
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// text is the message's routing text, as ContentText reads a chat
// message's content: its text parts, an image as its marker and URL.
func (m *ChatMessage) text() string {
	switch c := m.Content.(type) {
	case string:
		return c
	case []chatPart:
		var sb strings.Builder
		for _, pt := range c {
			if pt.ImageURL != nil {
				sb.WriteString("<|image|>")
				sb.WriteString(pt.ImageURL.URL)
			} else {
				sb.WriteString(pt.Text)
			}
		}
		return sb.String()
	}
	return ""
}
