package gateway

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/kvgate/kvgate/internal/router"
)

// outcome is what the gateway saw of a response.
type outcome struct {
	firstAt    time.Time
	cached     int // -1 when the response carried no usage
	completion int
	err        error
	// upstreamFault: the replica broke the response (not the client).
	upstreamFault bool
}

type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (u *usage) cached() int {
	if u == nil || u.PromptTokensDetails == nil {
		return -1
	}
	return u.PromptTokensDetails.CachedTokens
}

// maxBody bounds a non-streamed response the gateway holds to read its usage.
const maxBody = 64 << 20

// copyBody relays a non-streamed response and reads its usage.
func (g *Gateway) copyBody(w http.ResponseWriter, body io.Reader) outcome {
	data, err := io.ReadAll(io.LimitReader(body, maxBody+1))
	if len(data) > maxBody {
		err = fmt.Errorf("response larger than %d bytes", maxBody)
		data = data[:maxBody]
	}
	out := outcome{cached: -1, err: err, upstreamFault: err != nil}
	if _, werr := w.Write(data); werr != nil && out.err == nil {
		out.err = werr
	}
	var v struct {
		Usage *usage `json:"usage"`
	}
	if json.Unmarshal(data, &v) == nil && v.Usage != nil {
		out.cached, out.completion = v.Usage.cached(), v.Usage.CompletionTokens
	}
	return out
}

// copyStream relays an SSE stream event by event, flushing each one at
// once (as httputil.ReverseProxy does with FlushInterval -1). It notes the
// first token's arrival for the router and reads the usage chunk. If the
// upstream breaks after the first byte the client gets an SSE error event,
// never a retry: tokens were already generated.
func (g *Gateway) copyStream(w http.ResponseWriter, body io.Reader, tk *router.Ticket) outcome {
	out := outcome{cached: -1}
	rc := http.NewResponseController(w)
	br := bufio.NewReaderSize(body, 32<<10)
	var event bytes.Buffer
	sawDone := false
	for {
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			// A very long line: keep reading it whole.
			long := append([]byte(nil), line...)
			for errors.Is(err, bufio.ErrBufferFull) {
				line, err = br.ReadSlice('\n')
				long = append(long, line...)
			}
			line = long
		}
		if len(line) > 0 {
			event.Write(line)
			g.inspect(line, &out, tk, &sawDone)
			if len(bytes.TrimRight(line, "\r\n")) == 0 { // end of an SSE event
				if _, werr := w.Write(event.Bytes()); werr != nil {
					out.err = fmt.Errorf("writing to client: %w", werr)
					return out
				}
				_ = rc.Flush()
				event.Reset()
			}
		}
		if err == io.EOF {
			if event.Len() > 0 {
				_, _ = w.Write(event.Bytes())
				_ = rc.Flush()
			}
			if !sawDone {
				// The replica closed the stream cleanly but early: tell the
				// client, or it would take a cut answer for a whole one.
				out.err, out.upstreamFault = errors.New("stream ended without data: [DONE]"), true
				ae := &apiError{Status: http.StatusBadGateway, Type: "server_error", Code: "upstream_stream_error",
					Message: "the replica's stream ended before it was complete; the response is incomplete"}
				_, _ = fmt.Fprintf(w, "data: %s\n\n", ae.body())
				_ = rc.Flush()
			}
			return out
		}
		if err != nil {
			out.err, out.upstreamFault = fmt.Errorf("upstream stream broke: %w", err), true
			ae := &apiError{Status: http.StatusBadGateway, Type: "server_error", Code: "upstream_stream_error",
				Message: "the replica's stream broke after it started; the response is incomplete"}
			_, _ = fmt.Fprintf(w, "data: %s\n\n", ae.body())
			_ = rc.Flush()
			return out
		}
	}
}

// inspect reads one SSE line for the first token and the usage.
func (g *Gateway) inspect(line []byte, out *outcome, tk *router.Ticket, sawDone *bool) {
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		return
	}
	data = bytes.TrimSpace(data)
	if bytes.Equal(data, []byte("[DONE]")) {
		*sawDone = true
		return
	}
	hasUsage := bytes.Contains(data, []byte(`"usage":{`)) || bytes.Contains(data, []byte(`"usage": {`))
	if !out.firstAt.IsZero() && !hasUsage {
		return
	}
	var c struct {
		Choices []struct {
			Text  string `json:"text"`
			Delta struct {
				Content   string          `json:"content"`
				Reasoning string          `json:"reasoning_content"`
				ToolCalls json.RawMessage `json:"tool_calls"`
			} `json:"delta"`
		} `json:"choices"`
		Usage *usage `json:"usage"`
	}
	if json.Unmarshal(data, &c) != nil {
		return
	}
	if out.firstAt.IsZero() {
		for _, ch := range c.Choices {
			if ch.Text != "" || ch.Delta.Content != "" || ch.Delta.Reasoning != "" || len(ch.Delta.ToolCalls) > 0 {
				out.firstAt = g.now()
				tk.FirstToken(out.firstAt)
				break
			}
		}
	}
	if c.Usage != nil {
		out.cached, out.completion = c.Usage.cached(), c.Usage.CompletionTokens
	}
}
