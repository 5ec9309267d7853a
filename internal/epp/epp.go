// Package epp is kvgate as the endpoint picker (EPP) of a Gateway API
// inference gateway: an Envoy external processing (ext_proc v3) server
// speaking the Gateway API Inference Extension's endpoint-picker protocol
// (docs/proposals/004-endpoint-picker-protocol). The proxy — Envoy,
// kgateway, GKE's or Istio's gateway — sends each request's header and
// body; kvgate routes it through the gateway's own request path
// (gateway.Picker: admission, parse, router, ticket) and answers with the
// chosen replica's ip:port in the x-gateway-destination-endpoint header
// and in the envoy.lb dynamic metadata, fallbacks after it; the proxy
// then sends the replica's response header and body through, which the
// gateway reads as it reads its own upstream answers (first token, usage,
// completion) and settles the ticket exactly as kvgate serve does.
//
// Body modes: FULL_DUPLEX_STREAMED (the protocol's: the body arrives in
// chunks, the pick goes with the request header's response once the body
// is whole, and every chunk is sent back) and BUFFERED (the header is let
// through at once; the pick goes with the body's response, whose header
// mutation Envoy applies in this mode only). The proxy's
// ProcessingRequest.protocol_config says which; without it, epp.body_mode.
package epp

import (
	"bytes"
	"errors"
	"io"
	"log/slog"
	"net"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	procmodev3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kvgate/kvgate/internal/gateway"
)

// Server is the ext_proc service.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	picker  *gateway.Picker
	cfg     gateway.EPPConfig
	maxBody int64
	log     *slog.Logger
}

// New is the ext_proc service of g, configured by cfg (epp:) with
// request bodies bounded by maxBody (max_body_bytes).
func New(g *gateway.Gateway, cfg gateway.EPPConfig, maxBody int64, log *slog.Logger) (*Server, error) {
	p, err := g.NewPicker(cfg.Fallbacks)
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Server{picker: p, cfg: cfg, maxBody: maxBody, log: log}, nil
}

// defaultMode is epp.body_mode as Envoy's enum.
func (s *Server) defaultMode() procmodev3.ProcessingMode_BodySendMode {
	if s.cfg.BodyMode == gateway.BodyModeBuffered {
		return procmodev3.ProcessingMode_BUFFERED
	}
	return procmodev3.ProcessingMode_FULL_DUPLEX_STREAMED
}

// Process serves one HTTP request's stream: its messages in order, one
// request at a time.
func (s *Server) Process(stream extprocv3.ExternalProcessor_ProcessServer) error {
	c := &call{s: s, stream: stream, reqMode: s.defaultMode(), respMode: s.defaultMode()}
	defer c.end()
	for {
		req, err := stream.Recv()
		switch {
		case errors.Is(err, io.EOF), status.Code(err) == codes.Canceled:
			return nil
		case err != nil:
			return err
		}
		if err := c.handle(req); err != nil {
			return err
		}
		if c.closed {
			return nil
		}
	}
}

// call is one request's stream.
type call struct {
	s                 *Server
	stream            extprocv3.ExternalProcessor_ProcessServer
	reqMode, respMode procmodev3.ProcessingMode_BodySendMode
	req               request
	subset            []string
	body              bytes.Buffer
	overflow          bool // the body passed max_body_bytes: the rest is not kept
	h                 *gateway.Handoff
	// closed: the gateway answered the request itself (a local reply):
	// the stream is over.
	closed bool
}

// handle answers one message of the proxy.
func (c *call) handle(req *extprocv3.ProcessingRequest) error {
	if pc := req.GetProtocolConfig(); pc != nil {
		c.reqMode, c.respMode = pc.GetRequestBodyMode(), pc.GetResponseBodyMode()
	}
	if req.GetObservabilityMode() {
		return status.Error(codes.FailedPrecondition, "kvgate's endpoint picker must answer: turn observability_mode off")
	}
	switch v := req.GetRequest().(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		return c.requestHeaders(v.RequestHeaders, req.GetMetadataContext())
	case *extprocv3.ProcessingRequest_RequestBody:
		return c.requestBody(v.RequestBody)
	case *extprocv3.ProcessingRequest_RequestTrailers:
		return c.requestTrailers()
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		return c.responseHeaders(v.ResponseHeaders, req.GetMetadataContext())
	case *extprocv3.ProcessingRequest_ResponseBody:
		return c.responseBody(v.ResponseBody)
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		c.endHandoff(true)
		return c.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{
			ResponseTrailers: &extprocv3.TrailersResponse{}}})
	}
	return status.Error(codes.InvalidArgument, "a processing request without a request or response part")
}

