package gateway

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// The gateway's own errors on the Messages API's paths come in Anthropic's
// shape ({"type":"error","error":{"type","message"},"request_id"}), the
// error type named by the status as Anthropic names it, with the same
// status codes and Retry-After; the chat API's stay OpenAI's. Before,
// every one was OpenAI's, which Anthropic's SDKs and Claude Code do not
// read.
func TestMessagesErrorsAnthropicShape(t *testing.T) {
	f := newMessagesReplica(t, `{"input_tokens":4,"output_tokens":1}`)
	cfg := tenantsConfig(f.srv.URL)
	cfg.Tenants[1].TokensPerMinute = 10 // bulk: a call asking 64 tokens is over it
	cfg.MaxBodyBytes = 4 << 10
	gw := startGateway(t, cfg)
	allListed(t, gw)
	msg := func(model string, maxTokens int) string {
		return `{"model":"` + model + `","max_tokens":` + itoa(maxTokens) + `,"messages":[{"role":"user","content":"x"}]}`
	}
	for _, c := range []struct {
		name, path, key, body, typ string
		status                     int
	}{
		{"no key", "/v1/messages", "wrong", msg("m", 5), "authentication_error", http.StatusUnauthorized},
		{"isolated tenant", "/v1/messages", "k-gold", msg("m", 5), "permission_error", http.StatusForbidden},
		{"unknown model", "/v1/messages", "k-none", msg("nope", 5), "not_found_error", http.StatusNotFound},
		{"malformed", "/v1/messages/count_tokens", "k-none", `{"model":"m","messages":{}}`, "invalid_request_error", http.StatusBadRequest},
		{"too large", "/v1/messages", "k-none", msg("m", 5)[:20] + strings.Repeat(" ", 5<<10) + msg("m", 5)[20:], "request_too_large", http.StatusRequestEntityTooLarge},
		{"quota", "/v1/messages", "k-bulk", msg("m", 64), "rate_limit_error", http.StatusTooManyRequests},
		{"unknown path", "/v1/messages/batches", "k-none", msg("m", 5), "not_found_error", http.StatusNotFound},
	} {
		resp, out := post(t, gw.srv.URL+c.path, c.body, bearerHdr(c.key)...)
		var e struct {
			Type  string `json:"type"`
			Error struct {
				Type, Message string
			} `json:"error"`
			RequestID string `json:"request_id"`
		}
		if resp.StatusCode != c.status || json.Unmarshal([]byte(out), &e) != nil || e.Type != "error" || e.Error.Type != c.typ ||
			e.Error.Message == "" || e.RequestID != resp.Header.Get("X-Request-Id") || strings.Contains(out, `"code"`) {
			t.Errorf("%s: %d %s, want %d in Anthropic's shape, type %s", c.name, resp.StatusCode, out, c.status, c.typ)
		}
		if c.status == http.StatusTooManyRequests && resp.Header.Get("Retry-After") == "" {
			t.Errorf("%s: no Retry-After", c.name)
		}
	}
	if resp, out := post(t, gw.srv.URL+"/v1/chat/completions", `{"model":"nope","messages":[{"role":"user","content":"x"}]}`, bearerHdr("k-none")...); resp.StatusCode != http.StatusNotFound ||
		errorCode(out) != "model_not_found" {
		t.Errorf("the chat API's error: %d %s, want OpenAI's shape", resp.StatusCode, out)
	}
	gw.g.cutNow() // past the drain
	if resp, out := post(t, gw.srv.URL+"/v1/messages", msg("m", 5), bearerHdr("k-none")...); resp.StatusCode != http.StatusServiceUnavailable ||
		!strings.Contains(out, `"type":"overloaded_error"`) || resp.Header.Get("Retry-After") == "" {
		t.Errorf("draining: %d %s, want 503 overloaded_error", resp.StatusCode, out)
	}
	if n := len(f.requests()); n != 0 {
		t.Errorf("%d refused requests reached the replica", n)
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

// The endpoint picker's own replies (a request the proxy sent wrong) take
// the Messages API's shape on its paths too, its query aside (Claude Code
// sends /v1/messages?beta=true), and OpenAI's elsewhere. Before, they
// were always OpenAI's.
func TestLocalReplyShape(t *testing.T) {
	for _, c := range []struct {
		path, want string
	}{
		{"/v1/messages?beta=true", `{"type":"error","error":{"type":"api_error","message":"m"}}`},
		{"/v1/messages/count_tokens", `{"type":"error","error":{"type":"api_error","message":"m"}}`},
		{"/v1/chat/completions", `{"error":{"message":"m","type":"server_error","param":null,"code":"epp_misconfigured"}}`},
		{"", `{"error":{"message":"m","type":"server_error","param":null,"code":"epp_misconfigured"}}`},
	} {
		r := LocalReply(c.path, http.StatusInternalServerError, "epp_misconfigured", "m")
		if r.Status != http.StatusInternalServerError || strings.TrimSpace(string(r.Body)) != c.want {
			t.Errorf("%q: %d %s, want %s", c.path, r.Status, r.Body, c.want)
		}
	}
}
