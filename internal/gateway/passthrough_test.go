package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

// apiReplica is a vLLM-shaped replica of the rest of the API: embeddings,
// the Responses API with its per-server store, tokenize, score, rerank,
// audio transcriptions. With a key set it refuses (401) every request
// without it, probes included, as vLLM's --api-key does, and counts them.
type apiReplica struct {
	srv   *httptest.Server
	name  string
	model string
	key   string

	mu       sync.Mutex
	seen     []string // "METHOD PATH" of every API request (not probes)
	bodies   map[string][]byte
	store    map[string]bool // response ids held
	next     int
	uploaded int64 // bytes of the last uploaded file
	form     map[string]string

	unauthorized atomic.Int64
	probes       sync.Map // path → true once probed with the key
	status       atomic.Int64
	down         atomic.Bool // /health answers 503
	// hold, when set, holds a streamed response after its response.created
	// event until it is closed.
	hold chan struct{}
}

func newAPIReplica(t *testing.T, name, model, key string) *apiReplica {
	t.Helper()
	f := &apiReplica{name: name, model: model, key: key, bodies: map[string][]byte{}, store: map[string]bool{}}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *apiReplica) serve(w http.ResponseWriter, r *http.Request) {
	if f.key != "" && r.Header.Get("Authorization") != "Bearer "+f.key {
		f.unauthorized.Add(1)
		w.WriteHeader(http.StatusUnauthorized)
		_, _ = io.WriteString(w, `{"error":{"message":"Unauthorized","type":"x","code":"401"}}`)
		return
	}
	switch r.URL.Path {
	case "/health":
		f.probes.Store("/health", true)
		if f.down.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
		return
	case "/metrics":
		f.probes.Store("/metrics", true)
		_, _ = io.WriteString(w, "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 0\n")
		return
	case "/v1/models":
		f.probes.Store("/v1/models", true)
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","created":1700000000,"owned_by":"vllm",`+
			`"root":"/models/%s","parent":null,"max_model_len":4096,"permission":[{"id":"modelperm-1","object":"model_permission",`+
			`"allow_sampling":true,"is_blocking":false}]}]}`, f.model, f.model)
		return
	}
	body, _ := io.ReadAll(r.Body)
	f.mu.Lock()
	f.seen = append(f.seen, r.Method+" "+r.URL.Path)
	f.bodies[r.URL.Path] = body
	f.mu.Unlock()
	if s := f.status.Load(); s != 0 {
		w.WriteHeader(int(s))
		fmt.Fprintf(w, `{"error":{"message":"status %d","type":"x","code":"y"}}`, s)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	switch {
	case r.URL.Path == "/v1/embeddings":
		fmt.Fprintf(w, `{"object":"list","model":%q,"data":[{"object":"embedding","index":0,"embedding":[0.5,0.25]}],`+
			`"usage":{"prompt_tokens":7,"total_tokens":7}}`, f.model)
	case r.URL.Path == "/v1/responses":
		f.responses(w, r, body)
	case strings.HasPrefix(r.URL.Path, "/v1/responses/"):
		f.response(w, r)
	case r.URL.Path == "/v1/audio/transcriptions":
		f.transcribe(w, r, body)
	case r.URL.Path == "/tokenize":
		_, _ = io.WriteString(w, `{"count":2,"max_model_len":4096,"tokens":[1,2]}`)
	default: // score, rerank, pooling, …: echo the path
		fmt.Fprintf(w, `{"path":%q,"replica":%q}`, r.URL.Path, f.name)
	}
}

