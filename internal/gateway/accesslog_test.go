package gateway

import (
	"bufio"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/testutil"
)

// get sends a GET with optional headers through a client that does not
// follow redirects.
func get(t *testing.T, url string, hdr ...string) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	c := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(body)
}

// lockedBuffer is a log sink the handlers write to while the test reads.
type lockedBuffer struct{ testutil.SyncBuffer }

// accessLines are the access log's lines so far, decoded.
func (b *lockedBuffer) accessLines(t *testing.T) []map[string]any {
	t.Helper()
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(b.String()))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		if m["msg"] == "access" {
			out = append(out, m)
		}
	}
	return out
}

func startLoggedGateway(t *testing.T, cfg Config, sink *lockedBuffer) *testGW {
	t.Helper()
	return startGatewayWith(t, cfg, Options{Logger: slog.New(slog.NewJSONHandler(sink, nil))})
}

func TestAccessLog(t *testing.T) {
	a := newFakeReplica(t)
	cfg := baseConfig(a.srv.URL)
	cfg.AccessLog = true
	cfg.APIKeys = []string{"client-key-123"}
	cfg.AdminToken = "admin-456"
	sink := &lockedBuffer{}
	gw := startLoggedGateway(t, cfg, sink)
	waitListed(t, gw) // until the replica lists its models it judges unknown ones itself
	auth := []string{"Authorization", "Bearer client-key-123"}
	secretPrompt := "my very private prompt text"
	post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"`+secretPrompt+`","max_tokens":3,"stream":true}`,
		append(auth, "X-Request-Id", "r-stream")...)
	post(t, gw.srv.URL+"/v1/chat/completions", `{"model":"m","messages":[{"role":"user","content":"`+secretPrompt+`"}]}`,
		append(auth, "X-Request-Id", "r-chat")...)
	post(t, gw.srv.URL+"/v1/completions", `{"model":"nope","prompt":"x"}`, append(auth, "X-Request-Id", "r-404")...)
	post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "Authorization", "Bearer wrong", "X-Request-Id", "r-401")
	get(t, gw.srv.URL+"/health")
	get(t, gw.srv.URL+"/metrics")
	get(t, gw.srv.URL+"/ui/state", "Authorization", "Bearer admin-456")
	var lines []map[string]any
	eventually(t, "four access lines", func() bool { lines = sink.accessLines(t); return len(lines) >= 4 })
	waitIdle(t, gw)
	byID := map[string]map[string]any{}
	for _, l := range lines {
		byID[l["request_id"].(string)] = l
	}
	if len(lines) != 4 || len(byID) != 4 {
		t.Fatalf("%d access lines for %d requests (probes, scrapes and the live view are left out): %v", len(lines), len(byID), lines)
	}
	s := byID["r-stream"]
	if s["method"] != "POST" || s["path"] != "/v1/completions" || s["model"] != "m" || s["replica"] != a.srv.URL ||
		s["status"] != 200.0 || s["prompt_tokens"] != 10.0 || s["cached_tokens"] != 8.0 || s["completion_tokens"] != 3.0 {
		t.Errorf("streamed request's line: %v", s)
	}
	if _, ok := s["ttft_ms"]; !ok {
		t.Errorf("streamed request's line has no ttft_ms: %v", s)
	}
	if _, ok := s["e2e_ms"]; !ok {
		t.Errorf("no e2e_ms: %v", s)
	}
	if c := byID["r-chat"]; c["path"] != "/v1/chat/completions" || c["status"] != 200.0 || c["cached_tokens"] != 8.0 {
		t.Errorf("chat line: %v", c)
	}
	if e := byID["r-404"]; e["status"] != 404.0 || e["replica"] != nil {
		t.Errorf("unknown model's line: %v", e)
	}
	if e := byID["r-401"]; e["status"] != 401.0 {
		t.Errorf("bad key's line: %v", e)
	}
	all := sink.String()
	for _, secret := range []string{secretPrompt, "client-key-123", "admin-456", "wrong"} {
		if strings.Contains(all, secret) {
			t.Errorf("the log holds %q", secret)
		}
	}
}

// Off by default: no access line.
func TestAccessLogOff(t *testing.T) {
	a := newFakeReplica(t)
	sink := &lockedBuffer{}
	gw := startLoggedGateway(t, baseConfig(a.srv.URL), sink)
	post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`)
	waitIdle(t, gw)
	if n := len(sink.accessLines(t)); n != 0 {
		t.Errorf("%d access lines with the access log off", n)
	}
	if wb, ok := gw.g.Handler().(*writeBounded); !ok {
		t.Errorf("the handler (%T) is not the write deadline's", gw.g.Handler())
	} else if _, ok := wb.next.(*guard); !ok {
		t.Errorf("the handler is wrapped (%T) with the access log off", wb.next)
	}
}

