package gateway

import (
	"bytes"
	"encoding/json"
	"strings"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/router"
)

// responseHomesSize bounds the response ids remembered: at about 120
// bytes an entry (its owner is the tenant's name, shared), and the
// chain's first id (the replica's id format: about 40 bytes for vLLM's,
// at most responsesHeadLen), 64 Ki ids are about 10 MiB. An id evicted is
// looked up again (passthrough.go), never lost; its chain then starts
// again as a program of its own.
const responseHomesSize = 64 << 10

// responseHomes remembers which replica holds each stored response (vLLM
// keeps a Responses API call's state in the memory of the server that
// answered it): its slot, and the replica's serial, so that a slot given
// to another replica once the router forgot this one (discovery) is not
// taken for its home: the entry is dropped, and the id looked up again.
type responseHomes struct {
	rt *router.Router
	c  *lru.Cache[string, home]
}

// home is a stored response's replica: its slot and serial; the first
// response of its chain (previous_response_id back to a call that had
// none), which names the chain's program (program.go) when the client
// names none; and, when it was created through this gateway (owned), the
// tenant whose call created it (ownedBy).
type home struct {
	slot   int
	serial uint64
	root   string
	owner  string
	owned  bool
}

func newResponseHomes(rt *router.Router, n int) *responseHomes {
	c, _ := lru.New[string, home](n) // n > 0: cannot fail
	return &responseHomes{rt: rt, c: c}
}

// get is the replica holding response id, false when the id is unknown or
// its replica was forgotten since.
func (h *responseHomes) get(id string) (*router.Replica, bool) {
	hm, ok := h.c.Get(id)
	if !ok {
		return nil, false
	}
	if hm.slot < h.rt.Replicas() {
		if r := h.rt.Replica(hm.slot); r.Serial() == hm.serial {
			return r, true
		}
	}
	h.c.Remove(id)
	return nil, false
}

// add remembers that replica slot holds response id, of the chain that
// root began ("": id begins it); created: tenant's call created it here
// (else it was found by a lookup, its creator unknown).
func (h *responseHomes) add(id string, slot int, root string, created bool, tenant string) {
	if root == "" {
		root = id
	}
	h.c.Add(id, home{slot: slot, serial: h.rt.Replica(slot).Serial(), root: root, owner: tenant, owned: created})
}

// ownedBy reports whether tenant may name response id: the replicas keep
// no owner (vLLM's store is the server's), so one tenant holding
// another's id would read, continue, cancel or delete it. The gateway
// knows the creator of the responses created through it, and refuses the
// others' (an id it found by a lookup, its creator unknown, stays open to
// any client: the rule cannot be kept across gateways or a restart).
func (h *responseHomes) ownedBy(id, tenant string) bool {
	hm, ok := h.c.Peek(id)
	return !ok || !hm.owned || hm.owner == tenant
}

// chain is the first response of the chain response id belongs to: its
// remembered root, else id itself (a chain met in its middle starts there).
func (h *responseHomes) chain(id string) string {
	if hm, ok := h.c.Peek(id); ok {
		return hm.root
	}
	return id
}

func (h *responseHomes) remove(id string) { h.c.Remove(id) }

// responsesHeadLen is what relayBody keeps of a Responses answer's start,
// where its id is (vLLM writes "id" first).
const responsesHeadLen = 4 << 10

// responseIDOf reads the top-level "id" of a JSON object from its first
// bytes; "" when they do not reach it.
func responseIDOf(head []byte) string {
	dec := json.NewDecoder(bytes.NewReader(head))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return ""
	}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return ""
		}
		if tok == "id" {
			var id string
			if dec.Decode(&id) != nil {
				return ""
			}
			return id
		}
		var skip json.RawMessage
		if dec.Decode(&skip) != nil {
			return ""
		}
	}
	return ""
}

// responsesEvent is what the gateway reads of a Responses API stream
// event: the response's id (response.created and the other response.*
// events), whether it carries generated output (the *.delta events: the
// first one is the first token) and the usage (response.completed).
type responsesEvent struct {
	Type     string `json:"type"`
	Response *struct {
		ID    string          `json:"id"`
		Usage *responsesUsage `json:"usage"`
	} `json:"response"`
}

// responsesUsage is the Responses API's usage object.
type responsesUsage struct {
	InputTokens        int `json:"input_tokens"`
	OutputTokens       int `json:"output_tokens"`
	InputTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
}

// usage is u in the chat API's terms (cached -1 when not reported).
func (u *responsesUsage) usage() *openai.Usage {
	out := &openai.Usage{PromptTokens: u.InputTokens, CompletionTokens: u.OutputTokens,
		TotalTokens: u.InputTokens + u.OutputTokens}
	if u.InputTokensDetails != nil {
		out.PromptTokensDetails = &openai.PromptTokensDetails{CachedTokens: u.InputTokensDetails.CachedTokens}
	}
	return out
}

// inspectResponses reads one Responses stream event for the response's
// id, the first token, the usage and the end: the stream has no [DONE];
// response.completed, response.incomplete or response.failed ends it.
func (g *Gateway) inspectResponses(data []byte, a *attempt, sawEnd *bool) {
	if a.respID != "" && !a.firstAt.IsZero() && !bytes.Contains(data, []byte(`"usage"`)) && !isResponsesEnd(data) {
		return // nothing left to learn from this event: skip the decoding
	}
	var ev responsesEvent
	if json.Unmarshal(data, &ev) != nil {
		return
	}
	switch ev.Type {
	case "response.completed", "response.incomplete", "response.failed":
		*sawEnd = true
	}
	if ev.Response != nil {
		if a.respID == "" {
			a.respID = ev.Response.ID
		}
		if ev.Response.Usage != nil {
			a.noteUsage(ev.Response.Usage.usage())
		}
	}
	if a.firstAt.IsZero() && strings.HasSuffix(ev.Type, ".delta") {
		a.firstAt = g.clock.Now()
		a.tk.FirstToken(a.firstAt)
		traceFirstToken(a)
	}
}

// responsesBodyUsage reads the usage of a whole Responses answer from its
// last bytes (nil when absent).
func responsesBodyUsage(tail []byte) *openai.Usage {
	var r struct {
		Usage *responsesUsage `json:"usage"`
	}
	if json.Unmarshal(tail, &r) == nil && r.Usage != nil {
		return r.Usage.usage()
	}
	obj, ok := lastUsageValue(tail)
	var u responsesUsage
	if !ok || json.Unmarshal(obj, &u) != nil {
		return nil
	}
	return u.usage()
}

// isResponsesEnd reports whether an event's data may be a stream's last
// event (checked by decoding it).
func isResponsesEnd(data []byte) bool {
	return bytes.Contains(data, []byte("response.completed")) || bytes.Contains(data, []byte("response.incomplete")) ||
		bytes.Contains(data, []byte("response.failed"))
}
