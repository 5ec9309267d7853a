package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"

	"github.com/kvgate/kvgate/internal/openai"
	"github.com/kvgate/kvgate/internal/prompt"
)

// Request bodies are forwarded as the client wrote them. The two steps of
// a disaggregated request change a few top-level fields; editObject does
// so and keeps every other member's bytes as they came (key, value, number
// formatting, key order), as a proxy that decodes into a map and encodes
// again would not (float precision, key order, duplicate keys).

// fieldEdit sets or removes one top-level member of a JSON object.
type fieldEdit struct {
	key string
	// value is the member's new JSON value; nil removes the member.
	value []byte
	// ifPresent: set only when the object has the member (vLLM's proxy sets
	// max_completion_tokens only when the request has it).
	ifPresent bool
}

// mayName reports whether JSON object body may have a member key: it
// spells key, or escapes a character (\u), which could spell it.
func mayName(body []byte, key string) bool {
	return bytes.Contains(body, []byte(`"`+key+`"`)) || bytes.Contains(body, []byte(`\u`))
}

// clientBody edits an admitted exchange's JSON body as the replicas must
// see it: its tenant's terms (tenantEdits), and without the client's
// kv_transfer_params, on every fleet and path unless pass_kv_transfer_params
// lets them through to an aggregated fleet (an outer P/D proxy's steps;
// a peer pull still replaces them). Those are the gateway's to write (a
// disaggregated request's steps, a peer pull): a client's could point a
// replica's KV connector at any host, to fetch a prefix from or to store as
// this prompt's KV for every later client.
func (g *Gateway) clientBody(x *exchange) error {
	if x.upload != nil || len(x.body) == 0 {
		return nil // no JSON body: nothing of it to edit
	}
	edits := g.ten.tenantEdits(x)
	if x.parsed.KVTransferParams && !(g.cfg.PassKVTransferParams && !g.ctl.Disaggregated()) {
		edits = append(edits, fieldEdit{key: "kv_transfer_params"})
	}
	if len(edits) == 0 {
		return nil
	}
	body, err := editObject(x.body, edits...)
	if err != nil {
		return &prompt.RequestError{Msg: err.Error()}
	}
	x.body = body
	return nil
}

// askUsage makes a streamed completion or chat ask its replica for the
// usage (stream_options.include_usage, the client's other options kept)
// when flow control counts it: a tenant's quota and fair share are
// corrected by the usage, and vLLM sends none in a stream that did not ask
// for it, so such a stream generated for free (no output charged without
// max_tokens; the fair share refunded the output it expected). The usage
// chunk goes to the client only if it asked (exchange.hideUsage): the
// relay keeps it back, and behind an endpoint picker, whose proxy relays
// the stream itself, the picker answers the proxy the stream without it
// (usageStrip), when the proxy lets it edit the answer (PickRequest).
func (g *Gateway) askUsage(x *exchange) error {
	p := x.parsed
	if g.ten == nil || !p.Stream || p.StreamUsage || x.kind != prompt.Completion && x.kind != prompt.Chat {
		return nil
	}
	if p.StreamOptions == nil {
		// No options (or null): one member appended, a copy of the body
		// where editObject would decode it all (~5 µs a KiB).
		x.body, x.hideUsage = withMember(x.body, "stream_options", []byte(`{"include_usage":true}`)), true
		return nil
	}
	so, err := editObject(p.StreamOptions, fieldEdit{key: "include_usage", value: []byte("true")})
	if err != nil {
		return &prompt.RequestError{Param: "stream_options", Msg: err.Error()}
	}
	body, err := editObject(x.body, fieldEdit{key: "stream_options", value: so})
	if err != nil {
		return &prompt.RequestError{Msg: err.Error()}
	}
	x.body, x.hideUsage = body, true
	return nil
}

// withMember is the JSON object body (valid: its parse checked it) with
// member key: value appended, in a copy. A member of that key before it is
// null or absent (the caller's check): readers that keep a repeated key's
// last value (Python's json, pydantic's, Go's) read the appended one.
func withMember(body []byte, key string, value []byte) []byte {
	end := bytes.LastIndexByte(body, '}')
	head := bytes.TrimRight(body[:end], " \t\r\n")
	k, _ := json.Marshal(key)
	out := make([]byte, 0, len(body)+len(k)+len(value)+2)
	out = append(out, head...)
	if head[len(head)-1] != '{' {
		out = append(out, ',')
	}
	out = append(append(append(out, k...), ':'), value...)
	return append(out, body[end:]...)
}

// usageOnly reports whether a stream event's data is the usage chunk that
// include_usage adds: usage and no choices.
func usageOnly(data []byte) bool {
	if !bytes.Contains(data, []byte(`"usage"`)) {
		return false
	}
	c, err := openai.ParseChunk(data)
	return err == nil && c.Usage != nil && len(c.Choices) == 0
}

