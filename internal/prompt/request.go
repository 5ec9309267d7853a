package prompt

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Kind is the OpenAI endpoint a request was sent to.
type Kind int

const (
	Completion Kind = iota // POST /v1/completions
	Chat                   // POST /v1/chat/completions
)

func (k Kind) String() string {
	if k == Chat {
		return "chat"
	}
	return "completion"
}

// RequestError is a client fault in a request body; the gateway maps it to 400.
type RequestError struct {
	Param string // the offending field, OpenAI's error "param"
	Msg   string
}

func (e *RequestError) Error() string {
	if e.Param == "" {
		return e.Msg
	}
	return e.Param + ": " + e.Msg
}

// ErrInvalid matches every *RequestError with errors.Is.
var ErrInvalid = errors.New("invalid request")

func (e *RequestError) Is(target error) bool { return target == ErrInvalid }

func invalid(param, format string, args ...any) error {
	return &RequestError{Param: param, Msg: fmt.Sprintf(format, args...)}
}

// Message is one chat message. Content is a string or a list of parts.
type Message struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
	Name    string          `json:"name,omitempty"`
	// ToolCalls and ToolCallID are kept raw: they are part of what the model reads.
	ToolCalls  json.RawMessage `json:"tool_calls,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
}

// Parsed is what routing needs from a request body.
type Parsed struct {
	Kind      Kind
	Model     string
	Stream    bool
	MaxTokens int // 0 when absent
	User      string
	CacheSalt string
	// Text is the routing text: the completions prompt (the first one of a
	// batch), or the chat messages rendered in order with their roles, so
	// that a shared system prompt is a shared prefix.
	Text string
	// TokenIDs is set instead of Text when the prompt was given as token ids.
	TokenIDs []uint32
	// KeyText is what prefix-key policies hash: the first user message of a
	// chat (or the prompt of a completion).
	KeyText string
	// System is the chat's leading system prompt ("" when none).
	System string
	// Prompts is the number of prompts of a batched completions request.
	Prompts int
}

// MaxNesting bounds JSON nesting depth of a request body: a body of a million
// '[' must not cost a million stack frames of anyone's decoder.
const MaxNesting = 64

type body struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            []Message       `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	Stream              bool            `json:"stream"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	User                string          `json:"user"`
	CacheSalt           string          `json:"cache_salt"`
}

// Parse reads a completions or chat request body.
func Parse(kind Kind, data []byte) (*Parsed, error) {
	if err := checkNesting(data, MaxNesting); err != nil {
		return nil, err
	}
	var b body
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&b); err != nil {
		return nil, invalid("", "request body is not valid JSON: %v", err)
	}
	if dec.More() {
		return nil, invalid("", "request body has data after the JSON object")
	}
	if b.Model == "" {
		return nil, invalid("model", "you must provide a model parameter")
	}
	p := &Parsed{Kind: kind, Model: b.Model, Stream: b.Stream, User: b.User, CacheSalt: b.CacheSalt}
	switch {
	case b.MaxTokens != nil:
		p.MaxTokens = *b.MaxTokens
	case b.MaxCompletionTokens != nil:
		p.MaxTokens = *b.MaxCompletionTokens
	}
	if p.MaxTokens < 0 {
		return nil, invalid("max_tokens", "must be at least 0, got %d", p.MaxTokens)
	}
	var err error
	if kind == Chat {
		err = p.fromChat(b.Messages, b.Tools)
	} else {
		err = p.fromPrompt(b.Prompt)
	}
	if err != nil {
		return nil, err
	}
	return p, nil
}

func (p *Parsed) fromPrompt(raw json.RawMessage) error {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return invalid("prompt", "you must provide a prompt")
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return invalid("prompt", "%v", err)
		}
		p.Text, p.KeyText, p.Prompts = s, s, 1
		return nil
	case '[':
	default:
		return invalid("prompt", "must be a string, a list of strings or a list of token ids")
	}
	var list []json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil {
		return invalid("prompt", "%v", err)
	}
	if len(list) == 0 {
		return invalid("prompt", "must not be empty")
	}
	first := bytes.TrimSpace(list[0])
	switch {
	case len(first) > 0 && first[0] == '"': // list of strings: a batch; route on the first
		var ss []string
		if err := json.Unmarshal(raw, &ss); err != nil {
			return invalid("prompt", "a list of prompts must hold only strings: %v", err)
		}
		p.Text, p.KeyText, p.Prompts = ss[0], ss[0], len(ss)
	case len(first) > 0 && first[0] == '[': // list of token-id lists
		var ids [][]uint32
		if err := json.Unmarshal(raw, &ids); err != nil {
			return invalid("prompt", "a list of token-id prompts must hold lists of non-negative integers: %v", err)
		}
		p.TokenIDs, p.Prompts = ids[0], len(ids)
	default: // one prompt as token ids
		var ids []uint32
		if err := json.Unmarshal(raw, &ids); err != nil {
			return invalid("prompt", "token ids must be non-negative integers: %v", err)
		}
		p.TokenIDs, p.Prompts = ids, 1
	}
	return nil
}

func (p *Parsed) fromChat(msgs []Message, tools json.RawMessage) error {
	if len(msgs) == 0 {
		return invalid("messages", "you must provide at least one message")
	}
	var sb strings.Builder
	if t := bytes.TrimSpace(tools); len(t) > 0 && string(t) != "null" {
		// Chat templates put tool definitions ahead of the conversation.
		sb.WriteString("<|tools|>\n")
		sb.Write(t)
		sb.WriteString("\n")
	}
	for i, m := range msgs {
		text, err := ContentText(m.Content)
		if err != nil {
			return invalid(fmt.Sprintf("messages[%d].content", i), "%v", err)
		}
		if m.Role == "" {
			return invalid(fmt.Sprintf("messages[%d].role", i), "a message needs a role")
		}
		p.noteMessage(i, m.Role, text)
		RenderMessage(&sb, m.Role, text)
		if len(m.ToolCalls) > 0 {
			sb.Write(m.ToolCalls)
			sb.WriteString("\n")
		}
	}
	p.Text = sb.String()
	p.finishChat()
	return nil
}

// noteMessage takes a chat's routing keys from message i: the leading system
// prompt and the first user message.
func (p *Parsed) noteMessage(i int, role, text string) {
	if i == 0 && role == "system" {
		p.System = text
	}
	if p.KeyText == "" && role == "user" {
		p.KeyText = text
	}
}

func (p *Parsed) finishChat() {
	if p.KeyText == "" {
		p.KeyText = p.Text
	}
	p.Prompts = 1
}

// ChatParsed is what Parse makes of a chat request with these messages
// (and no tools), given their rendering text = RenderChat(roles, contents):
// load generators and the replay use it so that their routing keys are the
// gateway's.
func ChatParsed(model string, roles, contents []string, text string, maxTokens int) Parsed {
	p := Parsed{Kind: Chat, Model: model, MaxTokens: maxTokens, Text: text}
	for i, role := range roles {
		p.noteMessage(i, role, contents[i])
	}
	p.finishChat()
	return p
}

// RenderMessage appends one chat message as the routing text renders it:
// "<|role|>\ncontent\n". Rendering is append-only, so a conversation's next
// turn extends the previous turn's text and shares its blocks.
func RenderMessage(sb *strings.Builder, role, content string) {
	sb.WriteString("<|")
	sb.WriteString(role)
	sb.WriteString("|>\n")
	sb.WriteString(content)
	sb.WriteString("\n")
}

// RenderChat renders messages given as (role, content) pairs; used by load
// generators so that their token counts equal the gateway's and the sim's.
func RenderChat(roles, contents []string) string {
	var sb strings.Builder
	for i := range roles {
		RenderMessage(&sb, roles[i], contents[i])
	}
	return sb.String()
}

// ContentText returns a message content's text: a string, or the text parts
// of a list (image and audio parts contribute their URL or data, so that
// different media never share a prefix).
func ContentText(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		err := json.Unmarshal(raw, &s)
		return s, err
	}
	if raw[0] != '[' {
		return "", errors.New("content must be a string or a list of parts")
	}
	var parts []struct {
		Type     string `json:"type"`
		Text     string `json:"text"`
		ImageURL *struct {
			URL string `json:"url"`
		} `json:"image_url"`
		InputAudio *struct {
			Data string `json:"data"`
		} `json:"input_audio"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", err
	}
	var sb strings.Builder
	for _, pt := range parts {
		switch {
		case pt.Type == "text":
			sb.WriteString(pt.Text)
		case pt.ImageURL != nil:
			sb.WriteString("<|image|>")
			sb.WriteString(pt.ImageURL.URL)
		case pt.InputAudio != nil:
			sb.WriteString("<|audio|>")
			sb.WriteString(pt.InputAudio.Data)
		}
	}
	return sb.String(), nil
}

