package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	lru "github.com/hashicorp/golang-lru/v2"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/router"
	"github.com/kvgate/kvgate/internal/sharedstate"
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
// With shared state, each response created through the gateway is also
// recorded in Redis with its replica and owner (sharedstate.ResponseHome),
// so that another gateway, or this one after a restart or an eviction,
// knows both for an id it does not remember.
type responseHomes struct {
	rt     *router.Router
	c      *lru.Cache[string, home]
	shared responseRecords // nil: this gateway alone
	// strict: tenants are configured, and an id whose owner the gateway
	// cannot learn is refused (locate says why).
	strict bool
	// absent holds, by model and id, until when an id every replica
	// answered 404 for is answered 404 without asking them again
	// (notedAbsent).
	absent *lru.Cache[string, time.Time]
	now    func() time.Time
}

// absentTTL is how long an id no replica holds is answered 404 at once,
// and absentSize bounds the ids so remembered (about 100 bytes each). A
// lookup asks every replica of the call's pool (serve tries each in turn,
// the endpoint picker probes them): a client polling an id that does not
// exist, or no longer does, would cost every replica a request per poll.
// Response ids are made by the replica that stores the response, and a
// client learns one only once it is stored; so an id every replica has
// just said it does not hold is not about to appear, unless it was made
// on a replica past the gateway, which then waits out the TTL.
const (
	absentTTL  = 5 * time.Second
	absentSize = 4 << 10
)

// responseRecords is what responseHomes needs of the shared state
// (sharedstate.Syncer): queue a record or its deletion, read one back.
type responseRecords interface {
	NoteResponse(id string, h sharedstate.ResponseHome)
	ForgetResponse(id string)
	ResponseHome(ctx context.Context, id string) (sharedstate.ResponseHome, bool, error)
}

// home is a stored response's replica: its slot and serial; the first
// response of its chain (previous_response_id back to a call that had
// none), which names the chain's program (program.go) when the client
// names none; and, when its creator is known (owned: it was created
// through this gateway, or its owner checked), the tenant whose call
// created it.
type home struct {
	slot   int
	serial uint64
	root   string
	owner  string
	owned  bool
}

func newResponseHomes(rt *router.Router, n int, shared responseRecords, strict bool, now func() time.Time) *responseHomes {
	c, _ := lru.New[string, home](n) // n > 0: cannot fail
	absent, _ := lru.New[string, time.Time](absentSize)
	return &responseHomes{rt: rt, c: c, shared: shared, strict: strict, absent: absent, now: now}
}

// responseNotFound is the 404 of stored response id, worded as vLLM's.
func responseNotFound(id string) error {
	return errNotFound.with(fmt.Sprintf("Response with id '%s' not found.", id))
}

// absentKey keys the ids no replica holds by the call's model too: a
// lookup asks the replicas of its model's pool only.
func absentKey(model, id string) string { return model + "\x00" + id }

// notedAbsent reports whether every replica answered 404 for id, for a
// call of model, less than absentTTL ago.
func (h *responseHomes) notedAbsent(model, id string) bool {
	k := absentKey(model, id)
	until, ok := h.absent.Peek(k)
	if ok && !h.now().Before(until) {
		h.absent.Remove(k)
		return false
	}
	return ok
}

// noteAbsent remembers that every replica a call of model could go to
// answered 404 for id: only an id a replica could have made (plainID,
// within sharedstate.MaxResponseID), so that the entries stay small
// whatever a client names (a previous_response_id may be as long as a
// body).
func (h *responseHomes) noteAbsent(model, id string) {
	if plainID(id) {
		h.absent.Add(absentKey(model, id), h.now().Add(absentTTL))
	}
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
// root began ("": id begins it); owned: tenant's call created it (else its
// creator is unknown: found by a lookup without tenants).
func (h *responseHomes) add(id string, slot int, root string, owned bool, tenant string) {
	if root == "" {
		root = id
	}
	h.c.Add(id, home{slot: slot, serial: h.rt.Replica(slot).Serial(), root: root, owner: tenant, owned: owned})
}

// created remembers response id, just created by tenant's call on replica
// slot, and records it in the shared state: once (a stream's is, as soon
// as its id comes: relayEvent; the attempt's end tells it again).
func (h *responseHomes) created(id string, slot int, root, tenant string) {
	if hm, ok := h.c.Peek(id); ok && hm.owned && hm.owner == tenant && hm.slot == slot && hm.serial == h.rt.Replica(slot).Serial() {
		return
	}
	h.add(id, slot, root, true, tenant)
	if h.shared != nil {
		h.shared.NoteResponse(id, sharedstate.ResponseHome{Replica: h.rt.Name(slot), Tenant: tenant})
	}
}

// found remembers that a lookup for tenant's call found response id on
// replica slot: with tenants, locate let the lookup go only for the owner
// the shared record names; without, the owner stays unknown.
func (h *responseHomes) found(id string, slot int, tenant string) {
	h.add(id, slot, h.chain(id), h.strict, tenant)
}

// errOwnerUnchecked: with tenants, the owner of a stored response the
// gateway does not remember is read from the shared state, which did not
// answer: the id may well be the client's, so not a 404.
var errOwnerUnchecked = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "shared_state_unavailable",
	Message: "the owner of the response named cannot be checked now (shared state unreachable); retry later"}