// usageStrip takes out of a stream passing in chunks (an endpoint
// picker's proxy relays it: Handoff.Body) the usage chunk the gateway
// asked for and the client did not (askUsage), as relayStream keeps it
// back: the stream is cut at its events' ends (a blank line), and the
// part of an event a chunk ends in is held until the rest comes (vLLM
// writes whole events: nothing is held in practice). An event held past
// maxLine passes as it is.
type usageStrip struct {
	held    []byte
	maxLine int
}

// pass is what the client gets of the next chunk (eos: the last).
func (f *usageStrip) pass(chunk []byte, eos bool) []byte {
	buf := append(f.held, chunk...)
	end := len(buf)
	if !eos {
		end = eventsEnd(buf)
		if len(buf)-end > 4*f.maxLine {
			end = len(buf)
		}
	}
	done := buf[:end]
	f.held = append([]byte(nil), buf[end:]...)
	if !bytes.Contains(done, []byte(`"usage"`)) {
		return done
	}
	out := make([]byte, 0, len(done))
	er := openai.NewEventReader(bytes.NewReader(done), max(f.maxLine, len(done)))
	for {
		ev, err := er.Next()
		if err != nil {
			return out
		}
		if !ev.HasData || !usageOnly(ev.Data) {
			out = append(out, ev.Raw...)
		}
	}
}

// eventsEnd is where the last whole SSE event of b ends: after its last
// blank line (0: none).
func eventsEnd(b []byte) int {
	end := 0
	if i := bytes.LastIndex(b, []byte("\n\n")); i >= 0 {
		end = i + 2
	}
	if i := bytes.LastIndex(b, []byte("\r\n\r\n")); i >= 0 && i+4 > end {
		end = i + 4
	}
	return end
}

// member is one top-level member of an object: its key, decoded, and its
// bytes from the key's opening quote to the value's end.
type member struct {
	key string
	raw []byte
}

// objectMembers splits a JSON object into its top-level members.
func objectMembers(body []byte) ([]member, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, errors.New("the request body is not a JSON object")
	}
	var out []member
	for dec.More() {
		start := dec.InputOffset()
		tok, err := dec.Token()
		if err != nil {
			return nil, err
		}
		key, _ := tok.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return nil, err
		}
		raw := bytes.TrimLeft(body[start:dec.InputOffset()], " \t\r\n,")
		out = append(out, member{key: key, raw: raw})
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, errors.New("the request body is not a JSON object")
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("the request body has data after its JSON object")
	}
	return out, nil
}

// editObject applies edits to the JSON object body: the members they name
// are removed (every occurrence of a duplicated key), and those with a
// value are added at the end, in the order given; the other members keep
// their bytes and order.
func editObject(body []byte, edits ...fieldEdit) ([]byte, error) {
	ms, err := objectMembers(body)
	if err != nil {
		return nil, err
	}
	present := map[string]bool{}
	for _, m := range ms {
		present[m.key] = true
	}
	edited := func(key string) bool {
		for _, e := range edits {
			if e.key == key {
				return true
			}
		}
		return false
	}
	out := make([]byte, 0, len(body)+256)
	out = append(out, '{')
	for _, m := range ms {
		if !edited(m.key) {
			out = appendMember(out, m.raw)
		}
	}
	for _, e := range edits {
		if e.value == nil || (e.ifPresent && !present[e.key]) {
			continue
		}
		k, _ := json.Marshal(e.key)
		out = appendMember(out, append(append(k, ':'), e.value...))
	}
	return append(out, '}'), nil
}

func appendMember(out, raw []byte) []byte {
	if len(out) > 1 {
		out = append(out, ',')
	}
	return append(out, raw...)
}

// prefillKVParams ask a prefill replica to hold the prompt's KV for a
// remote decode: the parameters of vLLM's disaggregation proxies.
var prefillKVParams = []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,` +
	`"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// prefillBody is the prefill step's body: the client's with
// prefillKVParams, stream false, max_tokens 1 (and max_completion_tokens 1
// when present), without stream_options, and, as vLLM's toy proxy, without
// min_tokens and min_completion_tokens (a prefill replica would refuse
// them above max_tokens 1). Every other member keeps its bytes.
func prefillBody(body []byte) ([]byte, error) {
	one := []byte("1")
	return editObject(body,
		fieldEdit{key: "kv_transfer_params", value: prefillKVParams},
		fieldEdit{key: "stream", value: []byte("false")},
		fieldEdit{key: "max_tokens", value: one},
		fieldEdit{key: "max_completion_tokens", value: one, ifPresent: true},
		fieldEdit{key: "stream_options"},
		fieldEdit{key: "min_tokens"},
		fieldEdit{key: "min_completion_tokens"},
	)
}

// decodeBody is the decode step's body: the client's, with the prefill
// answer's kv_transfer_params (kv), or without any when kv is nil (the
// decode replica computes the prompt). A client's own kv_transfer_params
// never reach a replica of a prefill/decode fleet: they could point a
// decode replica at any host.
func decodeBody(body, kv []byte) ([]byte, error) {
	if kv == nil && !mayName(body, "kv_transfer_params") {
		return body, nil
	}
	return editObject(body, fieldEdit{key: "kv_transfer_params", value: kv})
}