// checkNesting rejects JSON nested deeper than max, scanning bytes (strings
// skipped) before any decoder recurses into it.
func checkNesting(data []byte, max int) error {
	depth, inStr, esc := 0, false, false
	for _, c := range data {
		if inStr {
			switch {
			case esc:
				esc = false
			case c == '\\':
				esc = true
			case c == '"':
				inStr = false
			}
			continue
		}
		switch c {
		case '"':
			inStr = true
		case '{', '[':
			depth++
			if depth > max {
				return invalid("", "JSON nested deeper than %d levels", max)
			}
		case '}', ']':
			depth--
		}
	}
	return nil
}

// Blocks returns the prompt's token count under tok and appends its chained
// full-block hashes to dst. Token-id prompts are hashed as given; text under
// the Approx tokenizer is hashed in place.
func (p *Parsed) Blocks(dst []uint64, tok Tokenizer, root uint64, blockSize int) (int, []uint64) {
	if p.TokenIDs != nil {
		return len(p.TokenIDs), BlockHashes(dst, root, TokenBytes(nil, p.TokenIDs), blockSize)
	}
	return TextBlocks(dst, tok, root, p.Text, blockSize)
}

// TextBlocks is Blocks for text.
func TextBlocks(dst []uint64, tok Tokenizer, root uint64, text string, blockSize int) (int, []uint64) {
	if _, ok := tok.(Approx); ok || tok == nil {
		n := (Approx{}).Count(text)
		if dst == nil && blockSize > 0 {
			dst = make([]uint64, 0, n/blockSize) // one allocation, exactly sized
		}
		return n, ApproxBlockHashes(dst, root, text, blockSize)
	}
	ids := tok.Encode(nil, text)
	return len(ids), BlockHashes(dst, root, TokenBytes(nil, ids), blockSize)
}
