package standin

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// stream is one request's ext_proc stream.
type stream struct {
	p    *Proxy
	c    extprocv3.ExternalProcessor_ProcessClient
	recv chan received
	stop context.CancelFunc
}

type received struct {
	r   *extprocv3.ProcessingResponse
	err error
}

// open opens the request's stream, with a reader of its answers (it ends
// with the stream's context: the request's).
func (p *Proxy) open(ctx context.Context) (*stream, error) {
	ctx, stop := context.WithCancel(ctx)
	c, err := p.client.Process(ctx)
	if err != nil {
		stop()
		return nil, fmt.Errorf("%w: %v", errPicker, err)
	}
	s := &stream{p: p, c: c, recv: make(chan received, 64), stop: stop}
	go func() {
		for {
			r, err := c.Recv()
			select {
			case s.recv <- received{r, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return s, nil
}

// next is the picker's next answer, within the message timeout.
func (s *stream) next() (*extprocv3.ProcessingResponse, error) {
	t := s.p.cfg.Clock.NewTimer(s.p.cfg.MessageTimeout)
	defer t.Stop()
	select {
	case v := <-s.recv:
		return v.answer()
	case <-t.C():
		return nil, errTimeout
	case <-s.c.Context().Done(): // stopped or ended: its reader sends no more
		// An answer read before the end is here already (the reader
		// passes each on before it reads again): a local reply is the
		// picker's last message, after which it ends the stream, and
		// picking the end at random lost it (TestLocalReplies, 1 run in
		// about 30).
		select {
		case v := <-s.recv:
			return v.answer()
		default:
		}
		return nil, fmt.Errorf("%w: %v", errPicker, s.c.Context().Err())
	}
}

// answer is the received answer, or the picker's failure.
func (v received) answer() (*extprocv3.ProcessingResponse, error) {
	if v.err != nil {
		return nil, fmt.Errorf("%w: %v", errPicker, v.err)
	}
	return v.r, nil
}

func (s *stream) send(r *extprocv3.ProcessingRequest) error {
	if err := s.c.Send(r); err != nil {
		return fmt.Errorf("%w: %v", errPicker, err)
	}
	return nil
}

// abort ends the stream early.
func (s *stream) abort() { s.stop() }

// request sends the request's header and body and reads the decision.
func (s *stream) request(r *http.Request, body []byte) (decision, error) {
	first := &extprocv3.ProcessingRequest{
		Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
			Headers: requestHeaders(r), EndOfStream: len(body) == 0}},
		ProtocolConfig:  &extprocv3.ProtocolConfiguration{RequestBodyMode: s.p.cfg.RequestMode, ResponseBodyMode: s.p.cfg.ResponseMode},
		MetadataContext: s.subsetHint(r),
	}
	if err := s.send(first); err != nil {
		return decision{}, err
	}
	d := decision{header: r.Header.Clone(), body: body}
	switch {
	case len(body) == 0:
		return s.headersAnswer(d)
	case s.p.cfg.RequestMode == Buffered:
		return s.buffered(d)
	}
	return s.duplex(d)
}

// headersAnswer reads the answer to the request's header: the pick, or a
// local reply.
func (s *stream) headersAnswer(d decision) (decision, error) {
	resp, err := s.answer(&d)
	if err != nil || d.local != nil {
		return d, err
	}
	h := resp.GetRequestHeaders()
	if h == nil {
		return d, fmt.Errorf("%w: a spurious answer to the request header: %T", errPicker, resp.GetResponse())
	}
	return s.decide(d, h.GetResponse(), resp.GetDynamicMetadata())
}

// answer reads the picker's next answer; a local reply (an immediate
// response) is set on d, which is then decided.
func (s *stream) answer(d *decision) (*extprocv3.ProcessingResponse, error) {
	resp, err := s.next()
	if err == nil {
		d.local = resp.GetImmediateResponse()
	}
	return resp, err
}

// buffered: the header's answer first (a continue), then the whole body
// in one message, whose answer carries the pick.
func (s *stream) buffered(d decision) (decision, error) {
	resp, err := s.answer(&d)
	if err != nil || d.local != nil {
		return d, err
	}
	if resp.GetRequestHeaders() == nil {
		return d, fmt.Errorf("%w: a spurious answer to the request header", errPicker)
	}
	applyMutation(d.header, resp.GetRequestHeaders().GetResponse().GetHeaderMutation())
	if err := s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: d.body, EndOfStream: true}}}); err != nil {
		return d, err
	}
	if resp, err = s.answer(&d); err != nil || d.local != nil {
		return d, err
	}
	if resp.GetRequestBody() == nil {
		return d, fmt.Errorf("%w: a spurious answer to the request body", errPicker)
	}
	if b := resp.GetRequestBody().GetResponse().GetBodyMutation().GetBody(); b != nil {
		d.body = b // Envoy sends the body the picker answered
	}
	return s.decide(d, resp.GetRequestBody().GetResponse(), resp.GetDynamicMetadata())
}