// A disaggregated request's line names the decode replica that answered
// and the prefill replica whose KV it pulled, as its headers do; its
// routing decision is counted once (the prefill step's).
func TestAccessLogPrefillDecode(t *testing.T) {
	pre, dec, _ := pdSims(t)
	cfg := pdConfig(t, "ttft", pre, dec)
	cfg.AccessLog = true
	sink := &lockedBuffer{}
	gw := startLoggedGateway(t, cfg, sink)
	waitPD(t, gw)
	body, _ := json.Marshal(map[string]any{"model": sim.DefaultModel, "max_tokens": 4, "stream": true,
		"stream_options": map[string]any{"include_usage": true}, "prompt": strings.Repeat("a prompt long enough for a prefill step ", 20)})
	resp, out := post(t, gw.srv.URL+"/v1/completions", string(body), "X-Request-Id", "r-pd")
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	pdHeaders(t, "the request", resp.Header, pre, dec)
	var lines []map[string]any
	eventually(t, "the access line", func() bool { lines = sink.accessLines(t); return len(lines) == 1 })
	l := lines[0]
	if l["request_id"] != "r-pd" || l["replica"] != resp.Header.Get("X-Kvgate-Replica") || l["prefill"] != resp.Header.Get(headerPrefill) ||
		l["status"] != 200.0 || l["ttft_ms"] == nil || l["prompt_tokens"] == nil || l["attempts"] != nil {
		t.Errorf("line %v, want replica %s and prefill %s", l, resp.Header.Get("X-Kvgate-Replica"), resp.Header.Get(headerPrefill))
	}
	waitIdle(t, gw)
	if n := counterValue(t, gw.g.reg, "kvgate_route_decisions_total", nil); n != 1 {
		t.Errorf("%v decisions counted for one disaggregated request, want 1", n)
	}
}

// A request retried elsewhere says how many replicas it tried, and names
// the one that answered.
func TestAccessLogRetry(t *testing.T) {
	a, b := newFakeReplica(t), newFakeReplica(t)
	b.status.Store(http.StatusServiceUnavailable)
	cfg := baseConfig(a.srv.URL, b.srv.URL)
	cfg.Policy, cfg.AccessLog = "round_robin", true
	sink := &lockedBuffer{}
	gw := startLoggedGateway(t, cfg, sink)
	waitListed(t, gw)
	for _, id := range []string{"r1", "r2"} {
		if resp, out := post(t, gw.srv.URL+"/v1/completions", `{"model":"m","prompt":"x"}`, "X-Request-Id", id); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
	}
	var lines []map[string]any
	eventually(t, "two access lines", func() bool { lines = sink.accessLines(t); return len(lines) == 2 })
	retried := 0
	for _, l := range lines {
		if l["replica"] != a.srv.URL {
			t.Errorf("line %v: the answer came from %s", l, a.srv.URL)
		}
		if l["attempts"] == 2.0 {
			retried++
		}
	}
	if retried != 1 || b.requests.Load() != 1 {
		t.Errorf("%d lines with attempts 2, %d requests at the refusing replica; want 1, 1: %v", retried, b.requests.Load(), lines)
	}
}
