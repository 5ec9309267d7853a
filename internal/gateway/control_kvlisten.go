package gateway

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/kvevents"
	"github.com/kvgate/kvgate/internal/kvevents/kvzmq"
)

// maxUnknownTopicsLogged bounds the distinct unknown topics logged (a
// misconfigured fleet logs each once; a hostile one cannot flood the log).
const maxUnknownTopicsLogged = 64

// errPeerAddress: a batch whose topic names a replica, published from an
// address kv_events_trust does not trust for it.
var errPeerAddress = errors.New("kv events: the publisher's address is not its replica's (kv_events_trust)")

// kvTopics finds the target of a batch received on the listening socket:
// the topic's HOST:PORT is a replica's URL, its rank the batch's
// data_parallel_rank (or the port offset it arrived on).
type kvTopics struct {
	byHostPort map[string][]int // host:port → the server's targets
	byHost     map[string][]int // host → the server's targets, when one server has that host
}

// newKVTopics maps the replicas' topics, and has the address book (when
// listening) follow their hosts.
func (c *control) newKVTopics() *kvTopics {
	t := &kvTopics{byHostPort: map[string][]int{}, byHost: map[string][]int{}}
	hostCount := map[string]int{}
	for i := range c.rt.Replicas() {
		if c.rt.Replica(i).Removed() {
			continue
		}
		hp := hostPort(c.rt.URL(i))
		if _, seen := t.byHostPort[hp]; !seen {
			host, _, _ := net.SplitHostPort(hp)
			hostCount[host]++
		}
		t.byHostPort[hp] = append(t.byHostPort[hp], i)
	}
	for hp, slots := range t.byHostPort {
		if host, _, _ := net.SplitHostPort(hp); hostCount[host] == 1 {
			t.byHost[host] = slots
		}
	}
	if b := c.kv.book.Load(); b != nil {
		hosts := make([]string, 0, len(hostCount))
		for h := range hostCount {
			if h != "" {
				hosts = append(hosts, h)
			}
		}
		b.SetHosts(hosts)
	}
	return t
}

// slots are the targets of the server a topic names (ok false: no replica
// has that address, or it was removed: a replica discovered later is found
// once the membership change rebuilt the topics).
func (t *kvTopics) slots(topic string) ([]int, bool) {
	h := strings.ToLower(kvevents.TopicHost(topic))
	slots, ok := t.byHostPort[h]
	if !ok {
		slots, ok = t.byHost[strings.Trim(h, "[]")]
	}
	return slots, ok
}

// kvTarget is the router slot of a batch with topic and rank.
func (c *control) kvTarget(t *kvTopics, topic string, rank int) (int, bool) {
	slots, ok := t.slots(topic)
	if !ok {
		return 0, false
	}
	for _, i := range slots {
		k, ranked := c.rt.Replica(i).Rank()
		if !ranked || k == rank {
			return i, true
		}
	}
	return 0, false
}

// listenKV binds kv_events_listen, and for data-parallel replicas the
// ports after it (vLLM's rank k connects to the endpoint's port + k), and
// returns their closers. The ports are bound at start: for the ranks of
// the replicas known then, and the data_parallel_size discovery gives
// every replica it finds (a data-parallel server discovered later, with
// its size counted rather than configured, has its ranks past those
// unheard).
func (c *control) listenKV(ctx context.Context) []func() error {
	trust, _ := kvzmq.ParseTrust(c.cfg.KVEventsTrust) // Validate checked it
	closers := []func() error{c.followKVAddrs(ctx)}
	ranks := 1
	if d := c.cfg.Discovery; d != nil {
		ranks = max(ranks, d.DataParallelSize)
	}
	for i := range c.rt.Replicas() {
		if k, ranked := c.rt.Replica(i).Rank(); ranked {
			ranks = max(ranks, k+1)
		}
	}
	for k := range ranks {
		ep := kvevents.OffsetPort(c.cfg.KVEventsListen, k)
		l, err := kvzmq.Listen(ctx, ep, func(m kvevents.Message) { c.onListened(ctx, c.kv.topics.Load(), k, m) },
			c.listenOptions(ep, k, trust))
		if err != nil {
			c.log.Error("kv events: cannot listen; replicas that connect there stay on the approximate index",
				"endpoint", ep, "err", err)
			continue
		}
		c.log.Info("kv events: listening", "endpoint", ep, "addr", l.Addr().String(), "trust", trust.String())
		closers = append(closers, l.Close)
	}
	return closers
}

