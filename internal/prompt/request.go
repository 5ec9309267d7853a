package prompt

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Kind is the OpenAI endpoint a request was sent to.
type Kind int

const (
	Completion Kind = iota // POST /v1/completions
	Chat                   // POST /v1/chat/completions
	Embedding              // POST /v1/embeddings: input, or chat messages (vLLM)
	Responses              // POST /v1/responses: instructions and input
	Tokenize               // POST /tokenize: prompt, or chat messages
	// Messages is the Anthropic Messages API (POST /v1/messages), which
	// vLLM runs as the chat it converts the request to (messages.go).
	Messages
	CountTokens // POST /v1/messages/count_tokens: a Messages request without generation
	// Other is any other JSON body the replicas serve (/v1/score,
	// /rerank, /pooling, /detokenize …): only model and stream are read;
	// it has no prompt, so it is routed by load.
	Other
)

func (k Kind) String() string {
	switch k {
	case Chat:
		return "chat"
	case Embedding:
		return "embedding"
	case Responses:
		return "responses"
	case Tokenize:
		return "tokenize"
	case Messages:
		return "messages"
	case CountTokens:
		return "count_tokens"
	case Other:
		return "other"
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

// UnmarshalJSON reads a message with exact key matching, as vLLM does.
// data may be a decoder's buffer, reused after the call: what the
// message keeps raw is copied.
func (m *Message) UnmarshalJSON(data []byte) error {
	raw, ok := readMembers(data)
	if !ok {
		var mm map[string]json.RawMessage
		if err := json.Unmarshal(data, &mm); err != nil {
			return err
		}
		raw = fromMap(mm)
	}
	*m = Message{Content: bytes.Clone(raw.val("content")), ToolCalls: bytes.Clone(raw.val("tool_calls"))}
	for _, f := range [...]struct {
		key string
		dst *string
	}{{"role", &m.Role}, {"name", &m.Name}, {"tool_call_id", &m.ToolCallID}} {
		if v, ok := raw.get(f.key); ok && !isNull(v) {
			if s, simple := simpleString(v); simple {
				*f.dst = s
			} else if err := json.Unmarshal(v, f.dst); err != nil {
				return fmt.Errorf("%s: %s", f.key, jsonTypeError(err))
			}
		}
	}
	return nil
}

// Parsed is what routing needs from a request body.
type Parsed struct {
	Kind      Kind
	Model     string
	Stream    bool
	MaxTokens int // 0 when absent
	User      string
	CacheSalt string
	// PromptCacheKey is OpenAI's prompt_cache_key: the client's own name
	// for the requests that share a prefix (an agent's session, a
	// conversation), the first source of a request's program id (see
	// router.ProgramOf). "" when absent.
	PromptCacheKey string
	// SessionShared: the program id the request names is a session its
	// client's subagents and side calls share (Claude Code's metadata.user_id
	// session, and its session header): the router scopes it by the
	// conversation's start, its leading system prompt and first user
	// message (router.ProgramOf), so that each subagent is a program.
	SessionShared bool
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
	// Messages: the prompt came as chat messages (a chat, or an embeddings
	// or tokenize request given messages), which a replica's /tokenize
	// takes as messages.
	Messages bool
	// PreviousResponseID is a Responses request's previous_response_id: the
	// replica holding that response must answer it.
	PreviousResponseID string
	// Priority is vLLM's priority (lower is earlier; 0 when absent),
	// saturated to ±MaxPriority; PrioritySet: the body named one.
	Priority    int
	PrioritySet bool
	// Samples is a completion's or chat's n: the sequences it generates
	// for each prompt (1 when absent), in [1, MaxSamples].
	Samples int
	// StreamOptions is a completion's or chat's stream_options object as
	// sent (nil when absent); StreamUsage: its include_usage is true (the
	// replica ends a stream with the usage only then).
	StreamOptions json.RawMessage
	StreamUsage   bool
	// KVTransferParams: the body names vLLM's kv_transfer_params (however
	// its key is spelt), which only a gateway may send a replica.
	KVTransferParams bool
	// Render is, of a prompt given as chat messages, the other fields that
	// change the tokens a replica's chat template renders it to (tools,
	// chat_template_kwargs, add_generation_prompt...: renderKeys), as sent
	// and in that order; none when absent or null. A replica's /tokenize
	// takes them with the messages (precise mode's remote tokenizer).
	Render []Field
}

// Field is a member of a request body: its key and its raw value.
type Field struct {
	Key   string
	Value json.RawMessage
}

// renderKeys are the fields of a chat besides its messages that vLLM's
// chat template rendering takes, in its chat completions and its
// /tokenize alike (ChatCompletionRequest, TokenizeChatRequest).
var renderKeys = []string{"tools", "add_generation_prompt", "continue_final_message", "add_special_tokens",
	"chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs"}

// renderOf is Parsed.Render of a body's members.
func renderOf(raw members) []Field {
	var fs []Field
	for _, k := range renderKeys {
		if v := raw.val(k); len(v) > 0 && !isNull(v) {
			fs = append(fs, Field{k, v})
		}
	}
	return fs
}

// MaxPriority bounds a request's priority: a larger one counts as this
// (vLLM takes any integer; only its order matters).
const MaxPriority = 1 << 20

// MaxSamples bounds n, the sequences a completion or chat generates per
// prompt: far above what a client asks (OpenAI allows 128, RL rollouts
// use tens), far below where a charge of n × max_tokens could overflow.
const MaxSamples = 1 << 12

// MaxNesting bounds JSON nesting depth of a request body: a body of a million
// '[' must not cost a million stack frames of anyone's decoder.
const MaxNesting = 64

// MaxTokensLimit bounds max_tokens and max_completion_tokens before any
// model's context is known: far above every served context (2^24 tokens),
// far below where token arithmetic could overflow. The gateway checks the
// model's own max_model_len on top of it.
const MaxTokensLimit = 1 << 24

// body is what Parse reads of a request. JSON keys match exactly, as vLLM's
// (pydantic's) do: "MODEL" or "Stream" are not "model" or "stream".
type body struct {
	Model               string
	Prompt              json.RawMessage
	Messages            []Message
	Tools               json.RawMessage
	Stream              bool
	MaxTokens           *int
	MaxCompletionTokens *int
	User                string
	CacheSalt           string
	Priority            *int
	PromptCacheKey      string
	raw                 members // every member, for the other kinds' fields
}

// decodeBody decodes the fields routing needs with exact key matching
// (encoding/json alone matches keys case-insensitively).
func decodeBody(data []byte) (*body, error) {
	raw, ok := readMembers(data)
	if !ok {
		var err error
		if raw, err = decodeMembers(data); err != nil {
			return nil, err
		}
	}
	b := &body{Prompt: raw.val("prompt"), Tools: raw.val("tools"), raw: raw}
	fields := []struct {
		key string
		dst any
	}{{"model", &b.Model}, {"messages", &b.Messages}, {"stream", &b.Stream},
		{"user", &b.User}, {"cache_salt", &b.CacheSalt}, {"prompt_cache_key", &b.PromptCacheKey}}
	for _, f := range fields {
		if err := decodeField(raw, f.key, f.dst); err != nil {
			return nil, err
		}
	}
	var err error
	if b.MaxTokens, err = tokenLimit(raw, "max_tokens"); err != nil {
		return nil, err
	}
	if b.MaxCompletionTokens, err = tokenLimit(raw, "max_completion_tokens"); err != nil {
		return nil, err
	}
	if b.Priority, err = priority(raw); err != nil {
		return nil, err
	}
	return b, nil
}

// decodeMembers is encoding/json's reading of a body that is not a valid
// JSON object, for its errors. Unmarshal reads the body in place; a
// Decoder would copy it whole into a buffer of its own first (the proxy's
// largest allocation). Unmarshal refuses data after the object too; the
// Decoder, on that path only, says which of the two errors it is.
func decodeMembers(data []byte) (members, error) {
	var m map[string]json.RawMessage
	if json.Unmarshal(data, &m) != nil {
		dec := json.NewDecoder(bytes.NewReader(data))
		if err := dec.Decode(&m); err != nil {
			return nil, invalid("", "request body is not valid JSON: %v", err)
		}
		return nil, invalid("", "request body has data after the JSON object")
	}
	if m == nil {
		return nil, invalid("", "request body must be a JSON object")
	}
	return fromMap(m), nil
}

// priority reads the optional priority: an integer, saturated to
// ±MaxPriority (nil: absent).
func priority(raw members) (*int, error) {
	v, ok := raw.get("priority")
	if !ok || isNull(v) {
		return nil, nil
	}
	s := string(bytes.TrimSpace(v))
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		var ne *strconv.NumError
		if !errors.As(err, &ne) || !errors.Is(ne.Err, strconv.ErrRange) {
			return nil, invalid("priority", "must be an integer, got %s", s)
		}
		n = MaxPriority
		if strings.HasPrefix(s, "-") {
			n = -MaxPriority
		}
	}
	p := int(min(max(n, -MaxPriority), MaxPriority))
	return &p, nil
}

func decodeField(raw members, key string, dst any) error {
	v, ok := raw.get(key)
	if !ok || isNull(v) {
		return nil
	}
	switch d := dst.(type) { // the common shapes without encoding/json's reflection
	case *string:
		if str, ok := simpleString(v); ok {
			*d = str
			return nil
		}
	case *bool:
		if b, ok := jsonBool(v); ok {
			*d = b
			return nil
		}
	}
	if err := json.Unmarshal(v, dst); err != nil {
		return invalid(key, "%s", jsonTypeError(err))
	}
	return nil
}

func jsonBool(v []byte) (b, ok bool) {
	switch string(v) {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

// tokenLimit reads an optional token count: an integer in [0, MaxTokensLimit].
func tokenLimit(raw members, key string) (*int, error) {
	v, ok := raw.get(key)
	if !ok || isNull(v) {
		return nil, nil
	}
	s := string(bytes.TrimSpace(v))
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		var ne *strconv.NumError
		if errors.As(err, &ne) && errors.Is(ne.Err, strconv.ErrRange) {
			return nil, invalid(key, "must be at most %d, got %s", MaxTokensLimit, s)
		}
		return nil, invalid(key, "must be an integer, got %s", s)
	}
	if n < 0 {
		return nil, invalid(key, "must be at least 0, got %d", n)
	}
	if n > MaxTokensLimit {
		return nil, invalid(key, "must be at most %d, got %d", MaxTokensLimit, n)
	}
	m := int(n)
	return &m, nil
}

// samples reads a completion's or chat's n: an integer in [1,
// MaxSamples], 1 when absent (other kinds: 1, their n is not vLLM's).
func samples(kind Kind, raw members) (int, error) {
	v, ok := raw.get("n")
	if !ok || isNull(v) || kind != Completion && kind != Chat {
		return 1, nil
	}
	s := string(bytes.TrimSpace(v))
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 1 || n > MaxSamples {
		return 0, invalid("n", "must be an integer from 1 to %d, got %s", MaxSamples, s)
	}
	return int(n), nil
}

// streamOptions reads stream_options: an object (nil when absent or
// null), and whether its include_usage is true (its key matched exactly,
// as vLLM matches it).
func streamOptions(raw members) (json.RawMessage, bool, error) {
	v, ok := raw.get("stream_options")
	if !ok || isNull(v) {
		return nil, false, nil
	}
	var m map[string]json.RawMessage
	if json.Unmarshal(v, &m) != nil || m == nil {
		return nil, false, invalid("stream_options", "must be an object, got %s", bytes.TrimSpace(v))
	}
	return v, string(bytes.TrimSpace(m["include_usage"])) == "true", nil
}

func isNull(v json.RawMessage) bool { return string(bytes.TrimSpace(v)) == "null" }

// jsonTypeError words a decoding error of one field without Go type names.
func jsonTypeError(err error) string {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		return fmt.Sprintf("has the wrong type (JSON %s)", te.Value)
	}
	return err.Error()
}

// Parse reads a completions or chat request body.
func Parse(kind Kind, data []byte) (*Parsed, error) {
	if err := checkNesting(data, MaxNesting); err != nil {
		return nil, err
	}
	b, err := decodeBody(data)
	if err != nil {
		return nil, err
	}
	if b.Model == "" && (kind == Completion || kind == Chat || kind == Messages || kind == CountTokens) {
		// The other endpoints default to the replica's model, as vLLM's do.
		return nil, invalid("model", "you must provide a model parameter")
	}
	p := &Parsed{Kind: kind, Model: b.Model, Stream: b.Stream, User: b.User, CacheSalt: b.CacheSalt, PromptCacheKey: b.PromptCacheKey}
	if b.Priority != nil {
		p.Priority, p.PrioritySet = *b.Priority, true
	}
	_, p.KVTransferParams = b.raw.get("kv_transfer_params")
	switch {
	case b.MaxTokens != nil:
		p.MaxTokens = *b.MaxTokens
	case b.MaxCompletionTokens != nil:
		p.MaxTokens = *b.MaxCompletionTokens
	}
	if p.Samples, err = samples(kind, b.raw); err != nil {
		return nil, err
	}
	if kind == Completion || kind == Chat {
		if p.StreamOptions, p.StreamUsage, err = streamOptions(b.raw); err != nil {
			return nil, err
		}
	}
	switch kind {
	case Chat:
		err = p.fromChat(b.Messages, b.Tools)
		p.Render = renderOf(b.raw)
	case Completion:
		err = p.fromPrompt("prompt", b.Prompt)
	default:
		err = p.fromOther(kind, b)
	}
	if err != nil {
		return nil, err
	}
	return p, nil
}

// fromPrompt reads a prompt given as param (completions' prompt,
// embeddings' input): a string, a list of strings (a batch, routed on the
// first), token ids, or a list of token-id lists.
func (p *Parsed) fromPrompt(param string, raw json.RawMessage) error {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return invalid(param, "you must provide a prompt")
	}
	switch raw[0] {
	case '"':
		s, simple := simpleString(raw)
		if !simple {
			if err := json.Unmarshal(raw, &s); err != nil {
				return invalid(param, "%v", err)
			}
		}
		p.Text, p.KeyText, p.Prompts = s, s, 1
		return nil
	case '[':
	default:
		return invalid(param, "must be a string, a list of strings or a list of token ids")
	}
	var list []json.RawMessage
	if err := json.Unmarshal(raw, &list); err != nil {
		return invalid(param, "%v", err)
	}
	if len(list) == 0 {
		return invalid(param, "must not be empty")
	}
	first := bytes.TrimSpace(list[0])
	switch {
	case len(first) > 0 && first[0] == '"': // list of strings: a batch; route on the first
		var ss []string
		if err := json.Unmarshal(raw, &ss); err != nil {
			return invalid(param, "a list of prompts must hold only strings: %v", err)
		}
		p.Text, p.KeyText, p.Prompts = ss[0], ss[0], len(ss)
	case len(first) > 0 && first[0] == '[': // list of token-id lists
		var ids [][]uint32
		if err := json.Unmarshal(raw, &ids); err != nil {
			return invalid(param, "a list of token-id prompts must hold lists of non-negative integers: %v", err)
		}
		p.TokenIDs, p.Prompts = ids[0], len(ids)
	default: // one prompt as token ids
		var ids []uint32
		if err := json.Unmarshal(raw, &ids); err != nil {
			return invalid(param, "token ids must be non-negative integers: %v", err)
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
	p.Messages = true
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
	// One allocation: a long conversation's text grown by doubling was
	// allocated twice over (a 1M-request multiturn replay renders 10 GB).
	n := 0
	for i := range roles {
		n += len("<||>\n\n") + len(roles[i]) + len(contents[i])
	}
	sb.Grow(n)
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
	var parts []contentPart
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", err
	}
	var sb strings.Builder
	for _, pt := range parts {
		pt.render(&sb)
	}
	return sb.String(), nil
}

// contentPart is one part of a message's content, in chat's shape (text,
// image_url {url}, input_audio {data}) or the Responses API's (input_text,
// output_text, input_image with image_url a string, input_file).
type contentPart struct {
	Type       string          `json:"type"`
	Text       string          `json:"text"`
	ImageURL   json.RawMessage `json:"image_url"`
	InputAudio *struct {
		Data string `json:"data"`
	} `json:"input_audio"`
	FileID   string `json:"file_id"`
	FileData string `json:"file_data"`
}

// render appends the part's routing text: its text, or a marker and what
// identifies its media, so that different media never share a prefix.
func (pt *contentPart) render(sb *strings.Builder) {
	switch {
	case pt.Type == "text" || pt.Type == "input_text" || pt.Type == "output_text":
		sb.WriteString(pt.Text)
	case len(pt.ImageURL) > 0 && !isNull(pt.ImageURL):
		sb.WriteString("<|image|>")
		sb.WriteString(imageURL(pt.ImageURL))
	case pt.InputAudio != nil:
		sb.WriteString("<|audio|>")
		sb.WriteString(pt.InputAudio.Data)
	case pt.FileID != "" || pt.FileData != "":
		sb.WriteString("<|file|>")
		sb.WriteString(pt.FileID)
		sb.WriteString(pt.FileData)
	}
}

// imageURL is an image_url's URL: chat's {"url": ...} or the Responses
// API's plain string.
func imageURL(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var o struct {
		URL string `json:"url"`
	}
	_ = json.Unmarshal(raw, &o)
	return o.URL
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
