package gateway

import (
	"bytes"
	"crypto/subtle"
	"encoding/json"
	"mime"
	"net/http"
	"slices"

	"github.com/kvgate/kvgate/internal/gateway/ui"
	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// adminToken is the configured token, from the config or KVGATE_ADMIN_TOKEN.
func (g *Gateway) adminToken() string { return g.cfg.AdminToken }

// admin guards /debug/* and /admin/*: 404 without a configured token (the
// endpoints do not exist: adminOn), 401 without the right bearer token.
func (g *Gateway) admin(h http.HandlerFunc) http.HandlerFunc {
	return g.adminOn(func(w http.ResponseWriter, r *http.Request) {
		got, ok := bearer(r.Header)
		if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(g.adminToken())) != 1 {
			writeError(w, errUnauth.with("admin endpoints need Authorization: Bearer <admin token>"))
			return
		}
		h(w, r)
	})
}

// adminOn answers 404, naming --admin-token, while no admin token is
// configured; past it h checks the token (/ui takes its cookie too).
func (g *Gateway) adminOn(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if g.adminToken() == "" {
			writeError(w, errAdminOff)
			return
		}
		h(w, r)
	}
}

// replicaDebug is a replica as /admin/replicas, /debug/route and the live
// view show it.
type replicaDebug = ui.ReplicaRow

func replicaDebugs(g *Gateway, views []policy.ReplicaView, d *policy.Decision) []replicaDebug {
	out := make([]replicaDebug, 0, len(views))
	for i, v := range views {
		if g.rt.Replica(v.Index).Vacant() {
			continue // a forgotten replica's slot: nothing to show
		}
		rd := replicaDebug{Slot: v.Index, URL: v.URL, State: replicaState(g.rt.Replica(v.Index)), Healthy: v.Healthy, MatchBlocks: v.Match, InFlight: v.InFlight,
			PendingPrefill: v.PendingPrefill, IndexBlocks: g.rt.Index().ReplicaLen(v.Index), Pool: g.rt.Replica(v.Index).Pool(),
			Programs: v.Programs, ProgramTokens: v.ProgramTokens}
		if g.ctl.Disaggregated() {
			rd.Role = v.Role.String()
		}
		if k, ranked := g.rt.Replica(v.Index).Rank(); ranked {
			rd.Rank = &k
		}
		if v.HaveMetrics {
			w, u, r, k, age := v.Waiting, v.WaitingUnseen, v.Running, v.KVUsage, float64(v.MetricsAge.Microseconds())/1000
			rd.Waiting, rd.WaitingUnseen, rd.Running, rd.KVUsage, rd.MetricsAgeMs = &w, &u, &r, &k, &age
		}
		if d != nil && i < len(d.Scores) {
			s := d.Scores[i]
			rd.Score = &s
		}
		out = append(out, rd)
	}
	return out
}

// debugKind is the kind /debug/route reads a body as: ?kind=chat or
// ?kind=messages (an Anthropic Messages body) names it, else a body with
// messages is a chat's, any other a completion's.
func debugKind(r *http.Request, body []byte) prompt.Kind {
	switch r.URL.Query().Get("kind") {
	case "chat":
		return prompt.Chat
	case "messages":
		return prompt.Messages
	}
	var probe struct {
		Messages json.RawMessage `json:"messages"`
	}
	if json.Unmarshal(body, &probe) == nil && len(probe.Messages) > 0 {
		return prompt.Chat
	}
	return prompt.Completion
}

// debug serves POST /debug/route: the decision for a request body, nothing
// sent; ?tenant=NAME keys it as that tenant's request would be (its
// cache salt: an isolated tenant matches only its own prefixes).
func (g *Gateway) debug(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/debug/route" {
		writeError(w, errNotFound)
		return
	}
	if r.Method != http.MethodPost {
		writeError(w, errMethod.with("use POST with a completions or chat request body"))
		return
	}
	body, release, err := g.readDebugBody(w, r)
	if err != nil {
		writeError(w, err)
		return
	}
	defer release()
	kind := debugKind(r, body)
	t, err := g.debugTenant(r.URL.Query().Get("tenant"))
	if err != nil {
		writeError(w, err)
		return
	}
	model, req, err := g.prepare(r.Context(), kind, body, r.Header, t)
	if err != nil {
		writeError(w, err)
		return
	}
	pool, _ := model.Pool()
	resp := map[string]any{
		"policy":  model.Policy().Name(),
		"request": map[string]any{"kind": kind.String(), "tokens": req.Tokens, "blocks": len(req.Blocks)},
	}
	if pool != "" {
		resp["pool"] = pool
	}
	if g.ctl.Disaggregated() {
		g.debugPair(resp, req)
	} else {
		g.debugDecision(resp, req)
	}
	g.debugFlow(resp, req)
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(resp)
}

