package chaos

import (
	"net"
	"net/http"
	"net/http/httptrace"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/gateway"
)

// attempt is one upstream call the gateway made for a request.
type attempt struct {
	target string // the replica's base URL (scheme://host)
	status int    // 0: no response (the error is in err)
	// wrote: the request was written on a connection before it failed, so
	// the replica may have begun generating it (ambiguous when status is 0).
	wrote bool
	err   string
}

// notStarted reports whether the replica surely did not start the request:
// the attempt failed before the request was written (a refused or failed
// connection), or the replica refused it (503, 429). These are the only
// attempts after which the retry rule lets another replica receive the
// request; after anything else (a connection cut once the request was
// sent, a first-byte timeout, any other answer) the replica may be
// generating it — or it may be a query of death — so a retry could
// duplicate the work or crash replica after replica.
func (a attempt) notStarted() bool {
	return (a.status == 0 && !a.wrote) || a.status == http.StatusServiceUnavailable || a.status == http.StatusTooManyRequests
}

// recorder is the gateway's upstream transport, wrapped: it notes every
// inference call by the client's X-Request-Id (the gateway forwards it), so
// that the suite can check per request which replicas received it and
// what each answered.
type recorder struct {
	inner *http.Transport

	mu   sync.Mutex
	byID map[string][]attempt
}

// newRecorder builds the transport the gateway would build for cfg (the
// same dial timeout, response-header timeout, pool and no compression; see
// gateway.New), wrapped to record. The gateway only applies
// FirstByteTimeout to the transport it builds itself, so the copy must.
func newRecorder(cfg gateway.Config) *recorder {
	return &recorder{
		inner: &http.Transport{
			Proxy:                 nil,
			DialContext:           (&net.Dialer{Timeout: cfg.ConnectTimeout.D(), KeepAlive: 30 * time.Second}).DialContext,
			MaxIdleConns:          4096,
			MaxIdleConnsPerHost:   1024,
			IdleConnTimeout:       90 * time.Second,
			ResponseHeaderTimeout: cfg.FirstByteTimeout.D(),
			DisableCompression:    true,
		},
		byID: make(map[string][]attempt),
	}
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	id := req.Header.Get("X-Request-Id")
	if req.Method != http.MethodPost || id == "" {
		return r.inner.RoundTrip(req) // probes, scrapes, tokenize
	}
	var wrote atomic.Bool
	trace := &httptrace.ClientTrace{WroteRequest: func(i httptrace.WroteRequestInfo) {
		if i.Err == nil {
			wrote.Store(true)
		}
	}}
	req = req.WithContext(httptrace.WithClientTrace(req.Context(), trace))
	resp, err := r.inner.RoundTrip(req)
	a := attempt{target: req.URL.Scheme + "://" + req.URL.Host, wrote: wrote.Load()}
	if err != nil {
		a.err = err.Error()
	} else {
		a.status = resp.StatusCode
	}
	r.mu.Lock()
	r.byID[id] = append(r.byID[id], a)
	r.mu.Unlock()
	return resp, err
}

// attempts returns the attempts recorded for id, in order.
func (r *recorder) attempts(id string) []attempt {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]attempt(nil), r.byID[id]...)
}

func (r *recorder) close() { r.inner.CloseIdleConnections() }

// outcome says how an attempt ended.
func (a attempt) outcome() string {
	if a.status != 0 {
		return http.StatusText(a.status)
	}
	if a.wrote {
		return "cut after the request was sent: " + a.err
	}
	return "failed before the request was sent: " + a.err
}

// ruleViolation checks one request's attempts against the gateway's retry
// rule: at most retries+1 attempts, each on a replica not tried before, and
// a further attempt only after one the replica surely did not start. It
// returns "" when the attempts keep the rule.
func ruleViolation(as []attempt, retries int) string {
	if len(as) > retries+1 {
		return "more attempts than the retry budget"
	}
	seen := map[string]bool{}
	for k, a := range as {
		if seen[a.target] {
			return "the same replica tried twice: " + a.target
		}
		seen[a.target] = true
		if k < len(as)-1 && !a.notStarted() {
			return "sent again after " + a.target + " may have started it (" + a.outcome() + ")"
		}
	}
	return ""
}
