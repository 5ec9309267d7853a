// Package ui is the gateway's live view: GET /ui, one self-contained page
// (inline CSS and script, no external asset) that polls GET /ui/state
// every second. Like /debug and /admin it exists only when an admin token
// is configured. A browser signs in once with /ui?token=TOKEN: the view
// sets a session cookie and redirects to /ui, so that the token leaves the
// address bar (and the history); scripts and tools may send
// Authorization: Bearer TOKEN instead.
//
// The view reads the gateway through a narrow interface (Source: the
// admin token and the fleet of the moment) and keeps its own tallies of
// settled attempts (Tallies), which the gateway feeds. It refuses with
// the errors below; the gateway answers them in its error shape.
package ui

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	_ "embed"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"time"
)

// Refusals of the view (the gateway maps them to its HTTP errors).
var (
	ErrNotFound     = errors.New("ui: no such page")
	ErrMethod       = errors.New("use GET")
	ErrUnauthorized = errors.New("the live view needs the admin token: open /ui?token=<admin token> once, " +
		"or send Authorization: Bearer <admin token>")
	ErrWrongToken = errors.New("wrong admin token")
)

// Source is what the view reads of the gateway.
type Source interface {
	// AdminToken opens the view ("": the view does not exist).
	AdminToken() string
	// Fleet is the fleet at now: the policy, the requests in flight and
	// one row per replica shown (the view adds its tallies to each).
	Fleet(now time.Time) Fleet
}

// Fleet is the gateway's side of the view's state.
type Fleet struct {
	Policy   string
	InFlight int64
	Replicas []Replica
	// Tenants are the flow controller's tenants, by pool (none with flow
	// control off).
	Tenants []Tenant
}

// Tenant is one tenant's row in one pool: its share and what it was
// served, and its requests waiting in the gateway, by band.
type Tenant struct {
	Pool   string  `json:"pool,omitempty"`
	Name   string  `json:"name"` // "" for keys of no tenant
	Weight float64 `json:"weight"`
	// Served is the GPU work it was served (uncached prompt tokens plus
	// output tokens), the fair share's measure.
	Served float64 `json:"served_tokens"`
	Queued int     `json:"queued"`
	Active int     `json:"active"` // waiting or in flight
	// Bands are its requests waiting by band (priority), when any waits.
	Bands map[string]int `json:"queued_by_band,omitempty"`
}

// ReplicaRow is a replica as the operator's pages show it: /admin/replicas,
// /debug/route and the view.
type ReplicaRow struct {
	Slot           int    `json:"-"` // the router's (listings leave free slots out)
	URL            string `json:"url"`
	State          string `json:"state"`          // active, draining (removed, requests in flight) or removed (until forget_after)
	Role           string `json:"role,omitempty"` // a prefill/decode fleet's
	Pool           string `json:"pool,omitempty"` // with pools: in the config
	Rank           *int   `json:"rank,omitempty"`
	Healthy        bool   `json:"healthy"`
	MatchBlocks    int    `json:"match_blocks"`
	InFlight       int    `json:"in_flight"`
	PendingPrefill int    `json:"pending_prefill_tokens"`
	Waiting        *int   `json:"waiting,omitempty"`
	// WaitingUnseen: of Waiting, the requests beyond those the gateways
	// had there without a first token when the scrape was taken (what
	// ttft counts as other clients' queue).
	WaitingUnseen *int     `json:"waiting_unseen,omitempty"`
	Running       *int     `json:"running,omitempty"`
	KVUsage       *float64 `json:"kv_usage,omitempty"`
	MetricsAgeMs  *float64 `json:"metrics_age_ms,omitempty"`
	Score         *float64 `json:"score,omitempty"`
	IndexBlocks   int      `json:"index_blocks"`
	// Programs and ProgramTokens: the live programs homed on the replica
	// and the contexts they reserve there (router, programs.go).
	Programs      int `json:"programs,omitempty"`
	ProgramTokens int `json:"program_tokens,omitempty"`
}

// Replica is one replica's row in the view: its row as /admin/replicas
// shows it, and what the view adds.
type Replica struct {
	ReplicaRow
	// Name keys the replica's tally (its URL, URL#k for a rank).
	Name string `json:"-"`
	// State: healthy (in rotation), unhealthy (its /health fails),
	// ejected (its breaker is open), half-open (back on trial) or draining
	// (removed by discovery, its requests in flight finishing; once they
	// have, the row goes).
	State       string   `json:"state"`
	ScrapeAgeMs *float64 `json:"scrape_age_ms"` // nil: never scraped
	Attempts    int64    `json:"attempts"`
	Share       float64  `json:"share"`
	HitRate     *float64 `json:"hit_rate"`
	KVSynced    *bool    `json:"kv_synced,omitempty"` // precise mode only
}

// State is GET /ui/state's answer.
type State struct {
	Policy        string     `json:"policy"`
	Now           time.Time  `json:"now"`
	BucketSeconds float64    `json:"bucket_seconds"`
	InFlight      int64      `json:"in_flight"`
	Attempts      int64      `json:"attempts"`
	HitRate       *float64   `json:"hit_rate"`
	Replicas      []Replica  `json:"replicas"`
	Series        []Point    `json:"series"`
	Decisions     []Decision `json:"decisions"`
	Tenants       []Tenant   `json:"tenants,omitempty"`
}

