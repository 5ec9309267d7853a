package gateway

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/discovery"
	"github.com/kvgate/kvgate/internal/testutil"
)

// The replicas come from exactly one source, and each source's settings
// are checked with errors naming the key.
func TestReplicaSourcesValidate(t *testing.T) {
	tests := []struct {
		yaml string
		want string // "" valid
	}{
		{"replicas: [{url: http://a:1}]", ""},
		{"replicas_file: /etc/kvgate/replicas.yaml", ""},
		{"discovery: {dns: vllm.llm.svc.cluster.local:8000, interval: 10s, role: decode}", ""},
		{"discovery: {dns: _http._tcp.vllm.llm.svc.cluster.local, scheme: https}", ""},
		{"discovery: {kubernetes: {namespace: llm, selector: kubernetes.io/service-name=vllm, port: 8000}}", ""},
		{"discovery: {kubernetes: {namespace: llm, selector: app=vllm, port: http, role_label: tier}}", ""},
		{"discovery: {kubernetes: {namespace: llm, inference_pool: vllm-pool}}", ""},
		{"discovery: {kubernetes: {namespace: llm, inference_pool: p, inference_pool_group: inference.networking.x-k8s.io}}", ""},
		{"discovery: {kubernetes: {namespace: llm, inference_pool: p, port: 8000}}", "discovery.kubernetes.port: with inference_pool"},
		{"discovery: {kubernetes: {namespace: llm, inference_pool: p, selector: a=b}}", "discovery.kubernetes.selector: with inference_pool"},
		{"discovery: {kubernetes: {namespace: llm, selector: a=b, port: 1, inference_pool_group: x}}", "give inference_pool too"},
		{"discovery: {kubernetes: {inference_pool: p}}", "discovery.kubernetes.namespace"},
		{"{}", "no replicas"},
		{"replicas: [{url: http://a:1}]\nreplicas_file: /x", "one source"},
		{"replicas_file: /x\ndiscovery: {dns: a:1}", "one source"},
		{"discovery: {}", "give dns: NAME:PORT or kubernetes:"},
		{"discovery: {dns: a:1, kubernetes: {namespace: llm, selector: a=b, port: 1}}", "not both"},
		{"discovery: {dns: vllm}", "want NAME:PORT"},
		{"discovery: {dns: vllm:http}", "not a number"},
		{"discovery: {dns: _http.vllm}", "SRV name"},
		{"discovery: {dns: a:1, scheme: ftp}", "discovery.scheme"},
		{"discovery: {dns: a:1, role: Prefill}", "discovery.role"},
		{"discovery: {kubernetes: {selector: a=b, port: 1}}", "namespace"},
		{"discovery: {kubernetes: {namespace: llm, port: 1}}", "selector"},
		{"discovery: {kubernetes: {namespace: llm, selector: a=b}}", "discovery.kubernetes.port"},
		{"discovery: {kubernetes: {namespace: llm, selector: a=b, port: 70000}}", "discovery.kubernetes.port"},
		{"discovery: {kubernetes: {namespace: llm, selector: a=b, port: 1}, role: decode}", "role label"},
		{"discovery: {dns: a:1, intervall: 5s}", "discovery.intervall: unknown key (did you mean interval?)"},
		{"replicas_file: /x\nforget_after: 10m", ""},
		{"replicas_file: /x\nforget_after: 0s", "forget_after: must be positive"},
	}
	for _, tc := range tests {
		cfg, err := ParseConfig([]byte(tc.yaml))
		if err == nil {
			err = cfg.Validate()
		}
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.yaml, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: got %v, want an error with %q", tc.yaml, err, tc.want)
		}
	}
}

func TestParseReplicasFile(t *testing.T) {
	list, err := ParseReplicasFile([]byte("- url: http://a:8000\n  role: prefill\n- url: http://b:8000\n  role: decode\n  api_key: k\n"))
	if err != nil || len(list) != 2 || list[0].Role != "prefill" || list[1].APIKey != "k" {
		t.Fatalf("%+v %v", list, err)
	}
	if list, err := ParseReplicasFile([]byte("replicas:\n- url: http://a:8000\n")); err != nil || len(list) != 1 {
		t.Fatalf("the config's shape: %+v %v", list, err)
	}
	for bad, want := range map[string]string{
		"":                                       "no replicas",
		"[]":                                     "no replicas",
		"- url: ftp://a\n":                       "not an http(s) URL",
		"- url: http://a:1\n- url: http://a:1\n": "listed twice",
		"- url: http://a:1\n  rol: x\n":          "line 2: replicas[0].rol: unknown key (did you mean role?)",
		"- url: http://a:1\n  role: prefill\n":   "role decode or both",
		"- url: http://a:1\n  kv_events: tcp://a:2\n": "kv_events_listen",
		"replicas: [{url: http://a:1}]\nlisten: x\n":  "line 2: listen: unknown key",
		"[not yaml": "YAML",
	} {
		if _, err := ParseReplicasFile([]byte(bad)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: got %v, want %q", bad, err, want)
		}
	}
}

// The files the gateway reads again while it runs (the --config file on
// SIGHUP, a replicas file at start) share the replicas watcher's reader: a
// FIFO (or any file that is not a regular one) is an error at once, never
// a read that blocks (finding 10).
func TestFilesReadWhileRunningRefuseAFIFO(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fifo.yaml")
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Skip("no FIFOs here:", err)
	}
	t.Cleanup(func() { // lets a blocked open go (the base's os.ReadFile)
		if w, err := os.OpenFile(path, os.O_RDWR|syscall.O_NONBLOCK, 0); err == nil {
			_ = w.Close()
		}
	})
	for name, read := range map[string]func() error{
		"config": func() error { _, err := LoadConfig(path); return err },
		"replicas_file": func() error {
			_, err := initialReplicas(Config{ReplicasFile: path})
			return err
		},
	} {
		errc := make(chan error, 1)
		go func() { errc <- read() }()
		select {
		case err := <-errc:
			if !errors.Is(err, discovery.ErrNotRegular) {
				t.Errorf("%s: %v, want %v", name, err, discovery.ErrNotRegular)
			}
		case <-time.After(testutil.Bound(10 * time.Second)): // a generous bound for a broken reader
			t.Fatalf("%s: the read of a FIFO is still blocked", name)
		}
	}
}
