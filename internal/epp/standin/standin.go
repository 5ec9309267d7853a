// Package standin is an Envoy stand-in for kvgate's endpoint picker: an
// HTTP reverse proxy whose routing is an ext_proc client, as Envoy's
// ext_proc filter in front of an ORIGINAL_DST cluster routed by the
// x-gateway-destination-endpoint header is. It drives the picker as Envoy
// does in both request body modes — FULL_DUPLEX_STREAMED (header, body
// chunks and the response chunks on one stream, the pick in the header's
// answer, every chunk sent back) and BUFFERED (one message per part, each
// answered before the next, the pick in the body's answer) — sends the
// replica's response header (with the endpoint that served it in the
// envoy.lb metadata) and body through it, and applies what it answers.
//
// It keeps Envoy's failure semantics: each message waits at most
// MessageTimeout for its answer (Envoy's message_timeout, default 200 ms;
// Envoy has no per-message timeout in full-duplex mode, where the route's
// timeout bounds the request: the stand-in uses MessageTimeout there too,
// for the pick); when the picker fails (no stream, an error, a timeout, a
// spurious answer) the request fails with 504 (a timeout) or 500 — or,
// once part of the answer reached the client, its connection is cut —
// unless FailureModeAllow, and then it goes on without the picker: to one
// of the cluster's endpoints of the stand-in's own choosing (round robin)
// when there was no pick, else the rest of the answer passes unchanged,
// as Envoy's failure_mode_allow and the InferencePool's FailOpen say.
//
// It is for tests and for trying the picker without Envoy (kvgate epp
// --standin): one request per ext_proc stream, no TLS, no retries but the
// picker's fallback endpoints on a connection refused or a 503.
package standin

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	procmodev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"

	"github.com/kvgate/kvgate/internal/clock"
)

// Mode is a body send mode the stand-in speaks.
type Mode = procmodev3.ProcessingMode_BodySendMode

// The two body modes of the endpoint-picker protocol.
const (
	FullDuplex = procmodev3.ProcessingMode_FULL_DUPLEX_STREAMED
	Buffered   = procmodev3.ProcessingMode_BUFFERED
)

// Config configures a Proxy.
type Config struct {
	// Conn is the picker's gRPC connection.
	Conn grpc.ClientConnInterface
	// RequestMode and ResponseMode are the body modes (FullDuplex when
	// unset: the protocol's).
	RequestMode, ResponseMode Mode
	// MessageTimeout bounds each wait for the picker's answer (Envoy's
	// message_timeout; 200 ms when unset).
	MessageTimeout time.Duration
	// Clock times MessageTimeout (nil: the real clock; tests use a fake).
	Clock clock.Clock
	// FailureModeAllow goes on without the picker when it fails.
	FailureModeAllow bool
	// Cluster are the endpoints (host:port) a request goes to without the
	// picker (FailureModeAllow), in turn.
	Cluster []string
	// Transport makes the upstream calls (default: a new http.Transport).
	Transport http.RoundTripper
	// Subset, when set, gives a request's subset hint (the endpoints the
	// picker may choose; nil: none).
	Subset func(*http.Request) []string
	// Namespace and SubsetNamespace are the metadata namespaces (envoy.lb,
	// envoy.lb.subset_hint when unset).
	Namespace, SubsetNamespace string
	// MaxBody bounds a request body the stand-in buffers (8 MiB when unset).
	MaxBody int64
}

// Proxy is the stand-in: an http.Handler.
type Proxy struct {
	cfg    Config
	client extprocv3.ExternalProcessorClient
	http   *http.Client
	next   atomic.Uint64 // round robin over Cluster
	// Stats count what happened, for tests and logs.
	Stats Stats
}

// Stats are the stand-in's counts.
type Stats struct {
	Picked, FailedOpen, FailedClosed, Local, Fallbacks atomic.Int64
}

// New is a stand-in on cfg.
func New(cfg Config) *Proxy {
	if cfg.RequestMode == 0 {
		cfg.RequestMode = FullDuplex
	}
	if cfg.ResponseMode == 0 {
		cfg.ResponseMode = FullDuplex
	}
	if cfg.MessageTimeout <= 0 {
		cfg.MessageTimeout = 200 * time.Millisecond
	}
	cfg.Clock = clock.OrReal(cfg.Clock)
	if cfg.Namespace == "" {
		cfg.Namespace = "envoy.lb"
	}
	if cfg.SubsetNamespace == "" {
		cfg.SubsetNamespace = "envoy.lb.subset_hint"
	}
	if cfg.MaxBody <= 0 {
		cfg.MaxBody = 8 << 20
	}
	tr := cfg.Transport
	if tr == nil {
		tr = &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 256, DisableCompression: true}
	}
	return &Proxy{cfg: cfg, client: extprocv3.NewExternalProcessorClient(cfg.Conn), http: &http.Client{Transport: tr}}
}

