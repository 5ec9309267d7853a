package sim

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"slices"
	"strconv"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvgate/kvgate/internal/engine"
	"github.com/kvgate/kvgate/internal/prompt"
)

// maxBody bounds a request body: the longest context (128k tokens of 4
// bytes) in JSON with room to spare.
const maxBody = 32 << 20

func (r *Replica) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", r.inference(prompt.Completion))
	mux.HandleFunc("POST /v1/chat/completions", r.inference(prompt.Chat))
	mux.HandleFunc("POST /v1/messages", r.inference(prompt.Messages)) // messages.go
	mux.HandleFunc("GET /v1/models", r.models)
	mux.HandleFunc("GET /health", r.health)
	mux.HandleFunc("POST /tokenize", r.tokenize)
	mux.HandleFunc("GET /version", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, map[string]string{"version": "kvgate-sim"})
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(r.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("POST "+PathKVRead, r.kvRead)
	mux.HandleFunc("POST "+PathKVRelease, r.kvReleaseSide)
	mux.HandleFunc("POST "+PathKVServable, r.kvServable)
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if !r.gate.enter() {
			writeError(w, errShuttingDown)
			return
		}
		defer r.gate.leave()
		mux.ServeHTTP(w, req)
	})
}

func writeJSON(w http.ResponseWriter, v any) {
	data, err := json.Marshal(v)
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(data)
}

func (r *Replica) health(w http.ResponseWriter, _ *http.Request) {
	if r.failed.Load() {
		writeError(w, errFailed)
		return
	}
	w.WriteHeader(http.StatusOK) // vLLM answers an empty 200
}

// models is vLLM's GET /v1/models: a card per served name of the base
// model (root: the model it runs) and one per LoRA adapter (root: its name,
// the sim having no adapter path; parent: the first served name).
func (r *Replica) models(w http.ResponseWriter, _ *http.Request) {
	type card struct {
		ID          string  `json:"id"`
		Object      string  `json:"object"`
		Created     int64   `json:"created"`
		OwnedBy     string  `json:"owned_by"`
		Root        string  `json:"root"`
		Parent      *string `json:"parent"`
		MaxModelLen int     `json:"max_model_len"`
	}
	created, base := r.start.Unix(), r.cfg.servedName()
	data := make([]card, 0, len(r.cfg.ServedModelNames)+len(r.cfg.Adapters))
	for _, name := range r.cfg.ServedModelNames {
		data = append(data, card{ID: name, Object: "model", Created: created, OwnedBy: "vllm", Root: r.cfg.Model,
			MaxModelLen: r.cfg.MaxModelLen})
	}
	for _, a := range r.cfg.Adapters {
		data = append(data, card{ID: a, Object: "model", Created: created, OwnedBy: "vllm", Root: a,
			Parent: &base, MaxModelLen: r.cfg.MaxModelLen})
	}
	writeJSON(w, map[string]any{"object": "list", "data": data})
}

// adapterOf resolves a requested model name: a served name of the base
// model ("" adapter), one of the LoRA adapters, or not served (the model
// path itself is not a name once ServedModelNames are set, as in vLLM).
func (r *Replica) adapterOf(model string) (string, error) {
	switch {
	case slices.Contains(r.cfg.ServedModelNames, model):
		return "", nil
	case slices.Contains(r.cfg.Adapters, model):
		return model, nil
	}
	return "", modelNotFound(model)
}

// tokenizeKeys are the fields /tokenize reads: with messages, the tools
// their chat renders too, as the chat endpoint does (parseKeys).
var tokenizeKeys = keys{"model": nil, "prompt": nil, "messages": messageKeys, "tools": nil}

