package gateway

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	_ "embed"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strings"
)

// The live view: GET /ui, one self-contained page (inline CSS and script,
// no external asset) that polls GET /ui/state every second. Like /debug
// and /admin it exists only when an admin token is configured. A browser
// signs in once with /ui?token=TOKEN: the gateway sets a session cookie
// and redirects to /ui, so that the token leaves the address bar (and the
// history); scripts and tools may send Authorization: Bearer TOKEN instead.

//go:embed ui/index.html
var uiPage []byte

// uiCSP allows the page's own inline script and style (by hash) and
// requests to the gateway itself, nothing else: even a replica URL that
// slipped past the page's escaping could load nothing.
var uiCSP = "default-src 'none'; script-src " + inlineHash(uiPage, "script") + "; style-src " +
	inlineHash(uiPage, "style") + "; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// inlineHash is the CSP source of the page's one inline <tag> element.
func inlineHash(page []byte, tag string) string {
	_, rest, ok := bytes.Cut(page, []byte("<"+tag+">"))
	body, _, ok2 := bytes.Cut(rest, []byte("</"+tag+">"))
	if !ok || !ok2 {
		panic("gateway: ui/index.html has no inline <" + tag + ">")
	}
	sum := sha256.Sum256(body)
	return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
}

// uiCookie is the session cookie's name. Its value is derived from the
// admin token (uiSession), never the token itself: a leaked cookie opens
// the view, not the admin endpoints, and a new token ends every session.
const uiCookie = "kvgate_ui"

func uiSession(token string) string {
	m := hmac.New(sha256.New, []byte(token))
	m.Write([]byte("kvgate live view session v1"))
	return hex.EncodeToString(m.Sum(nil))
}

// serveUI serves /ui (the page) and /ui/state (its data).
func (g *Gateway) serveUI(w http.ResponseWriter, r *http.Request) {
	tok := g.adminToken()
	if tok == "" {
		writeError(w, errNotFound)
		return
	}
	state := r.URL.Path == "/ui/state"
	if !state && r.URL.Path != "/ui" && r.URL.Path != "/ui/" {
		writeError(w, errNotFound)
		return
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		writeError(w, errMethod.with("use GET"))
		return
	}
	if q := r.URL.Query(); q.Has("token") && !state {
		g.uiSignIn(w, r, q.Get("token"), tok)
		return
	}
	if !uiAuthorized(r, tok) {
		writeError(w, errUnauth.with("the live view needs the admin token: open /ui?token=<admin token> once, "+
			"or send Authorization: Bearer <admin token>"))
		return
	}
	h := w.Header()
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	if state {
		h.Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(g.liveState())
		return
	}
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Security-Policy", uiCSP)
	h.Set("X-Frame-Options", "DENY")
	_, _ = w.Write(uiPage)
}

// uiSignIn checks a token given in the address and, when right, sets the
// session cookie and redirects to the same page without the token.
func (g *Gateway) uiSignIn(w http.ResponseWriter, r *http.Request, got, tok string) {
	if subtle.ConstantTimeCompare([]byte(got), []byte(tok)) != 1 {
		writeError(w, errUnauth.with("wrong admin token"))
		return
	}
	http.SetCookie(w, &http.Cookie{Name: uiCookie, Value: uiSession(tok), Path: "/ui", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: overTLS(r)})
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Referrer-Policy", "no-referrer")
	http.Redirect(w, r, r.URL.Path, http.StatusSeeOther)
}

// overTLS reports whether the browser reached the gateway over TLS: its
// own listener, or a proxy in front that says so (the cookie only gets
// stricter when a client claims it falsely).
func overTLS(r *http.Request) bool {
	return r.TLS != nil || strings.EqualFold(r.Header.Get("X-Forwarded-Proto"), "https")
}

// uiAuthorized accepts the bearer token or the session cookie, each
// compared in constant time.
func uiAuthorized(r *http.Request, tok string) bool {
	if got, ok := bearer(r.Header); ok {
		return subtle.ConstantTimeCompare([]byte(got), []byte(tok)) == 1
	}
	c, err := r.Cookie(uiCookie)
	return err == nil && subtle.ConstantTimeCompare([]byte(c.Value), []byte(uiSession(tok))) == 1
}
