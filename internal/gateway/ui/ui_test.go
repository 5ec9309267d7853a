package ui_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/gateway/ui"
	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

func TestUINotFoundWithoutAdminToken(t *testing.T) {
	a := newFakeReplica(t)
	gw := startGateway(t, baseConfig(a.URL))
	for _, p := range []string{"/ui", "/ui/", "/ui/state", "/ui?token=x"} {
		if resp, _ := get(t, gw.srv.URL+p, "Authorization", "Bearer x"); resp.StatusCode != http.StatusNotFound {
			t.Errorf("%s without an admin token: %d, want 404", p, resp.StatusCode)
		}
	}
}

func TestUIAuthentication(t *testing.T) {
	a := newFakeReplica(t)
	cfg := baseConfig(a.URL)
	cfg.AdminToken = "s3cret"
	gw := startGateway(t, cfg)
	base := gw.srv.URL
	for _, c := range []struct {
		path string
		hdr  []string
	}{
		{"/ui", nil}, {"/ui/state", nil}, {"/ui", []string{"Authorization", "Bearer wrong"}},
		{"/ui/state", []string{"Cookie", ui.CookieName + "=s3cret"}}, // the token itself is no session
		{"/ui/state?token=s3cret", nil},                              // only the page signs in
	} {
		resp, body := get(t, base+c.path, c.hdr...)
		if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(body, "/ui?token=") {
			t.Errorf("%s %v: %d %s, want 401 saying how to sign in", c.path, c.hdr, resp.StatusCode, body)
		}
	}
	resp, _ := get(t, base+"/ui?token=wrong")
	if resp.StatusCode != http.StatusUnauthorized || len(resp.Cookies()) != 0 {
		t.Fatalf("wrong token in the address: %d, cookies %v", resp.StatusCode, resp.Cookies())
	}
	if resp, _ := post(t, base+"/ui", `{}`, "Authorization", "Bearer s3cret"); resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("POST /ui: %d, want 405", resp.StatusCode)
	}

	// Signing in: a cookie (not the token), then the page without the token.
	resp, _ = get(t, base+"/ui?token=s3cret")
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/ui" {
		t.Fatalf("sign-in: %d to %q, want 303 to /ui", resp.StatusCode, resp.Header.Get("Location"))
	}
	cs := resp.Cookies()
	if len(cs) != 1 {
		t.Fatalf("sign-in set %d cookies", len(cs))
	}
	c := cs[0]
	if c.Name != ui.CookieName || !c.HttpOnly || c.SameSite != http.SameSiteStrictMode || c.Secure || c.Path != "/ui" ||
		c.Value == "" || strings.Contains(c.Value, "s3cret") {
		t.Fatalf("cookie %+v: want HttpOnly, SameSite=Strict, not Secure over plain HTTP, path /ui, no token in it", c)
	}
	resp, body := get(t, base+"/ui", "Cookie", c.Name+"="+c.Value)
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") ||
		!strings.Contains(body, `id="replicas"`) {
		t.Fatalf("the page with the cookie: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	csp := resp.Header.Get("Content-Security-Policy")
	if !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "script-src 'sha256-") || strings.Contains(csp, "unsafe-inline") {
		t.Errorf("CSP %q", csp)
	}
	if strings.Contains(body, "http://") && strings.Contains(body, "src=\"http") {
		t.Error("the page loads an external asset")
	}
	if resp, _ := get(t, base+"/ui/state", "Cookie", c.Name+"="+c.Value); resp.StatusCode != 200 {
		t.Errorf("state with the cookie: %d", resp.StatusCode)
	}
	if resp, _ := get(t, base+"/ui/state", "Authorization", "Bearer s3cret"); resp.StatusCode != 200 {
		t.Errorf("state with the bearer token: %d", resp.StatusCode)
	}
	if resp, _ := get(t, base+"/ui/nothing", "Authorization", "Bearer s3cret"); resp.StatusCode != http.StatusNotFound {
		t.Errorf("/ui/nothing: %d", resp.StatusCode)
	}
	// Behind a TLS-terminating proxy the cookie is Secure.
	resp, _ = get(t, base+"/ui?token=s3cret", "X-Forwarded-Proto", "https")
	if cs := resp.Cookies(); len(cs) != 1 || !cs[0].Secure {
		t.Errorf("over TLS: cookies %v, want one Secure", cs)
	}
}

