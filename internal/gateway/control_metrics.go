package gateway

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/router"
)

// replicaCollector exposes the per-replica gauges for the replicas of the
// moment: replicas join and leave while the gateway runs, so the series
// are made at each scrape rather than registered once. A removed replica
// is listed while it drains, then its gauges go away; kvgate_replicas
// counts the replicas by membership state.
type replicaCollector struct {
	rt                                   *router.Router
	clk                                  clock.Clock
	inFlight, healthy, age, state        *prometheus.Desc
	synced, preciseBlocks, replicasCount *prometheus.Desc
}

func newReplicaCollector(rt *router.Router, clk clock.Clock) *replicaCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, nil)
	}
	return &replicaCollector{rt: rt, clk: clk,
		inFlight: d("kvgate_replica_in_flight", "Requests in flight to the replica.", "replica"),
		healthy:  d("kvgate_replica_healthy", "1 when the replica is in rotation.", "replica"),
		age: d("kvgate_scrape_age_seconds", "Age of the replica's last good /metrics scrape (-1: never scraped). Past "+
			"scrape_stale_after the replica is routed on the gateway's own counts.", "replica"),
		state: d("kvgate_replica_draining", "1 while a removed replica's requests in flight finish (it gets no new "+
			"ones), 0 for a replica in the fleet.", "replica"),
		synced: d("kvgate_kv_events_synced", "1 when the replica's precise index is trusted (its KV events followed in "+
			"sync), else 0: the approximate index answers for it.", "replica"),
		preciseBlocks: d("kvgate_precise_index_blocks", "Blocks the precise index holds for the replica, from its KV events.", "replica"),
		replicasCount: d("kvgate_replicas", "Replicas by membership: active (in the fleet), draining (removed, requests "+
			"in flight), removed (kept for a revival until forget_after: no series of their own), free (slots of forgotten "+
			"replicas, which the next replicas added take).", "state"),
	}
}

func (c *replicaCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.inFlight, c.healthy, c.age, c.state, c.synced, c.preciseBlocks, c.replicasCount} {
		ch <- d
	}
}

func (c *replicaCollector) Collect(ch chan<- prometheus.Metric) {
	count := map[string]int{"active": 0, "draining": 0, "removed": 0, "free": 0}
	now := c.clk.Now()
	for i := range c.rt.Replicas() {
		r := c.rt.Replica(i)
		st := replicaState(r)
		count[st]++
		if st == "removed" || st == "free" {
			continue
		}
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, r.Name())
		}
		gauge(c.inFlight, float64(r.InFlight()))
		gauge(c.healthy, b2f(r.Healthy() && !r.Removed()))
		gauge(c.state, b2f(st == "draining"))
		age := -1.0
		if a := r.MetricsAge(now); a >= 0 {
			age = a.Seconds()
		}
		gauge(c.age, age)
		if p := c.rt.Precise(); p != nil {
			gauge(c.synced, b2f(r.PreciseSynced()))
			gauge(c.preciseBlocks, float64(p.Index().ReplicaLen(i)))
		}
	}
	for st, n := range count {
		ch <- prometheus.MustNewConstMetric(c.replicasCount, prometheus.GaugeValue, float64(n), st)
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// poolInfo exposes kvgate_pool_info{pool,replica} 1 for every replica not
// removed, so that any per-replica series can be grouped by pool (a join,
// rather than a pool label on every series).
type poolInfo struct {
	rt   *router.Router
	desc *prometheus.Desc
}

func registerPoolInfo(reg prometheus.Registerer, rt *router.Router) {
	reg.MustRegister(&poolInfo{rt: rt, desc: prometheus.NewDesc("kvgate_pool_info",
		"Each replica's pool (pools: in the config): 1 per replica not removed by discovery.", []string{"pool", "replica"}, nil)})
}

func (p *poolInfo) Describe(ch chan<- *prometheus.Desc) { ch <- p.desc }

func (p *poolInfo) Collect(ch chan<- prometheus.Metric) {
	for i := range p.rt.Replicas() {
		if r := p.rt.Replica(i); !r.Removed() {
			ch <- prometheus.MustNewConstMetric(p.desc, prometheus.GaugeValue, 1, r.Pool(), p.rt.Name(i))
		}
	}
}

// kvMetrics are the control plane's KV-event counters (precise mode), by
// replica but kvUnknownTopic.
type kvMetrics struct {
	kvBatches           *prometheus.CounterVec // replica
	kvDropped           *prometheus.CounterVec // replica, reason
	kvGaps              *prometheus.CounterVec // replica
	kvReplayed          *prometheus.CounterVec // replica
	kvBlockSizeMismatch *prometheus.CounterVec // replica
	kvUnknownTopic      prometheus.Counter
}

// newKVMetrics makes and registers the KV-event counters.
func newKVMetrics(reg prometheus.Registerer) *kvMetrics {
	m := &kvMetrics{}
	m.kvBatches = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_kv_events_batches_total",
		Help: "KV-event batches received from the replica (precise mode)."}, []string{"replica"})
	m.kvDropped = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_kv_events_dropped_total",
		Help: "Stored-block events the precise index could not take, by reason: unknown_parent (stored before " +
			"kvgate listened), block_size (the replica's block size is not a multiple of block_size, or the " +
			"token ids do not fill the blocks), other; and whole batches: peer_address (published for the replica from another " +
			"address, kv_events_trust)."}, []string{"replica", "reason"})
	m.kvGaps = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_kv_events_gaps_total",
		Help: "Sequence gaps in the replica's KV-event stream (filled from its replay endpoint when it has one; " +
			"otherwise the replica is out of sync until resynchronised)."}, []string{"replica"})
	m.kvReplayed = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_kv_events_replayed_total",
		Help: "KV-event batches fetched from the replica's replay endpoint (at start, after a late join or a gap)."}, []string{"replica"})
	m.kvBlockSizeMismatch = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_kv_events_block_size_mismatch_total",
		Help: "Batches whose block size differs from the replica's vllm:cache_config_info (the events are used)."}, []string{"replica"})
	m.kvUnknownTopic = prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_kv_events_unknown_topic_total",
		Help: "Batches received on kv_events_listen whose topic (kv@HOST:PORT@MODEL) names no configured replica."})
	reg.MustRegister(m.kvBatches, m.kvDropped, m.kvGaps, m.kvReplayed, m.kvBlockSizeMismatch, m.kvUnknownTopic)
	return m
}

// forgetReplica deletes every series of the replica named name.
func (m *kvMetrics) forgetReplica(name string) {
	for _, v := range []*prometheus.MetricVec{m.kvBatches.MetricVec, m.kvDropped.MetricVec, m.kvGaps.MetricVec,
		m.kvReplayed.MetricVec, m.kvBlockSizeMismatch.MetricVec} {
		v.DeletePartialMatch(prometheus.Labels{"replica": name})
	}
}
