package gateway

import (
	"context"
	"log/slog"
	"time"

	"github.com/kvgate/kvgate/internal/gateway/ui"
)

// settledAttempt is one attempt as settle hands it to the sinks, with
// what several of them read worked out once.
type settledAttempt struct {
	x   *exchange
	a   *attempt
	end time.Time
	// sent: the attempt went to the replica (outcome.sent); a skipped one
	// is routed again and counted then.
	sent bool
	// name is the replica's (metrics, logs); policy names the policy that
	// decided (the ticket's: a pool's own, or the one a passthrough
	// request was routed by).
	name, policy string
	// branch is what the decision did with the prompt's prefix (branchOf;
	// "": a decode step after a prefill step, whose decision was the
	// prefill step's).
	branch string
	// ttft is from the request's arrival to the attempt's first token
	// (-1: none seen).
	ttft time.Duration
	// route is the decision's receipt, with its check against the
	// replica's report (receipt.go).
	route receipt
}

// sink hears every settled attempt, once (settle). A sink must not block:
// it runs on the request path.
type sink func(*settledAttempt)

// sinks are where settled attempts go: the metrics, the live view's
// tallies, the access log, tracing, the recording and the debug log. The
// ones on are in all, in the order they hear; met, ui, rec and tr are
// also read elsewhere (the metrics by the whole gateway, tracing by the
// request path's spans; rec and tr are nil when off).
type sinks struct {
	met *metrics
	ui  *ui.Tallies
	rec *recorder
	tr  *tracing
	all []sink
}

// newSinks lists the sinks on: tracing and the recording only when on,
// the access log's notes only when the access log is, the live view's
// tallies only when it can be served (an admin token is configured: it is
// not reloadable, and without it /ui answers 404).
func (g *Gateway) newSinks(met *metrics, rec *recorder, tr *tracing) sinks {
	k := sinks{met: met, ui: ui.NewTallies(), rec: rec, tr: tr}
	k.all = []sink{met.settled}
	if g.cfg.AdminToken != "" {
		k.all = append(k.all, g.noteUI)
	}
	if g.cfg.AccessLog {
		k.all = append(k.all, noteAccess)
	}
	if tr != nil {
		k.all = append(k.all, func(s *settledAttempt) { endAttempt(s.a, &s.route) })
	}
	if rec != nil {
		k.all = append(k.all, rec.settled)
	}
	if g.ten != nil {
		k.all = append(k.all, g.ten.settled)
	}
	k.all = append(k.all, logAttempt)
	return k
}

// logAttempt logs a settled attempt at debug (its arguments built only
// when debug is on).
func logAttempt(s *settledAttempt) {
	if !s.x.base.Enabled(context.Background(), slog.LevelDebug) {
		return
	}
	a := s.a
	s.x.logger().Debug("attempt", "replica", s.name, "step", a.step, "verdict", a.v.String(), "status", a.status,
		"matched_blocks", a.tk.Decision.Matched, "blocks", len(a.tk.Request().Blocks), "reason", a.tk.Decision.Reason,
		"cached_tokens", a.cached, "e2e", s.end.Sub(s.x.start), "err", a.err)
}