// responses creates a stored response, or refuses a previous_response_id
// it does not hold with vLLM's 404 (before any work).
func (f *apiReplica) responses(w http.ResponseWriter, r *http.Request, body []byte) {
	var req struct {
		Prev   string `json:"previous_response_id"`
		Stream bool   `json:"stream"`
	}
	_ = json.Unmarshal(body, &req)
	f.mu.Lock()
	if req.Prev != "" && !f.store[req.Prev] {
		f.mu.Unlock()
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprintf(w, `{"error":{"message":"Response with id '%s' not found.","type":"NotFoundError","code":404}}`, req.Prev)
		return
	}
	f.next++
	id := fmt.Sprintf("resp_%s_%d", f.name, f.next)
	f.store[id] = true
	f.mu.Unlock()
	usage := `{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":2,"total_tokens":42}`
	if !req.Stream {
		fmt.Fprintf(w, `{"id":%q,"object":"response","created_at":1,"model":%q,"status":"completed","output":[{"type":"message",`+
			`"id":"msg_1","role":"assistant","status":"completed","content":[{"type":"output_text","text":"hi","annotations":[]}]}],`+
			`"usage":%s}`, id, f.model, usage)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	resp := fmt.Sprintf(`{"id":%q,"object":"response","created_at":1,"model":%q,"status":"in_progress","output":[]}`, id, f.model)
	fmt.Fprintf(w, "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":%s}\n\n", resp)
	if f.hold != nil {
		_ = http.NewResponseController(w).Flush()
		<-f.hold
	}
	fmt.Fprint(w, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":1,\"delta\":\"hi\"}\n\n")
	done := strings.Replace(resp, `"in_progress","output":[]`, `"completed","output":[],"usage":`+usage, 1)
	fmt.Fprintf(w, "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":2,\"response\":%s}\n\n", done)
}

// response serves GET and DELETE /v1/responses/{id}: 404 for an id it
// does not hold.
func (f *apiReplica) response(w http.ResponseWriter, r *http.Request) {
	id, _ := responsePathID(r.URL.Path)
	f.mu.Lock()
	held := f.store[id]
	if held && r.Method == http.MethodDelete {
		delete(f.store, id)
	}
	f.mu.Unlock()
	if !held {
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprintf(w, `{"error":{"message":"Response with id '%s' not found.","type":"NotFoundError","code":404}}`, id)
		return
	}
	fmt.Fprintf(w, `{"id":%q,"object":"response","created_at":1,"model":%q,"status":"completed","output":[]}`, id, f.model)
}

// transcribe reads a multipart upload and answers the file's size.
func (f *apiReplica) transcribe(w http.ResponseWriter, r *http.Request, body []byte) {
	_, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		w.WriteHeader(http.StatusBadRequest)
		return
	}
	mr := multipart.NewReader(strings.NewReader(string(body)), params["boundary"])
	form := map[string]string{}
	var size int64
	for {
		p, err := mr.NextPart()
		if err != nil {
			break
		}
		if p.FileName() != "" {
			size, _ = io.Copy(io.Discard, p)
			continue
		}
		v, _ := io.ReadAll(p)
		form[p.FormName()] = string(v)
	}
	f.mu.Lock()
	f.uploaded, f.form = size, form
	f.mu.Unlock()
	fmt.Fprintf(w, `{"text":"%d bytes heard by %s"}`, size, f.name)
}

func (f *apiReplica) requests() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.seen...)
}

func (f *apiReplica) body(path string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return string(f.bodies[path])
}

// apiGateway starts a gateway in front of replicas, each listed before it
// returns, with eject_after 1 (one failure counted would eject).
func apiGateway(t *testing.T, reps ...*apiReplica) *testGW {
	t.Helper()
	cfg := baseConfig()
	for _, f := range reps {
		cfg.Replicas = append(cfg.Replicas, ReplicaConfig{URL: f.srv.URL, APIKey: f.key})
	}
	cfg.EjectAfter = 1
	gw := startGateway(t, cfg)
	eventually(t, "every replica listed", func() bool {
		for i := range gw.g.rt.Replicas() {
			if gw.g.rt.Replica(i).Served() == nil {
				return false
			}
		}
		return true
	})
	return gw
}

// do sends a request through the gateway and returns its status, header and body.
func do(t *testing.T, method, url, contentType, body string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// noEjections checks that no replica was ejected: with eject_after 1, no
// attempt was counted against one.
func noEjections(t *testing.T, gw *testGW) {
	t.Helper()
	for i := range gw.g.rt.Replicas() {
		if gw.g.fleet.Ejected(i) {
			t.Fatalf("replica %d was ejected: a client's error counted against it", i)
		}
	}
}
