package gateway

import (
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strconv"

	"github.com/kvgate/kvgate/internal/router"
)

// Peer pulls (#28). When the decision names a peer to pull the prompt's
// cached prefix from (policy.Decision.Pull: ttft prices the pull in its
// choice; for the other policies the router adds llm-d's
// p2p-source-producer's after it), the request carries it to the chosen
// replica as llm-d's routing sidecar does (llm-d-router v0.10
// pkg/sidecar/proxy, connector "offloading"):
//
//	"kv_transfer_params": {"remote_kv_source": {"kv_request_id": ID, "remote_host": HOST, "remote_port": PORT}}
//
// and vLLM's OffloadingConnector pulls the blocks from the peer's P2P tier
// instead of computing them; a failed lookup is a miss, never an error.
// The client's own kv_transfer_params are replaced: they could point a
// replica at any host. The answer says where from: X-Kvgate-Pull-From, the
// source replica's URL as configured.

// headerPullFrom names the replica a request pulled its prefix from.
const headerPullFrom = "X-Kvgate-Pull-From"

// Behind an endpoint picker (kvgate epp) the proxy sends the client's body
// itself: the pull goes as llm-d's p2p-source-producer sends it, in request
// headers for the routing sidecar in front of the chosen replica, which
// writes kv_transfer_params itself (llm-d-router pkg/sidecar/proxy): the
// source's endpoint (host:port, as the picker names replicas) and the port
// of its P2P tier (kv_pulls.port plus its rank, or its own port), which
// sidecars before the port header read from their --p2p-connector-port.
const (
	headerKVSource     = "X-Kv-Cache-Source-Host-Port"
	headerKVSourcePort = "X-Kv-Cache-Source-P2p-Port"
)

// pullHeaders sets, in h, the sidecar's headers of a pull from src.
func pullHeaders(h http.Header, src *router.Replica, requestID string, p KVPullsConfig) error {
	ep, err := Endpoint(src.URL())
	if err != nil {
		return err
	}
	s, err := pullSource(src, requestID, p)
	if err != nil {
		return err
	}
	h.Set(headerKVSource, ep)
	h.Set(headerKVSourcePort, strconv.Itoa(s.Port))
	return nil
}

// KVPullsConfig is the kv_pulls: block (fixed at start).
type KVPullsConfig struct {
	// Enabled lets decisions name a pull (the replicas run an offloading
	// connector with a P2P tier, or are kvgate sims).
	Enabled bool `json:"enabled"`
	// Param is the key under kv_transfer_params: remote_kv_source (llm-d's
	// sidecar since llm-d-router #2133; p2p before).
	Param string `json:"param"`
	// Port is remote_port: vLLM's P2P tier listens on its own port (llm-d's
	// --p2p-connector-port, 7777), rank k of a data-parallel replica on
	// Port + k; 0 sends the source replica's own port, where kvgate sim
	// answers pulls.
	Port int `json:"port"`
}

// DefaultKVPullParam is kv_pulls.param's default.
const DefaultKVPullParam = "remote_kv_source"

// kvPullParam is what a kv_pulls.param may be: a JSON key vLLM's connector
// reads, lower-case.
var kvPullParam = regexp.MustCompile(`^[a-z][a-z0-9_]{0,63}$`)

func (p KVPullsConfig) validate() error {
	switch {
	case !kvPullParam.MatchString(p.Param):
		return fmt.Errorf("kv_pulls.param %q: want a lower-case key of letters, digits and _ (e.g. %s)", p.Param, DefaultKVPullParam)
	case p.Port < 0 || p.Port > 65535:
		return fmt.Errorf("kv_pulls.port %d: want 0 (the source replica's own port) to 65535", p.Port)
	}
	return nil
}

// kvPullSource is the pull's remote_kv_source.
type kvPullSource struct {
	RequestID string `json:"kv_request_id"`
	Host      string `json:"remote_host"`
	Port      int    `json:"remote_port"`
}