// requestHeaders reads the request's header: a request without a body
// (or whose body the proxy does not send) is picked at once; in buffered
// mode the header is let through and the pick waits for the body; in
// full-duplex mode the header's answer waits for the body.
func (c *call) requestHeaders(h *extprocv3.HttpHeaders, md *corev3.Metadata) error {
	r, err := readRequest(h.GetHeaders())
	if err != nil {
		return c.localReply(gateway.LocalReply(r.path, 431, "header_too_large", err.Error())) // its :path, when it came first
	}
	c.req, c.subset = r, subset(md, c.s.cfg.SubsetNamespace)
	switch {
	case h.GetEndOfStream(), c.reqMode == procmodev3.ProcessingMode_NONE:
		return c.pick(false)
	case c.reqMode == procmodev3.ProcessingMode_BUFFERED:
		return c.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestHeaders{
			RequestHeaders: &extprocv3.HeadersResponse{}}})
	case c.reqMode != procmodev3.ProcessingMode_FULL_DUPLEX_STREAMED:
		return c.localReply(gateway.LocalReply(r.path, 500, "epp_misconfigured", "kvgate's endpoint picker needs the request "+
			"body in FULL_DUPLEX_STREAMED or BUFFERED mode (ext_proc processing_mode.request_body_mode)"))
	}
	return nil
}

// requestBody keeps a chunk of the body (up to max_body_bytes: past it
// the gateway refuses the request, 413) and picks at its end.
func (c *call) requestBody(b *extprocv3.HttpBody) error {
	if room := c.s.maxBody + 1 - int64(c.body.Len()); int64(len(b.GetBody())) > room {
		c.body.Write(b.GetBody()[:max(room, 0)])
		c.overflow = true
	} else if !c.overflow {
		c.body.Write(b.GetBody())
	}
	if !b.GetEndOfStream() {
		return nil
	}
	return c.pick(c.reqMode == procmodev3.ProcessingMode_BUFFERED)
}

// requestTrailers ends a full-duplex body that had no end of stream.
func (c *call) requestTrailers() error {
	if c.h == nil && !c.closed {
		if err := c.pick(false); err != nil || c.closed {
			return err
		}
	}
	return c.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{
		RequestTrailers: &extprocv3.TrailersResponse{}}})
}

// pick routes the request and answers the proxy: a local reply when the
// gateway refused it, else the pick in the header and the metadata — in
// the body's answer (buffered), else in the header's, followed in
// full-duplex mode by the body sent back.
func (c *call) pick(buffered bool) error {
	h, p, reply := c.s.picker.Pick(gateway.PickRequest{Context: c.stream.Context(), Method: c.req.method,
		Target: c.req.path, Header: c.req.header, Body: c.body.Bytes(), Overflow: c.overflow,
		RemoteAddr: c.remoteAddr(), Subset: c.subset, EditsAnswer: c.editsAnswer()})
	if reply != nil {
		return c.localReply(reply)
	}
	c.h = h
	common := &extprocv3.CommonResponse{HeaderMutation: pickMutation(p), ClearRouteCache: true}
	md := pickMetadata(c.s.cfg.DestinationNamespace, p)
	body := c.body.Bytes()
	if p.Body != nil { // the gateway edited it (its length is in the header mutation)
		body = p.Body
	}
	if buffered {
		if p.Body != nil {
			common.BodyMutation = &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_Body{Body: body}}
		}
		if err := c.send(&extprocv3.ProcessingResponse{DynamicMetadata: md, Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: common}}}); err != nil {
			return err
		}
		h.Sent()
		return nil
	}
	if err := c.send(&extprocv3.ProcessingResponse{DynamicMetadata: md, Response: &extprocv3.ProcessingResponse_RequestHeaders{
		RequestHeaders: &extprocv3.HeadersResponse{Response: common}}}); err != nil {
		return err
	}
	h.Sent()
	if c.reqMode != procmodev3.ProcessingMode_FULL_DUPLEX_STREAMED || c.body.Len() == 0 && c.req.method == "GET" {
		return nil
	}
	for _, ch := range chunks(body, true) {
		if err := c.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
			RequestBody: &extprocv3.BodyResponse{Response: ch}}}); err != nil {
			return err
		}
	}
	return nil
}

