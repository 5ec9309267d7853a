package gateway

import (
	"log/slog"
	"net/http"
	"strings"
	"time"
)

// The access log (access_log: true, kvgate serve --access-log): one line
// per request at info, when it ends, with what an operator looks for —
// method, path, the client's tenant, model, the replica that answered (and the prefill replica
// of a disaggregated request), the status the client got, TTFT, end to
// end, the usage's prompt, cached and generated tokens, and the request
// id. Never the prompt, the answer or any key: the line is built from
// named fields only, never from the body or the headers.

// accessWriter is the client's ResponseWriter seen by the access log: it
// keeps the status the client got, and the exchange's settled attempts
// write what they learnt into it (noteAccess). It hides nothing: Unwrap lets
// http.ResponseController reach the connection (flush, deadlines).
type accessWriter struct {
	http.ResponseWriter
	status int
	// Filled by noteAccess from the attempts (the last one wins; a prefill
	// step names only the prefill replica).
	model, replica, prefill string
	tenant                  string        // the client's tenant ("": none)
	ttft                    time.Duration // -1: no first token seen
	prompt, cached, output  int
	attempts                int
	route                   *receipt // the answering attempt's (nil: none)
}

func (w *accessWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *accessWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

func (w *accessWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// quietPaths are requests the access log leaves out: probes, scrapes and
// the live view's polling, which would drown the requests served.
func quietPath(p string) bool {
	return p == "/health" || p == "/ready" || p == "/metrics" || p == "/ui" || strings.HasPrefix(p, "/ui/")
}

// withAccessLog wraps the gateway's handler with the access log when it is
// on.
func (g *Gateway) withAccessLog(h http.Handler) http.Handler {
	if !g.cfg.AccessLog {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if quietPath(r.URL.Path) {
			h.ServeHTTP(w, r)
			return
		}
		aw := &accessWriter{ResponseWriter: w, ttft: -1, cached: -1}
		start := g.clock.Now()
		// Deferred: a handler that aborts the connection (a body cut
		// midway) panics with http.ErrAbortHandler, and is logged too.
		defer g.logAccess(aw, r, start)
		h.ServeHTTP(aw, r)
	})
}

// noteAccess is the access log's sink: it writes a settled attempt's
// outcome into the access log's record of its exchange (a skipped attempt
// sent nothing: nothing to say).
func noteAccess(s *settledAttempt) {
	x, a, name, ttft := s.x, s.a, s.name, s.ttft
	aw, ok := x.w.(*accessWriter)
	if !ok || !s.sent {
		return
	}
	aw.model = modelOf(x)
	if a.step == stepPrefill {
		aw.prefill = name
		return
	}
	aw.attempts++ // tries of the answering step: more than one is a retry
	aw.replica, aw.ttft, aw.route = name, ttft, &s.route
	if a.prefill == nil {
		aw.prefill = ""
	}
	if a.prompt > 0 || a.output > 0 {
		aw.prompt, aw.cached, aw.output = a.prompt, a.cached, a.output
	}
}

// modelOf is the model an exchange asked for ("" when it named none).
func modelOf(x *exchange) string {
	if x.parsed == nil {
		return ""
	}
	return x.parsed.Model
}

func (g *Gateway) logAccess(aw *accessWriter, r *http.Request, start time.Time) {
	status := aw.status
	if status == 0 {
		status = http.StatusOK // the handler wrote nothing: net/http sends 200
	}
	attrs := []slog.Attr{slog.String("method", r.Method), slog.String("path", r.URL.Path),
		slog.Int("status", status), slog.String("request_id", aw.Header().Get("X-Request-Id"))}
	if aw.tenant != "" {
		attrs = append(attrs, slog.String("tenant", aw.tenant))
	}
	if aw.model != "" {
		attrs = append(attrs, slog.String("model", aw.model))
	}
	if aw.replica != "" {
		attrs = append(attrs, slog.String("replica", aw.replica))
	}
	if aw.prefill != "" {
		attrs = append(attrs, slog.String("prefill", aw.prefill))
	}
	if aw.attempts > 1 {
		attrs = append(attrs, slog.Int("attempts", aw.attempts))
	}
	if aw.ttft >= 0 {
		attrs = append(attrs, slog.Float64("ttft_ms", ms(aw.ttft)))
	}
	attrs = append(attrs, slog.Float64("e2e_ms", ms(g.clock.Since(start))))
	if aw.route != nil {
		attrs = append(attrs, aw.route.attrs()...)
	}
	if aw.prompt > 0 || aw.output > 0 {
		attrs = append(attrs, slog.Int("prompt_tokens", aw.prompt), slog.Int("completion_tokens", aw.output))
		if aw.cached >= 0 {
			attrs = append(attrs, slog.Int("cached_tokens", aw.cached))
		}
	}
	g.log.LogAttrs(r.Context(), slog.LevelInfo, "access", attrs...)
}

// ms is d in milliseconds, to the microsecond.
func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
