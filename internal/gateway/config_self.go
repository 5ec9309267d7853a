package gateway

import (
	"log/slog"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
)

// A replica that is this gateway (loop.go's second defence against
// request loops): a replica URL equal to the gateway's own listen address
// is refused at config time (validateNoSelf), and dropped with an error
// log when discovery or a replicas file brings one later (dropSelf, which
// the control plane applies to every source's list).

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
	for key, r := range c.replicaKeys() {
		if selfLoop(c.Listen, r.URL, localHost) {
			errs = append(errs, keyErr(key+".url", "%q is this gateway's own listen address (%s): every request "+
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
