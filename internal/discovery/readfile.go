package discovery

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
	"time"
)

// Limits of ReadFile: a replicas file of thousands of replicas, or a
// config file, is well under a megabyte.
const (
	MaxFileBytes    = 8 << 20
	FileReadTimeout = 5 * time.Second
)

// Errors of ReadFile.
var (
	// ErrNotRegular: the path is a FIFO, a socket, a device or a directory.
	// Opening a FIFO for reading blocks until a writer comes, and a device
	// may never end: the watcher would hang, keeping nothing up to date.
	ErrNotRegular  = errors.New("not a regular file")
	ErrFileTooBig  = fmt.Errorf("larger than %d bytes", MaxFileBytes)
	ErrReadTimeout = fmt.Errorf("not read within %s", FileReadTimeout)
)

// ReadFile reads a file the gateway reads again while it runs (a replicas
// file, the --config file on SIGHUP): only a regular file, at most
// MaxFileBytes, within FileReadTimeout. The mode is checked before the
// open (stat, following a ConfigMap's symlinks) and again on the open file
// (fstat: the path may have been swapped in between), and the open is
// non-blocking, so that a FIFO swapped in cannot block the open itself.
func ReadFile(path string) ([]byte, error) {
	if err := regular(os.Stat(path)); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	if err := regular(f.Stat()); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	timer := time.NewTimer(FileReadTimeout)
	defer timer.Stop()
	data, err := readBounded(f, MaxFileBytes, timer.C)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return data, nil
}

// regular is the error of a file (from a stat) that is not a regular file,
// or is larger than MaxFileBytes (refused before it is read; a file that
// grows past it while read is caught by readBounded).
func regular(fi fs.FileInfo, err error) error {
	switch {
	case err != nil:
		return err
	case !fi.Mode().IsRegular():
		return fmt.Errorf("%w (mode %s)", ErrNotRegular, fi.Mode().Type())
	case fi.Size() > MaxFileBytes:
		return fmt.Errorf("%w (%d bytes)", ErrFileTooBig, fi.Size())
	}
	return nil
}

// readBounded reads rc to its end, at most limit bytes, and closes it;
// ErrReadTimeout when timeout fires first. A regular file's read cannot be
// interrupted (it has no deadline: a hung network file system), so it runs
// in a goroutine that ends, and closes rc, when the read returns; the
// caller does not wait for it.
func readBounded(rc io.ReadCloser, limit int64, timeout <-chan time.Time) ([]byte, error) {
	type result struct {
		data []byte
		err  error
	}
	done := make(chan result, 1)
	go func() {
		defer rc.Close()
		data, err := io.ReadAll(io.LimitReader(rc, limit+1))
		done <- result{data, err}
	}()
	select {
	case r := <-done:
		switch {
		case r.err != nil:
			return nil, r.err
		case int64(len(r.data)) > limit:
			return nil, ErrFileTooBig
		}
		return r.data, nil
	case <-timeout:
		return nil, ErrReadTimeout
	}
}
