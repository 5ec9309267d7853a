package sim

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
)

// Peer pulls on vLLM's wire, as llm-d's routing sidecar sends them (its
// offloading connector, pkg/sidecar/proxy in llm-d-router v0.10): a request
// whose kv_transfer_params carry
//
//	"remote_kv_source": {"kv_request_id": ID, "remote_host": HOST, "remote_port": PORT}
//
// pulls the cached prefix of its prompt from the peer at HOST:PORT instead of
// computing it (vLLM's OffloadingConnector with a p2p secondary tier serves
// the peer's side). Here HOST:PORT is the peer sim's HTTP address, and its
// side channel (POST PathKVServable) answers how many leading blocks of the
// prompt it holds, in its GPU cache or its host tier; the engine pulls
// those beyond its own hit over its KV link (engine.Request.PullBlocks). A
// peer that does not answer, or holds nothing more, makes the replica
// compute the prompt: vLLM reports a failed lookup as a miss, never an
// error to the client. remote_kv_source may come alone or with
// do_remote_decode (the prefill side of a P/D pair pulling a prefix), the
// one combination llm-d's sidecar sends.

// PathKVServable is the side channel's lookup of a peer pull.
const PathKVServable = "/kvgate/sim/kv_servable"

// remoteKVSource is the key of a peer pull in kv_transfer_params.
const remoteKVSource = "remote_kv_source"

// kvSource is a peer pull's remote_kv_source.
type kvSource struct {
	requestID string
	host      string
	port      int
}

// readKVSource reads remote_kv_source from kv_transfer_params o: an object
// with remote_host (a string) and remote_port (in [1, 65535]), and
// optionally kv_request_id (a string); nil when absent or null.
func readKVSource(o body) (*kvSource, error) {
	raw := o.get(remoteKVSource)
	if raw == nil || string(raw) == "null" {
		return nil, nil
	}
	var b body
	if raw[0] != '{' || json.Unmarshal(raw, &b) != nil {
		return nil, kvBad(remoteKVSource, "remote_kv_source must be an object.")
	}
	src := &kvSource{}
	for _, f := range []struct {
		key string
		dst *string
	}{{"kv_request_id", &src.requestID}, {"remote_host", &src.host}} {
		if v := b.get(f.key); v != nil && json.Unmarshal(v, f.dst) != nil {
			return nil, kvBad(remoteKVSource+"."+f.key, "%s must be a string.", f.key)
		}
	}
	port, err := b.integer("remote_port")
	switch {
	case src.host == "" || len(src.host) > 255:
		return nil, kvBad(remoteKVSource+".remote_host", "remote_kv_source needs remote_host, at most 255 bytes.")
	case err != nil || !port.set || port.v < 1 || port.v > 65535:
		return nil, kvBad(remoteKVSource+".remote_port", "remote_port must be an integer in [1, 65535].")
	case len(src.requestID) > 256:
		return nil, kvBad(remoteKVSource+".kv_request_id", "kv_request_id is at most 256 bytes.")
	}
	src.port = int(port.v)
	return src, nil
}

// kvServableRequest asks a peer how many leading blocks of a prompt it
// holds; kvServableAnswer says.
type kvServableRequest struct {
	BlockHashes []uint64 `json:"block_hashes"`
}

type kvServableAnswer struct {
	Blocks    int `json:"blocks"`
	BlockSize int `json:"block_size"`
}

// openSource asks j's peer how many leading blocks of its prompt it can
// serve; an error says why the replica computes the prompt instead.
func (r *Replica) openSource(ctx context.Context, j *job) (int, error) {
	src, hashes := j.kv.source, j.prompts[0].hashes
	if len(hashes) == 0 {
		return 0, nil
	}
	url := "http://" + net.JoinHostPort(src.host, strconv.Itoa(src.port)) + PathKVServable
	var a kvServableAnswer
	if err := r.sideCall(ctx, url, kvServableRequest{BlockHashes: hashes}, &a); err != nil {
		return 0, err
	}
	if a.BlockSize != r.cfg.BlockSize {
		// vLLM rejects such a transfer (block_len mismatch).
		return 0, fmt.Errorf("the peer's blocks are of %d tokens, this replica's of %d", a.BlockSize, r.cfg.BlockSize)
	}
	return min(max(a.Blocks, 0), len(hashes)), nil
}

