package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/gateway"
	"github.com/kvgate/kvgate/internal/testutil"
)

func listedReplica(t *testing.T) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			_, _ = io.WriteString(w, `{"data":[{"id":"m"}]}`)
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestSIGHUPReloadsTheReplicasFileAndTheConfig: a SIGHUP re-reads the
// replicas file at once (a replica added) and applies the --config file's
// reloadable settings, logging what changed and what needs a restart.
func TestSIGHUPReloadsTheReplicasFileAndTheConfig(t *testing.T) {
	a, b := listedReplica(t), listedReplica(t)
	dir := t.TempDir()
	replicas, config := filepath.Join(dir, "replicas.yaml"), filepath.Join(dir, "kvgate.yaml")
	write := func(path, s string) {
		if err := os.WriteFile(path+".tmp", []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(path+".tmp", path); err != nil {
			t.Fatal(err)
		}
	}
	write(replicas, "- url: "+a.URL+"\n")
	write(config, "replicas_file: "+replicas+"\nretries: 2\n")
	f := &serveFlags{configPath: config, listen: "127.0.0.1:0", policy: "ttft", tokenizer: "approx", logLevel: "info"}
	set := map[string]bool{}
	cfg, _, err := f.config(set)
	if err != nil {
		t.Fatal(err)
	}
	logs := &testutil.SyncBuffer{}
	log := slog.New(slog.NewTextHandler(logs, nil))
	g, err := gateway.New(cfg, gateway.Options{Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { g.Run(ctx) })
	defer func() { cancel(); wg.Wait() }()
	stop := watchSIGHUP(f, set, g, log)
	defer stop()

	write(replicas, "- url: "+a.URL+"\n- url: "+b.URL+"\n")
	write(config, "replicas_file: "+replicas+"\nretries: 4\nlisten: 127.0.0.1:1\n")
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "b added and the config applied", func() bool {
		_, ok := g.Router().Lookup(b.URL)
		s := logs.String()
		return ok && strings.Contains(s, "key=retries old=2 new=4") && strings.Contains(s, "ignored until a restart\" key=listen")
	})
	if s := logs.String(); !strings.Contains(s, "replica added") {
		t.Fatalf("no info line for the added replica:\n%s", s)
	}
	// A config that does not load is logged; the running one stays.
	write(config, "replicas_file: "+replicas+"\nretries: -1\n")
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 10*time.Second, "the bad config logged", func() bool {
		return strings.Contains(logs.String(), "config reload failed: keeping the running configuration")
	})
}