// errPicker: the picker failed (no stream, an error, a spurious answer);
// errTimeout: it did not answer in time.
var (
	errPicker  = errors.New("standin: the endpoint picker failed")
	errTimeout = errors.New("standin: the endpoint picker did not answer in time")
)

// ServeHTTP proxies one request through the picker.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, p.cfg.MaxBody))
	if err != nil {
		http.Error(w, "request body: "+err.Error(), http.StatusRequestEntityTooLarge)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	s, err := p.open(ctx)
	var d decision
	if err == nil {
		d, err = s.request(r, body)
	}
	switch {
	case err == nil && d.local != nil:
		p.Stats.Local.Add(1)
		writeLocal(w, d.local)
		return
	case err != nil && !p.cfg.FailureModeAllow:
		p.failClosed(w, err)
		return
	case err != nil:
		p.Stats.FailedOpen.Add(1)
		s = nil // go on without the picker
		d = decision{endpoints: []string{p.cfg.Cluster[int(p.next.Add(1)-1)%max(len(p.cfg.Cluster), 1)]}, header: r.Header.Clone(), body: body}
	default:
		p.Stats.Picked.Add(1)
	}
	p.forward(w, r, s, d)
}

// failClosed answers the client when the picker failed before any of the
// answer reached it: 504 when the picker did not answer in time, else 500
// (Envoy's local replies with failure_mode_allow false).
func (p *Proxy) failClosed(w http.ResponseWriter, err error) {
	p.Stats.FailedClosed.Add(1)
	code := http.StatusInternalServerError
	if errors.Is(err, errTimeout) {
		code = http.StatusGatewayTimeout
	}
	http.Error(w, err.Error(), code)
}

// decision is what the picker said of a request: a local reply, or the
// endpoints to try in order with the request's header and body as mutated.
type decision struct {
	local     *extprocv3.ImmediateResponse
	endpoints []string
	header    http.Header
	body      []byte
}

// forward sends the request to the decision's endpoints in turn (the next
// one after a connection refused or a 503: Envoy's retry on the picker's
// fallbacks), and the answer back through the picker.
func (p *Proxy) forward(w http.ResponseWriter, r *http.Request, s *stream, d decision) {
	var resp *http.Response
	var served string
	var err error
	for i, ep := range d.endpoints {
		served = ep
		resp, err = p.call(r, ep, d)
		if i < len(d.endpoints)-1 && (err != nil || resp.StatusCode == http.StatusServiceUnavailable) {
			if resp != nil {
				_ = resp.Body.Close()
			}
			p.Stats.Fallbacks.Add(1)
			continue
		}
		break
	}
	if err != nil {
		if s != nil {
			s.abort()
		}
		http.Error(w, "upstream: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	if s == nil {
		copyResponse(w, resp)
		return
	}
	s.response(w, resp, served)
}

// call makes the upstream call to endpoint ep.
func (p *Proxy) call(r *http.Request, ep string, d decision) (*http.Response, error) {
	up, err := http.NewRequestWithContext(r.Context(), r.Method, "http://"+ep+r.URL.RequestURI(), strings.NewReader(string(d.body)))
	if err != nil {
		return nil, err
	}
	up.Header = d.header.Clone()
	up.Header.Del("X-Gateway-Destination-Endpoint")
	up.ContentLength = int64(len(d.body))
	return p.http.Do(up)
}

// copyResponse copies an answer to the client as it comes.
func copyResponse(w http.ResponseWriter, resp *http.Response) {
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	buf := make([]byte, 32<<10)
	rc := http.NewResponseController(w)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return
			}
			_ = rc.Flush()
		}
		if err != nil {
			return
		}
	}
}

// writeLocal writes the picker's local reply.
func writeLocal(w http.ResponseWriter, ir *extprocv3.ImmediateResponse) {
	for _, h := range ir.GetHeaders().GetSetHeaders() {
		w.Header().Set(h.GetHeader().GetKey(), value(h.GetHeader()))
	}
	code := int(ir.GetStatus().GetCode())
	if code < 100 || code > 599 {
		code = http.StatusInternalServerError
	}
	w.WriteHeader(code)
	_, _ = w.Write(ir.GetBody())
}
