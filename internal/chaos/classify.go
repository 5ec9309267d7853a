package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
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
	reason    string // for FailedClear and Lost: what was seen
}

// openAIError is the error shape kvgate and vLLM answer with.
type openAIError struct {
	Error *struct {
		Message string `json:"message"`
		Type    string `json:"type"`
	} `json:"error"`
}

// clearError reports whether data is an OpenAI-shaped error with a message
// and a type: something a client library turns into a typed exception.
func clearError(data []byte) (string, bool) {
	var e openAIError
	if json.Unmarshal(bytes.TrimSpace(data), &e) != nil || e.Error == nil {
		return "", false
	}
	if e.Error.Message == "" || e.Error.Type == "" {
		return "", false
	}
	return e.Error.Type + ": " + e.Error.Message, true
}

// classify reads resp to its end and judges it. wantTokens is the number of
// tokens every complete generation carries (the load sets ignore_eos and
// max_tokens, so a complete answer has exactly that many). The caller
// closes resp.Body.
func classify(resp *http.Response, stream bool, wantTokens int) verdict {
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
		return classifyStream(resp.Body, wantTokens)
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
		Usage *struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
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

// classifyStream judges an SSE stream: it counts the token chunks, notes
// [DONE] and any error event.
func classifyStream(body io.Reader, wantTokens int) verdict {
	br := bufio.NewReaderSize(body, 64<<10)
	tokens, done := 0, false
	read := 0
	for {
		line, err := br.ReadBytes('\n')
		read += len(line)
		if read > maxAnswer {
			return verdict{class: Lost, reason: "stream longer than the client's bound"}
		}
		if data, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r\n"), []byte("data:")); ok {
			data = bytes.TrimSpace(data)
			switch {
			case bytes.Equal(data, []byte("[DONE]")):
				done = true
			case bytes.HasPrefix(data, []byte(`{"error"`)):
				msg, clear := clearError(data)
				if !clear {
					return verdict{class: Lost, reason: fmt.Sprintf("stream error event not OpenAI-shaped: %.120q", data)}
				}
				// The error event ends the stream for the client whatever follows.
				_, _ = io.Copy(io.Discard, io.LimitReader(br, maxAnswer))
				return verdict{class: FailedClear, streamErr: true, reason: fmt.Sprintf("stream error after %d tokens: %s", tokens, msg)}
			default:
				n, perr := tokenChunk(data)
				if perr != nil {
					return verdict{class: Lost, reason: perr.Error()}
				}
				tokens += n
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return verdict{class: Lost, reason: fmt.Sprintf("stream cut after %d tokens without an error event: %v", tokens, err)}
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

// tokenChunk counts the output tokens of one chunk: a completions chunk's
// non-empty text or a chat chunk's non-empty delta content (chat's first,
// role-only chunk carries none).
func tokenChunk(data []byte) (int, error) {
	var c struct {
		Choices []struct {
			Text  string `json:"text"`
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(data, &c); err != nil {
		return 0, fmt.Errorf("malformed stream chunk %.80q: %v", data, err)
	}
	n := 0
	for _, ch := range c.Choices {
		if ch.Text != "" || ch.Delta.Content != "" {
			n++
		}
	}
	return n, nil
}

// lostNetErr names a client-side failure: no status at all.
func lostNetErr(err error) verdict {
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		return verdict{class: Lost, reason: "no answer before the client's deadline: " + err.Error()}
	}
	return verdict{class: Lost, reason: "connection failed without an answer: " + err.Error()}
}
