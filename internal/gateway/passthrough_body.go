package gateway

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/internal/prompt"
	"github.com/kvgate/kvgate/internal/router"
)

// admitPassthrough admits a request to a passthrough path: GET, POST or
// DELETE; a JSON body (or none) read whole, any other body streamed.
func (g *Gateway) admitPassthrough(w http.ResponseWriter, r *http.Request, kind prompt.Kind) (*exchange, func(), error) {
	x, err := g.begin(w, r, kind, http.MethodGet, http.MethodPost, http.MethodDelete)
	if err != nil {
		return nil, nil, err
	}
	if !isJSON(r.Header.Get("Content-Type")) && r.ContentLength != 0 && r.Method != http.MethodGet {
		var releaseHead func()
		if x.upload, releaseHead, err = g.startUpload(w, r); err != nil {
			return nil, nil, err
		}
		// The upload's read deadline ends with the exchange, whatever ends it.
		endUpload := func() { _ = x.rc.SetReadDeadline(time.Time{}); releaseHead() }
		release, err := g.enter(x, endUpload, func() (*prompt.Parsed, router.Resolved, error) { return g.parseUpload(x) })
		return x, release, err
	}
	var releaseBody = func() {}
	if r.Method != http.MethodGet {
		if x.body, releaseBody, err = g.readBody(w, r); err != nil {
			return nil, nil, err
		}
	}
	release, err := g.enter(x, releaseBody, func() (*prompt.Parsed, router.Resolved, error) { return g.parseOther(kind, x.body) })
	return x, release, err
}

// isJSON reports whether a Content-Type is JSON's (or absent).
func isJSON(ct string) bool { return ct == "" || strings.HasPrefix(ct, "application/json") }

// parseOther reads a passthrough body: its prompt where the kind has one,
// its model (which the replicas must serve, when named) and stream. An
// empty body has neither: it goes to any replica.
func (g *Gateway) parseOther(kind prompt.Kind, body []byte) (*prompt.Parsed, router.Resolved, error) {
	if len(bytes.TrimSpace(body)) == 0 {
		return &prompt.Parsed{Kind: kind}, g.rt.Resolve(""), nil
	}
	p, err := prompt.Parse(kind, body)
	if err != nil {
		return nil, router.Resolved{}, err
	}
	model, err := g.checkModel(p.Model)
	if err != nil {
		return nil, model, err
	}
	return p, model, checkLength(p, model, 0)
}

// parseUpload is what routing knows of a streamed upload: the model and
// stream fields of its form, when they came in its first bytes.
func (g *Gateway) parseUpload(x *exchange) (*prompt.Parsed, router.Resolved, error) {
	p := &prompt.Parsed{Kind: x.kind, Model: x.upload.model, Stream: x.upload.stream}
	model, err := g.checkModel(p.Model)
	return p, model, err
}

// checkModel resolves a request's model (once: the resolution goes with
// the request) and answers 404 for one no replica serves ("": none named,
// any replica of the first pool).
func (g *Gateway) checkModel(name string) (router.Resolved, error) {
	model := g.rt.Resolve(name)
	if name != "" && !model.Served() {
		return model, errModel.with(fmt.Sprintf("The model `%s` does not exist.", name))
	}
	return model, nil
}

// uploadPeek is how much of a streamed upload the gateway reads before
// routing it, to find the form's model: OpenAI's clients write the small
// fields before the file, or right after a short one.
const uploadPeek = 64 << 10

// upload is a streamed request body on its way to a replica: its first
// bytes, then the rest of the client's body, within max_body_bytes. It
// counts what the transport read of it (a body partly sent cannot be sent
// elsewhere) and keeps the client's side's error (too large, or gone).
type upload struct {
	r      io.Reader
	length int64 // the client's Content-Length (-1: unknown)
	model  string
	stream bool
	read   atomic.Int64
	mu     sync.Mutex
	err    error // the client's body failed: too large, or broken
}

func (u *upload) Read(p []byte) (int, error) {
	n, err := u.r.Read(p)
	u.read.Add(int64(n))
	if err != nil && !errors.Is(err, io.EOF) {
		u.mu.Lock()
		u.err = err
		u.mu.Unlock()
	}
	return n, err
}

// clientErr is the client's side's error, or nil.
func (u *upload) clientErr() error {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.err
}

// replayable reports whether x's body can be sent again: it is held
// whole, or no replica read a byte of the upload yet.
func (x *exchange) replayable() bool { return x.upload == nil || x.upload.read.Load() == 0 }

// startUpload reads the first bytes of a streamed body, charged to the
// body memory as they arrive and within the body's read deadline
// (bodyread.go), and finds the form's model and stream in them. The rest
// streams to the replica within body_read_timeout from the start: that
// deadline holds until the replica answers. The returned release gives
// back the memory the first bytes hold.
func (g *Gateway) startUpload(w http.ResponseWriter, r *http.Request) (*upload, func(), error) {
	if r.ContentLength > g.cfg.MaxBodyBytes {
		return nil, nil, errTooLarge.with(fmt.Sprintf("request body larger than %d bytes", g.cfg.MaxBodyBytes))
	}
	h := &bodyHold{b: g.bodies, client: clientKey(r)}
	dl := g.newBodyDeadline(w)
	dl.arm()
	body := http.MaxBytesReader(w, r.Body, g.cfg.MaxBodyBytes)
	head, err := g.readCharged(r, io.LimitReader(body, uploadPeek), h, dl, uploadPeek)
	if err != nil {
		dl.end(false)
		h.release()
		return nil, nil, err
	}
	_ = dl.rc.SetReadDeadline(dl.start.Add(dl.limit))
	u := &upload{r: io.MultiReader(bytes.NewReader(head), body), length: r.ContentLength}
	u.model, u.stream = formFields(r.Header.Get("Content-Type"), head)
	return u, h.release, nil
}

// formFields reads the model and stream fields of a multipart form from
// its first bytes, as far as they go; a field past them is not seen.
func formFields(contentType string, head []byte) (model string, stream bool) {
	mt, params, err := mime.ParseMediaType(contentType)
	if err != nil || !strings.HasPrefix(mt, "multipart/") || params["boundary"] == "" {
		return "", false
	}
	mr := multipart.NewReader(bytes.NewReader(head), params["boundary"])
	for {
		part, err := mr.NextPart()
		if err != nil {
			return model, stream
		}
		switch part.FormName() {
		case "model":
			v, err := io.ReadAll(io.LimitReader(part, 1024))
			if err == nil {
				model = strings.TrimSpace(string(v))
			}
		case "stream":
			v, _ := io.ReadAll(io.LimitReader(part, 16))
			stream = strings.EqualFold(strings.TrimSpace(string(v)), "true")
		}
		part.Close()
	}
}
