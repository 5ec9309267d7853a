package kvzmq

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// Who may publish on a listening socket. A topic kv@HOST:PORT@MODEL only
// claims to speak for the replica at HOST:PORT; what vouches for the claim
// is the connection's source address, which TCP's handshake makes
// unforgeable off-path: an engine connects from its own address (a pod's
// IP on Kubernetes, no NAT between pods), so by default a publisher may
// speak only for the replicas whose host is that address.

// Trust entries (kvgate's kv_events_trust).
const (
	// TrustReplicaAddress: a publisher may publish for the replicas whose
	// host (an IP, or a name resolving to it) is its source address.
	TrustReplicaAddress = "replica_address"
	// TrustAny: anyone who can connect may publish for any replica (no
	// check: kvgate before issue 22).
	TrustAny = "any"
)

// ErrTrust: a trust list that is empty or names something else than
// replica_address, any or a CIDR.
var ErrTrust = errors.New("kvevents: bad trust list")

// Trust says which publishers may publish for which replica: the union of
// its entries, replica_address and CIDRs (a publisher from one of the
// networks may publish for any replica), or any alone.
type Trust struct {
	anyone, replicaAddress bool
	nets                   []netip.Prefix
}

// ParseTrust reads a trust list: "replica_address", "any" (alone), and
// CIDRs such as "10.0.0.0/8" or "fd00::/8" (a single address is
// "10.1.2.3/32").
func ParseTrust(entries []string) (Trust, error) {
	var t Trust
	if len(entries) == 0 {
		return t, fmt.Errorf("%w: empty: no publisher could publish (want %s, %s or CIDRs)", ErrTrust, TrustReplicaAddress, TrustAny)
	}
	for _, e := range entries {
		switch e = strings.TrimSpace(e); e {
		case TrustReplicaAddress:
			t.replicaAddress = true
		case TrustAny:
			t.anyone = true
		default:
			p, err := netip.ParsePrefix(e)
			if err != nil {
				hint := ""
				if _, aerr := netip.ParseAddr(e); aerr == nil {
					hint = " (one address is ADDRESS/32, or /128)"
				}
				return Trust{}, fmt.Errorf("%w: %q is not %s, %s or a CIDR%s", ErrTrust, e, TrustReplicaAddress, TrustAny, hint)
			}
			t.nets = append(t.nets, p.Masked())
		}
	}
	if t.anyone && len(entries) > 1 {
		return Trust{}, fmt.Errorf("%w: %s admits everyone: it stands alone", ErrTrust, TrustAny)
	}
	return t, nil
}

// Anyone reports whether every publisher is trusted (any).
func (t Trust) Anyone() bool { return t.anyone }

// ReplicaAddress reports whether a publisher is trusted for the replicas
// at its own address.
func (t Trust) ReplicaAddress() bool { return t.replicaAddress }

// ForAll reports whether a publisher at addr may publish for every replica:
// any, or addr within one of the networks.
func (t Trust) ForAll(addr netip.Addr) bool {
	return t.anyone || slices.ContainsFunc(t.nets, func(p netip.Prefix) bool { return p.Contains(addr) })
}

func (t Trust) String() string {
	var s []string
	if t.anyone {
		s = append(s, TrustAny)
	}
	if t.replicaAddress {
		s = append(s, TrustReplicaAddress)
	}
	for _, p := range t.nets {
		s = append(s, p.String())
	}
	return strings.Join(s, ",")
}

// LookupFunc resolves a host name to its addresses.
type LookupFunc func(ctx context.Context, host string) ([]netip.Addr, error)

// AddrBook defaults.
const (
	// DefaultAddrRefresh: how often names are resolved again. A pod that
	// restarts under the same name (a StatefulSet's) comes back with a new
	// IP; the refused connection of its new address also asks for a
	// refresh (Kick), so it waits at most DefaultAddrMinRefresh.
	DefaultAddrRefresh    = 30 * time.Second
	DefaultAddrMinRefresh = 5 * time.Second
	addrLookupTimeout     = 2 * time.Second
)

// AddrBookOptions tunes an AddrBook; the zero value gives the defaults.
type AddrBookOptions struct {
	Refresh    time.Duration // default DefaultAddrRefresh
	MinRefresh time.Duration // the least time between two rounds; default DefaultAddrMinRefresh
}

