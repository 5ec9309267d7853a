package sim

import (
	"bytes"
	"encoding/json"
	"net/http"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/prompt"
)

// streamChoice is one choice of a streamed chunk as vLLM writes it:
// openai's fields, plus logprobs (null: the sim samples none) and, in a
// completions chunk, stop_reason (null).
type streamChoice struct {
	openai.ChunkChoice
	Logprobs   *struct{}       `json:"logprobs"`
	StopReason json.RawMessage `json:"stop_reason,omitempty"`
}

// tokenMark stands for the token text in a chunk's template: encoded as
// \u0000, which no output piece contains (see pieces).
const tokenMark = "\x00"

var (
	encodedMark = []byte(`\u0000`)
	jsonNull    = json.RawMessage("null")
)

// sseWriter formats the chunks of one streamed call as vLLM does. Every
// byte comes from internal/openai's types through encoding/json, but once
// per call: the chunk head (id, object, created, model) and each choice's
// JSON are encoded as templates cut at the token text, and a token's chunk
// is head + the choice's prefix + the token (a JSON-safe piece) + the
// suffix of its finish reason.
type sseWriter struct {
	chat   bool
	chunk  openai.Chunk // the call's head fields
	head   []byte       // `data: {"id":...,"model":...,"choices":[`
	pre    [][]byte     // per choice position: its JSON up to the token text
	post   map[string][]byte
	buf    []byte
	choice []streamState
	tokens bool // the last take wrote a token
}

// streamState is what a stream has written of one choice.
type streamState struct {
	written, take int
	finished      bool
}

func newSSEWriter(j *job, choices int, id string, created int64) *sseWriter {
	s := &sseWriter{chat: j.kind == prompt.Chat, pre: make([][]byte, choices), post: map[string][]byte{},
		choice: make([]streamState, choices)}
	s.chunk = openai.Chunk{ID: id, Object: "text_completion", Created: created, Model: j.model,
		Choices: []openai.ChunkChoice{}}
	if s.chat {
		s.chunk.Object = "chat.completion.chunk"
	}
	b, _ := json.Marshal(s.chunk)                      // {..."choices":[]}
	s.head = append([]byte("data: "), b[:len(b)-2]...) // through "choices":[
	return s
}

// template is a choice's JSON with tokenMark as its text, cut around it.
func (s *sseWriter) template(index int, finish string, role bool) (pre, post []byte) {
	c := streamChoice{ChunkChoice: openai.ChunkChoice{Index: index}}
	if finish != "" {
		c.FinishReason = &finish
	}
	if s.chat {
		c.Delta = &openai.Delta{Content: tokenMark}
		if role {
			c.Delta.Role = "assistant"
		}
	} else {
		c.Text, c.StopReason = tokenMark, jsonNull
	}
	b, _ := json.Marshal(c)
	i := bytes.Index(b, encodedMark)
	return b[:i], b[i+len(encodedMark):]
}

// role is chat's first chunk of a choice: the assistant role, empty content.
func (s *sseWriter) role(index int) {
	pre, post := s.template(index, "", true)
	s.buf = append(s.buf, s.head...)
	s.buf = append(s.buf, pre...)
	s.buf = append(s.buf, post...)
	s.buf = append(s.buf, "]}\n\n"...)
}

// token is one output token's chunk; finish is "" or the finish reason
// carried by the last token's chunk.
func (s *sseWriter) token(pos, index int, text, finish string) {
	if s.pre[pos] == nil {
		s.pre[pos], _ = s.template(index, "", false)
	}
	post, ok := s.post[finish]
	if !ok {
		_, post = s.template(index, finish, false)
		s.post[finish] = post
	}
	s.buf = append(s.buf, s.head...)
	s.buf = append(s.buf, s.pre[pos]...)
	s.buf = append(s.buf, text...)
	s.buf = append(s.buf, post...)
	s.buf = append(s.buf, "]}\n\n"...)
}

