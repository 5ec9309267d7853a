package sim

import (
	"encoding/json"
	"net/http"
	"strconv"

	"github.com/kvgate/kvgate/internal/prompt"
)

// sseWriter formats the chunks of one streamed call as vLLM does, by
// appending bytes: the token texts are JSON-safe pieces, and the per-call
// head (id, object, created, model) is encoded once.
type sseWriter struct {
	chat bool
	head []byte // `data: {"id":...,"model":...,"choices":[`
	buf  []byte
}

func newSSEWriter(j *job, id string, created int64) *sseWriter {
	s := &sseWriter{chat: j.kind == prompt.Chat}
	obj := "text_completion"
	if s.chat {
		obj = "chat.completion.chunk"
	}
	model, _ := json.Marshal(j.model)
	s.head = append(s.head, `data: {"id":"`...)
	s.head = append(s.head, id...)
	s.head = append(s.head, `","object":"`...)
	s.head = append(s.head, obj...)
	s.head = append(s.head, `","created":`...)
	s.head = strconv.AppendInt(s.head, created, 10)
	s.head = append(s.head, `,"model":`...)
	s.head = append(s.head, model...)
	s.head = append(s.head, `,"choices":[`...)
	return s
}

// role is chat's first chunk of a choice: the assistant role, empty content.
func (s *sseWriter) role(index int) {
	s.buf = append(s.buf, s.head...)
	s.buf = append(s.buf, `{"index":`...)
	s.buf = strconv.AppendInt(s.buf, int64(index), 10)
	s.buf = append(s.buf, `,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`+"\n\n"...)
}

// token is one output token's chunk; finish is "" or the finish reason
// carried by the last token's chunk.
func (s *sseWriter) token(index int, text, finish string) {
	s.buf = append(s.buf, s.head...)
	s.buf = append(s.buf, `{"index":`...)
	s.buf = strconv.AppendInt(s.buf, int64(index), 10)
	if s.chat {
		s.buf = append(s.buf, `,"delta":{"content":"`...)
		s.buf = append(s.buf, text...)
		s.buf = append(s.buf, `"},"logprobs":null,"finish_reason":`...)
	} else {
		s.buf = append(s.buf, `,"text":"`...)
		s.buf = append(s.buf, text...)
		s.buf = append(s.buf, `","logprobs":null,"finish_reason":`...)
	}
	if finish == "" {
		s.buf = append(s.buf, "null"...)
	} else {
		s.buf = append(s.buf, '"')
		s.buf = append(s.buf, finish...)
		s.buf = append(s.buf, '"')
	}
	if !s.chat {
		s.buf = append(s.buf, `,"stop_reason":null`...)
	}
	s.buf = append(s.buf, "}]}\n\n"...)
}

// usage is the chunk stream_options.include_usage adds: no choices.
func (s *sseWriter) usage(u usageJSON) {
	data, _ := json.Marshal(u)
	s.buf = append(s.buf, s.head[:len(s.head)-len(`"choices":[`)]...)
	s.buf = append(s.buf, `"choices":[],"usage":`...)
	s.buf = append(s.buf, data...)
	s.buf = append(s.buf, "}\n\n"...)
}

func (s *sseWriter) done() { s.buf = append(s.buf, "data: [DONE]\n\n"...) }

// streamCall answers a streamed request: headers at once (as vLLM's
// StreamingResponse), then each wake-up's tokens as one chunk per token,
// flushed together; chat's role chunk goes with the first token, so the
// first data byte marks the first token. A choice's last token carries
// finish_reason; then the usage chunk if asked and [DONE].
func (r *Replica) streamCall(w http.ResponseWriter, req *http.Request, j *job, cl *call, die bool) {
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	if rc.Flush() != nil {
		r.abort(cl)
		return
	}
	s := newSSEWriter(j, r.responseID(idPrefix(j.kind)), r.clock.Now().Unix())
	written := make([]int, len(cl.choices)) // tokens written per choice
	take := make([]int, len(cl.choices))
	fin := make([]bool, len(cl.choices))
	for {
		if !r.wait(req, cl) {
			return
		}
		cl.mu.Lock()
		all := true
		for i, c := range cl.choices {
			take[i], c.pending = c.pending, 0
			fin[i] = c.finished
			all = all && c.finished
		}
		cl.mu.Unlock()
		s.buf = s.buf[:0]
		for i, c := range cl.choices {
			for k := range take[i] {
				if s.chat && written[i] == 0 {
					s.role(c.index)
				}
				finish := ""
				if fin[i] && k == take[i]-1 {
					finish = c.reason
				}
				s.token(c.index, c.gen.next(), finish)
				written[i]++
			}
		}
		if all {
			if j.includeUsage {
				s.usage(j.usage(cl))
			}
			s.done()
		}
		if len(s.buf) == 0 {
			continue
		}
		if _, err := w.Write(s.buf); err != nil {
			r.abort(cl)
			return
		}
		if err := rc.Flush(); err != nil {
			r.abort(cl)
			return
		}
		if all {
			return
		}
		if die {
			// The replica dies mid-stream: the client has its first chunk
			// and then a cut connection (no terminating chunk, no [DONE]).
			r.abort(cl)
			panic(http.ErrAbortHandler)
		}
	}
}