// locate is the replica holding stored response id for a call of tenant;
// nil and no error when the replicas must be asked (a lookup). The
// replicas keep no owner (vLLM's store is the server's), so one tenant
// holding another's id would read, continue, cancel or delete it: the
// gateway answers another tenant's id with the 404 of an unknown one. The
// owner is known when the gateway remembers the id, or from the shared
// record. An id whose owner stays unknown (no shared state; a record
// expired, never written — created before this version, or straight on a
// replica — or forged) is open to any client without tenants, as a
// replica's own ids are; with tenants it is refused, as another tenant's:
// tenant isolation is what tenants are configured for, and an unknown
// owner cannot be told from another tenant. The response stays on its
// replica: the owner's client, refused, starts a new chain.
func (h *responseHomes) locate(ctx context.Context, id, tenant string) (*router.Replica, error) {
	notFound := func() error { return responseNotFound(id) }
	if hm, ok := h.c.Peek(id); ok {
		if hm.owned && hm.owner != tenant || !hm.owned && h.strict {
			return nil, notFound()
		}
		r, _ := h.get(id)
		return r, nil
	}
	var rec sharedstate.ResponseHome
	found, err := false, error(nil)
	if h.shared != nil {
		rec, found, err = h.shared.ResponseHome(ctx, id)
	}
	switch {
	case found:
		// Remembered, whoever asked: no Redis read at the id's next call
		// (another tenant's included), nor a 503 while Redis is down.
		slot, listed := h.rt.Lookup(rec.Replica)
		if listed {
			h.add(id, slot, "", true, rec.Tenant)
		}
		switch {
		case rec.Tenant != tenant:
			return nil, notFound()
		case listed:
			return h.rt.Replica(slot), nil
		}
		return nil, nil
	case !h.strict:
		return nil, nil
	case err != nil && !errors.Is(err, sharedstate.ErrCorrupt):
		return nil, errOwnerUnchecked
	}
	return nil, notFound()
}

// chain is the first response of the chain response id belongs to: its
// remembered root, else id itself (a chain met in its middle starts there).
func (h *responseHomes) chain(id string) string {
	if hm, ok := h.c.Peek(id); ok {
		return hm.root
	}
	return id
}

// remove forgets response id, deleted by its owner's call: here and in
// the shared state, so that no gateway routes its id by the record.
func (h *responseHomes) remove(id string) {
	h.c.Remove(id)
	if h.shared != nil {
		h.shared.ForgetResponse(id)
	}
}

// responsesHeadLen is what relayBody keeps of a Responses answer's start,
// where its id is (vLLM writes "id" first).
const responsesHeadLen = 4 << 10

// responseIDOf reads the top-level "id" of a JSON object from its first
// bytes; "" when they do not reach it.
func responseIDOf(head []byte) string {
	id := firstID(head)
	if len(id) > sharedstate.MaxResponseID {
		return "" // a replica's id past any vLLM makes: not remembered
	}
	return id
}

// firstID is the top-level "id" member of the JSON object head.
func firstID(head []byte) string {
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

// responseCreated reads, from an event of a Responses stream
// (response.created is the first), the id of the response it creates, and
// tells the exchange (exchange.created).
func (g *Gateway) responseCreated(x *exchange, a *attempt, data []byte) {
	var ev responsesEvent
	if json.Unmarshal(data, &ev) != nil || ev.Response == nil || ev.Response.ID == "" ||
		len(ev.Response.ID) > sharedstate.MaxResponseID { // past any id vLLM makes: not remembered
		return
	}
	a.respID = ev.Response.ID
	if x.created != nil {
		x.created(a)
	}
}

// inspectResponses reads one Responses stream event for the first token,
// the usage and the end (its id: responseCreated): the stream has no
// [DONE]; response.completed, response.incomplete or response.failed ends
// it.
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
	if ev.Response != nil && ev.Response.Usage != nil {
		a.noteUsage(ev.Response.Usage.usage())
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

// lookupComplete reports whether a lookup of x that asked asked replicas
// asked every replica x could go to: every replica listed is in rotation
// (one out of it, ejected or failing its health checks, was not asked and
// may hold the response), and as many were asked as x's model's pool has
// now (one back in rotation since is not counted as asked).
func (g *Gateway) lookupComplete(x *exchange, asked int) bool {
	for i := range g.rt.Replicas() {
		if r := g.rt.Replica(i); !r.Removed() && !r.Healthy() {
			return false
		}
	}
	views, err := g.rt.Candidates(x.req)
	if err != nil {
		return false
	}
	n := 0
	for i := range views {
		if views[i].Healthy {
			n++
		}
	}
	return asked >= n
}
