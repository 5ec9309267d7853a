package gateway

import (
	"encoding/json"
	"net/http"
)

// models serves GET /v1/models: the union of what the replicas list, each
// model's card as the first replica listing it sent it (every field vLLM
// writes: max_model_len, root, parent, permission, created, owned_by …),
// behind the API keys when keys are configured. With pools, only the
// models a pool routes to a replica of its own listing them. A model known otherwise
// (no card kept) gets a card of the fields the gateway knows.
func (g *Gateway) models(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		writeError(w, errMethod.with("use GET"))
		return
	}
	if !g.authorized(r) {
		writeError(w, errUnauth)
		return
	}
	type card struct {
		ID          string  `json:"id"`
		Object      string  `json:"object"`
		Created     int64   `json:"created"`
		OwnedBy     string  `json:"owned_by"`
		Root        string  `json:"root,omitempty"`
		Parent      *string `json:"parent"`
		MaxModelLen int     `json:"max_model_len,omitempty"`
	}
	ms := g.servedModels(g.fleet.Models())
	data := make([]json.RawMessage, 0, len(ms))
	for _, m := range ms {
		if m.Card != "" && json.Valid([]byte(m.Card)) {
			data = append(data, json.RawMessage(m.Card))
			continue
		}
		c := card{ID: m.ID, Object: "model", OwnedBy: "kvgate", Root: m.Root, MaxModelLen: m.MaxModelLen}
		if m.Parent != "" {
			c.Parent = &m.Parent
		}
		b, _ := json.Marshal(c)
		data = append(data, b)
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
}
