package sharedstate

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/kvgate/kvgate/internal/router"
)

// SaveFile writes a snapshot of rt's approximate index to path: a gateway
// without Redis keeps what it learnt across a restart. The write is atomic
// (a temporary file in the same directory, synced, then renamed over path),
// so a crash mid-write leaves the previous snapshot whole; the file is
// readable by its owner only (0600).
func SaveFile(path string, rt *router.Router, at time.Time) error {
	s := TakeSnapshot(rt, "", at)
	if err := WriteFileAtomic(path, AppendSnapshot(make([]byte, 0, 64+9*s.Len()), &s)); err != nil {
		return fmt.Errorf("sharedstate: snapshot file: %w", err)
	}
	return nil
}

// WriteFileAtomic writes data to path, readable by its owner only, as one
// step: a temporary file beside it, synced, renamed over path, and the
// directory synced. A reader sees the old file or the new one, never a
// part of either, even if the process dies while writing.
func WriteFileAtomic(path string, data []byte) error {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	f, err := os.CreateTemp(dir, base+".tmp*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	fail := func(err error) error {
		_ = f.Close()
		_ = os.Remove(tmp)
		return fmt.Errorf("%s: %w", path, err)
	}
	if err := f.Chmod(0o600); err != nil {
		return fail(err)
	}
	if _, err := f.Write(data); err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(err)
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("%s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("%s: %w", path, err)
	}
	// The rename is durable once the directory is synced (best effort: not
	// every system can sync a directory).
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		_ = d.Close()
	}
	return nil
}

// ErrStateFile is LoadFile's error for a path that is not a regular file
// (a FIFO would block the start for ever) or is over the size cap.
var ErrStateFile = errors.New("sharedstate: snapshot file refused")

// LoadFile restores the snapshot SaveFile wrote at path into rt's
// approximate index and returns the number of blocks restored. A missing
// file is a first start, not an error (0, nil); a file that is not a
// regular one, is larger than maxBytes (0: SnapshotBytesFor(0)), does not
// decode or has a value out of bounds is an error, and rt is left
// untouched. It is opened without blocking and checked before it is read.
func LoadFile(path string, rt *router.Router, maxBytes int64) (int, error) {
	if maxBytes <= 0 {
		maxBytes = SnapshotBytesFor(0)
	}
	data, err := ReadFileBounded(path, maxBytes)
	if data == nil || err != nil {
		return 0, err
	}
	s, err := DecodeSnapshot(data)
	if err == nil {
		err = s.Check()
	}
	if err != nil {
		return 0, fmt.Errorf("sharedstate: snapshot file %s: %w", path, err)
	}
	return s.Restore(rt), nil
}

// ReadFileBounded reads a file this process wrote before (WriteFileAtomic)
// and must not trust: nil and no error when it does not exist (a first
// start); ErrStateFile when it is not a regular file (a FIFO would block
// the start for ever) or holds more than maxBytes. It is opened without
// blocking and checked before it is read.
func ReadFileBounded(path string, maxBytes int64) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("sharedstate: state file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	switch {
	case err != nil:
		return nil, fmt.Errorf("sharedstate: state file %s: %w", path, err)
	case !fi.Mode().IsRegular():
		return nil, fmt.Errorf("%w: %s is not a regular file (%v)", ErrStateFile, path, fi.Mode().Type())
	case fi.Size() > maxBytes:
		return nil, fmt.Errorf("%w: %s has %d bytes, the cap is %d", ErrStateFile, path, fi.Size(), maxBytes)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("sharedstate: state file %s: %w", path, err)
	}
	if int64(len(data)) > maxBytes {
		return nil, fmt.Errorf("%w: %s grew past the cap of %d bytes", ErrStateFile, path, maxBytes)
	}
	return data, nil
}