// pullBody is the request body sent to a replica that pulls from src: the
// client's with kv_transfer_params {param: source} in place of any of its
// own (editObject keeps every other member's bytes).
func pullBody(body []byte, src *router.Replica, requestID string, p KVPullsConfig) ([]byte, error) {
	s, err := pullSource(src, requestID, p)
	if err != nil {
		return nil, err
	}
	kv, err := json.Marshal(map[string]kvPullSource{p.Param: s})
	if err != nil {
		return nil, err
	}
	return editObject(body, fieldEdit{key: "kv_transfer_params", value: kv})
}

// pullSource addresses src's P2P tier: its URL's host, and kv_pulls.port
// plus its rank, or its URL's own port.
func pullSource(src *router.Replica, requestID string, p KVPullsConfig) (kvPullSource, error) {
	u, err := url.Parse(src.URL())
	if err != nil || u.Hostname() == "" {
		return kvPullSource{}, fmt.Errorf("pull source %q has no host", src.URL())
	}
	s := kvPullSource{RequestID: requestID, Host: u.Hostname(), Port: p.Port}
	if p.Port > 0 {
		if k, ranked := src.Rank(); ranked {
			s.Port = min(p.Port+k, 65535)
		}
		return s, nil
	}
	port := u.Port()
	if port == "" {
		port = map[bool]string{true: "443", false: "80"}[u.Scheme == "https"]
	}
	if s.Port, err = strconv.Atoi(port); err != nil {
		return kvPullSource{}, fmt.Errorf("pull source %q: port %q", src.URL(), port)
	}
	return s, nil
}

// preparePull readies attempt a to carry its decision's pull, when
// kv_pulls is enabled and the body can be edited (a streamed upload cannot:
// it goes without the pull, and the replica computes the prefix).
func (g *Gateway) preparePull(x *exchange, a *attempt) {
	p := a.tk.Decision.Pull
	if p == nil || !g.cfg.KVPulls.Enabled || x.upload != nil || a.body != nil {
		return
	}
	src := g.rt.Replica(p.Replica)
	id := kvTransferID(x)
	body, err := pullBody(x.body, src, id, g.cfg.KVPulls)
	if err != nil {
		x.logger().Warn("peer pull not sent", "source", src.URL(), "err", err)
		return
	}
	a.body, a.pullFrom, a.kvID = body, src, id
}

// kvTransferID is the id of one attempt's KV transfer: the client's
// X-Request-Id (or the gateway's, exchange.id) and 64 random bits. The
// replica's engine keys the transfer by it: vLLM takes its request id
// from X-Request-Id (OpenAIServing._base_request_id), and the
// NixlConnector's decode side names the prefill's request
// (remote_request_id) to read and free its blocks; the OffloadingConnector
// keys a peer pull by kv_request_id ("a unique transfer id": llm-d's
// sidecar makes a new UUID per request). Two clients may send the same
// X-Request-Id at once, and one exchange tries several times: the client's
// id alone would mix their transfers. The client's id stays the
// prefix, for the replica's logs, and stays the exchange's in the
// gateway's logs and the answer's X-Request-Id.
func kvTransferID(x *exchange) string {
	var b [8]byte
	_, _ = crand.Read(b[:])
	return x.id + "-kv" + hex.EncodeToString(b[:])
}

// setPullFrom names the replica an attempt pulled from.
func setPullFrom(x *exchange, a *attempt) {
	if a.pullFrom != nil {
		x.w.Header().Set(headerPullFrom, a.pullFrom.URL())
	}
}

// pickPull sets, in set, the headers of attempt a's pull for the sidecar
// of the replica an endpoint picker chose (kv_pulls enabled and the
// decision names one).
func (g *Gateway) pickPull(x *exchange, a *attempt, set http.Header) {
	p := a.tk.Decision.Pull
	if p == nil || !g.cfg.KVPulls.Enabled {
		return
	}
	src := g.rt.Replica(p.Replica)
	if err := pullHeaders(set, src, x.id, g.cfg.KVPulls); err != nil {
		x.logger().Warn("peer pull not sent", "source", src.URL(), "err", err)
		return
	}
	a.pullFrom = src
}
