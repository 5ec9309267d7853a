package gateway

import (
	"maps"
	"net/http"
	"strings"

	"github.com/kvgate/kvgate/internal/policy"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// The rest of vLLM's API. Every path the replicas serve besides
// completions and chat goes through the same request path as they do:
// admission (keys, drain, body size and memory, the concurrency limit),
// routing through the router (its load counts and observers), attempts
// settled by verdict (a client's 4xx never counts against a replica;
// refusals before any work are retried elsewhere), and the relay (SSE
// flushed event by event, any other body streamed).
//
// Routing:
//   - a request with a prompt (embeddings' input or messages, a Responses
//     call's instructions and input, tokenize's prompt or messages, an
//     Anthropic Messages call's system and messages, passthrough_messages.go)
//     is routed by the configured policy, cache-aware;
//   - a request without one (score, rerank, pooling, detokenize, audio, a
//     GET) is routed by load (least_load) among the replicas serving the
//     body's model, or among all replicas when it names none;
//   - a stateful Responses call (previous_response_id, or a path
//     /v1/responses/{id}...) goes to the replica holding that response:
//     the gateway remembers which replica created each response it relayed
//     (a bounded LRU). An id it does not know (evicted, created through
//     another gateway, or before a restart) is looked up: the replicas are
//     asked in turn, least loaded first, each at most once; a 404 means
//     "not here" (vLLM checks the id before any work) and the next one is
//     asked; the one that answers otherwise is remembered, and when every
//     replica answered 404 the client gets the last 404. With shared
//     state, the replica and owner of each response created are recorded
//     in Redis, and read back for an id the gateway does not remember;
//     with tenants, an id is answered only for its owner's calls
//     (responseHomes.locate).
//
// Bodies. A JSON body (or none) is read whole within max_body_bytes and
// max_body_memory, as completions' are, so that a refused attempt can be
// sent elsewhere. Any other body (a multipart audio upload) is streamed to
// the replica within max_body_bytes: the gateway holds only its first 64
// KiB, where it looks for the form's model and stream fields; such a body
// is sent to another replica only when the first never read a byte of it.

// passthroughPaths are the replicas' paths the gateway proxies besides
// completions and chat, with the kind of body routing reads: an
// allow-list. Every other path is 404 (the mux's catch-all) unless the
// config's passthrough: list opts it in, so that an API-key holder cannot
// reach a replica's admin endpoints (/v1/load_lora_adapter,
// /reset_prefix_cache, /sleep, /collective_rpc …) with the replica's own
// key attached. The list is the inference and read-only paths of vLLM's
// OpenAI server as vLLM's own routers pass them (vllm-project/router's
// src/server.rs; production-stack's routers/main_router.py, less its
// /sleep, /wake_up and /is_sleeping), and vLLM's other inference
// endpoints (pooling, classify, the Cohere-style /v2/rerank, SageMaker's
// /invocations, audio translations, the Anthropic-style /v1/messages).
// /v1/models and /health are the gateway's own.
var passthroughPaths = map[string]prompt.Kind{
	"/v1/embeddings":            prompt.Embedding,
	"/v1/responses":             prompt.Responses,
	"/v1/responses/{id}":        prompt.Other, // GET a stored response (DELETE it)
	"/v1/responses/{id}/cancel": prompt.Other,
	"/tokenize":                 prompt.Tokenize,
	"/detokenize":               prompt.Other,
	"/rerank":                   prompt.Other,
	"/v1/rerank":                prompt.Other,
	"/v2/rerank":                prompt.Other,
	"/score":                    prompt.Other,
	"/v1/score":                 prompt.Other,
	"/pooling":                  prompt.Other,
	"/classify":                 prompt.Other,
	"/invocations":              prompt.Other,
	"/v1/audio/transcriptions":  prompt.Other,
	"/v1/audio/translations":    prompt.Other,
	"/v1/messages":              prompt.Messages,
	"/v1/messages/count_tokens": prompt.CountTokens,
}

// passthrough serves passthroughPaths and the paths config opts in; homes
// are the replicas holding the stored responses it relayed.
type passthrough struct {
	g      *Gateway
	homes  *responseHomes
	byLoad policy.Policy
}

// passthroughRoutes registers passthroughPaths and the config's
// passthrough: paths on m. An opted-in path is routed by load (its body is
// not one routing reads) and gets the replica's api_key like the others.
func (g *Gateway) passthroughRoutes(m *http.ServeMux) {
	byLoad, err := policy.New("least_load", policy.Options{Seed: g.cfg.Seed})
	if err != nil {
		panic(err) // a registered policy without parameters: cannot fail
	}
	homes := newResponseHomes(g.rt, responseHomesSize, g.records, len(g.cfg.Tenants) > 0, g.clock.Now)
	pt := &passthrough{g: g, homes: homes, byLoad: byLoad}
	g.pt = pt
	paths := maps.Clone(passthroughPaths)
	for _, p := range g.cfg.Passthrough {
		if _, ok := paths[p]; !ok {
			paths[p] = prompt.Other
		}
	}
	for path, kind := range paths {
		m.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) { pt.serve(w, r, kind) })
	}
}

// serve admits a request, chooses how to route it and attempts it.
func (pt *passthrough) serve(w http.ResponseWriter, r *http.Request, kind prompt.Kind) {
	g := pt.g
	x, release, err := g.admitPassthrough(w, r, kind)
	if err != nil {
		g.fail(w, r, err)
		return
	}
	defer release()
	if err := pt.choose(x); err != nil {
		g.endUnrouted(x, err)
		return
	}
	g.run(x, pt.attempt)
	if x.lookup && x.missed && x.notHere == len(x.exclude) && g.lookupComplete(x, x.notHere) {
		// Every replica the call could go to said it does not hold the id.
		pt.homes.noteAbsent(x.req.Model, statefulID(x))
	}
}

