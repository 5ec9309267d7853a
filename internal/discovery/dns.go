package discovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// Resolver is the part of net.Resolver the DNS source uses (tests inject
// answers).
type Resolver interface {
	LookupIPAddr(ctx context.Context, host string) ([]net.IPAddr, error)
	LookupSRV(ctx context.Context, service, proto, name string) (string, []*net.SRV, error)
}

// DNS defaults.
const (
	DefaultDNSInterval = 5 * time.Second
	// DefaultRemoveAfter: a replica leaves after this many consecutive
	// answers without it. One answer missing a live pod is common (a
	// resolver's cache between two endpoint updates, a truncated answer,
	// a round-robin subset); two in a row, an interval apart, is a
	// replica gone. Its in-flight work is never dropped either way
	// (a removed replica drains), but a flap would cost a revival's
	// churn in the logs and a gap in its traffic.
	DefaultRemoveAfter = 2
	lookupTimeout      = 5 * time.Second
)

// DNSConfig configures a DNS source.
type DNSConfig struct {
	// Name is HOST:PORT (A/AAAA records, each address a replica on PORT,
	// e.g. a headless Service vllm.ns.svc.cluster.local:8000), or a SRV
	// name _SERVICE._PROTO.DOMAIN (each target HOST:PORT a replica).
	Name     string
	Scheme   string        // default http
	Interval time.Duration // default DefaultDNSInterval
	// RemoveAfter: consecutive answers without a replica before it is
	// removed (default DefaultRemoveAfter; 1: at once).
	RemoveAfter int
	// Template is every replica's settings but its URL (role, api key,
	// data-parallel size): one role per DNS entry.
	Template Replica
	Resolver Resolver // default net.DefaultResolver
	Clock    clock.Clock
	Log      *slog.Logger
}

// DNS re-resolves a name every interval.
type DNS struct {
	cfg     DNSConfig
	host    string
	port    string
	srv     bool
	missing map[string]int // URL listed → consecutive answers without it
	failing bool
}

// ParseDNSName checks a DNS source's name: HOST:PORT, or _SERVICE._PROTO.DOMAIN.
func ParseDNSName(name string) (host, port string, srv bool, err error) {
	if strings.HasPrefix(name, "_") {
		parts := strings.SplitN(name, ".", 3)
		if len(parts) < 3 || !strings.HasPrefix(parts[1], "_") || parts[2] == "" || strings.Contains(name, ":") {
			return "", "", false, fmt.Errorf("dns %q: a SRV name is _SERVICE._PROTO.DOMAIN (e.g. _http._tcp.vllm.ns.svc.cluster.local)", name)
		}
		return name, "", true, nil
	}
	host, port, err = net.SplitHostPort(name)
	if err != nil || host == "" {
		return "", "", false, fmt.Errorf("dns %q: want NAME:PORT (A/AAAA records) or a SRV name _SERVICE._PROTO.DOMAIN", name)
	}
	if n, err := strconv.Atoi(port); err != nil || n <= 0 || n > 65535 {
		return "", "", false, fmt.Errorf("dns %q: port %q is not a number from 1 to 65535", name, port)
	}
	return host, port, false, nil
}

// NewDNS makes a DNS source.
func NewDNS(cfg DNSConfig) (*DNS, error) {
	host, port, srv, err := ParseDNSName(cfg.Name)
	if err != nil {
		return nil, err
	}
	if cfg.Scheme == "" {
		cfg.Scheme = "http"
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultDNSInterval
	}
	if cfg.RemoveAfter <= 0 {
		cfg.RemoveAfter = DefaultRemoveAfter
	}
	if cfg.Resolver == nil {
		cfg.Resolver = net.DefaultResolver
	}
	cfg.Clock = clock.OrReal(cfg.Clock)
	cfg.Log = logger(cfg.Log)
	return &DNS{cfg: cfg, host: host, port: port, srv: srv, missing: map[string]int{}}, nil
}

// Name is "dns NAME".
func (d *DNS) Name() string { return "dns " + d.cfg.Name }

// Run resolves now and every interval until ctx ends.
func (d *DNS) Run(ctx context.Context, update func([]Replica)) {
	tick := d.cfg.Clock.NewTicker(d.cfg.Interval)
	defer tick.Stop()
	var last []string
	for {
		if urls, ok := d.Resolve(ctx); ok && !slices.Equal(urls, last) {
			last = urls
			update(d.list(urls))
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
		}
	}
}

func (d *DNS) list(urls []string) []Replica {
	out := make([]Replica, len(urls))
	for i, u := range urls {
		out[i] = d.cfg.Template
		out[i].URL = u
	}
	return out
}

// Resolve looks the name up once and returns the replicas' URLs, sorted:
// those answered, and those missing from fewer than RemoveAfter answers in
// a row. ok false: the lookup failed (logged once until it works again),
// and the caller keeps its list.
func (d *DNS) Resolve(ctx context.Context) (urls []string, ok bool) {
	ctx, cancel := context.WithTimeout(ctx, lookupTimeout)
	defer cancel()
	found, err := d.lookup(ctx)
	if err != nil {
		if ctx.Err() == nil && !d.failing {
			d.cfg.Log.Warn("dns discovery: the lookup failed; keeping the previous replica list", "name", d.cfg.Name, "err", err)
		}
		d.failing = true
		return nil, false
	}
	if d.failing {
		d.cfg.Log.Info("dns discovery: the lookup works again", "name", d.cfg.Name, "replicas", len(found))
		d.failing = false
	}
	for u := range d.missing {
		if slices.Contains(found, u) {
			d.missing[u] = 0
			continue
		}
		if d.missing[u]++; d.missing[u] >= d.cfg.RemoveAfter {
			delete(d.missing, u)
		}
	}
	for _, u := range found {
		d.missing[u] = 0
	}
	for u := range d.missing {
		urls = append(urls, u)
	}
	slices.Sort(urls)
	return urls, true
}

// errEmpty: an answer without a record (a Service scaled to zero answers
// NXDOMAIN, which is an error too): the list is kept rather than emptied.
var errEmpty = errors.New("no records")

// lookup is the distinct URLs the name resolves to now.
func (d *DNS) lookup(ctx context.Context) ([]string, error) {
	var out []string
	if d.srv {
		_, srvs, err := d.cfg.Resolver.LookupSRV(ctx, "", "", d.host)
		if err != nil {
			return nil, err
		}
		for _, s := range srvs {
			host := strings.TrimSuffix(s.Target, ".")
			out = append(out, d.cfg.Scheme+"://"+net.JoinHostPort(host, strconv.Itoa(int(s.Port))))
		}
	} else {
		addrs, err := d.cfg.Resolver.LookupIPAddr(ctx, d.host)
		if err != nil {
			return nil, err
		}
		for _, a := range addrs {
			out = append(out, d.cfg.Scheme+"://"+net.JoinHostPort(a.IP.String(), d.port))
		}
	}
	if len(out) == 0 {
		return nil, errEmpty
	}
	slices.Sort(out)
	return slices.Compact(out), nil
}
