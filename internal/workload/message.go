package workload

import "github.com/kvgate/kvgate/internal/prompt"

// Message is one chat message of a request. Its content is Text when held,
// or else made on demand as Words(Seed, Tokens): a generated conversation
// holds 48 bytes a message instead of its text, which each turn re-sends
// with the whole history (a 1M-request multiturn workload held 1 GB of it),
// much as a trace request holds hash ids rather than text. Text many
// requests share (a system prompt), that no seed makes (a request log's)
// or whose making would cost more than holding it (an agent's long tool
// outputs, re-sent turn after turn) is held, once.
type Message struct {
	Role string
	Text string
	// Seed and Tokens make the content when Text is "" and Tokens > 0.
	Seed   uint64
	Tokens int
}

// heldMsg is a message whose content is text.
func heldMsg(role, text string) Message { return Message{Role: role, Text: text} }

// wordsMsg is a message whose content is Words(seed, tokens), made when
// asked for.
func wordsMsg(role string, seed uint64, tokens int) Message {
	return Message{Role: role, Seed: seed, Tokens: max(tokens, 0)}
}

func (m *Message) made() bool { return m.Text == "" && m.Tokens > 0 }

// Len is the content's length in bytes.
func (m *Message) Len() int {
	if m.made() {
		return m.Tokens * prompt.TokenBytesPer
	}
	return len(m.Text)
}

// Content is the message's text.
func (m *Message) Content() string {
	if m.made() {
		return Words(m.Seed, m.Tokens)
	}
	return m.Text
}

// AppendContent appends Content() to dst.
func (m *Message) AppendContent(dst []byte) []byte {
	if m.made() {
		return AppendWords(dst, m.Seed, m.Tokens)
	}
	return append(dst, m.Text...)
}

// renderLen is len(prompt.RenderChat) of msgs without rendering:
// "<|" role "|>\n" content "\n" per message.
func renderLen(msgs []Message) int {
	n := 0
	for i := range msgs {
		n += len(msgs[i].Role) + msgs[i].Len() + 6
	}
	return n
}

// appendChat is prompt.RenderChat of msgs into a byte buffer, grown once.
func appendChat(dst []byte, msgs []Message) []byte {
	start := len(dst)
	dst = grow(dst, renderLen(msgs))[:start]
	for i := range msgs {
		dst = append(dst, "<|"...)
		dst = append(dst, msgs[i].Role...)
		dst = append(dst, "|>\n"...)
		dst = msgs[i].AppendContent(dst)
		dst = append(dst, '\n')
	}
	return dst
}

// ChatParts appends each message's role to roles and its content to
// contents, as a substring of text, which must be the request's Text() (or
// AppendText's bytes): the arguments of prompt.ChatParsed, with no content
// made or copied again.
func (r *Request) ChatParts(text string, roles, contents []string) ([]string, []string) {
	pos := 0
	for i := range r.Messages {
		m := &r.Messages[i]
		pos += len(m.Role) + len("<||>\n")
		roles, contents = append(roles, m.Role), append(contents, text[pos:pos+m.Len()])
		pos += m.Len() + 1
	}
	return roles, contents
}
