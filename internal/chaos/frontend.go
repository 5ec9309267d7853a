package chaos

import (
	"bytes"
	"context"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"
)

// frontend serves a simulated replica's handler on a listener of its own,
// for the faults the sim cannot inject by itself: answering 429 to some
// requests (rate limiting in front of a replica), and flapping (the
// replica's address going away and coming back repeatedly, as a process
// that crashes and is restarted by its supervisor does). The replica's
// engine and cache survive a flap, as with the sim's own refuse window.
type frontend struct {
	addr    string // host:port, kept across restarts
	handler http.Handler

	mu  sync.Mutex
	srv *http.Server // nil while down
	wg  sync.WaitGroup
}

func startFrontend(h http.Handler) (*frontend, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	f := &frontend{addr: ln.Addr().String(), handler: h}
	f.serve(ln)
	return f, nil
}

func (f *frontend) URL() string { return "http://" + f.addr }

// serve starts a server on ln; f.mu is held or f is not shared yet.
func (f *frontend) serve(ln net.Listener) {
	srv := &http.Server{Handler: f.handler, ReadHeaderTimeout: 10 * time.Second}
	f.srv = srv
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		_ = srv.Serve(ln)
	}()
}

// down closes the listener and cuts every open connection: new
// connections are refused, streams in flight break.
func (f *frontend) down() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.srv != nil {
		_ = f.srv.Close()
		f.srv = nil
	}
}

// up listens again on the same address.
func (f *frontend) up() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.srv != nil {
		return nil
	}
	ln, err := net.Listen("tcp", f.addr)
	if err != nil {
		return err
	}
	f.serve(ln)
	return nil
}

// close stops the frontend and waits for its server goroutines.
func (f *frontend) close() {
	f.down()
	f.wg.Wait()
}

// flap alternates the frontend down for downFor and up for upFor, starting
// down after upFor, until ctx ends; it leaves the frontend up. It returns
// the number of down windows and the first error re-listening.
func (f *frontend) flap(ctx context.Context, upFor, downFor time.Duration) (int, error) {
	windows := 0
	t := time.NewTimer(upFor)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return windows, f.up()
		case <-t.C:
		}
		f.down()
		windows++
		t.Reset(downFor)
		select {
		case <-ctx.Done():
			return windows, f.up()
		case <-t.C:
		}
		if err := f.up(); err != nil {
			return windows, err
		}
		t.Reset(upFor)
	}
}

// limit429 wraps a replica's handler: each inference request is answered
// 429 with Retry-After and an OpenAI rate-limit error with probability
// rate (seeded draws), the rest reach the replica.
func limit429(h http.Handler, rate float64, seed uint64) http.Handler {
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(seed, 0x429))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/") {
			mu.Lock()
			refuse := rng.Float64() < rate
			mu.Unlock()
			if refuse {
				_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 32<<20))
				w.Header().Set("Content-Type", "application/json")
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusTooManyRequests)
				_, _ = io.WriteString(w, `{"error":{"message":"rate limit reached (chaos stand-in)","type":"rate_limit_error","param":null,"code":"rate_limit_exceeded"}}`)
				return
			}
		}
		h.ServeHTTP(w, r)
	})
}

// truncateStreams wraps a replica's handler: with probability rate (seeded
// draws) a streamed answer is cut after its first event, and the response
// then ends cleanly (the chunked body's terminator, no [DONE]) — a replica
// or a proxy in front of it that closes a stream early without an error.
// The replica itself generates the whole answer.
func truncateStreams(h http.Handler, rate float64, seed uint64) http.Handler {
	var mu sync.Mutex
	rng := rand.New(rand.NewPCG(seed, 0x7c))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/") {
			mu.Lock()
			cut := rng.Float64() < rate
			mu.Unlock()
			if cut {
				w = &truncatingWriter{ResponseWriter: w}
			}
		}
		h.ServeHTTP(w, r)
	})
}

// truncatingWriter passes an SSE response up to the end of its first event
// and swallows the rest; other responses pass whole.
type truncatingWriter struct {
	http.ResponseWriter
	cut bool
}

func (t *truncatingWriter) Write(p []byte) (int, error) {
	if t.cut {
		return len(p), nil
	}
	if !strings.HasPrefix(t.Header().Get("Content-Type"), "text/event-stream") {
		return t.ResponseWriter.Write(p)
	}
	if i := bytes.Index(p, []byte("\n\n")); i >= 0 {
		t.cut = true
		if _, err := t.ResponseWriter.Write(p[:i+2]); err != nil {
			return 0, err
		}
		return len(p), nil
	}
	return t.ResponseWriter.Write(p)
}

// Flush forwards flushes until the cut (the sim flushes through
// http.NewResponseController, which finds this method).
func (t *truncatingWriter) Flush() {
	if f, ok := t.ResponseWriter.(http.Flusher); ok && !t.cut {
		f.Flush()
	}
}

// errFrontend wraps a frontend failure.
var errFrontend = errors.New("chaos: frontend")