// duplex: the body in chunks as it comes; the header's answer (the pick)
// then the body sent back in chunks up to its end of stream.
func (s *stream) duplex(d decision) (decision, error) {
	for off := 0; off < len(d.body); {
		n := min(len(d.body)-off, 16<<10)
		if err := s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: d.body[off : off+n], EndOfStream: off+n == len(d.body)}}}); err != nil {
			return d, err
		}
		off += n
	}
	d, err := s.headersAnswer(d)
	if err != nil || d.local != nil {
		return d, err
	}
	var out bytes.Buffer
	for {
		resp, err := s.next()
		if err != nil {
			return d, err
		}
		sb := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sb == nil {
			return d, fmt.Errorf("%w: a spurious answer in the request body's stream", errPicker)
		}
		out.Write(sb.GetBody())
		if sb.GetEndOfStream() {
			d.body = out.Bytes()
			return d, nil
		}
	}
}

// decide reads the pick from an answer: the destination header (which the
// stand-in routes by, as an ORIGINAL_DST cluster with use_http_header
// does), which must equal the dynamic metadata's.
func (s *stream) decide(d decision, c *extprocv3.CommonResponse, md *structpb.Struct) (decision, error) {
	applyMutation(d.header, c.GetHeaderMutation())
	dest := d.header.Get("X-Gateway-Destination-Endpoint")
	meta := md.GetFields()[s.p.cfg.Namespace].GetStructValue().GetFields()["x-gateway-destination-endpoint"].GetStringValue()
	if dest == "" || dest != meta {
		return d, fmt.Errorf("%w: destination header %q and envoy.lb metadata %q differ", errPicker, dest, meta)
	}
	for _, ep := range strings.Split(dest, ",") {
		d.endpoints = append(d.endpoints, strings.TrimSpace(ep))
	}
	return d, nil
}

// response sends the replica's answer through the picker and writes what
// it answers to the client.
func (s *stream) response(w http.ResponseWriter, resp *http.Response, served string) {
	defer s.stop()
	md := &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{s.p.cfg.Namespace: {Fields: map[string]*structpb.Value{
		"x-gateway-destination-endpoint-served": structpb.NewStringValue(served)}}}}
	err := s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseHeaders{
		ResponseHeaders: &extprocv3.HttpHeaders{Headers: responseHeaders(resp)}}, MetadataContext: md})
	var ans *extprocv3.ProcessingResponse
	if err == nil {
		ans, err = s.next()
	}
	if err != nil && !s.p.cfg.FailureModeAllow {
		// Nothing reached the client yet: Envoy answers it itself.
		s.p.failClosed(w, err)
		return
	}
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	if err == nil {
		applyMutation(w.Header(), ans.GetResponseHeaders().GetResponse().GetHeaderMutation())
	}
	w.WriteHeader(resp.StatusCode)
	if err != nil {
		s.failedMidway(w, nil, resp.Body)
		return
	}
	var pending []byte
	if s.p.cfg.ResponseMode == Buffered {
		pending, err = s.bufferedBody(w, resp.Body)
	} else {
		pending, err = s.duplexBody(w, resp.Body)
	}
	if err != nil {
		s.failedMidway(w, pending, resp.Body)
		return
	}
	_ = s.c.CloseSend()
}

// failedMidway: the picker failed while the answer was passing. With
// failure_mode_allow the rest passes without it — first pending, the part
// read from the replica that the picker did not send back; else the
// client's connection is cut.
func (s *stream) failedMidway(w http.ResponseWriter, pending []byte, body io.Reader) {
	if !s.p.cfg.FailureModeAllow {
		s.p.Stats.FailedClosed.Add(1)
		panic(http.ErrAbortHandler)
	}
	s.p.Stats.FailedOpen.Add(1)
	if _, err := w.Write(pending); err != nil {
		return
	}
	_, _ = io.Copy(w, body)
}

// duplexBody sends each chunk as it comes, and writes what the picker
// sends back as it comes, flushed: as Envoy's full-duplex mode, nothing
// pairs an answer with a chunk (the picker may send back less, or more
// later; kvgate's takes out a usage chunk the client did not ask for), and
// the body's end is the picker's end of stream. Each wait for the picker
// is bounded by MessageTimeout while a chunk sent has no answer yet. On an
// error, pending is what was sent and not yet answered, by length.
func (s *stream) duplexBody(w http.ResponseWriter, body io.Reader) (pending []byte, err error) {
	e := &echo{s: s, w: w, rc: http.NewResponseController(w), sent: make(chan struct{}, 1), done: make(chan error, 1)}
	go e.run()
	buf := make([]byte, 32<<10)
	for {
		n, rerr := body.Read(buf)
		eos := rerr != nil
		if n > 0 || eos {
			e.mu.Lock()
			e.unanswered, e.eos = append(e.unanswered, buf[:n]...), eos
			e.mu.Unlock()
			if err := s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
				ResponseBody: &extprocv3.HttpBody{Body: buf[:n], EndOfStream: eos}}}); err != nil {
				s.stop() // ends the echo's wait
				<-e.done
				return e.pending(), err
			}
			select {
			case e.sent <- struct{}{}:
			default:
			}
		}
		if eos {
			break
		}
		select {
		case err := <-e.done: // the picker failed: the rest passes without it, or not at all
			e.done <- err
			return e.pending(), err
		default:
		}
	}
	if err := <-e.done; err != nil {
		return e.pending(), err
	}
	return nil, nil
}

