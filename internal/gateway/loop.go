package gateway

import (
	crand "crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"

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

// thisHost is what names this machine: its hostname and its interfaces'
// addresses (no DNS: names other than localhost and the hostname are not
// resolved at config time; the Via check stops what this misses).
type thisHost struct {
	name  string
	addrs []net.IP
}

// localHost reads this machine's names once.
var localHost = sync.OnceValue(func() thisHost {
	h := thisHost{}
	h.name, _ = os.Hostname()
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			h.addrs = append(h.addrs, n.IP)
		}
	}
	return h
})

// selfLoop reports whether replicaURL is the listen address listen: the
// same port, and a host that reaches the listening socket. A socket on a
// specific address is reached by that address (and, for a loopback one, by
// localhost and the unspecified address, which Linux connects to
// loopback); one on every address (":8080", "0.0.0.0", "[::]") by any of
// this machine's: loopback, unspecified, its hostname, its interfaces'.
func selfLoop(listen, replicaURL string, here func() thisHost) bool {
	lhost, lport, err := net.SplitHostPort(listen)
	if err != nil {
		return false
	}
	u, err := url.Parse(replicaURL)
	if err != nil || !samePort(lport, u.Port(), u.Scheme) {
		return false
	}
	rhost := u.Hostname()
	switch {
	case strings.EqualFold(lhost, rhost):
		return true
	case lhost == "" || isUnspecified(lhost):
		return loopbackish(rhost, true) || here().names(rhost)
	case loopbackish(lhost, false):
		return loopbackish(rhost, false) && reaches(lhost, rhost)
	}
	l, r := net.ParseIP(lhost), net.ParseIP(rhost)
	return l != nil && r != nil && l.Equal(r)
}

// samePort reports whether a listen port and a URL's port (by default its
// scheme's) are one port; port 0 (any free port) never is.
func samePort(listen, port, scheme string) bool {
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[scheme]
	}
	lp, err1 := net.LookupPort("tcp", listen) // numeric, or a service name from /etc/services
	rp, err2 := net.LookupPort("tcp", port)
	return err1 == nil && err2 == nil && lp != 0 && lp == rp
}

func isUnspecified(host string) bool {
	ip := net.ParseIP(host)
	return ip != nil && ip.IsUnspecified()
}

// loopbackish reports whether host is localhost, a loopback address or
// the unspecified address; anyLoopback: any of 127.0.0.0/8 (a socket on
// every address answers them all), else only 127.0.0.1 and ::1, the ones
// localhost names.
func loopbackish(host string, anyLoopback bool) bool {
	if strings.EqualFold(host, "localhost") || isUnspecified(host) {
		return true
	}
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return false
	}
	return anyLoopback || ip.Equal(net.IPv4(127, 0, 0, 1)) || ip.Equal(net.IPv6loopback)
}

// reaches reports whether a connection to rhost reaches a socket bound to
// the loopback name lhost (both loopbackish): one IP reaches only itself;
// a name or the unspecified address may mean either.
func reaches(lhost, rhost string) bool {
	l, r := net.ParseIP(lhost), net.ParseIP(rhost)
	if l == nil || r == nil || l.IsUnspecified() || r.IsUnspecified() {
		return true
	}
	return l.Equal(r)
}

// names reports whether host names this machine.
func (h thisHost) names(host string) bool {
	if h.name != "" && strings.EqualFold(host, h.name) {
		return true
	}
	ip := net.ParseIP(host)
	for _, a := range h.addrs {
		if ip != nil && a.Equal(ip) {
			return true
		}
	}
	return false
}

// validateNoSelf refuses replicas (the config's and its pools') whose URL
// is the gateway's own listen address.
func (c *Config) validateNoSelf() []error {
	var errs []error
	for _, r := range c.allReplicas() {
		if selfLoop(c.Listen, r.URL, localHost) {
			errs = append(errs, fmt.Errorf("replica %q is this gateway's own listen address (%s): every request "+
				"sent to it would come back to the gateway, in a loop", r.URL, c.Listen))
		}
	}
	return errs
}

// dropSelf is list without the replicas whose URL is the gateway's own
// listen address, each logged: discovery and replicas files, whose lists
// are applied while the gateway runs, lose that entry and keep the rest.
func dropSelf(listen string, list []ReplicaConfig, log *slog.Logger, source string) []ReplicaConfig {
	var out []ReplicaConfig
	for i, r := range list {
		if !selfLoop(listen, r.URL, localHost) {
			if out != nil {
				out = append(out, r)
			}
			continue
		}
		if out == nil {
			out = append(make([]ReplicaConfig, 0, len(list)), list[:i]...)
		}
		log.Error("replica refused: its URL is this gateway's own listen address, requests would loop",
			"replica", r.URL, "listen", listen, "source", source)
	}
	if out == nil {
		return list
	}
	return out
}
