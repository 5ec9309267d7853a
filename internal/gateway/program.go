package gateway

import (
	"net/http"
	"strconv"

	"github.com/kvgate/kvgate/internal/policy"
)

// Program identity (router.ProgramOf): a request's program is named, in
// order, by its body's prompt_cache_key (OpenAI's client-side cache key),
// by a session header, or by its Responses chain (the first response of
// the chain its previous_response_id continues; passthrough_responses.go).
//
// The session headers, in order:
//   - X-Session-Id: kvgate's own since the session policy (and OpenCode's,
//     which Dynamo maps to its session id);
//   - X-Dynamo-Session-Id: NVIDIA Dynamo's canonical agent session header
//     (Dynamo 1.5+, docs "Session IDs": one id per reasoning/tool chain; its
//     X-Dynamo-Parent-Session-Id names a subagent's parent, which kvgate
//     does not need: a subagent is a program of its own).
//
// llm-d's session affinity is not a program id: its x-session-token header
// (inference scheduler ≤ v0.2) and its llm-d-session cookie (later) carry
// the base64 name of the pod the previous request went to, the same for
// every session on that pod; kvgate does not read them.
var programHeaders = [...]string{"X-Session-Id", "X-Dynamo-Session-Id"}

// programHeader is the program id a request's headers name ("" for none).
func programHeader(h http.Header) string {
	for _, name := range programHeaders {
		if v := h.Get(name); v != "" {
			return v
		}
	}
	return ""
}

// programDebug is req's program as /debug/route shows it: its hash (not
// the client's id), and, once the router knows it, its home and context.
func (g *Gateway) programDebug(req *policy.Request) map[string]any {
	p := req.Program
	out := map[string]any{"id": strconv.FormatUint(p.ID, 16), "continues": p.Continues, "turns": p.Turns}
	if p.Continues {
		out["home"], out["context_tokens"] = g.rt.URL(p.Home), p.Tokens
	}
	return out
}