// usage is the chunk stream_options.include_usage adds: no choices; the
// usage carries the sim's Timing.
func (s *sseWriter) usage(u openai.Usage, t *Timing) {
	b, _ := json.Marshal(chunkOut{Chunk: s.chunk, Usage: &usageOut{Usage: u, Timing: t}})
	s.buf = append(s.buf, "data: "...)
	s.buf = append(s.buf, b...)
	s.buf = append(s.buf, "\n\n"...)
}

func (s *sseWriter) done() { s.buf = append(s.buf, "data: "+openai.DoneData+"\n\n"...) }

// chunkWriter formats a streamed call's events: take moves the tokens
// delivered since the last wake-up into events (all: every choice
// finished), tookTokens reports whether that take had any, end appends
// the stream's end (the usage, with the sim's timing), out is what to
// write. sseWriter (completions, chat) and messagesWriter (Messages).
type chunkWriter interface {
	take(cl *call) (all bool)
	tookTokens() bool
	end(u openai.Usage, t *Timing, includeUsage bool)
	out() []byte
}

func (s *sseWriter) tookTokens() bool { return s.tokens }

// chunkWriter is the writer of a streamed call of j's kind.
func (r *Replica) chunkWriter(j *job, cl *call) chunkWriter {
	id := r.responseID(idPrefix(j.kind))
	if j.kind == prompt.Messages {
		return newMessagesWriter(j, id)
	}
	return newSSEWriter(j, len(cl.choices), id, r.clock.Now().Unix())
}

// end is the usage chunk if asked, then [DONE].
func (s *sseWriter) end(u openai.Usage, t *Timing, includeUsage bool) {
	if includeUsage {
		s.usage(u, t)
	}
	s.done()
}

func (s *sseWriter) out() []byte { return s.buf }

// take moves the tokens the driver delivered since the last wake-up into
// chunks, and reports whether every choice has finished. Chat's role chunk
// goes with a choice's first token; a choice's last token carries its
// finish reason.
func (s *sseWriter) take(cl *call) (all bool) {
	cl.mu.Lock()
	all = true
	for i, c := range cl.choices {
		st := &s.choice[i]
		st.take, c.pending = c.pending, 0
		st.finished = c.finished
		all = all && c.finished
	}
	cl.mu.Unlock()
	s.buf, s.tokens = s.buf[:0], false
	for i, c := range cl.choices {
		st := &s.choice[i]
		s.tokens = s.tokens || st.take > 0
		for k := range st.take {
			if s.chat && st.written == 0 {
				s.role(c.index)
			}
			finish := ""
			if st.finished && k == st.take-1 {
				finish = c.reason
			}
			s.token(i, c.index, c.gen.next(), finish)
			st.written++
		}
	}
	return all
}

// streamCall answers a streamed request: headers at once (as vLLM's
// StreamingResponse), then each wake-up's tokens as one chunk per token,
// flushed together, so the first data byte marks the first token; then the
// usage chunk if asked and [DONE].
func (r *Replica) streamCall(w http.ResponseWriter, req *http.Request, j *job, cl *call, die bool) {
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	if rc.Flush() != nil {
		cl.core.abort(cl)
		return
	}
	s := r.chunkWriter(j, cl)
	for {
		if !r.wait(req, cl) {
			return
		}
		all := s.take(cl)
		if j.firstOut.IsZero() && s.tookTokens() {
			j.firstOut = r.clock.Now()
			if j.hasHold {
				// Model time waits for the first token to reach the client.
				r.tl.Hold(j.hold+1, r.tl.Now())
			}
		}
		if all {
			s.end(j.usage(cl), r.timing(j, cl), j.includeUsage)
			if j.hasHold {
				// Model time waits for the end to reach the client: its
				// next turn follows from there.
				r.tl.Hold(j.hold+3, r.tl.Now())
			}
		}
		if len(s.out()) == 0 {
			continue
		}
		if _, err := w.Write(s.out()); err != nil || rc.Flush() != nil {
			cl.core.abort(cl)
			return
		}
		if all {
			return
		}
		if die {
			// The replica dies mid-stream: the client has its first chunk
			// and then a cut connection (no terminating chunk, no [DONE]).
			cl.core.abort(cl)
			panic(http.ErrAbortHandler)
		}
	}
}
