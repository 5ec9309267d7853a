package main

import (
	"os"
	"path/filepath"
	"testing"
)

// --access-log turns the access log on; the config's access_log does too,
// and the flag given explicitly wins over it.
func TestServeAccessLogFlag(t *testing.T) {
	if cfg, err := serveConfig(t, "--replicas", "http://a"); err != nil || cfg.AccessLog {
		t.Fatalf("default: %v access log %v, want off", err, cfg.AccessLog)
	}
	if cfg, err := serveConfig(t, "--replicas", "http://a", "--access-log"); err != nil || !cfg.AccessLog {
		t.Fatalf("--access-log: %v access log %v", err, cfg.AccessLog)
	}
	path := filepath.Join(t.TempDir(), "kvgate.yaml")
	if err := os.WriteFile(path, []byte("replicas: [{url: http://a}]\naccess_log: true\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if cfg, err := serveConfig(t, "--config", path); err != nil || !cfg.AccessLog {
		t.Fatalf("access_log: true in the file: %v access log %v", err, cfg.AccessLog)
	}
	if cfg, err := serveConfig(t, "--config", path, "--access-log=false"); err != nil || cfg.AccessLog {
		t.Fatalf("--access-log=false over the file: %v access log %v", err, cfg.AccessLog)
	}
}
