package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/fleet"
	"github.com/kvgate/kvgate/internal/sharedstate"
)

// Behind an endpoint picker, a call naming a stored response the gateway
// does not know (no tenants: any client may name it; no shared record;
// the gateway restarted without state_file, or its bounded memory dropped
// the id) cannot be looked up as the HTTP front does, by sending it to
// each replica in turn until one does not answer 404: the proxy sends a
// request once. So the picker asks the replicas itself, before it picks:
// GET /v1/responses/{id} to each replica it may choose, eight at a time,
// and pins the call to the one that has it. Before, such a call went by load to one
// replica, which answered 404 unless it happened to hold the response.

// lookupProbeTimeout bounds each replica's answer, as a health probe's;
// lookupProbes bounds the replicas asked at once by one lookup (after a
// restart, every chain under way looks its response up once).
const (
	lookupProbeTimeout = 2 * time.Second
	lookupProbes       = 8
)

// errLookupUnchecked: a replica the response may be on did not answer.
var errLookupUnchecked = &apiError{Status: http.StatusServiceUnavailable, Type: "server_error", Code: "replica_unavailable",
	Message: "the replica holding the response named could not be found now (a replica did not answer); retry later"}

// find pins x, a lookup of stored response id, to the replica holding it:
// the 404 of an unknown id when every replica it may go to answers 404, a
// 503 when none has it but one did not answer, or when there is none to
// ask (as serve's: nothing says the response does not exist).
func (h *Handoff) find(id string) error {
	g, x := h.g, h.x
	notFound := responseNotFound(id)
	if !plainID(id) {
		return notFound // no replica makes such an id; none is asked (it would be a path of the client's)
	}
	// The replicas the call may be pinned to: healthy, not excluded, of the
	// pool routing its model (the first pool's without one), as a route.
	var cands []int
	if views, err := g.rt.Candidates(x.req, x.exclude...); err == nil {
		for i := range views {
			if views[i].Healthy {
				cands = append(cands, i)
			}
		}
	}
	if len(cands) == 0 {
		return errNoReplica
	}
	// The probes carry the call's Via and this gateway's hop, as the call
	// would: a replica that is this gateway again (a loop) refuses them.
	via := append(slices.Clone(x.r.Header.Values("Via")), viaEntry(x.r, g.via))
	switch holder, unchecked := g.askHolders(x.r.Context(), cands, id, via); {
	case holder >= 0:
		x.pol, x.lookup = pinned(holder), false
		g.pt.homes.found(id, holder, x.tenant.label())
		return nil
	case unchecked:
		return errLookupUnchecked
	case g.lookupComplete(x, len(cands)):
		g.pt.homes.noteAbsent(x.req.Model, id)
	}
	return notFound
}

// askHolders asks replicas cands, lookupProbes at a time, whether they
// hold response id: the first that does (-1: none), and whether one did
// not answer (once one does, the others' answers are not awaited).
func (g *Gateway) askHolders(ctx context.Context, cands []int, id string, via []string) (holder int, unchecked bool) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg sync.WaitGroup
		mu sync.Mutex
	)
	holder = -1
	slots := make(chan struct{}, lookupProbes)
	for _, i := range cands {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			has, err := g.holdsResponse(ctx, i, id, via)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case has && holder < 0:
				holder = i
				cancel() // the others' answers are not needed
			case err != nil && !errors.Is(err, context.Canceled):
				unchecked = true
			}
		})
	}
	wg.Wait()
	return holder, unchecked
}

// plainID: id is one a replica makes (vLLM's "resp_" and hex), within the
// shared record's bound: letters, digits, '_' and '-' only, so that the
// path asked is /v1/responses/{id} and nothing else.
func plainID(id string) bool {
	if id == "" || len(id) > sharedstate.MaxResponseID {
		return false
	}
	for _, c := range []byte(id) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// holdsResponse asks replica i whether it stores response id: true on 200,
// an error when it could not tell (no answer in time, 408, 429, 5xx but
// 508), else false.
func (g *Gateway) holdsResponse(ctx context.Context, i int, id string, via []string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, lookupProbeTimeout)
	defer cancel()
	rep := g.rt.Replica(i)
	req, err := fleet.NewRequest(ctx, http.MethodGet, rep.URL(), rep.APIKey(), "/v1/responses/"+id, nil,
		func(h http.Header) { h["Via"] = via })
	if err != nil {
		return false, err
	}
	resp, err := g.client.Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // a short answer keeps its connection
	switch c := resp.StatusCode; {
	case c == http.StatusOK:
		return true, nil
	case c == http.StatusRequestTimeout || c == http.StatusTooManyRequests || c >= 500 && c != http.StatusLoopDetected:
		return false, fmt.Errorf("GET /v1/responses/{id}: %s", resp.Status) // busy or failing: may hold it
	}
	// 404, and any other refusal (a replica that does not serve stored
	// responses, or not to this gateway's key; 508: it leads back to this
	// gateway, the probe's Via names it) would refuse the call too.
	return false, nil
}
