package gateway

import (
	"net/http"
	"strconv"
	"time"

	"github.com/kvgate/kvgate/internal/gateway/ui"
	"github.com/kvgate/kvgate/internal/policy"
)

// The live view (/ui) is its own package; the gateway gives it a narrow
// view of itself (liveView: the admin token and the fleet of the
// moment), feeds its tallies from settle (noteUI) and answers its
// refusals in the gateway's error shape (errors.go).

// serveUI serves /ui and /ui/state.
func (g *Gateway) serveUI(v *ui.View) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := v.Serve(w, r); err != nil {
			writeError(w, err)
		}
	}
}

// noteUI is the live view's sink: it counts every settled attempt that
// was sent.
func (g *Gateway) noteUI(s *settledAttempt) {
	if !s.sent {
		return
	}
	a := s.a
	n := ui.Attempt{At: s.end, Replica: s.name, RequestID: s.x.id, Model: modelOf(s.x), Policy: s.policy, Step: a.step,
		Branch: s.branch, Route: g.describe(a.tk.Decision), Verdict: a.v.String(), Served: a.v == served, Status: a.status,
		TTFT: s.ttft, Prompt: a.prompt, Cached: a.cached}
	if a.prefill != nil && a.step != stepPrefill {
		n.PrefillURL = a.prefill.URL()
	}
	g.ui.Note(n)
}

// liveView is what the live view reads of the gateway (ui.Source).
type liveView struct{ g *Gateway }

func (l liveView) AdminToken() string { return l.g.adminToken() }

// Fleet is the replicas from the router's own views (as /admin/replicas
// shows them), with each one's rotation state and scrape age.
func (l liveView) Fleet(now time.Time) ui.Fleet {
	g := l.g
	views := g.rt.Views(&policy.Request{Now: now})
	fl := ui.Fleet{Policy: g.rt.Policy().Name(), InFlight: g.inFlight.Load()}
	for _, rd := range replicaDebugs(g, views, nil) {
		r := g.rt.Replica(rd.Slot)
		if r.Removed() && !r.Draining() {
			continue // a discovery source removed it and its last request ended: gone
		}
		row := ui.Replica{ReplicaRow: rd, Name: g.rt.Name(rd.Slot), State: g.replicaState(rd.Slot)}
		if age := r.MetricsAge(now); age >= 0 {
			ms := ms(age)
			row.ScrapeAgeMs = &ms
		}
		if g.rt.Precise() != nil {
			synced := r.PreciseSynced()
			row.KVSynced = &synced
		}
		fl.Replicas = append(fl.Replicas, row)
	}
	fl.Tenants = g.uiTenants()
	return fl
}

// uiTenants are the flow controller's tenants with their requests waiting
// by band (none with flow control off).
func (g *Gateway) uiTenants() []ui.Tenant {
	type key struct{ pool, tenant string }
	bands := map[key]map[string]int{}
	for _, d := range g.rt.QueueDepths() {
		k := key{d.Pool, d.Tenant}
		if bands[k] == nil {
			bands[k] = map[string]int{}
		}
		bands[k][strconv.Itoa(d.Band)] += d.Requests
	}
	var out []ui.Tenant
	for _, t := range g.rt.FlowTenants() {
		out = append(out, ui.Tenant{Pool: t.Pool, Name: t.Tenant, Weight: t.Weight, Served: t.Served, Queued: t.Queued,
			Active: t.Active, Bands: bands[key{t.Pool, t.Tenant}]})
	}
	return out
}

// replicaState names replica i's rotation state for the view.
func (g *Gateway) replicaState(i int) string {
	if g.rt.Replica(i).Removed() {
		return "draining" // removed by discovery, its requests in flight finishing
	}
	switch g.fleet.State(i) {
	case "open":
		return "ejected"
	case "half-open":
		if g.rt.Healthy(i) {
			return "half-open"
		}
	}
	if !g.rt.Healthy(i) {
		return "unhealthy"
	}
	return "healthy"
}
