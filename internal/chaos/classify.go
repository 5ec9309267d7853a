package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"

	"github.com/kvgate/kvgate/internal/openai"
)

// Class is what a client made of one request's answer.
type Class int

const (
	// Succeeded: a complete generation (every requested token, and for a
	// stream the terminating data: [DONE]).
	Succeeded Class = iota
	// FailedClear: an error the client can act on — an OpenAI-shaped JSON
	// error body with a 4xx/5xx status, or, for a stream that had started,
	// an SSE event `data: {"error": {...}}`.
	FailedClear
	// HungUp: the client closed the stream on purpose after its first
	// token (the client-side scenarios: a client hanging up, a slow reader
	// giving up). Neither the gateway's success nor its failure.
	HungUp
	// Lost: anything else — no answer by the client's deadline, a
	// connection cut without an error body, a stream that stops without an
	// error event, a short or malformed answer, or a generation the gateway
	// duplicated beyond its retry rule.
	Lost
)

func (c Class) String() string {
	switch c {
	case Succeeded:
		return "succeeded"
	case FailedClear:
		return "failed-clear"
	case HungUp:
		return "hung-up"
	default:
		return "lost"
	}
}

// maxAnswer bounds what the client reads of one answer.
const maxAnswer = 4 << 20

// verdict is the classification of one answer and why.
type verdict struct {
	class     Class
	streamErr bool   // the stream ended with an SSE error event
	empty     bool   // Lost: the connection closed without an answer (an empty reply)
	reason    string // for FailedClear and Lost: what was seen
}

// clearError reports whether data is an OpenAI-shaped error body
// ({"error": {...}}) with a message and a type: something a client library
// turns into a typed exception. vLLM's older flat shape does not count: the
// gateway must answer in OpenAI's.
func clearError(data []byte) (string, bool) {
	var e openai.ErrorBody
	if json.Unmarshal(data, &e) != nil || e.Error.Message == "" || e.Error.Type == "" {
		return "", false
	}
	return e.Error.Type + ": " + e.Error.Message, true
}

// isErrorEvent reports whether a stream event's data is an error (an
// "error" member, or vLLM's flat {"object": "error"}), clear or not.
func isErrorEvent(data []byte) bool {
	var probe struct {
		Error  json.RawMessage `json:"error"`
		Object string          `json:"object"`
	}
	return json.Unmarshal(data, &probe) == nil && (len(probe.Error) > 0 || probe.Object == "error")
}

// classify reads resp to its end and judges it. wantTokens is the number of
// tokens every complete generation carries (the load sets ignore_eos and
// max_tokens, so a complete answer has exactly that many). The caller
// closes resp.Body. onFirst, when set, is called at a stream's first token:
// true means the client hangs up there (the answer is then HungUp).
func classify(resp *http.Response, stream bool, wantTokens int, onFirst func() bool) verdict {
	if resp.StatusCode != http.StatusOK {
		data, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
		if err != nil {
			return verdict{class: Lost, reason: fmt.Sprintf("status %d, body cut: %v", resp.StatusCode, err)}
		}
		if resp.StatusCode < 400 {
			return verdict{class: Lost, reason: fmt.Sprintf("status %d", resp.StatusCode)}
		}
		msg, ok := clearError(data)
		if !ok {
			return verdict{class: Lost, reason: fmt.Sprintf("status %d without an OpenAI error body: %.120q", resp.StatusCode, data)}
		}
		return verdict{class: FailedClear, reason: fmt.Sprintf("%d %s", resp.StatusCode, msg)}
	}
	if stream {
		return classifyStream(resp.Body, wantTokens, onFirst)
	}
	return classifyBody(resp.Body, wantTokens)
}

// classifyBody judges a non-streamed completions or chat answer.
func classifyBody(body io.Reader, wantTokens int) verdict {
	data, err := io.ReadAll(io.LimitReader(body, maxAnswer))
	if err != nil {
		return verdict{class: Lost, reason: "body cut: " + err.Error()}
	}
	var v struct {
		Choices []struct {
			Text    *string `json:"text"`
			Message *struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Usage *openai.Usage `json:"usage"`
	}
	if err := json.Unmarshal(data, &v); err != nil {
		return verdict{class: Lost, reason: fmt.Sprintf("200 with a malformed body: %v", err)}
	}
	if len(v.Choices) != 1 || v.Usage == nil {
		return verdict{class: Lost, reason: fmt.Sprintf("200 with %d choices, usage %v", len(v.Choices), v.Usage != nil)}
	}
	text := ""
	switch c := v.Choices[0]; {
	case c.Text != nil:
		text = *c.Text
	case c.Message != nil:
		text = c.Message.Content
	}
	if v.Usage.CompletionTokens != wantTokens || text == "" {
		return verdict{class: Lost, reason: fmt.Sprintf("short answer: %d tokens of %d", v.Usage.CompletionTokens, wantTokens)}
	}
	return verdict{class: Succeeded}
}

// classifyStream judges an SSE stream: it counts the chunks carrying a
// token (openai.Chunk.HasToken), notes [DONE] and any error event.
func classifyStream(body io.Reader, wantTokens int, onFirst func() bool) verdict {
	er := openai.NewEventReader(body, 0)
	tokens, done, read := 0, false, 0
	for {
		ev, err := er.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return verdict{class: Lost, reason: fmt.Sprintf("stream cut after %d tokens without an error event: %v", tokens, err)}
		}
		if read += len(ev.Raw); read > maxAnswer {
			return verdict{class: Lost, reason: "stream longer than the client's bound"}
		}
		switch {
		case !ev.HasData:
		case openai.IsDone(ev.Data):
			done = true
		case isErrorEvent(ev.Data):
			return streamError(ev.Data, tokens)
		default:
			c, perr := openai.ParseChunk(ev.Data)
			if perr != nil {
				return verdict{class: Lost, reason: fmt.Sprintf("malformed stream chunk %.80q: %v", ev.Data, perr)}
			}
			if c.HasToken() {
				tokens++
				if tokens == 1 && onFirst != nil && onFirst() {
					return verdict{class: HungUp, reason: "the client hung up after the first token"}
				}
			}
		}
	}
	switch {
	case !done:
		return verdict{class: Lost, reason: fmt.Sprintf("stream ended after %d tokens without [DONE] or an error event", tokens)}
	case tokens != wantTokens:
		return verdict{class: Lost, reason: fmt.Sprintf("stream ended with %d tokens of %d", tokens, wantTokens)}
	}
	return verdict{class: Succeeded}
}

// streamError judges a stream's error event: it ends the stream for the
// client whatever follows, clearly if OpenAI-shaped.
func streamError(data []byte, tokens int) verdict {
	msg, clear := clearError(data)
	if !clear {
		return verdict{class: Lost, reason: fmt.Sprintf("stream error event not OpenAI-shaped: %.120q", data)}
	}
	return verdict{class: FailedClear, streamErr: true, reason: fmt.Sprintf("stream error after %d tokens: %s", tokens, msg)}
}

// lostNetErr names a client-side failure: no status at all.
func lostNetErr(err error) verdict {
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		return verdict{class: Lost, reason: "no answer before the client's deadline: " + err.Error()}
	}
	return verdict{class: Lost, empty: true, reason: "connection failed without an answer: " + err.Error()}
}
