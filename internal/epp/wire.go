package epp

import (
	"errors"
	"net/http"
	"net/textproto"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvgate/kvgate/internal/gateway"
)

// The endpoint-picker protocol's names (gateway-api-inference-extension,
// docs/proposals/004-endpoint-picker-protocol).
const (
	// HeaderDestination names the endpoints picked, "ip:port,ip:port,...":
	// the request header, and the key in the destination namespace of the
	// dynamic metadata (envoy.lb by default).
	HeaderDestination = "x-gateway-destination-endpoint"
	// KeySubset is the key, in the subset namespace of the request's filter
	// metadata (envoy.lb.subset_hint), of the endpoints the proxy allows.
	KeySubset = "x-gateway-destination-endpoint-subset"
	// KeyServed is the key, in the destination namespace of the response's
	// metadata, of the endpoint that served the request.
	KeyServed = "x-gateway-destination-endpoint-served"
)

// Bounds of what the proxy sends, checked where it enters.
const (
	maxHeaderBytes   = 64 << 10 // a request's header, in all (net/http's MaxHeaderBytes here is 64 KiB too)
	maxSubset        = 4096     // endpoints in a subset hint
	maxEndpointBytes = 262      // "[" + an IPv6 address with zone + "]:" + port, generously
	// chunkBytes bounds one body chunk sent back: Envoy's streamed chunks
	// should stay under 64 KiB (ProcessingMode's FULL_DUPLEX_STREAMED).
	chunkBytes = 62000
)

var (
	errHeaderTooLarge = errors.New("the request's header is larger than 64 KiB")
	errStatus         = errors.New("the response's :status is not an HTTP status")
)

// request is a request's header as the proxy sent it: pseudo-headers
// apart.
type request struct {
	method, path, authority string
	header                  http.Header
}

// headerValue is a header's value: raw_value, as Envoy sends it, else value.
func headerValue(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}

// readRequest reads a request's header map, within maxHeaderBytes.
func readRequest(m *corev3.HeaderMap) (request, error) {
	r := request{header: http.Header{}}
	n := 0
	for _, h := range m.GetHeaders() {
		k, v := h.GetKey(), headerValue(h)
		if n += len(k) + len(v); n > maxHeaderBytes {
			return r, errHeaderTooLarge
		}
		switch strings.ToLower(k) {
		case ":method":
			r.method = v
		case ":path":
			r.path = v
		case ":authority":
			r.authority = v
		default:
			if !strings.HasPrefix(k, ":") {
				r.header.Add(textproto.CanonicalMIMEHeaderKey(k), v)
			}
		}
	}
	if r.authority != "" && r.header.Get("Host") == "" {
		r.header.Set("Host", r.authority)
	}
	return r, nil
}

// readResponse reads a response's header map: its status and header.
func readResponse(m *corev3.HeaderMap) (int, http.Header, error) {
	h := http.Header{}
	status, n := 0, 0
	for _, hv := range m.GetHeaders() {
		k, v := hv.GetKey(), headerValue(hv)
		if n += len(k) + len(v); n > maxHeaderBytes {
			return 0, nil, errHeaderTooLarge
		}
		switch {
		case k == ":status":
			s, err := strconv.Atoi(v)
			if err != nil || s < 100 || s > 599 {
				return 0, nil, errStatus
			}
			status = s
		case !strings.HasPrefix(k, ":"):
			h.Add(textproto.CanonicalMIMEHeaderKey(k), v)
		}
	}
	if status == 0 {
		return 0, nil, errStatus
	}
	return status, h, nil
}

// metaString is the string at key in namespace ns of md ("" when absent
// or not a short string).
func metaString(md *corev3.Metadata, ns, key string) string {
	v := md.GetFilterMetadata()[ns].GetFields()[key]
	if s := v.GetStringValue(); len(s) <= maxEndpointBytes*(maxSubset+1) {
		return s
	}
	return ""
}

// subset is the proxy's subset hint for a request: the endpoints it
// allows (nil: no hint). The protocol sends a list of strings; a
// comma-separated string is read as one too. Entries past the bounds are
// dropped: a pick outside the list would break the protocol, a pick
// among fewer endpoints does not.
func subset(md *corev3.Metadata, ns string) []string {
	v, ok := md.GetFilterMetadata()[ns].GetFields()[KeySubset]
	if !ok {
		return nil
	}
	out := []string{}
	add := func(s string) {
		if s = strings.TrimSpace(s); s != "" && len(s) <= maxEndpointBytes && len(out) < maxSubset {
			out = append(out, s)
		}
	}
	if l := v.GetListValue(); l != nil {
		for _, e := range l.GetValues() {
			add(e.GetStringValue())
		}
		return out
	}
	for _, s := range strings.Split(v.GetStringValue(), ",") {
		add(s)
	}
	return out
}

// destinations is the pick's endpoints as the protocol writes them:
// the chosen one first, then the fallbacks.
func destinations(p gateway.Pick) string {
	return strings.Join(append([]string{p.Endpoint}, p.Fallbacks...), ",")
}

// pickMetadata is the dynamic metadata of a pick: the endpoints under
// ns (envoy.lb), with the same value as the header.
func pickMetadata(ns string, p gateway.Pick) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		ns: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			HeaderDestination: structpb.NewStringValue(destinations(p)),
		}}),
	}}
}

// pickMutation is the request header's mutation of a pick: the
// destination header, and the header the gateway would send the replica.
func pickMutation(p gateway.Pick) *extprocv3.HeaderMutation {
	m := &extprocv3.HeaderMutation{RemoveHeaders: lower(p.Remove)}
	m.SetHeaders = append(m.SetHeaders, setHeader(HeaderDestination, destinations(p)))
	for k, vs := range p.Set {
		m.SetHeaders = append(m.SetHeaders, setHeader(strings.ToLower(k), strings.Join(vs, ", ")))
	}
	return m
}

// setHeaders is a mutation setting h.
func setHeaders(h http.Header) *extprocv3.HeaderMutation {
	m := &extprocv3.HeaderMutation{}
	for k, vs := range h {
		m.SetHeaders = append(m.SetHeaders, setHeader(strings.ToLower(k), strings.Join(vs, ", ")))
	}
	return m
}

func setHeader(k, v string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD}
}

func lower(ks []string) []string {
	out := make([]string, len(ks))
	for i, k := range ks {
		out[i] = strings.ToLower(k)
	}
	return out
}

// immediate is a local reply: the gateway's own answer.
func immediate(r *gateway.Reply) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{
		ImmediateResponse: &extprocv3.ImmediateResponse{Status: &typev3.HttpStatus{Code: typev3.StatusCode(r.Status)},
			Headers: setHeaders(r.Header), Body: r.Body, Details: "kvgate_epp"}}}
}

// chunks splits a body into StreamedBodyResponses of at most chunkBytes;
// the last carries eos. An empty body is one empty chunk.
func chunks(body []byte, eos bool) []*extprocv3.CommonResponse {
	var out []*extprocv3.CommonResponse
	for first := true; first || len(body) > 0; first = false {
		n := min(len(body), chunkBytes)
		out = append(out, &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{
			Mutation: &extprocv3.BodyMutation_StreamedResponse{StreamedResponse: &extprocv3.StreamedBodyResponse{
				Body: body[:n], EndOfStream: eos && n == len(body)}}}})
		body = body[n:]
	}
	return out
}
