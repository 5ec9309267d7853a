package gateway

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
)

// allowGateway is a gateway with API keys in front of one replica that
// has its own key, with paths opted in.
func allowGateway(t *testing.T, optIn ...string) (*testGW, *apiReplica) {
	t.Helper()
	a := newAPIReplica(t, "a", "m", "sk-replica-secret")
	cfg := baseConfig()
	cfg.Replicas = []ReplicaConfig{{URL: a.srv.URL, APIKey: a.key}}
	cfg.APIKeys = []string{"client-key"}
	cfg.Passthrough = optIn
	cfg.EjectAfter = 1
	gw := startGateway(t, cfg)
	eventually(t, "the replica listed", func() bool { return gw.g.rt.Replica(0).Served() != nil })
	return gw, a
}

// rawRequest writes one request line as given (no client library cleans
// or re-escapes its target) and returns the status and body.
func rawRequest(t *testing.T, srvURL, method, target, body string) (int, string) {
	t.Helper()
	u, _ := url.Parse(srvURL)
	c, err := net.Dial("tcp", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "%s %s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer client-key\r\nContent-Type: application/json\r\n"+
		"Content-Length: %d\r\nConnection: close\r\n\r\n%s", method, target, u.Host, len(body), body)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// errorCode is the code of an OpenAI-shaped error body ("" when it is not one).
func errorCode(body string) string {
	var e struct {
		Error struct {
			Code    string `json:"code"`
			Message string `json:"message"`
		} `json:"error"`
	}
	if json.Unmarshal([]byte(body), &e) != nil || e.Error.Message == "" {
		return ""
	}
	return e.Error.Code
}

// Passthrough is an allow-list: a replica's admin paths and unknown paths
// answer 404 (OpenAI's shape) and never reach it; the allowed paths reach
// it with its own key; a path passthrough: opts in does too.
func TestPassthroughAllowList(t *testing.T) {
	gw, a := allowGateway(t, "/v1/load_lora_adapter", "/reset_prefix_cache")
	lora := `{"lora_name":"x","lora_path":"/tmp/x"}`
	cases := []struct {
		method, path, body string
		status             int
		reach              bool
	}{
		{"POST", "/v1/load_lora_adapter", lora, 200, true}, // opted in
		{"POST", "/reset_prefix_cache", "", 200, true},     // opted in
		{"POST", "/v1/unload_lora_adapter", lora, 404, false},
		{"POST", "/sleep", "", 404, false},
		{"POST", "/wake_up", "", 404, false},
		{"POST", "/collective_rpc", `{"method":"x"}`, 404, false},
		{"GET", "/is_sleeping", "", 404, false},
		{"GET", "/server_info", "", 404, false},
		{"POST", "/v1/some/future/endpoint", `{"model":"m"}`, 404, false},
		{"POST", "/reset_prefix_cache/", "", 404, false}, // exact paths: no subtree
		{"POST", "/v1/score", `{"model":"m","text_1":"a","text_2":"b"}`, 200, true},
		{"POST", "/v1/rerank", `{"model":"m","query":"q","documents":["a"]}`, 200, true},
		{"POST", "/v1/messages", `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`, 200, true},
	}
	for _, c := range cases {
		before := len(a.requests())
		status, body := rawRequest(t, gw.srv.URL, c.method, c.path, c.body)
		if status != c.status {
			t.Fatalf("%s %s: %d %s, want %d", c.method, c.path, status, body, c.status)
		}
		if c.status == 404 && errorCode(body) != "not_found" {
			t.Fatalf("%s %s: the 404 is not in OpenAI's shape: %s", c.method, c.path, body)
		}
		got := a.requests()
		if reached := len(got) > before; reached != c.reach {
			t.Fatalf("%s %s: reached the replica %v, want %v", c.method, c.path, reached, c.reach)
		}
		if c.reach && got[len(got)-1] != c.method+" "+c.path {
			t.Fatalf("%s %s: the replica saw %q", c.method, c.path, got[len(got)-1])
		}
	}
	if n := a.unauthorized.Load(); n != 0 {
		t.Fatalf("%d requests reached the replica without its key", n)
	}
	noEjections(t, gw)
	waitIdle(t, gw)
}

// A path that does not name one resource plainly is refused with 400
// before routing, whatever path it would reach: encoded dot segments, dot
// segments, //, encoded / ? # \ %, control characters. None reaches the
// replica (the mux alone passes "/v1/%2e%2e/x" on as "/v1/../x").
func TestPassthroughRefusesUnplainPaths(t *testing.T) {
	gw, a := allowGateway(t)
	for _, target := range []string{
		"/v1/%2e%2e/reset_prefix_cache",
		"/v1/%2E%2E/reset_prefix_cache",
		"/v1/%2e/embeddings",
		"/v1/responses/%2e%2e",
		"/v1/../reset_prefix_cache",
		"/v1/./embeddings",
		"/v1//embeddings",
		"//v1/embeddings",
		"/v1/responses/a%2fb",
		"/v1/responses/a%2Fb/cancel",
		"/v1/responses/a%3fb",
		"/v1/responses/a%23b",
		"/v1/responses/a%5cb",
		"/v1/responses/%252e%252e/cancel",
		"/v1/responses/a%00",
		"/v1/responses/a%0d%0aX-Evil:%201",
	} {
		status, body := rawRequest(t, gw.srv.URL, "POST", target, `{"model":"m","input":"x"}`)
		if status != 400 || errorCode(body) != "invalid_path" {
			t.Fatalf("POST %s: %d %s, want 400 invalid_path", target, status, body)
		}
	}
	if got := a.requests(); len(got) != 0 {
		t.Fatalf("refused paths reached the replica: %q", got)
	}
	// Plain paths still pass, an encoded character that changes nothing
	// included; the replica sees the path decoded once.
	for _, c := range []struct{ target, seen string }{
		{"/v1/score", "POST /v1/score"},
		{"/v1/%73core", "POST /v1/score"},
		{"/v1/responses/resp_x.1/cancel", "POST /v1/responses/resp_x.1/cancel"},
	} {
		status, body := rawRequest(t, gw.srv.URL, "POST", c.target, `{"model":"m","text_1":"a","text_2":"b"}`)
		got := a.requests()
		if status == 400 || len(got) == 0 || got[len(got)-1] != c.seen {
			t.Fatalf("POST %s: %d %s; the replica saw %q", c.target, status, body, got)
		}
	}
	noEjections(t, gw)
	waitIdle(t, gw)
}

// checkPath, as a table: what passes and what is refused.
func TestCheckPath(t *testing.T) {
	for _, c := range []struct {
		raw string
		ok  bool
	}{
		{"/", true}, {"/ui/", true}, {"/v1/embeddings", true}, {"/v1/responses/resp_1", true},
		{"/a%20b", true}, {"/a.b/c..d/...", true}, {"/%7e", true},
		{"/..", false}, {"/.", false}, {"/a/./b", false}, {"/a/%2E", false}, {"/a//b", false},
		{"/a%2f", false}, {"/a%5C", false}, {"/a%3F", false}, {"/a%23", false}, {"/a%25", false},
		{"/a%7f", false}, {"/a%09", false},
	} {
		u, err := url.ParseRequestURI(c.raw)
		if err != nil {
			t.Fatalf("%s: %v", c.raw, err)
		}
		if err := checkPath(u); (err == nil) != c.ok {
			t.Errorf("checkPath(%q) = %v, want ok %v", c.raw, err, c.ok)
		}
	}
}

// passthrough: takes exact clean paths outside the gateway's own.
func TestValidatePassthrough(t *testing.T) {
	for _, c := range []struct {
		path string
		ok   bool
	}{
		{"/v1/load_lora_adapter", true}, {"/reset_prefix_cache", true}, {"/v1/embeddings", true}, // a default: no harm
		{"/version", true}, {"/a-b_c.d~e", true},
		{"", false}, {"/", false}, {"v1/x", false}, {"/v1/", false}, {"/sleep/", false},
		{"/v1/{id}", false}, {"/a?b", false}, {"/a%2e", false}, {"/a b", false}, {"POST /sleep", false},
		{"/a/../b", false}, {"/a//b", false}, {"/a/./b", false},
		{"/health", false}, {"/metrics", false}, {"/ready", false}, {"/v1/models", false},
		{"/v1/completions", false}, {"/v1/chat/completions", false}, {"/ui", false}, {"/ui/x", false},
		{"/debug/route", false}, {"/admin/replicas", false}, {"/" + strings.Repeat("a", 256), false},
	} {
		cfg := baseConfig("http://127.0.0.1:1")
		cfg.Passthrough = []string{c.path}
		if err := cfg.Validate(); (err == nil) != c.ok {
			t.Errorf("passthrough: [%q]: %v, want ok %v", c.path, err, c.ok)
		}
	}
	cfg := baseConfig("http://127.0.0.1:1")
	for i := range maxPassthrough + 1 {
		cfg.Passthrough = append(cfg.Passthrough, fmt.Sprintf("/p%d", i))
	}
	if err := cfg.Validate(); err == nil {
		t.Fatal("a passthrough: list past its bound was accepted")
	}
	parsed, err := ParseConfig([]byte("replicas: [{url: http://127.0.0.1:1}]\npassthrough: [/sleep, /wake_up]\n"))
	if err != nil || len(parsed.Passthrough) != 2 || parsed.Validate() != nil {
		t.Fatalf("passthrough: in YAML: %v %v", parsed.Passthrough, err)
	}
}
