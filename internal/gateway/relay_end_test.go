package gateway

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// closingWriter is a client that reads a stream up to its end and hangs
// up: every write after the one containing end fails, as to a connection
// reset.
type closingWriter struct {
	*httptest.ResponseRecorder
	end    string
	closed bool
}

func (w *closingWriter) Write(p []byte) (int, error) {
	if w.closed {
		return 0, syscall.ECONNRESET
	}
	w.closed = strings.Contains(string(p), w.end)
	return w.ResponseRecorder.Write(p)
}

// A client that hangs up once it has the answer's end (a Messages stream's
// message_stop, a chat's [DONE]) is served, whatever the replica sends
// after it (vLLM ends a Messages stream with a [DONE] after message_stop):
// a write failing past the end is not the client gone. One failing before
// the end still is.
func TestStreamWriteAfterTheEndIsServed(t *testing.T) {
	f := newMessagesReplica(t, `{"input_tokens":4,"output_tokens":1}`)
	gw := startGateway(t, baseConfig(f.srv.URL))
	allListed(t, gw)
	messages := "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":4}}}\n\n" +
		"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0}\n\n" +
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n" +
		"data: [DONE]\n\n"
	chat := "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\ndata: {\"late\":true}\n\n"
	for _, c := range []struct {
		name   string
		kind   prompt.Kind
		stream string
		end    string
		gone   bool
	}{
		{"messages, hung up at message_stop", prompt.Messages, messages, "message_stop", false},
		{"chat, hung up at [DONE]", prompt.Chat, chat, "[DONE]", false},
		{"messages, hung up before message_stop", prompt.Messages, messages, "content_block_start", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			rt := gw.g.Router()
			tk, err := rt.Route(rt.Prepare(&prompt.Parsed{Kind: c.kind, Model: "m", Text: "x", Prompts: 1}, "", ""))
			if err != nil {
				t.Fatal(err)
			}
			defer tk.Done(gw.g.clock.Now(), router.Outcome{CachedTokens: -1})
			w := &closingWriter{ResponseRecorder: httptest.NewRecorder(), end: c.end}
			x := &exchange{w: w, rc: *http.NewResponseController(w), r: httptest.NewRequest(http.MethodPost, "/", nil), kind: c.kind}
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			rerr, werr := gw.g.relayStream(x, &attempt{tk: tk}, ctx, cancel, strings.NewReader(c.stream))
			if rerr != nil {
				t.Fatalf("read error %v", rerr)
			}
			if gone := werr != nil; gone != c.gone || gone && !errors.Is(werr, syscall.ECONNRESET) {
				t.Fatalf("write error %v; want the client gone: %v", werr, c.gone)
			}
		})
	}
}
