package gateway

import (
	"crypto/subtle"
	"encoding/json"
	"net/http"
	"strings"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
)

// adminToken is the configured token, from the config or KVGATE_ADMIN_TOKEN.
func (g *Gateway) adminToken() string { return g.cfg.AdminToken }

// admin guards /debug/* and /admin/*: 404 without a configured token (the
// endpoints do not exist), 401 without the right bearer token.
func (g *Gateway) admin(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		tok := g.adminToken()
		if tok == "" {
			writeError(w, errNotFound)
			return
		}
		got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || subtle.ConstantTimeCompare([]byte(got), []byte(tok)) != 1 {
			writeError(w, errUnauth.with("admin endpoints need Authorization: Bearer <admin token>"))
			return
		}
		h(w, r)
	}
}

type replicaDebug struct {
	URL            string   `json:"url"`
	Healthy        bool     `json:"healthy"`
	MatchBlocks    int      `json:"match_blocks"`
	InFlight       int      `json:"in_flight"`
	PendingPrefill int      `json:"pending_prefill_tokens"`
	Waiting        *int     `json:"waiting,omitempty"`
	Running        *int     `json:"running,omitempty"`
	KVUsage        *float64 `json:"kv_usage,omitempty"`
	MetricsAgeMs   *float64 `json:"metrics_age_ms,omitempty"`
	Score          *float64 `json:"score,omitempty"`
	IndexBlocks    int      `json:"index_blocks"`
}

func replicaDebugs(g *Gateway, views []policy.ReplicaView, d *policy.Decision) []replicaDebug {
	out := make([]replicaDebug, len(views))
	for i, v := range views {
		rd := replicaDebug{URL: v.URL, Healthy: v.Healthy, MatchBlocks: v.Match, InFlight: v.InFlight,
			PendingPrefill: v.PendingPrefill, IndexBlocks: g.rt.Index().ReplicaLen(v.Index)}
		if v.HaveMetrics {
			w, r, k, age := v.Waiting, v.Running, v.KVUsage, float64(v.MetricsAge.Microseconds())/1000
			rd.Waiting, rd.Running, rd.KVUsage, rd.MetricsAgeMs = &w, &r, &k, &age
		}
		if d != nil && i < len(d.Scores) {
			s := d.Scores[i]
			rd.Score = &s
		}
		out[i] = rd
	}
	return out
}

// debug serves POST /debug/route: the decision for a request body, nothing sent.
func (g *Gateway) debug(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/debug/route" {
		writeError(w, errNotFound)
		return
	}
	if r.Method != http.MethodPost {
		writeError(w, errMethod.with("use POST with a completions or chat request body"))
		return
	}
	body, release, err := g.readBody(w, r)
	if err != nil {
		writeError(w, err)
		return
	}
	defer release()
	kind := prompt.Completion
	var probe struct {
		Messages json.RawMessage `json:"messages"`
	}
	if json.Unmarshal(body, &probe) == nil && len(probe.Messages) > 0 {
		kind = prompt.Chat
	}
	if r.URL.Query().Get("kind") == "chat" {
		kind = prompt.Chat
	}
	_, req, err := g.prepare(r.Context(), kind, body, r.Header.Get("X-Session-Id"))
	if err != nil {
		writeError(w, err)
		return
	}
	d, views, err := g.rt.DryRun(req)
	resp := map[string]any{
		"policy":   g.cfg.Policy,
		"request":  map[string]any{"kind": kind.String(), "tokens": req.Tokens, "blocks": len(req.Blocks)},
		"replicas": replicaDebugs(g, views, &d),
	}
	if err != nil {
		resp["error"] = err.Error()
	} else {
		d.Scores = nil
		resp["decision"] = d
		resp["replica_url"] = g.rt.URL(d.Replica)
		if k, ranked := g.rt.Replica(d.Replica).Rank(); ranked {
			resp["replica_rank"] = k
		}
		resp["est_ttft_ms"] = float64(d.EstTTFT.Microseconds()) / 1000
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(resp)
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
