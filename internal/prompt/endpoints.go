package prompt

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// The rest of vLLM's API: what routing reads of an embeddings, Responses,
// tokenize or other request. A prompt, where the endpoint has one, becomes
// routing text as a completion's or a chat's would, so that the same text
// sent to two endpoints of one model shares its blocks.

// fromOther reads the fields of kind's body that routing needs.
func (p *Parsed) fromOther(kind Kind, b *body) error {
	var err error
	switch kind {
	case Embedding, Tokenize:
		err = p.fromPromptOrMessages(kind, b)
	case Responses:
		err = p.fromResponses(b)
	case Messages, CountTokens:
		err = p.fromAnthropic(kind == CountTokens, b)
	}
	return err
}

// fromPromptOrMessages reads an embeddings request (input, or vLLM's chat
// messages) or a tokenize request (prompt, or messages). Without either
// the request has no prompt: it is routed by load and the replica judges.
func (p *Parsed) fromPromptOrMessages(kind Kind, b *body) error {
	if len(b.Messages) > 0 {
		p.Render = renderOf(b.raw)
		return p.fromChat(b.Messages, b.Tools)
	}
	param := "input"
	if kind == Tokenize {
		param = "prompt"
	}
	raw := b.raw.val(param)
	if len(raw) == 0 || isNull(raw) {
		return nil
	}
	return p.fromPrompt(param, raw)
}

// responseItem is one item of a Responses request's input: a message
// (role and content, with or without "type": "message"), or another item
// (function_call, function_call_output, reasoning …), kept raw.
type responseItem struct {
	Type    string          `json:"type"`
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// fromResponses reads a Responses request: instructions (a system prompt),
// input (a string, a user message, or a list of items), max_output_tokens
// and previous_response_id. Items render as chat messages, in order, so a
// conversation's next turn extends the previous one's text.
func (p *Parsed) fromResponses(b *body) error {
	var instructions string
	if err := decodeField(b.raw, "instructions", &instructions); err != nil {
		return err
	}
	if err := decodeField(b.raw, "previous_response_id", &p.PreviousResponseID); err != nil {
		return err
	}
	mt, err := tokenLimit(b.raw, "max_output_tokens")
	if err != nil {
		return err
	}
	if mt != nil {
		p.MaxTokens = *mt
	}
	var sb strings.Builder
	if instructions != "" {
		p.noteMessage(0, "system", instructions)
		RenderMessage(&sb, "system", instructions)
	}
	if err := p.responsesInput(&sb, b.raw.val("input")); err != nil {
		return err
	}
	p.Text = sb.String()
	if p.Text != "" {
		p.finishChat()
		p.Messages = false // instructions and items are not chat messages for /tokenize
	}
	return nil
}

// responsesInput renders a Responses request's input into sb.
func (p *Parsed) responsesInput(sb *strings.Builder, raw json.RawMessage) error {
	raw = bytes.TrimSpace(raw)
	switch {
	case len(raw) == 0 || isNull(raw):
		return nil // a follow-up may have only previous_response_id
	case raw[0] == '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return invalid("input", "%v", err)
		}
		p.noteMessage(1, "user", s)
		RenderMessage(sb, "user", s)
		return nil
	case raw[0] != '[':
		return invalid("input", "must be a string or a list of input items")
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return invalid("input", "%v", err)
	}
	for i, it := range items {
		if err := p.responsesItem(sb, i, it); err != nil {
			return err
		}
	}
	return nil
}

// responsesItem renders input item i: a message as a chat message, any
// other item as its type and its JSON (what the model reads of it).
func (p *Parsed) responsesItem(sb *strings.Builder, i int, raw json.RawMessage) error {
	var it responseItem
	if err := json.Unmarshal(raw, &it); err != nil {
		return invalid(fmt.Sprintf("input[%d]", i), "must be an object: %s", jsonTypeError(err))
	}
	if it.Role == "" {
		typ := it.Type
		if typ == "" {
			return invalid(fmt.Sprintf("input[%d]", i), "an input item needs a role or a type")
		}
		RenderMessage(sb, typ, string(bytes.TrimSpace(raw)))
		return nil
	}
	text, err := ContentText(it.Content)
	if err != nil {
		return invalid(fmt.Sprintf("input[%d].content", i), "%v", err)
	}
	// Position 1: instructions, when present, are the system prompt at 0.
	p.noteMessage(i+1, it.Role, text)
	if i == 0 && it.Role == "system" && p.System == "" {
		p.System = text
	}
	RenderMessage(sb, it.Role, text)
	return nil
}