// View serves the page and its state.
type View struct {
	src     Source
	tallies *Tallies
	bearer  func(http.Header) (string, bool)
	now     func() time.Time
}

// New is the view of src and tallies; bearer reads a request's bearer
// token (the gateway's one check of every door), now is the clock.
func New(src Source, tallies *Tallies, bearer func(http.Header) (string, bool), now func() time.Time) *View {
	return &View{src: src, tallies: tallies, bearer: bearer, now: now}
}

//go:embed index.html
var page []byte

// csp allows the page's own inline script and style (by hash) and
// requests to the gateway itself, nothing else: even a replica URL that
// slipped past the page's escaping could load nothing.
var csp = "default-src 'none'; script-src " + inlineHash(page, "script") + "; style-src " +
	inlineHash(page, "style") + "; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// inlineHash is the CSP source of the page's one inline <tag> element.
func inlineHash(page []byte, tag string) string {
	_, rest, ok := bytes.Cut(page, []byte("<"+tag+">"))
	body, _, ok2 := bytes.Cut(rest, []byte("</"+tag+">"))
	if !ok || !ok2 {
		panic("ui: index.html has no inline <" + tag + ">")
	}
	sum := sha256.Sum256(body)
	return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
}

// CookieName is the session cookie's name. Its value is derived from the
// admin token (session), never the token itself: a leaked cookie opens
// the view, not the admin endpoints, and a new token ends every session.
const CookieName = "kvgate_ui"

func session(token string) string {
	m := hmac.New(sha256.New, []byte(token))
	m.Write([]byte("kvgate live view session v1"))
	return hex.EncodeToString(m.Sum(nil))
}

// Serve serves /ui (the page) and /ui/state (its data), or refuses with
// one of the errors above (nothing written but the Allow header).
func (v *View) Serve(w http.ResponseWriter, r *http.Request) error {
	tok := v.src.AdminToken()
	if tok == "" {
		return ErrNotFound
	}
	state := r.URL.Path == "/ui/state"
	if !state && r.URL.Path != "/ui" && r.URL.Path != "/ui/" {
		return ErrNotFound
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		return ErrMethod
	}
	if q := r.URL.Query(); q.Has("token") && !state {
		return signIn(w, r, q.Get("token"), tok)
	}
	if !v.authorized(r, tok) {
		return ErrUnauthorized
	}
	h := w.Header()
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	if state {
		h.Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(v.State())
		return nil
	}
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Security-Policy", csp)
	h.Set("X-Frame-Options", "DENY")
	_, _ = w.Write(page)
	return nil
}

// signIn checks a token given in the address and, when right, sets the
// session cookie and redirects to the same page without the token.
func signIn(w http.ResponseWriter, r *http.Request, got, tok string) error {
	if subtle.ConstantTimeCompare([]byte(got), []byte(tok)) != 1 {
		return ErrWrongToken
	}
	http.SetCookie(w, &http.Cookie{Name: CookieName, Value: session(tok), Path: "/ui", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: overTLS(r)})
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Referrer-Policy", "no-referrer")
	http.Redirect(w, r, r.URL.Path, http.StatusSeeOther)
	return nil
}

// overTLS reports whether the browser reached the gateway over TLS: its
// own listener, or a proxy in front that says so (the cookie only gets
// stricter when a client claims it falsely).
func overTLS(r *http.Request) bool {
	return r.TLS != nil || strings.EqualFold(r.Header.Get("X-Forwarded-Proto"), "https")
}

// authorized accepts the bearer token or the session cookie, each
// compared in constant time.
func (v *View) authorized(r *http.Request, tok string) bool {
	if got, ok := v.bearer(r.Header); ok {
		return subtle.ConstantTimeCompare([]byte(got), []byte(tok)) == 1
	}
	c, err := r.Cookie(CookieName)
	return err == nil && subtle.ConstantTimeCompare([]byte(c.Value), []byte(session(tok))) == 1
}

// State gathers the view's state: the fleet from the source, the rest
// from the tallies.
func (v *View) State() State {
	now := v.now()
	snap := v.tallies.Snapshot(now)
	fl := v.src.Fleet(now)
	st := State{Policy: fl.Policy, Now: now.UTC(), BucketSeconds: BucketWidth.Seconds(), InFlight: fl.InFlight,
		Attempts: snap.Attempts, HitRate: snap.Fleet.HitRate(), Replicas: fl.Replicas, Series: snap.Series,
		Decisions: snap.Decisions, Tenants: fl.Tenants}
	if st.Decisions == nil {
		st.Decisions = []Decision{}
	}
	for i := range st.Replicas {
		row := &st.Replicas[i]
		t := snap.Replicas[row.Name]
		row.Attempts, row.HitRate = t.Attempts, t.HitRate()
		if snap.Attempts > 0 {
			row.Share = float64(t.Attempts) / float64(snap.Attempts)
		}
	}
	return st
}