// debugFlow adds to /debug/route's answer, with flow control on, whether
// the request would wait in its pool's queue now and why
// (router.FlowHold); the decision shown is the one it would get once
// released.
func (g *Gateway) debugFlow(resp map[string]any, req *policy.Request) {
	if !g.rt.FlowEnabled() {
		return
	}
	why := g.rt.FlowHold(req)
	flow := map[string]any{"held": why != ""}
	if why != "" {
		flow["reason"] = why
	}
	resp["flow"] = flow
}

// readDebugBody reads /debug/route's body: JSON's content type or none, as
// the inference paths take, and also a form's or plain text's when the
// body is a JSON object (curl -d sends application/x-www-form-urlencoded).
// The inference paths refuse those (415): their body goes on to a replica,
// and vLLM (FastAPI) reads a body as JSON only under JSON's type or none.
// /debug/route is typed by hand, and its body never leaves the gateway.
func (g *Gateway) readDebugBody(w http.ResponseWriter, r *http.Request) ([]byte, func(), error) {
	ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if ct != "application/x-www-form-urlencoded" && ct != "text/plain" {
		return g.readBody(w, r)
	}
	body, release, err := g.readBodyAs(w, r)
	if err != nil {
		return nil, nil, err
	}
	if t := bytes.TrimSpace(body); len(t) == 0 || t[0] != '{' || !json.Valid(t) {
		release()
		return nil, nil, errContentType
	}
	return body, release, nil
}

// debugDecision adds a request's decision to /debug/route's answer.
func (g *Gateway) debugDecision(resp map[string]any, req *policy.Request) {
	d, views, err := g.rt.DryRun(req)
	resp["replicas"] = replicaDebugs(g, views, &d)
	if req.Program.ID != 0 {
		resp["program"] = g.programDebug(req)
	}
	if err != nil {
		resp["error"] = err.Error()
		return
	}
	rd := g.describe(d)
	resp["decision"] = rd.Decision
	resp["replica_url"] = rd.ReplicaURL
	if rd.ReplicaRank != nil {
		resp["replica_rank"] = *rd.ReplicaRank
	}
	resp["est_ttft_ms"] = rd.EstTTFTMs
	if d.Pull != nil && g.cfg.KVPulls.Enabled {
		resp["pull_from"] = d.Pull.URL // X-Kvgate-Pull-From
	}
}

// routeDecision is a decision as /debug/route and the live view show it.
type routeDecision = ui.Route

// describe is d as shown (its per-replica scores left out).
func (g *Gateway) describe(d policy.Decision) routeDecision {
	d.Scores = nil
	rd := routeDecision{Decision: d, ReplicaURL: g.rt.URL(d.Replica), EstTTFTMs: float64(d.EstTTFT.Microseconds()) / 1000}
	if k, ranked := g.rt.Replica(d.Replica).Rank(); ranked {
		rd.ReplicaRank = &k
	}
	return rd
}

// debugPair adds a request's prefill/decode pair to /debug/route's answer:
// replica_url is the decode replica (X-Kvgate-Replica), prefill_url the
// prefill replica (X-Kvgate-Prefill), absent with skip_reason when the
// prefill step would be skipped; a replica's score is its side's (a
// replica of role both: the decode side's).
func (g *Gateway) debugPair(resp map[string]any, req *policy.Request) {
	pd, views, err := g.rt.DryRunPD(req)
	scores := policy.Decision{Scores: slices.Clone(pd.Decode.Scores)}
	for i, v := range views {
		if v.Role == policy.RolePrefill && i < len(pd.Prefill.Scores) && i < len(scores.Scores) {
			scores.Scores[i] = pd.Prefill.Scores[i]
		}
	}
	resp["replicas"] = replicaDebugs(g, views, &scores)
	if err != nil {
		resp["error"] = err.Error()
		return
	}
	pd.Decode.Scores, pd.Prefill.Scores = nil, nil
	resp["decision"] = pd
	resp["replica_url"] = g.rt.URL(pd.Decode.Replica)
	if k, ranked := g.rt.Replica(pd.Decode.Replica).Rank(); ranked {
		resp["replica_rank"] = k
	}
	if why := router.SkipReason(pd); why != "" {
		resp["skip_reason"] = why
	} else {
		resp["prefill_url"] = g.rt.URL(pd.Prefill.Replica)
		if k, ranked := g.rt.Replica(pd.Prefill.Replica).Rank(); ranked {
			resp["prefill_rank"] = k
		}
	}
	resp["est_ttft_ms"] = float64(pd.Decode.EstTTFT.Microseconds()) / 1000
}

// adminReplicas serves GET /admin/replicas: every replica's state.
func (g *Gateway) adminReplicas(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/admin/replicas" {
		writeError(w, errNotFound)
		return
	}
	views := g.rt.Views(&policy.Request{Now: g.clock.Now()})
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(map[string]any{"policy": g.cfg.Policy, "replicas": replicaDebugs(g, views, nil),
		"index_entries": g.rt.Index().Len()})
}
