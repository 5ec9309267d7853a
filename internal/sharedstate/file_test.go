package sharedstate

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"
)

func TestSaveAndLoadFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "index.snapshot")
	a := testRouter(t)
	_ = a.Index().Insert(1, []uint64{10, 11, 12})
	_ = a.Index().Insert(2, []uint64{20})
	if err := SaveFile(path, a, time.Unix(100, 0)); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("mode %v, want 0600", fi.Mode().Perm())
	}
	// Saving again replaces the file and leaves no temporary behind.
	_ = a.Index().Insert(0, []uint64{1})
	if err := SaveFile(path, a, time.Unix(101, 0)); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("directory holds %d files", len(ents))
	}
	b := testRouter(t)
	n, err := LoadFile(path, b, 0)
	if err != nil || n != 5 {
		t.Fatalf("LoadFile = %d, %v; want 5 blocks", n, err)
	}
	for i := range 3 {
		if !slices.Equal(a.Index().Snapshot(i), b.Index().Snapshot(i)) {
			t.Fatalf("replica %d: %v, want %v", i, b.Index().Snapshot(i), a.Index().Snapshot(i))
		}
	}
}

func TestLoadFileMissingIsAFirstStart(t *testing.T) {
	n, err := LoadFile(filepath.Join(t.TempDir(), "none"), testRouter(t), 0)
	if n != 0 || err != nil {
		t.Fatalf("LoadFile of a missing file = %d, %v", n, err)
	}
}

// A corrupt file is a clear error and the router stays as it was.
func TestLoadFileCorrupt(t *testing.T) {
	path := filepath.Join(t.TempDir(), "index.snapshot")
	a := testRouter(t)
	_ = a.Index().Insert(0, []uint64{1, 2, 3})
	if err := SaveFile(path, a, time.Unix(1, 0)); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(path)
	if err := os.WriteFile(path, data[:len(data)-3], 0o600); err != nil {
		t.Fatal(err)
	}
	b := testRouter(t)
	n, err := LoadFile(path, b, 0)
	if err == nil || !errors.Is(err, ErrCorrupt) || n != 0 {
		t.Fatalf("LoadFile of a truncated file = %d, %v", n, err)
	}
	if b.Index().Len() != 0 {
		t.Fatal("the router learnt from a corrupt file")
	}
	t.Logf("error: %v", err)
}

func TestSaveFileUnwritableDirectory(t *testing.T) {
	err := SaveFile(filepath.Join(t.TempDir(), "no", "such", "dir", "f"), testRouter(t), time.Unix(1, 0))
	if err == nil {
		t.Fatal("saved into a missing directory")
	}
}

// A state file that is not a regular file (a FIFO would block the start
// for ever), or is larger than the cap, is refused before it is read, and
// the router is left as it was.
func TestLoadFileRefuses(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "big")
	a := testRouter(t)
	_ = a.Index().Insert(0, []uint64{1, 2, 3, 4, 5, 6, 7, 8})
	if err := SaveFile(big, a, time.Unix(1, 0)); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, path string
		max        int64
	}{{"fifo", fifo, 0}, {"directory", dir, 0}, {"over the cap", big, 64}} {
		t.Run(c.name, func(t *testing.T) {
			b := testRouter(t)
			n, err := LoadFile(c.path, b, c.max)
			if !errors.Is(err, ErrStateFile) || n != 0 || b.Index().Len() != 0 {
				t.Fatalf("LoadFile = %d, %v", n, err)
			}
			t.Logf("error: %v", err)
		})
	}
}
