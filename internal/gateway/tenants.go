package gateway

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// The request path's side of tenants (config_tenants.go says what they
// are): a request's tenant from its key, then its terms — its band (the
// body's priority clamped to the tenant's range, or the tenant's
// default), its deadline (headerDeadline), its cache salt and its token
// quota — and the body its replica gets (priority and cache_salt as the
// gateway set them). Without tenants nothing here runs.

// headerDeadline is a request's time-to-first-token deadline in
// milliseconds from its arrival: the flow controller orders a tenant's
// requests by it (EDF) and sheds one that cannot meet it. It is the
// gateway's own header (X-Kvgate-*), read here and never sent upstream.
const headerDeadline = "X-Kvgate-Deadline-Ms"

// maxDeadlineMs bounds headerDeadline: an hour.
const maxDeadlineMs = 3_600_000

// saltTenant and saltClient prefix the cache_salt the gateway sends when
// a tenant isolates its cache: an isolated tenant's requests get
// saltTenant+name+":"+their own salt, every other request that names a
// salt saltClient+its salt, so that no client can name an isolated
// tenant's salt and share its KV.
const (
	saltTenant = "kvgate-tenant:"
	saltClient = "kvgate-client:"
)

// errQuota: the tenant's token quota for the minute is spent (quota.go).
var errQuota = &apiError{Status: http.StatusTooManyRequests, Type: "rate_limit_error", Code: "quota_exceeded",
	Message: "the tenant's token quota for this minute is spent; retry later"}

var errDeadline = &apiError{Status: http.StatusBadRequest, Type: "invalid_request_error", Code: "invalid_deadline",
	Message: headerDeadline + " must be an integer number of milliseconds from 1 to " + strconv.Itoa(maxDeadlineMs)}

// tenancy is the gateway's tenants: whose a key is, and what each
// tenant's requests get.
type tenancy struct {
	byKey map[[sha256.Size]byte]*tenant // by the SHA-256 of a key: a lookup that compares no key
	list  []*tenant
	// flow: the router's flow controller runs; enginePriority: bands go to
	// the replicas as vLLM's priority; isolating: some tenant isolates
	// its cache (every client salt is then namespaced).
	flow, enginePriority, isolating bool
	met                             *tenantMetrics
	// quotas are the tenants' token quotas (quota.go; nil: none has one).
	quotas *quotas
}

// tenant is one tenant (name "": the top-level api_keys', no tenant).
type tenant struct {
	name    string
	isolate bool
}

// newTenancy is the gateway's tenants (nil without tenants and flow
// control); shared is the shared state the quotas sync through (nil: none).
func newTenancy(cfg Config, o Options, rt *router.Router, shared quotaSyncer) *tenancy {
	if !cfg.flowOn() {
		return nil
	}
	tc := &tenancy{byKey: map[[sha256.Size]byte]*tenant{}, flow: true, enginePriority: cfg.FlowControl.EnginePriority}
	none := &tenant{}
	for _, k := range cfg.APIKeys {
		tc.byKey[sha256.Sum256([]byte(k))] = none
	}
	for _, c := range cfg.Tenants {
		t := &tenant{name: c.Name, isolate: c.IsolateCache}
		tc.isolating = tc.isolating || c.IsolateCache
		tc.list = append(tc.list, t)
		for _, k := range c.APIKeys {
			tc.byKey[sha256.Sum256([]byte(k))] = t
		}
	}
	tc.met = newTenantMetrics(o.Registry, rt)
	if tc.quotas = newQuotas(cfg, o.Clock, o.Logger, shared); tc.quotas != nil {
		o.Registry.MustRegister(quotaUsed{tc.quotas})
	}
	return tc
}

// admitQuota charges an exchange to its tenant's token quota: its prompt
// (as counted for its routing key) and its max_tokens, for each sequence
// it asks for (n samples of each prompt of a batch: a batch's other
// prompts counted as long as its first, the one routing reads); 429 when
// the tenant's minute is spent. The usage corrects the charge at the end.
func (g *Gateway) admitQuota(x *exchange) error {
	if g.ten == nil || g.ten.quotas == nil || x.tenant == nil {
		return nil
	}
	tq := g.ten.quotas.byName[x.tenant.name]
	if tq == nil {
		return nil
	}
	p := x.parsed
	prompts := max(p.Prompts, 1)
	c, err := g.ten.quotas.admit(tq, x.req.Tokens*prompts, p.MaxTokens*prompts*max(p.Samples, 1))
	if err != nil {
		g.ten.noteShed(x, err)
		return err
	}
	x.charge = c
	return nil
}

// settleQuota corrects an ended exchange's charge to its usage.
func (g *Gateway) settleQuota(x *exchange) {
	if x.charge != nil {
		g.ten.quotas.settle(x.charge, x.usage.known, x.usage.sent, x.usage.prompt, x.usage.output)
	}
}