// echo writes the picker's answers to a response body to the client.
type echo struct {
	s    *stream
	w    io.Writer
	rc   *http.ResponseController
	sent chan struct{} // a chunk was sent
	done chan error    // the picker's end of stream, or its failure

	mu         sync.Mutex
	unanswered []byte // sent and not yet answered, by length
	eos        bool   // the end of stream was sent
}

// outstanding waits until a chunk sent awaits an answer (or the end of
// stream was sent): the picker is timed only then.
func (e *echo) outstanding() error {
	for {
		e.mu.Lock()
		waiting := len(e.unanswered) > 0 || e.eos
		e.mu.Unlock()
		if waiting {
			return nil
		}
		select {
		case <-e.sent:
		case <-e.s.c.Context().Done():
			return fmt.Errorf("%w: %v", errPicker, e.s.c.Context().Err())
		}
	}
}

// run reads answers until the picker's end of stream.
func (e *echo) run() {
	for {
		if err := e.outstanding(); err != nil {
			e.done <- err
			return
		}
		resp, err := e.s.next()
		if err != nil {
			e.done <- err
			return
		}
		sb := resp.GetResponseBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sb == nil {
			e.done <- fmt.Errorf("%w: a spurious answer in the response body's stream", errPicker)
			return
		}
		e.mu.Lock()
		e.unanswered = e.unanswered[min(len(sb.GetBody()), len(e.unanswered)):]
		e.mu.Unlock()
		if _, err := e.w.Write(sb.GetBody()); err != nil {
			e.done <- err
			return
		}
		_ = e.rc.Flush()
		if sb.GetEndOfStream() {
			e.done <- nil
			return
		}
	}
}

func (e *echo) pending() []byte {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.unanswered
}

// bufferedBody sends the whole answer in one message and writes it once
// the picker answered. On an error, pending is what it read and did not
// write.
func (s *stream) bufferedBody(w io.Writer, body io.Reader) (pending []byte, err error) {
	all, err := io.ReadAll(body)
	if err != nil {
		return all, err
	}
	if err := s.send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
		ResponseBody: &extprocv3.HttpBody{Body: all, EndOfStream: true}}}); err != nil {
		return all, err
	}
	resp, err := s.next()
	if err != nil {
		return all, err
	}
	if resp.GetResponseBody() == nil {
		return all, fmt.Errorf("%w: a spurious answer to the response body", errPicker)
	}
	if b := resp.GetResponseBody().GetResponse().GetBodyMutation().GetBody(); b != nil {
		all = b // Envoy sends the body the picker answered
	}
	_, err = w.Write(all)
	return nil, err
}

// subsetHint is the request's subset hint as filter metadata (nil: none).
func (s *stream) subsetHint(r *http.Request) *corev3.Metadata {
	if s.p.cfg.Subset == nil {
		return nil
	}
	eps := s.p.cfg.Subset(r)
	if eps == nil {
		return nil
	}
	vals := make([]any, len(eps))
	for i, e := range eps {
		vals[i] = e
	}
	l, _ := structpb.NewList(vals)
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{s.p.cfg.SubsetNamespace: {Fields: map[string]*structpb.Value{
		"x-gateway-destination-endpoint-subset": structpb.NewListValue(l)}}}}
}

// requestHeaders is r's header as Envoy sends it: pseudo-headers first,
// lower-case keys, values in raw_value.
func requestHeaders(r *http.Request) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	add := func(k, v string) { m.Headers = append(m.Headers, &corev3.HeaderValue{Key: k, RawValue: []byte(v)}) }
	add(":method", r.Method)
	add(":path", r.URL.RequestURI())
	add(":authority", r.Host)
	add(":scheme", "http")
	for k, vs := range r.Header {
		for _, v := range vs {
			add(strings.ToLower(k), v)
		}
	}
	return m
}

// responseHeaders is resp's header as Envoy sends it.
func responseHeaders(resp *http.Response) *corev3.HeaderMap {
	m := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(resp.StatusCode))}}}
	for k, vs := range resp.Header {
		for _, v := range vs {
			m.Headers = append(m.Headers, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
		}
	}
	return m
}

// applyMutation applies a header mutation to h.
func applyMutation(h http.Header, m *extprocv3.HeaderMutation) {
	for _, k := range m.GetRemoveHeaders() {
		h.Del(k)
	}
	for _, o := range m.GetSetHeaders() {
		h.Set(o.GetHeader().GetKey(), value(o.GetHeader()))
	}
}

func value(h *corev3.HeaderValue) string {
	if len(h.GetRawValue()) > 0 {
		return string(h.GetRawValue())
	}
	return h.GetValue()
}
