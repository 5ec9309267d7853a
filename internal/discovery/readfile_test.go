package discovery

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
	"github.com/kvgate/kvgate/internal/testutil"
)

// fifo makes a FIFO at path. A reader blocked in its open (the base's
// os.ReadFile) is let go by unblock: an O_RDWR open never blocks on Linux
// and counts as the writer the reader waits for, whose close is its EOF.
// The caller registers unblock as its last cleanup, so that it runs first.
func fifo(t *testing.T, path string) (unblock func()) {
	t.Helper()
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Skip("no FIFOs here:", err)
	}
	return func() {
		if w, err := os.OpenFile(path, os.O_RDWR|syscall.O_NONBLOCK, 0); err == nil {
			_ = w.Close()
		}
	}
}

// within runs f and fails the test when it has not returned after a
// generous overall timeout (the base blocks in a FIFO's open for good).
func within(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(testutil.Bound(10 * time.Second)):
		t.Fatalf("%s: still blocked after 10 s", what)
	}
}

// A FIFO, a directory, a device or an oversized file at the replicas
// file's path is an error at once (finding 10: a FIFO blocked the watcher
// forever).
func TestFileLoadRefusesWhatIsNotASmallRegularFile(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big.yaml")
	if err := os.WriteFile(big, []byte("- url: http://a:8000\n"+strings.Repeat("#", MaxFileBytes)), 0o600); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, "good.yaml")
	if err := os.WriteFile(good, []byte("- url: http://a:8000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.yaml") // a ConfigMap's file is a symlink
	if err := os.Symlink(good, link); err != nil {
		t.Fatal(err)
	}
	pipe := filepath.Join(dir, "fifo.yaml")
	t.Cleanup(fifo(t, pipe))
	tests := []struct {
		name, path string
		want       error // nil: the list
	}{
		{"fifo", pipe, ErrNotRegular},
		{"directory", dir, ErrNotRegular},
		{"device", "/dev/zero", ErrNotRegular},
		{"too big", big, ErrFileTooBig},
		{"missing", filepath.Join(dir, "none.yaml"), os.ErrNotExist},
		{"regular", good, nil},
		{"symlink to a regular file", link, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var list []Replica
			var err error
			within(t, "Load", func() { list, err = NewFile(tc.path, 0, parseList, nil, nil).Load() })
			switch {
			case tc.want == nil && (err != nil || !slices.Equal(urls(list), []string{"http://a:8000"})):
				t.Fatalf("got %v, %v", list, err)
			case tc.want != nil && !errors.Is(err, tc.want):
				t.Fatalf("got %v, %v; want %v", list, err, tc.want)
			}
		})
	}
}

// The watcher keeps going past a FIFO: the FIFO is reported, and the file
// that replaces it is read.
func TestFileWatcherIsNotBlockedByAFIFO(t *testing.T) {
	path := filepath.Join(t.TempDir(), "replicas.yaml")
	unblock := fifo(t, path)
	clk := clock.NewFake(time.Unix(0, 0))
	read := make(chan error, 16)
	logged := &chanHandler{records: make(chan slog.Record, 16)}
	f := NewFile(path, time.Second, func(b []byte) ([]Replica, error) {
		l, err := parseList(b)
		read <- err
		return l, err
	}, clk, slog.New(logged))
	ch := run(t, f)
	t.Cleanup(unblock) // before run's cleanup waits for Run
	select {           // Run's first read reports the FIFO
	case r := <-logged.records:
		if r.Level != slog.LevelError || !strings.Contains(r.Message, "cannot be read") {
			t.Fatalf("logged %s %q", r.Level, r.Message)
		}
	case <-time.After(testutil.Bound(10 * time.Second)):
		t.Fatal("the FIFO was not reported: the watcher is blocked")
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte("- url: http://b:8000\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second)
	if got := next(t, ch); !slices.Equal(urls(got), []string{"http://b:8000"}) {
		t.Fatalf("after the FIFO was replaced %+v", got)
	}
	if err := <-read; err != nil {
		t.Fatal(err) // the FIFO was never handed to the parser
	}
}

// chanHandler hands every log record to a channel.
type chanHandler struct{ records chan slog.Record }

func (h *chanHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *chanHandler) Handle(_ context.Context, r slog.Record) error {
	h.records <- r
	return nil
}
func (h *chanHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *chanHandler) WithGroup(string) slog.Handler      { return h }

// blockingReader is a read that never returns until released.
type blockingReader struct{ release chan struct{} }

func (b blockingReader) Read([]byte) (int, error) { <-b.release; return 0, io.EOF }
func (b blockingReader) Close() error             { return nil }

func TestReadBoundedTimesOutAndCaps(t *testing.T) {
	b := blockingReader{make(chan struct{})}
	timeout := make(chan time.Time, 1)
	timeout <- time.Time{}
	if _, err := readBounded(b, 10, timeout); !errors.Is(err, ErrReadTimeout) {
		t.Fatalf("a hung read: %v", err)
	}
	close(b.release) // the abandoned read returns, and its goroutine ends
	if _, err := readBounded(io.NopCloser(strings.NewReader("12345678901")), 10, nil); !errors.Is(err, ErrFileTooBig) {
		t.Fatalf("11 bytes, limit 10: %v", err)
	}
	if got, err := readBounded(io.NopCloser(strings.NewReader("1234567890")), 10, nil); err != nil || string(got) != "1234567890" {
		t.Fatalf("10 bytes, limit 10: %q %v", got, err)
	}
}