// identify is a request's tenant and whether its key lets it in: with
// tenants, a key of a tenant or of api_keys (every request needs one);
// without, the api_keys check (authorized), and no tenant.
func (g *Gateway) identify(r *http.Request) (*tenant, bool) {
	tc := g.ten
	if tc == nil || len(tc.byKey) == 0 {
		return nil, g.keysOK(r)
	}
	tok, ok := bearer(r.Header)
	if !ok {
		return nil, false
	}
	t, ok := tc.byKey[sha256.Sum256([]byte(tok))]
	return t, ok
}

// debugTenant is the tenant named name for /debug/route ("": none).
func (g *Gateway) debugTenant(name string) (*tenant, error) {
	if name == "" {
		return nil, nil
	}
	if g.ten != nil {
		for _, t := range g.ten.list {
			if t.name == name {
				return t, nil
			}
		}
	}
	return nil, errNotFound.with("no tenant " + strconv.Quote(name) + " is configured")
}

// label is the tenant's name ("" for none).
func (t *tenant) label() string {
	if t == nil {
		return ""
	}
	return t.name
}

// applyTenant gives a parsed exchange its tenant's terms: its band and
// deadline (kept for its routing key); its cache salt and priority go in
// its body (tenantEdits, by clientBody). An isolating tenant's Messages
// call is refused: no salt can go in its body (errIsolatedMessages).
func (g *Gateway) applyTenant(x *exchange) error {
	tc := g.ten
	if tc == nil {
		return nil
	}
	if x.kind == prompt.Messages && x.tenant != nil && x.tenant.isolate {
		return errIsolatedMessages
	}
	p := x.parsed
	x.band = g.rt.BandOf(x.tenant.label(), p.Priority, p.PrioritySet)
	if v := x.r.Header.Get(headerDeadline); v != "" {
		ms, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || ms < 1 || ms > maxDeadlineMs {
			return errDeadline
		}
		x.deadline = x.start.Add(time.Duration(ms) * time.Millisecond)
	}
	return nil
}

// tenantEdits are the edits of x's JSON body for its tenant, on every
// path the gateway passes: the kinds vLLM generates for (completions,
// chat and Responses: vLLM's ResponsesRequest takes cache_salt and
// priority as completions do) get the tenant's cache_salt, and its band as
// priority with engine_priority; any other body keeps a salt it names
// only namespaced (a pooling request may carry one) and never a
// priority of the client's (vLLM's pooling requests take it too). A
// Messages call generates, but vLLM's Messages request has neither field:
// its band orders the gateway's own queue only. The
// parsed request's salt (its routing key's) becomes the one sent. None
// without tenants.
func (tc *tenancy) tenantEdits(x *exchange) []fieldEdit {
	if tc == nil {
		return nil
	}
	p := x.parsed
	gen := x.kind == prompt.Completion || x.kind == prompt.Chat || x.kind == prompt.Responses
	var edits []fieldEdit
	if salt, ok := tc.salt(x.tenant, p.CacheSalt); ok && (gen || p.CacheSalt != "") {
		p.CacheSalt = salt
		edits = append(edits, fieldEdit{key: "cache_salt", value: jsonString(salt)})
	}
	switch {
	case gen && tc.enginePriority:
		edits = append(edits, fieldEdit{key: "priority", value: strconv.AppendInt(nil, int64(x.band), 10)})
	case p.PrioritySet:
		edits = append(edits, fieldEdit{key: "priority"}) // only the gateway may set it
	}
	if x.kind == prompt.Responses && mayName(x.body, "request_id") {
		// vLLM takes a Responses call's id from its request_id ("return in
		// response"): a client naming another tenant's id would take that
		// response over. The replica makes one of its own instead.
		edits = append(edits, fieldEdit{key: "request_id"})
	}
	return edits
}

// maxCacheSalt is vLLM's bound on cache_salt (its requests' max_length).
const maxCacheSalt = 1024

// salt is the cache_salt of a request of t whose client named salt, and
// whether it differs (false: the body's stands). A client's salt within
// vLLM's bound whose prefixed form would pass it goes as its SHA-256
// (hex), so that the gateway's prefix never makes vLLM refuse a valid
// salt; a salt already past it is the client's, for vLLM to refuse.
func (tc *tenancy) salt(t *tenant, salt string) (string, bool) {
	var prefix string
	switch {
	case t != nil && t.isolate:
		prefix = saltTenant + t.name + ":"
	case tc.isolating && salt != "":
		prefix = saltClient
	default:
		return salt, false
	}
	if len(prefix)+len(salt) > maxCacheSalt && len(salt) <= maxCacheSalt {
		sum := sha256.Sum256([]byte(salt))
		salt = "sha256:" + hex.EncodeToString(sum[:])
	}
	return prefix + salt, true
}

// tagRequest puts the exchange's tenant, band and deadline on its
// routing key, for the flow controller.
func (g *Gateway) tagRequest(x *exchange) {
	if g.ten == nil {
		return
	}
	x.req.Tenant, x.req.Priority, x.req.Deadline = x.tenant.label(), x.band, x.deadline
	tenantProgram(x.req, x.tenant)
}

// jsonString is s as a JSON string.
func jsonString(s string) []byte {
	b, _ := json.Marshal(s)
	return b
}