// followKVAddrs starts what the listening socket checks publishers
// against: the replicas' topics and addresses (their names resolved in the
// background until the returned stop is called or ctx ends), and the
// count of what it refuses.
func (c *control) followKVAddrs(ctx context.Context) (stop func() error) {
	book := kvzmq.NewAddrBook(c.lookupAddrs, c.clock, kvzmq.AddrBookOptions{})
	c.kv.book.Store(book)
	c.kv.conns.Store(c.kvConnsMetric())
	c.kv.topics.Store(c.newKVTopics())
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); book.Run(ctx) }()
	return func() error { cancel(); <-done; return nil }
}

// listenOptions are the bounds and checks of the listening socket at port
// offset k.
func (c *control) listenOptions(ep string, k int, trust kvzmq.Trust) kvzmq.ListenOptions {
	return kvzmq.ListenOptions{
		OnConnect: func(remote net.Addr) {
			c.log.Info("kv events: a publisher connected", "endpoint", ep, "from", remote.String())
		},
		OnError:                  func(err error) { c.onListenError(ep, err) },
		HandshakeTimeout:         c.cfg.KVEventsHandshakeTimeout.D(),
		MaxConnections:           c.cfg.KVEventsMaxConnections,
		MaxConnectionsPerAddress: c.cfg.KVEventsMaxConnectionsPerAddress,
		MaxFrameBytes:            c.cfg.KVEventsMaxFrameBytes,
		IdleTimeout:              c.cfg.KVEventsIdleTimeout.D(),
		AcceptFrom:               func(a netip.Addr) bool { return c.kvMayConnect(trust, a) },
		Authorize:                func(a netip.Addr, topic string) error { return c.kvAuthorize(trust, k, a, topic) },
	}
}

// kvMayConnect reports whether a publisher from a may connect at all:
// trusted for every replica, or at a replica's address. A refusal asks
// the address book for a round (a pod back under its name with a new IP
// is let in on its next reconnection).
func (c *control) kvMayConnect(trust kvzmq.Trust, a netip.Addr) bool {
	if trust.ForAll(a) {
		return true
	}
	b := c.kv.book.Load()
	if trust.ReplicaAddress() && b.Has(a) {
		return true
	}
	b.Kick()
	return false
}

// kvAuthorize checks, before a batch is decoded, that its publisher at a
// may publish under topic: a topic that names a replica must come from
// that replica's address, unless kv_events_trust trusts a for every
// replica. A refused batch changes nothing (no restart, gap, resync or
// sync change: it never reaches the follower); it is counted as a drop
// with reason peer_address. A topic that names no replica passes here and
// is counted as unknown once decoded (onListened).
func (c *control) kvAuthorize(trust kvzmq.Trust, k int, a netip.Addr, topic string) error {
	t := c.kv.topics.Load()
	slots, ok := t.slots(topic)
	if !ok || trust.ForAll(a) {
		return nil
	}
	b := c.kv.book.Load()
	if trust.ReplicaAddress() && slices.Contains(b.Addrs(urlHost(c.rt.URL(slots[0]))), a) {
		return nil
	}
	b.Kick()
	i, ok := c.kvTarget(t, topic, k)
	if !ok {
		i = slots[0]
	}
	name := c.rt.Name(i)
	c.met.kvDropped.WithLabelValues(name, "peer_address").Inc()
	c.logKV(name, "peer_address", slog.LevelWarn, "kv events: a batch for this replica from another address, dropped "+
		"(a publisher may speak only for the replica at its own address: kv_events_trust)", "from", a.String(), "topic", topic)
	return errPeerAddress
}