// editsAnswer reports whether the proxy sends the answer's body through
// the picker and relays what it answers back (every body mode but NONE).
func (c *call) editsAnswer() bool {
	switch c.respMode {
	case procmodev3.ProcessingMode_FULL_DUPLEX_STREAMED, procmodev3.ProcessingMode_STREAMED, procmodev3.ProcessingMode_BUFFERED:
		return true
	}
	return false
}

// remoteAddr is the client's address: the last X-Forwarded-For entry
// (the one the proxy appended), else the proxy's own.
func (c *call) remoteAddr() string {
	if xff := c.req.header.Values("X-Forwarded-For"); len(xff) > 0 {
		last := xff[len(xff)-1]
		if i := strings.LastIndexByte(last, ','); i >= 0 {
			last = last[i+1:]
		}
		if ip := net.ParseIP(strings.TrimSpace(last)); ip != nil {
			return net.JoinHostPort(ip.String(), "0")
		}
	}
	if p, ok := peer.FromContext(c.stream.Context()); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return ""
}

// responseHeaders hands the replica's status and header to the request
// (and the endpoint that served it, when the proxy says), and adds
// kvgate's response headers (the replica, the route receipt).
func (c *call) responseHeaders(h *extprocv3.HttpHeaders, md *corev3.Metadata) error {
	resp := &extprocv3.HeadersResponse{}
	if c.h != nil {
		st, header, err := readResponse(h.GetHeaders())
		if err != nil {
			c.endHandoff(false)
			return status.Error(codes.InvalidArgument, err.Error())
		}
		set, remove := c.h.Respond(st, header, metaString(md, c.s.cfg.DestinationNamespace, KeyServed))
		m := setHeaders(set)
		m.RemoveHeaders = lower(remove)
		resp.Response = &extprocv3.CommonResponse{HeaderMutation: m}
		if h.GetEndOfStream() {
			c.endHandoff(true)
		}
	}
	return c.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: resp}})
}

// responseBody hands a chunk of the replica's answer to the request —
// and at its end of stream settles it — then sends back what the client
// gets of it (Handoff.Body: the chunk, less a usage chunk the client did
// not ask for; full-duplex: as chunks; else: unchanged, or replaced). In
// that order: the proxy ends the stream once it has the answer's last
// chunk, which would cut an answer complete but not yet settled
// (client_gone).
func (c *call) responseBody(b *extprocv3.HttpBody) error {
	out := b.GetBody()
	if c.h != nil {
		out = c.h.Body(out, b.GetEndOfStream())
		if b.GetEndOfStream() {
			c.endHandoff(true)
		}
	}
	resps := []*extprocv3.BodyResponse{{}}
	switch {
	case c.respMode == procmodev3.ProcessingMode_FULL_DUPLEX_STREAMED:
		resps = resps[:0]
		for _, ch := range chunks(out, b.GetEndOfStream()) {
			resps = append(resps, &extprocv3.BodyResponse{Response: ch})
		}
	case !bytes.Equal(out, b.GetBody()): // the usage chunk taken out (Handoff.Body)
		resps[0].Response = &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
			Mutation: &extprocv3.BodyMutation_Body{Body: out}}}
	}
	for _, r := range resps {
		if err := c.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: r}}); err != nil {
			return err
		}
	}
	return nil
}

// localReply sends the gateway's own answer; the stream is over.
func (c *call) localReply(r *gateway.Reply) error {
	c.closed = true
	return c.send(immediate(r))
}

func (c *call) send(r *extprocv3.ProcessingResponse) error { return c.stream.Send(r) }

// endHandoff ends the request's handoff (complete: its answer ended).
func (c *call) endHandoff(complete bool) {
	if c.h != nil {
		c.h.End(complete)
	}
}

// end ends the request when the stream ends (idempotent: a request whose
// answer ended is already settled).
func (c *call) end() { c.endHandoff(false) }
