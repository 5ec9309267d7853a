package gateway

import (
	crand "crypto/rand"
	"encoding/hex"
	"net/http"
	"strconv"
	"strings"

	"github.com/kvgate/kvgate/internal/sharedstate"
)

// Request loops. A replica URL that leads back to a gateway (its own
// listen address, or another gateway whose replicas lead back to it)
// turns one request into an unbounded chain of proxied requests, each
// holding a connection and a body. Two defences:
//
//   - every request a gateway sends upstream carries a Via entry (RFC 9110
//     §7.6.3) naming it, "1.1 kvgate-<id>", appended to the ones it
//     received; a request arriving with this gateway's own entry has been
//     here before and is answered 508 Loop Detected (RFC 5842) before any
//     routing. Via rather than a header of kvgate's own: it is the
//     standard's field for exactly this, proxies in between (Envoy, nginx)
//     pass it on or append to it, and kvgate strips the X-Kvgate-* headers
//     a client sends, which would erase a header of its own at the next
//     kvgate. A client that forges the entry only gets its own request
//     refused.
//   - a replica URL equal to the gateway's own listen address (selfLoop) is
//     refused at config time, and dropped with an error log when
//     discovery or a replicas file brings one later.

// viaName is the Via received-by pseudonym of gateway id: "kvgate-" and
// the id, in a token's characters (RFC 9110 §5.6.2).
func viaName(id string) string {
	return "kvgate-" + strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' {
			return r
		}
		return '-'
	}, id)
}

// gatewayID is this process's id: its name in the shared state when it
// shares (host-pid-random, unique per process, so the logs of both agree),
// else 12 random hex digits.
func gatewayID(s *sharedstate.Syncer) string {
	if s != nil {
		return s.Gateway()
	}
	var b [6]byte
	_, _ = crand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// viaEntry is the Via entry for a request received as r: its protocol
// version (the name omitted for HTTP) and this gateway's pseudonym.
func viaEntry(r *http.Request, name string) string {
	proto := "1.1"
	switch {
	case r.ProtoMajor >= 2:
		proto = strconv.Itoa(r.ProtoMajor)
	case r.ProtoMajor == 1 && r.ProtoMinor == 0:
		proto = "1.0"
	}
	return proto + " " + name
}

// looped reports whether h's Via names this gateway (name): the request
// has been through it already. Each entry is "protocol received-by
// [comment]"; entries are comma-separated, on one line or several.
func looped(h http.Header, name string) bool {
	for _, v := range h.Values("Via") {
		if !strings.Contains(v, name) {
			continue // the common case, without splitting
		}
		for _, e := range strings.Split(v, ",") {
			f := strings.Fields(e)
			if len(f) >= 2 && f[1] == name {
				return true
			}
		}
	}
	return false
}

// errLoop: the request carries this gateway's own Via entry.
var errLoop = &apiError{Status: http.StatusLoopDetected, Type: "server_error", Code: "loop_detected",
	Message: "the request has already passed through this gateway (its Via header names it): a replica URL " +
		"leads back to a gateway; check the replicas of the gateways on the way"}