// tokenize is vLLM's POST /tokenize: a completions prompt or chat messages
// in, {"count", "max_model_len", "tokens"} out, under the Approx tokenizer.
// It renders through prompt.Parse so that the count is the one the chat and
// completions endpoints (and the router) compute.
func (r *Replica) tokenize(w http.ResponseWriter, req *http.Request) {
	data, err := io.ReadAll(http.MaxBytesReader(w, req.Body, maxBody))
	if err != nil {
		writeError(w, err)
		return
	}
	p, err := r.parseTokenize(data)
	if err != nil {
		writeError(w, err)
		return
	}
	ids := p.TokenIDs
	if ids == nil {
		ids = prompt.Approx{}.Encode(make([]uint32, 0, prompt.Approx{}.Count(p.Text)), p.Text)
	}
	writeJSON(w, struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint32 `json:"tokens"`
		TokenStrs   []string `json:"token_strs"`
	}{len(ids), r.cfg.MaxModelLen, ids, nil})
}

func (r *Replica) parseTokenize(data []byte) (*prompt.Parsed, error) {
	b, err := decodeBody(data)
	if err != nil {
		return nil, err
	}
	if b.get("model") == nil {
		b["model"], _ = json.Marshal(r.cfg.servedName()) // optional in vLLM's tokenize
	}
	kind := prompt.Completion
	if b.get("messages") != nil {
		kind = prompt.Chat
	}
	p, err := b.parse(kind, tokenizeKeys)
	if err != nil {
		return nil, err
	}
	if _, err := r.adapterOf(p.Model); err != nil {
		return nil, err
	}
	return p, nil
}

// inference serves /v1/completions, /v1/chat/completions and /v1/messages.
func (r *Replica) inference(kind prompt.Kind) http.HandlerFunc {
	return func(w http.ResponseWriter, req *http.Request) {
		die, ok := r.beforeRequest(w, req)
		if !ok {
			return
		}
		data, err := io.ReadAll(http.MaxBytesReader(w, req.Body, maxBody))
		if err != nil {
			writeError(w, err)
			return
		}
		j, err := r.parseJob(kind, data)
		if err != nil {
			writeError(w, err)
			return
		}
		// vLLM checks the rank after the body, before the engine sees the
		// request (so an out-of-range rank saves a query of death).
		rank, err := r.requestedRank(req)
		if err != nil {
			writeError(w, err)
			return
		}
		if j.crash {
			r.crash()
			panic(http.ErrAbortHandler) // the connection is gone with the rest
		}
		var pullErr error
		if j.kv.remotePrefill {
			pullErr = r.openPull(req.Context(), j)
		}
		j.pull = j.kv.remotePrefill && pullErr == nil
		if j.kv.source != nil {
			j.pullBlocks, pullErr = r.openSource(req.Context(), j)
		}
		cl, reqs := r.newCall(j)
		j.submitted = r.clock.Now()
		j.hold, j.hasHold = HoldKey(req.Header)
		err = r.submit(cl, reqs, rank)
		if j.hasHold {
			// Arrived, at the model time its client held: its way here (and
			// a prefill step's answer's on to the gateway) is over.
			r.tl.Release(j.hold)
			r.tl.Release(j.hold + 2)
		}
		if err != nil {
			if errors.Is(err, engine.ErrTooLong) {
				// Not reached: MaxModelLen fits the cache, and limits checked it.
				err = contextTooLong(r.cfg.MaxModelLen, j.prompts[0].tokens, int64(j.maxTokens),
					promptField(kind), "max_tokens")
			}
			writeError(w, err)
			return
		}
		if len(r.cores) > 1 {
			// The sim's own aid: vLLM does not say which rank served.
			w.Header().Set(HeaderDataParallelRank, strconv.Itoa(cl.core.rank))
		}
		switch {
		case j.kv.remotePrefill:
			r.notePull(w, cl, pullErr)
		case j.kv.source != nil:
			r.noteSource(w, cl, j, pullErr)
		}
		if j.stream {
			r.streamCall(w, req, j, cl, die)
		} else {
			r.respondCall(w, req, j, cl, die)
		}
	}
}

// wait blocks until the call is poked; false when the client or the
// replica went away (the call is then aborted).
func (r *Replica) wait(req *http.Request, cl *call) bool {
	select {
	case <-cl.notify:
		return true
	case <-req.Context().Done():
		cl.core.abort(cl)
		return false
	case <-r.done:
		return false
	}
}