// choose sets how x is routed: pinned to the holder of the response it
// names, a lookup of an unknown one, by load without a prompt, or by the
// configured policy (on a prefill/decode fleet, a Responses call among the
// replicas that decode); and that the response a stream creates is
// remembered as soon as its id comes (exchange.created).
func (pt *passthrough) choose(x *exchange) error {
	x.created = func(a *attempt) { pt.created(x, a) }
	if prev := x.parsed.PreviousResponseID; prev != "" && x.req.Program.ID == 0 {
		router.SetProgram(x.req, pt.homes.chain(prev)) // the client names none: its chain does
		tenantProgram(x.req, x.tenant)
	}
	if id := statefulID(x); id != "" {
		r, err := pt.homes.locate(x.r.Context(), id, x.tenant.label())
		if err != nil {
			return err
		}
		if r != nil && !r.Removed() {
			if !r.Healthy() {
				return errHolderDown
			}
			x.pol = pinned(r.Index())
			return nil
		}
		if pt.homes.notedAbsent(x.req.Model, id) {
			return responseNotFound(id)
		}
		x.pol, x.lookup = pt.byLoad, true
		return nil
	}
	if x.parsed.Text == "" && x.parsed.TokenIDs == nil {
		x.pol = pt.byLoad
	}
	if (x.kind == prompt.Responses || x.kind == prompt.Messages) && pt.g.ctl.Disaggregated() {
		// A Responses or Messages call generates: on a prefill/decode fleet
		// it goes whole to a replica that decodes (it is not disaggregated).
		inner := x.pol
		if inner == nil {
			inner = pt.g.rt.Policy()
		}
		x.pol = decodes{inner}
	}
	return nil
}

// decodes decides with its policy among the replicas that decode (role
// decode or both): a prefill replica's part is the prompt alone.
type decodes struct{ inner policy.Policy }

var _ policy.Policy = decodes{}

func (p decodes) Name() string { return p.inner.Name() }

func (p decodes) Pick(req *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
	for i := range rs { // the router's views of this decision, made for it
		if rs[i].Role == policy.RolePrefill {
			rs[i].Healthy = false
		}
	}
	return p.inner.Pick(req, rs)
}

// attempt routes and tries x once, and remembers which replica holds the
// response it created or found.
func (pt *passthrough) attempt(x *exchange, last bool) (*attempt, error) {
	a, err := pt.g.routeAttempt(x, last)
	if err != nil || a.v != served {
		return a, err
	}
	pt.settled(x, a)
	return a, nil
}

// settled remembers, of attempt a served, the response it created or
// found, and forgets the one it deleted.
func (pt *passthrough) settled(x *exchange, a *attempt) {
	prev := x.parsed.PreviousResponseID
	pt.created(x, a)
	if id, ok := responsePathID(x.r.URL.Path); ok {
		if x.r.Method == http.MethodDelete {
			pt.homes.remove(id)
		} else if x.lookup {
			pt.homes.found(id, a.tk.Replica, x.tenant.label())
		}
	} else if x.lookup && prev != "" {
		pt.homes.found(prev, a.tk.Replica, x.tenant.label())
	}
}

// created remembers the response attempt a created (none: its id is
// ""), of the chain x's previous_response_id names: at the attempt's end,
// and a stream's as soon as its id comes (exchange.created).
func (pt *passthrough) created(x *exchange, a *attempt) {
	if a.respID == "" || a.respNoted {
		return
	}
	// Once per attempt: a stream's end must not remember again a response
	// its owner deleted while it streamed.
	a.respNoted = true
	root := ""
	if prev := x.parsed.PreviousResponseID; prev != "" {
		root = pt.homes.chain(prev)
	}
	pt.homes.created(a.respID, a.tk.Replica, root, x.tenant.label())
}

// statefulID is the id of the stored response x names: in its path
// (/v1/responses/{id}, /v1/responses/{id}/cancel …) or as a Responses
// call's previous_response_id; "" for none.
func statefulID(x *exchange) string {
	if id, ok := responsePathID(x.r.URL.Path); ok {
		return id
	}
	return x.parsed.PreviousResponseID
}

// responsePathID is the response id of a path /v1/responses/{id}[/...].
func responsePathID(path string) (string, bool) {
	rest, ok := strings.CutPrefix(path, "/v1/responses/")
	if !ok {
		return "", false
	}
	id, _, _ := strings.Cut(rest, "/")
	return id, id != ""
}

// pinned is the policy of a request that must go to one replica: it picks
// that replica while it is a candidate.
type pinned int

var (
	_ policy.Policy = pinned(0)
	_ policy.Pinner = pinned(0)
)

func (pinned) Name() string { return "pinned" }

// PinnedTo is the replica: the flow controller gates the request by its
// pool's saturation, not that replica's alone (policy.Pinner).
func (p pinned) PinnedTo() int { return int(p) }

func (p pinned) Pick(_ *policy.Request, rs []policy.ReplicaView) (policy.Decision, error) {
	i := int(p)
	if i >= len(rs) || !rs[i].Healthy {
		return policy.Decision{}, policy.ErrNoReplica
	}
	return policy.Decision{Replica: i, Reason: "holds the response named", Load: float64(rs[i].InFlight)}, nil
}
