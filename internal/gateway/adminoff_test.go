package gateway

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// Without an admin token the admin and debug endpoints do not exist (404),
// and the answer says how to turn them on.
func TestAdminOffSaysHowToTurnItOn(t *testing.T) {
	a := newFakeReplica(t)
	gw := startGateway(t, baseConfig(a.srv.URL))
	for _, c := range []struct{ method, path string }{
		{"POST", "/debug/route"}, {"GET", "/debug/pprof/"}, {"GET", "/admin/replicas"}, {"GET", "/ui"}, {"GET", "/ui/state"},
		{"GET", "/ui?token=x"},
	} {
		req, _ := http.NewRequest(c.method, gw.srv.URL+c.path, strings.NewReader(`{"model":"m","prompt":"x"}`))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(body), "--admin-token TOKEN") {
			t.Errorf("%s %s: %d %s", c.method, c.path, resp.StatusCode, body)
		}
	}
}

// /debug/route takes a JSON body under a form's or plain text's content
// type (what curl -d sends), as it takes one under JSON's or none; the
// inference paths still refuse those (415), and so does /debug/route a
// body that is not JSON.
func TestDebugRouteContentTypes(t *testing.T) {
	a := newFakeReplica(t)
	cfg := baseConfig(a.srv.URL)
	cfg.AdminToken = "s3cret"
	gw := startGateway(t, cfg)
	js := `{"model":"m","prompt":"x"}`
	for _, c := range []struct {
		path, ct, body string
		want           int
	}{
		{"/debug/route", "application/json", js, 200},
		{"/debug/route", "", js, 200},
		{"/debug/route", "application/x-www-form-urlencoded", js, 200},
		{"/debug/route", "text/plain; charset=utf-8", js, 200},
		{"/debug/route", "application/x-www-form-urlencoded", "model=m&prompt=x", 415},
		{"/debug/route", "multipart/form-data; boundary=x", js, 415},
		{"/v1/completions", "application/x-www-form-urlencoded", js, 415},
	} {
		resp, body := post(t, gw.srv.URL+c.path, c.body, "Content-Type", c.ct, "Authorization", "Bearer s3cret")
		if resp.StatusCode != c.want {
			t.Errorf("%s as %q: %d, want %d: %s", c.path, c.ct, resp.StatusCode, c.want, body)
		}
		if c.want == 415 && !strings.Contains(body, "-H 'Content-Type: application/json'") {
			t.Errorf("%s as %q: the 415 does not say what to send: %s", c.path, c.ct, body)
		}
	}
}