// AddrBook knows the addresses of a set of hosts: IP literals at once,
// names as a resolver last answered. Rounds of lookups run in Run's
// goroutine, never on a caller's: every Refresh, and on a Kick no sooner
// than MinRefresh after the last round. A failed lookup keeps a name's
// previous addresses (a DNS outage must not lock engines out).
type AddrBook struct {
	lookup LookupFunc
	clk    clock.Clock
	o      AddrBookOptions
	kick   chan struct{}

	mu        sync.Mutex
	literal   map[string]netip.Addr   // host → its address
	names     map[string][]netip.Addr // host → its addresses (nil: not resolved yet)
	all       map[netip.Addr]struct{} // every address above
	lastRound time.Time
}

// NewAddrBook follows no host until SetHosts.
func NewAddrBook(lookup LookupFunc, clk clock.Clock, o AddrBookOptions) *AddrBook {
	if o.Refresh <= 0 {
		o.Refresh = DefaultAddrRefresh
	}
	if o.MinRefresh <= 0 {
		o.MinRefresh = DefaultAddrMinRefresh
	}
	return &AddrBook{lookup: lookup, clk: clock.OrReal(clk), o: o, kick: make(chan struct{}, 1),
		literal: map[string]netip.Addr{}, names: map[string][]netip.Addr{}, all: map[netip.Addr]struct{}{}}
}

// hostAddr is host as an address ("[::1]" and "::1" alike), if it is one.
func hostAddr(host string) (netip.Addr, bool) {
	a, err := netip.ParseAddr(strings.Trim(host, "[]"))
	if err != nil {
		return netip.Addr{}, false
	}
	return a.Unmap().WithZone(""), true
}

// SetHosts makes hosts the ones followed: literals are known at once,
// names keep what they resolved to before, and a new name asks for a round.
func (b *AddrBook) SetHosts(hosts []string) {
	b.mu.Lock()
	literal, names := map[string]netip.Addr{}, map[string][]netip.Addr{}
	fresh := false
	for _, h := range hosts {
		h = strings.ToLower(h)
		if a, ok := hostAddr(h); ok {
			literal[h] = a
			continue
		}
		old, known := b.names[h]
		names[h] = old
		fresh = fresh || !known
	}
	b.literal, b.names = literal, names
	b.reindexLocked()
	b.mu.Unlock()
	if fresh {
		b.Kick()
	}
}

func (b *AddrBook) reindexLocked() {
	b.all = map[netip.Addr]struct{}{}
	for _, a := range b.literal {
		b.all[a] = struct{}{}
	}
	for _, as := range b.names {
		for _, a := range as {
			b.all[a] = struct{}{}
		}
	}
}

// Addrs are host's addresses as known now (nil: unknown).
func (b *AddrBook) Addrs(host string) []netip.Addr {
	if a, ok := hostAddr(host); ok {
		return []netip.Addr{a}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.names[strings.ToLower(host)]
}

// Has reports whether a is the address of a followed host.
func (b *AddrBook) Has(a netip.Addr) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	_, ok := b.all[a]
	return ok
}

// Names reports whether some followed host is a name (literals need no
// lookup, and so no Kick).
func (b *AddrBook) Names() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.names) > 0
}

// Kick asks Run for a round of lookups (at most one per MinRefresh); it
// never blocks.
func (b *AddrBook) Kick() {
	select {
	case b.kick <- struct{}{}:
	default:
	}
}

// Run resolves the names: at once, every Refresh, and on Kick, until ctx
// ends.
func (b *AddrBook) Run(ctx context.Context) {
	tick := b.clk.NewTicker(b.o.Refresh)
	defer tick.Stop()
	b.round(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
		case <-b.kick:
			b.mu.Lock()
			wait := b.o.MinRefresh - b.clk.Since(b.lastRound)
			b.mu.Unlock()
			if !clock.Sleep(b.clk, wait, ctx.Done()) {
				return
			}
		}
		b.round(ctx)
	}
}

// round resolves every followed name once.
func (b *AddrBook) round(ctx context.Context) {
	b.mu.Lock()
	hosts := make([]string, 0, len(b.names))
	for h := range b.names {
		hosts = append(hosts, h)
	}
	b.mu.Unlock()
	got := map[string][]netip.Addr{}
	for _, h := range hosts {
		lctx, cancel := context.WithTimeout(ctx, addrLookupTimeout)
		as, err := b.lookup(lctx, h)
		cancel()
		if err != nil || len(as) == 0 {
			continue
		}
		for i, a := range as {
			as[i] = a.Unmap().WithZone("")
		}
		got[h] = as
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for h, as := range got {
		if _, still := b.names[h]; still {
			b.names[h] = as
		}
	}
	b.reindexLocked()
	b.lastRound = b.clk.Now()
}
