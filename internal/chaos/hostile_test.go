package chaos

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/sim"
)

// hostileEnv is a gateway on one simulated replica with tight limits: a
// 64 KiB body, and a header-read timeout shortened from NewServer's 10 s so
// that a slow client is cut within the test.
const (
	hostileMaxBody    = 64 << 10
	hostileHeaderWait = 200 * time.Millisecond
)

func startHostile(t *testing.T) *env {
	t.Helper()
	if testing.Short() {
		t.Skip("live gateway and replica")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	sc := scenario{kind: "hostile", replicas: 1, timeScale: 20,
		gateway: func(c *gateway.Config) { c.MaxBodyBytes = hostileMaxBody },
		server:  func(s *http.Server) { s.ReadHeaderTimeout = hostileHeaderWait }}
	e, err := start(ctx, sc, Options{}.withDefaults())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.stop)
	return e
}

func gatewayAddr(e *env) string { return strings.TrimPrefix(e.base, "http://") }

// TestHostileBodies: every malformed or oversized body gets a clear
// OpenAI-shaped error with its 4xx status, and reaches no replica.
func TestHostileBodies(t *testing.T) {
	e := startHostile(t)
	c := &http.Client{Transport: e.clientTr, Timeout: 10 * time.Second}
	big := `{"model":"` + sim.DefaultModel + `","prompt":"` + strings.Repeat("a", hostileMaxBody) + `"}`
	nested := func(depth int) string {
		return `{"model":"` + sim.DefaultModel + `","prompt":` + strings.Repeat("[", depth) + strings.Repeat("]", depth) + `}`
	}
	tests := []struct {
		name        string
		path        string
		contentType string
		body        string
		status      int
	}{
		{"body over the limit", "/v1/completions", "application/json", big, http.StatusRequestEntityTooLarge},
		{"nesting past the parser's bound", "/v1/completions", "application/json", nested(65), http.StatusBadRequest},
		{"nesting 50k deep", "/v1/chat/completions", "application/json", nested(50000)[:hostileMaxBody-1], http.StatusBadRequest},
		{"not JSON", "/v1/completions", "application/json", `{"model":`, http.StatusBadRequest},
		{"wrong content type", "/v1/completions", "text/plain", `{"model":"x","prompt":"y"}`, http.StatusUnsupportedMediaType},
		{"unknown model", "/v1/completions", "application/json", `{"model":"nope","prompt":"y"}`, http.StatusNotFound},
		{"messages of the wrong type", "/v1/chat/completions", "application/json", `{"model":"` + sim.DefaultModel + `","messages":"hi"}`, http.StatusBadRequest},
		{"invalid UTF-8 in a string", "/v1/completions", "application/json", "{\"model\":\"" + sim.DefaultModel + "\",\"prompt\":\"\xff\xfe\"}", 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest(http.MethodPost, e.base+tc.path, strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Content-Type", tc.contentType)
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			data, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if tc.status == 0 {
				// Either answered or refused clearly: never a crash or a hang.
				if resp.StatusCode != http.StatusOK {
					if _, ok := clearError(data); !ok {
						t.Fatalf("status %d without a clear error: %.200s", resp.StatusCode, data)
					}
				}
				return
			}
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %.200s", resp.StatusCode, tc.status, data)
			}
			if _, ok := clearError(data); !ok {
				t.Fatalf("not an OpenAI error: %.200s", data)
			}
		})
	}
	if n := admitted(e.sims[0]); n > 1 {
		t.Fatalf("%d hostile requests reached the replica's engine", n)
	}
}

// TestHostileHeaders: a header block over NewServer's MaxHeaderBytes is
// refused with 431 before the gateway reads anything else.
func TestHostileHeaders(t *testing.T) {
	e := startHostile(t)
	c := &http.Client{Transport: e.clientTr, Timeout: 10 * time.Second}
	req, err := http.NewRequest(http.MethodPost, e.base+"/v1/completions", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Padding", strings.Repeat("x", 128<<10))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("status %d, want 431", resp.StatusCode)
	}
}

// TestSlowClients: clients that send their headers too slowly (slowloris)
// are cut after the header-read timeout without an answer, and meanwhile
// the gateway keeps answering everyone else.
func TestSlowClients(t *testing.T) {
	e := startHostile(t)
	addr := gatewayAddr(e)
	const slow = 16
	type cut struct {
		after time.Duration
		err   error
	}
	cuts := make(chan cut, slow)
	for range slow {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		start := time.Now()
		// A request line and one header, then nothing: the header block never ends.
		if _, err := io.WriteString(conn, "POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nX-Slow: 1"); err != nil {
			t.Fatal(err)
		}
		go func() {
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, err := bufio.NewReader(conn).ReadByte()
			cuts <- cut{time.Since(start), err}
		}()
	}
	// Everyone else is served while the slow clients hang.
	cl := &client{http: &http.Client{Transport: e.clientTr}, base: e.base, model: sim.DefaultModel,
		maxTokens: 8, timeout: 10 * time.Second, prefix: "hostile-"}
	for i := range 4 {
		if r := cl.do(context.Background(), i); r.verdict.class != Succeeded {
			t.Fatalf("request %d during the slowloris: %v %s", i, r.verdict.class, r.verdict.reason)
		}
	}
	for range slow {
		c := <-cuts
		var ne net.Error
		if errors.As(c.err, &ne) && ne.Timeout() {
			t.Fatalf("a slow client was still connected after %v", c.after)
		}
		if !errors.Is(c.err, io.EOF) && !strings.Contains(fmt.Sprint(c.err), "reset") {
			t.Fatalf("a slow client got %v, want the connection closed without an answer", c.err)
		}
		if c.after < hostileHeaderWait/2 {
			t.Fatalf("a slow client was cut after %v, before the %v header timeout", c.after, hostileHeaderWait)
		}
	}
}
