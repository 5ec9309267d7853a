package testutil

import (
	"bufio"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// redisStartWithin bounds how long a redis-server may take to answer PING.
const redisStartWithin = 10 * time.Second

// Redis is a redis-server the test started on a loopback port, with no
// persistence: Stop and Start simulate an outage (Start brings it back on
// the same port, empty, as a restarted cache without persistence comes
// back).
type Redis struct {
	t    testing.TB
	port int
	dir  string

	mu   sync.Mutex
	cmd  *exec.Cmd
	out  *SyncBuffer
	done chan struct{} // closed when the running server exits
}

// StartRedis starts a redis-server for the test and returns its URL
// (redis://127.0.0.1:PORT/0); it is stopped at the end of the test.
func StartRedis(t testing.TB) string {
	t.Helper()
	return NewRedis(t).URL()
}

// NewRedis starts a redis-server on a free 127.0.0.1 port, stopped at the
// end of the test. The test is skipped when redis-server is not installed
// (.ci/run installs it).
func NewRedis(t testing.TB) *Redis {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Skip("redis-server is not installed: .ci/run installs it (apt-get install redis-server)")
	}
	r := &Redis{t: t, dir: t.TempDir()}
	var err error
	for range 5 { // a free port can be taken between its probe and the server's bind
		if r.port, err = freePort(); err != nil {
			t.Fatalf("redis: %v", err)
		}
		if err = r.start(); err == nil {
			t.Cleanup(r.Stop)
			return r
		}
	}
	t.Fatalf("redis: %v", err)
	return nil
}

// URL is the server's URL, database 0.
func (r *Redis) URL() string { return fmt.Sprintf("redis://127.0.0.1:%d/0", r.port) }

// Addr is the server's host:port.
func (r *Redis) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(r.port)) }

// Start starts the server again on its port after Stop (a no-op while it
// runs).
func (r *Redis) Start() {
	r.t.Helper()
	if err := r.start(); err != nil {
		r.t.Fatalf("redis: %v", err)
	}
}

// Pause freezes the server (SIGSTOP): connections stay open and nothing
// answers, as with a Redis that hangs. Resume thaws it.
func (r *Redis) Pause() { r.signal(syscall.SIGSTOP) }

// Resume thaws a paused server (SIGCONT).
func (r *Redis) Resume() { r.signal(syscall.SIGCONT) }

func (r *Redis) signal(sig syscall.Signal) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd != nil {
		_ = r.cmd.Process.Signal(sig)
	}
}

// Stop stops the server (SIGTERM, then SIGKILL if it lingers) and waits
// for it to exit; its data is lost.
func (r *Redis) Stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd == nil {
		return
	}
	_ = r.cmd.Process.Signal(syscall.SIGCONT) // a paused server would not see SIGTERM
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
	case <-time.After(redisStartWithin):
		_ = r.cmd.Process.Kill()
		<-r.done
	}
	r.cmd = nil
}

func (r *Redis) start() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd != nil {
		return nil
	}
	cmd := exec.Command("redis-server", "--port", strconv.Itoa(r.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", r.dir)
	out := &SyncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting redis-server: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	deadline := time.Now().Add(redisStartWithin)
	for {
		if ping(r.Addr()) {
			r.cmd, r.out, r.done = cmd, out, done
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("redis-server on port %d exited: %s", r.port, lastLines(out.String(), 5))
		case <-time.After(PollEvery):
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			<-done
			return fmt.Errorf("redis-server on port %d did not answer PING within %v: %s", r.port, redisStartWithin, lastLines(out.String(), 5))
		}
	}
}

// ping sends a RESP PING and reports whether +PONG came back.
func ping(addr string) bool {
	c, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := c.Write([]byte("*1\r\n$4\r\nPING\r\n")); err != nil {
		return false
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	return err == nil && strings.TrimSpace(line) == "+PONG"
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, " | ")
}