// kvServable is the side channel's answer to a peer pull: the leading
// blocks of the prompt any core holds, in its GPU cache or its host tier.
func (r *Replica) kvServable(w http.ResponseWriter, req *http.Request) {
	var q kvServableRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, req.Body, maxBody)).Decode(&q); err != nil {
		writeError(w, badRequest("", "side channel request: %v", err))
		return
	}
	n := 0
	r.mu.Lock()
	for _, c := range r.cores {
		n = max(n, c.eng.Servable(q.BlockHashes))
	}
	r.mu.Unlock()
	writeJSON(w, kvServableAnswer{Blocks: n, BlockSize: r.cfg.BlockSize})
}

// noteSource reports a peer pull: the sim's header (HeaderKVPull) says
// "pulled" when the peer holds some of the prompt (the usage's cached
// tokens say how much), "recomputed: REASON" when the replica computes it;
// a pull whose peer holds none of it, or did not answer, counts as missed
// on the core that computes it (the engine counts those it is given that
// find nothing past its own hit).
func (r *Replica) noteSource(w http.ResponseWriter, cl *call, j *job, err error) {
	if err != nil || j.pullBlocks == 0 {
		cl.core.sourceMisses.Add(1)
	}
	switch {
	case err != nil:
		w.Header().Set(HeaderKVPull, "recomputed: "+strings.ReplaceAll(err.Error(), "\n", " "))
		r.log.Warn("sim: KV pull lookup failed, computing the prompt locally", "replica", r.url, "error", err)
	case j.pullBlocks == 0:
		w.Header().Set(HeaderKVPull, "recomputed: the peer holds none of the prompt")
	default:
		w.Header().Set(HeaderKVPull, "pulled")
	}
}

// Host tier and pull metrics: vLLM's OffloadingConnector's (CPU cache
// usage, bytes loaded and stored), and the sim's own for peer pulls.
const (
	MetricOffloadUsage      = "vllm:kv_offload_cpu_cache_usage_perc"
	MetricOffloadLoadBytes  = "vllm:kv_offload_load_bytes_total"
	MetricOffloadStoreBytes = "vllm:kv_offload_store_bytes_total"
	MetricPeerPulls         = "kvgate_sim_kv_peer_pulls_total"
	MetricPeerPullTokens    = "kvgate_sim_kv_peer_pull_tokens_total"
)

// tierCollector reads one core's host tier and pull counters at scrape
// time.
type tierCollector struct {
	c                                         *core
	bytesPerToken                             float64
	usage, loadBytes, storeBytes, pulls, pull *prometheus.Desc
}

func newTierCollector(labels prometheus.Labels, c *core) *tierCollector {
	d := func(name, help string, vars ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, vars, labels)
	}
	return &tierCollector{
		c: c, bytesPerToken: c.eng.Config().Profile.KVBytesPerToken,
		usage:      d(MetricOffloadUsage, "CPU KV-cache usage of the offloading connector. 1 means 100 percent usage."),
		loadBytes:  d(MetricOffloadLoadBytes, "Bytes loaded from the CPU KV cache into the GPU."),
		storeBytes: d(MetricOffloadStoreBytes, "Bytes stored into the CPU KV cache."),
		pulls:      d(MetricPeerPulls, "Peer pulls (remote_kv_source) by result: pulled, or missed (the peer held nothing more).", "result"),
		pull:       d(MetricPeerPullTokens, "Prompt tokens pulled from peers."),
	}
}

func (t *tierCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{t.usage, t.loadBytes, t.storeBytes, t.pulls, t.pull} {
		ch <- d
	}
}

func (t *tierCollector) Collect(ch chan<- prometheus.Metric) {
	s := t.c.stats()
	usage := 0.0
	if s.HostCapacity > 0 {
		usage = float64(s.HostBlocks) / float64(s.HostCapacity)
	}
	ch <- prometheus.MustNewConstMetric(t.usage, prometheus.GaugeValue, usage)
	ch <- prometheus.MustNewConstMetric(t.loadBytes, prometheus.CounterValue, float64(s.HostLoadTokens)*t.bytesPerToken)
	ch <- prometheus.MustNewConstMetric(t.storeBytes, prometheus.CounterValue,
		float64(s.HostStored)*float64(s.BlockSize)*t.bytesPerToken)
	ch <- prometheus.MustNewConstMetric(t.pulls, prometheus.CounterValue, float64(s.PeerPulls), "pulled")
	ch <- prometheus.MustNewConstMetric(t.pulls, prometheus.CounterValue, float64(s.PeerPullMisses+t.c.sourceMisses.Load()), "missed")
	ch <- prometheus.MustNewConstMetric(t.pull, prometheus.CounterValue, float64(s.PeerPullTokens))
}

var _ prometheus.Collector = (*tierCollector)(nil)
