package gateway

import (
	"context"
	"net"
	"strconv"
	"strings"

	"github.com/kvgate/kvgate/internal/kvevents"
)

// maxUnknownTopicsLogged bounds the distinct unknown topics logged (a
// misconfigured fleet logs each once; a hostile one cannot flood the log).
const maxUnknownTopicsLogged = 64

// kvTopics finds the target of a batch received on the listening socket:
// the topic's HOST:PORT is a replica's URL, its rank the batch's
// data_parallel_rank (or the port offset it arrived on).
type kvTopics struct {
	byHostPort map[string][]int // host:port → the server's targets
	byHost     map[string][]int // host → the server's targets, when one server has that host
}

func (g *Gateway) newKVTopics() *kvTopics {
	t := &kvTopics{byHostPort: map[string][]int{}, byHost: map[string][]int{}}
	hostCount := map[string]int{}
	for i := range g.rt.Replicas() {
		if g.rt.Replica(i).Removed() {
			continue
		}
		hp := hostPort(g.rt.URL(i))
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
	return t
}

// target is the router slot of a batch with topic and rank (ok false: no
// replica has that address, or it was removed: a replica discovered later
// is found once the membership change rebuilt the topics).
func (g *Gateway) kvTarget(t *kvTopics, topic string, rank int) (int, bool) {
	h := strings.ToLower(kvevents.TopicHost(topic))
	slots, ok := t.byHostPort[h]
	if !ok {
		slots, ok = t.byHost[strings.Trim(h, "[]")]
	}
	if !ok {
		return 0, false
	}
	for _, i := range slots {
		k, ranked := g.rt.Replica(i).Rank()
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
func (g *Gateway) listenKV(ctx context.Context) []func() error {
	g.topics.Store(g.newKVTopics())
	ranks := 1
	if d := g.cfg.Discovery; d != nil {
		ranks = max(ranks, d.DataParallelSize)
	}
	for i := range g.rt.Replicas() {
		if k, ranked := g.rt.Replica(i).Rank(); ranked {
			ranks = max(ranks, k+1)
		}
	}
	var closers []func() error
	for k := range ranks {
		ep := kvevents.OffsetPort(g.cfg.KVEventsListen, k)
		l, err := kvevents.Listen(ctx, ep, func(m kvevents.Message) { g.onListened(ctx, g.topics.Load(), k, m) },
			kvevents.ListenOptions{
				OnConnect: func(remote net.Addr) {
					g.log.Info("kv events: a publisher connected", "endpoint", ep, "from", remote.String())
				},
				OnError: func(err error) { g.log.Debug("kv events", "endpoint", ep, "err", err) },
			})
		if err != nil {
			g.log.Error("kv events: cannot listen; replicas that connect there stay on the approximate index",
				"endpoint", ep, "err", err)
			continue
		}
		g.log.Info("kv events: listening", "endpoint", ep, "addr", l.Addr().String())
		closers = append(closers, l.Close)
	}
	return closers
}

// onListened follows a batch received on the listening socket at port
// offset k.
func (g *Gateway) onListened(ctx context.Context, topics *kvTopics, k int, m kvevents.Message) {
	rank := k
	if m.Batch.DataParallelRank != nil {
		rank = *m.Batch.DataParallelRank
	}
	i, ok := g.kvTarget(topics, m.Topic, rank)
	if !ok {
		g.met.kvUnknownTopic.Inc()
		if g.unknownTopics.Add(1) <= maxUnknownTopicsLogged {
			if _, logged := g.kvLogged.LoadOrStore("topic\x00"+m.Topic+"\x00"+strconv.Itoa(rank), true); !logged {
				g.log.Warn("kv events: a batch whose topic names no configured replica (want kv@HOST:PORT@MODEL, "+
					"HOST:PORT as in the replica's URL); dropped", "topic", m.Topic, "rank", rank)
			}
		}
		return
	}
	g.onKVMessage(ctx, i, m)
}
