package gateway

import (
	"encoding/json"
	"net/http"
)

// models serves GET /v1/models: the union of what the replicas list, with
// their root, parent and context length (as vLLM lists them), behind the
// API keys when keys are configured.
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
	ms := g.fleet.Models()
	data := make([]card, 0, len(ms))
	for _, m := range ms {
		c := card{ID: m.ID, Object: "model", OwnedBy: "kvgate", Root: m.Root, MaxModelLen: m.MaxModelLen}
		if m.Parent != "" {
			c.Parent = &m.Parent
		}
		data = append(data, c)
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
}