func TestUIStateJSON(t *testing.T) {
	a, b := newFakeReplica(t), newFakeReplica(t)
	cfg := baseConfig(a.URL, b.URL)
	cfg.AdminToken = "tok"
	cfg.Policy = "round_robin"
	gw := startGateway(t, cfg)
	waitListed(t, gw)
	prompt := strings.Repeat("the same long system prompt ", 20)
	for _, stream := range []bool{false, true, false} {
		body, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "max_tokens": 3, "stream": stream})
		if resp, out := post(t, gw.srv.URL+"/v1/completions", string(body), "X-Request-Id", "req-<b>"); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, out)
		}
	}
	waitIdle(t, gw)
	var st ui.State
	eventually(t, "three attempts in the live view", func() bool {
		resp, body := get(t, gw.srv.URL+"/ui/state", "Authorization", "Bearer tok")
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		st = ui.State{}
		if err := json.Unmarshal([]byte(body), &st); err != nil {
			t.Fatal(err)
		}
		return st.Attempts == 3
	})
	if st.Policy != "round_robin" || len(st.Replicas) != 2 || st.HitRate == nil || *st.HitRate != 0.8 {
		t.Fatalf("state %+v: want 2 replicas, hit rate 8/10 from usage", st)
	}
	share := 0.0
	for _, r := range st.Replicas {
		share += r.Share
		if r.State != "healthy" || r.HitRate == nil || *r.HitRate != 0.8 || r.Attempts == 0 {
			t.Errorf("replica %+v", r)
		}
	}
	if share != 1 {
		t.Errorf("shares add up to %v", share)
	}
	var n int64
	ttft := false
	for _, p := range st.Series {
		n += p.Attempts
		ttft = ttft || p.TTFTMeanM != nil
	}
	if len(st.Series) != ui.Buckets || n != 3 || !ttft {
		t.Errorf("series of %d buckets holds %d attempts (want %d, 3), a TTFT: %v", len(st.Series), n, ui.Buckets, ttft)
	}
	if len(st.Decisions) != 3 {
		t.Fatalf("%d decisions, want 3", len(st.Decisions))
	}
	// Newest first: round robin over two replicas found the prompt on the
	// other replica (spilled), then nowhere (the first request, a miss).
	want := []string{"held_prefix", "spilled_load", "miss"}
	for i, d := range st.Decisions {
		if d.Branch != want[i] || d.RequestID != "req-<b>" || d.Model != "m" || d.Verdict != "served" || d.Status != 200 ||
			d.ReplicaURL == "" || d.Decision.Reason == "" {
			t.Errorf("decision %d: %+v, want branch %s", i, d, want[i])
		}
	}
	if st.Decisions[1].TTFTMs == nil || st.Decisions[0].TTFTMs != nil {
		t.Errorf("only the streamed request has a TTFT: %v %v", st.Decisions[1].TTFTMs, st.Decisions[0].TTFTMs)
	}
}

// A replica a discovery source removed shows as draining while its
// requests finish, and leaves the view when the last one has.
func TestUIDrainingReplica(t *testing.T) {
	a, b := newFakeReplica(t), newFakeReplica(t)
	cfg := baseConfig(a.URL, b.URL)
	cfg.AdminToken = "tok"
	gw := startGateway(t, cfg)
	rt := gw.g.Router()
	req := rt.Prepare(&prompt.Parsed{Kind: prompt.Completion, Model: "m", Text: "held", KeyText: "held", MaxTokens: 1, Prompts: 1}, "", "")
	tk, err := rt.Route(req, 0) // a request in flight at b
	if err != nil || tk.Replica != 1 {
		t.Fatalf("routed to %v: %v", tk, err)
	}
	if _, err := rt.SetReplicas([]router.Spec{{URL: a.URL}}); err != nil {
		t.Fatal(err)
	}
	states := func() map[string]string {
		_, body := get(t, gw.srv.URL+"/ui/state", "Authorization", "Bearer tok")
		var st ui.State
		if err := json.Unmarshal([]byte(body), &st); err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, r := range st.Replicas {
			out[r.URL] = r.State
		}
		return out
	}
	if s := states(); s[b.URL] != "draining" || len(s) != 2 {
		t.Fatalf("states %v: want %s draining", s, b.URL)
	}
	tk.Done(time.Now(), router.Outcome{CachedTokens: -1})
	if s := states(); len(s) != 1 || s[a.URL] == "" {
		t.Fatalf("states %v: want %s alone", s, a.URL)
	}
}
