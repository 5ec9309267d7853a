package discovery

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/kvgate/kvgate/internal/clock"
)

// DefaultFileInterval is how often a replicas file is looked at.
const DefaultFileInterval = 2 * time.Second

// File watches a replicas file: the same YAML list as the config's
// replicas:. It reads the file every Interval and compares its content's
// hash (a file is a few hundred bytes; a hash sees every edit, a
// Kubernetes ConfigMap's symlink swap included, where an mtime may not);
// Reload (SIGHUP) reads it at once. A file that cannot be read (not a
// regular file, too large, too slow: ReadFile) or parsed is logged once
// per content and the previous list kept.
type File struct {
	path     string
	interval time.Duration
	parse    func([]byte) ([]Replica, error)
	clk      clock.Clock
	log      *slog.Logger
	reload   chan struct{}
	last     [sha256.Size]byte // the content last looked at
	seen     bool
}

// NewFile watches path; parse turns its content into a checked list (the
// gateway's YAML parser and validation). interval 0: DefaultFileInterval.
func NewFile(path string, interval time.Duration, parse func([]byte) ([]Replica, error), clk clock.Clock, log *slog.Logger) *File {
	if interval <= 0 {
		interval = DefaultFileInterval
	}
	return &File{path: path, interval: interval, parse: parse, clk: clock.OrReal(clk), log: logger(log), reload: make(chan struct{}, 1)}
}

// Name is "file PATH".
func (f *File) Name() string { return "file " + f.path }

// Load reads and parses the file once.
func (f *File) Load() ([]Replica, error) {
	data, err := ReadFile(f.path)
	if err != nil {
		return nil, err
	}
	list, err := f.parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", f.path, err)
	}
	return list, nil
}

// Reload asks Run to read the file now (SIGHUP); it never blocks.
func (f *File) Reload() {
	select {
	case f.reload <- struct{}{}:
	default:
	}
}

// Run reads the file now and then every interval (or on Reload) until
// ctx ends, calling update when its content changed and parses.
func (f *File) Run(ctx context.Context, update func([]Replica)) {
	tick := f.clk.NewTicker(f.interval)
	defer tick.Stop()
	f.check(update, false)
	for {
		forced := false
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
		case <-f.reload:
			forced = true
		}
		f.check(update, forced)
	}
}

// check reads the file and calls update if its content is new (or forced:
// a SIGHUP re-applies even an unchanged file) and good.
func (f *File) check(update func([]Replica), forced bool) {
	data, err := ReadFile(f.path)
	if err != nil {
		sum := sha256.Sum256([]byte("error: " + err.Error()))
		if forced || !f.seen || sum != f.last {
			level := slog.LevelWarn
			if errors.Is(err, os.ErrNotExist) || errors.Is(err, ErrNotRegular) || errors.Is(err, ErrFileTooBig) {
				level = slog.LevelError
			}
			f.log.Log(context.Background(), level, "replicas file cannot be read: keeping the previous replica list",
				"path", f.path, "err", err)
		}
		f.last, f.seen = sum, true
		return
	}
	sum := sha256.Sum256(data)
	if !forced && f.seen && sum == f.last {
		return
	}
	f.last, f.seen = sum, true
	list, err := f.parse(bytes.Clone(data))
	if err != nil {
		f.log.Error("replicas file is not valid: keeping the previous replica list", "path", f.path, "err", err)
		return
	}
	if forced {
		f.log.Info("replicas file reloaded", "path", f.path, "replicas", len(list))
	}
	update(list)
}