// onListenError counts (and logs, at most once a minute per reason) the
// connections the listening socket refused or closed on its own.
func (c *control) onListenError(ep string, err error) {
	var ce *kvzmq.ConnError
	if !errors.As(err, &ce) || ce.Reason == kvzmq.ReasonClosed {
		c.log.Debug("kv events", "endpoint", ep, "err", err)
		return
	}
	c.kv.conns.Load().WithLabelValues(string(ce.Reason)).Inc()
	switch ce.Reason {
	case kvzmq.ReasonPeerAddress, kvzmq.ReasonFrameSize:
		c.logEvery("listen\x00"+string(ce.Reason), slog.LevelWarn, "kv events: a connection refused (peer_address: its source "+
			"address is no replica's, kv_events_trust; frame_size: a frame over kv_events_max_frame_bytes)",
			"endpoint", ep, "reason", string(ce.Reason), "from", ce.Remote.String())
	default:
		c.log.Debug("kv events", "endpoint", ep, "err", err)
	}
}

// kvConnsMetric is kvgate_kv_events_connections_closed_total, registered
// once.
func (c *control) kvConnsMetric() *prometheus.CounterVec {
	cv := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_kv_events_connections_closed_total",
		Help: "Connections to kv_events_listen refused or closed by kvgate, by reason: peer_address (the source address is " +
			"no replica's, kv_events_trust), per_address and max_connections (the caps), evicted (an idle one's slot went to " +
			"a newcomer), handshake, frame_size (over kv_events_max_frame_bytes), idle (kv_events_idle_timeout)."},
		[]string{"reason"})
	var dup prometheus.AlreadyRegisteredError
	if err := c.reg.Register(cv); errors.As(err, &dup) {
		return dup.ExistingCollector.(*prometheus.CounterVec)
	}
	return cv
}

// lookupAddrs resolves a replica's host name for the address book, with
// the gateway's resolver (DNS discovery's).
func (c *control) lookupAddrs(ctx context.Context, host string) ([]netip.Addr, error) {
	r := c.resolver
	if r == nil {
		r = net.DefaultResolver
	}
	ips, err := r.LookupIPAddr(ctx, host)
	if err != nil {
		return nil, err
	}
	out := make([]netip.Addr, 0, len(ips))
	for _, ip := range ips {
		if a, ok := netip.AddrFromSlice(ip.IP); ok {
			out = append(out, a.Unmap())
		}
	}
	return out, nil
}

// urlHost is a replica URL's host (name or address), lowercased.
func urlHost(u string) string {
	p, err := url.Parse(u)
	if err != nil {
		return ""
	}
	return strings.ToLower(p.Hostname())
}

// onListened follows a batch received on the listening socket at port
// offset k.
func (c *control) onListened(ctx context.Context, topics *kvTopics, k int, m kvevents.Message) {
	rank := k
	if m.Batch.DataParallelRank != nil {
		rank = *m.Batch.DataParallelRank
	}
	i, ok := c.kvTarget(topics, m.Topic, rank)
	if !ok {
		c.met.kvUnknownTopic.Inc()
		if c.kv.unknownTopics.Add(1) <= maxUnknownTopicsLogged {
			if _, logged := c.kv.logged.LoadOrStore("topic\x00"+m.Topic+"\x00"+strconv.Itoa(rank), true); !logged {
				c.log.Warn("kv events: a batch whose topic names no configured replica (want kv@HOST:PORT@MODEL, "+
					"HOST:PORT as in the replica's URL); dropped", "topic", m.Topic, "rank", rank)
			}
		}
		return
	}
	c.onKVMessage(ctx, i, m)
}
