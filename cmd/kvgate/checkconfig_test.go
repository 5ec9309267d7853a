package main

import (
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// writeConfig writes a config file into a temporary directory.
func writeConfig(t *testing.T, yaml string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kvgate.yaml")
	if err := os.WriteFile(p, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// A valid file with flags on top: exit 0, a summary of what would be
// served, and nothing started: the replica is never asked anything and the
// listen address, held by the test, is not bound.
func TestCheckConfigValid(t *testing.T) {
	var asked atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { asked.Add(1) }))
	defer up.Close()
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	path := writeConfig(t, `
listen: `+held.Addr().String()+`
policy: sglang
policy_params: {cache_threshold: 0.3}
tokenizer: remote
kv_events_listen: tcp://127.0.0.1:5557
replicas:
  - {url: `+up.URL+`, role: decode, api_key: secret-key-1}
  - {url: http://127.0.0.1:1, role: prefill, data_parallel_size: 2}
`)
	code, out, errs := runCmd(t, "", "serve", "--check-config", "--config", path, "--admin-token", "secret-token",
		"--policy-param", "balance_abs_threshold=8")
	if code != 0 || errs != "" {
		t.Fatalf("exit %d: %s", code, errs)
	}
	for _, want := range []string{"configuration valid (" + path + ")", "listen:    " + held.Addr().String(),
		"policy:    sglang (balance_abs_threshold=8, cache_threshold=0.3)", "1 prefill + 1 decode replicas",
		up.URL + "  role decode, api key set", "http://127.0.0.1:1  role prefill, 2 data-parallel ranks",
		"precise mode (KV events bound at tcp://127.0.0.1:5557)", "admin endpoints", "SIGHUP:    re-reads the replicas files; applies eject_after,"} {
		if !strings.Contains(out, want) {
			t.Errorf("summary lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "secret") {
		t.Errorf("the summary shows a secret:\n%s", out)
	}
	if n := asked.Load(); n != 0 {
		t.Fatalf("the replica was asked %d times", n)
	}
}

// Each mistake exits 2 naming it, whether in the file, in a flag, or in
// the file's absence; nothing goes to stdout.
func TestCheckConfigInvalid(t *testing.T) {
	good := "replicas: [{url: http://127.0.0.1:8000}]\n"
	for _, tc := range []struct {
		name, yaml string
		flags      []string
		want       string
	}{
		{"unknown field", good + "polcy: ttft\n", nil, `kvgate.yaml:2: polcy: unknown key (did you mean policy?)`},
		{"not YAML", "replicas: [\n", nil, "not valid YAML"},
		{"no replicas", "policy: ttft\n", nil, "no replicas"},
		{"bad URL", "replicas: [{url: ftp://x}]\n", nil, `"ftp://x" is not an http(s) URL`},
		{"bad role", "replicas: [{url: http://a, role: decoder}]\n", nil, "replicas[0].role"},
		{"an OpenAI base URL", "replicas: [{url: \"http://10.0.0.1:8000/v1/\"}]\n", nil,
			`kvgate.yaml:1: replicas[0].url: "http://10.0.0.1:8000/v1/" ends with /v1: give the server's base URL without it (http://10.0.0.1:8000)`},
		{"an OpenAI base URL by flag", "", []string{"--replicas", "http://10.0.0.1:8000,http://10.0.0.2:8000/prefix/v1"},
			`replicas[1].url: "http://10.0.0.2:8000/prefix/v1" ends with /v1: give the server's base URL without it (http://10.0.0.2:8000/prefix)`},
		{"unknown policy", good + "policy: fastest\n", nil, `unknown policy "fastest"`},
		{"bad policy parameter", good + "policy_params: {cache_treshold: 0.3}\n", nil, `unknown field "cache_treshold"`},
		{"bad listen", good + "listen: \"8080\"\n", nil, `kvgate.yaml:2: listen: "8080": want HOST:PORT`},
		{"bad listen port", good + "listen: \":80800\"\n", nil, "not a number from 0 to 65535"},
		{"precise without remote tokenizer", good + "kv_events_listen: tcp://127.0.0.1:5557\n", nil, "set tokenizer: remote"},
		{"a flag breaks a good file", good, []string{"--tokenizer", "exact"}, `invalid configuration: tokenizer: "exact": want approx or remote`},
		{"a bad flag parameter", good, []string{"--policy-param", "nonsense"}, "want name=value"},
		{"missing file", "", []string{"--config", "/nonexistent/kvgate.yaml"}, "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"serve", "--check-config", "--config", writeConfig(t, tc.yaml)}
			code, out, errs := runCmd(t, "", append(args, tc.flags...)...)
			if code != 2 || out != "" || !strings.Contains(errs, "invalid configuration") || !strings.Contains(errs, tc.want) {
				t.Fatalf("exit %d, stdout %q, stderr %q; want 2 and %q", code, out, errs, tc.want)
			}
		})
	}
}

// The replicas' other sources: a replicas file is read and checked as the
// gateway reads it at start, its replicas listed; discovery is described,
// and DNS is not asked (Kubernetes: checkconfig_kubernetes_test.go).
func TestCheckConfigSources(t *testing.T) {
	t.Setenv("KUBECONFIG", filepath.Join(t.TempDir(), "none"))
	file := writeConfig(t, "- {url: http://127.0.0.1:8001, role: prefill}\n- {url: http://127.0.0.1:8002, role: decode}\n")
	for _, tc := range []struct {
		name, yaml string
		flags      []string
		want       []string
	}{
		{"replicas file", "replicas_file: " + file + "\n", nil, []string{"replicas of " + file,
			"now 1 prefill + 1 decode replicas", "http://127.0.0.1:8001  role prefill"}},
		{"replicas file by flag", "replicas: [{url: http://127.0.0.1:9}]\n", []string{"--replicas-file", file},
			[]string{"replicas of " + file, "http://127.0.0.1:8002  role decode"}},
		{"dns", "discovery: {dns: vllm.llm.svc.cluster.local:8000}\n", nil,
			[]string{"replicas found by DNS vllm.llm.svc.cluster.local:8000", "found while serving"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"serve", "--check-config", "--config", writeConfig(t, tc.yaml)}, tc.flags...)
			code, out, errs := runCmd(t, "", args...)
			if code != 0 {
				t.Fatalf("exit %d: %s", code, errs)
			}
			for _, want := range tc.want {
				if !strings.Contains(out, want) {
					t.Errorf("summary lacks %q:\n%s", want, out)
				}
			}
		})
	}
	bad := writeConfig(t, "- {url: http://127.0.0.1:8001, kv_events: tcp://127.0.0.1:5557}\n")
	for _, tc := range []struct{ name, yaml, want string }{
		{"bad replicas file", "replicas_file: " + bad + "\n", "kv_events and kv_events_replay come from the config file only"},
		{"missing replicas file", "replicas_file: /nonexistent/replicas.yaml\n", "no such file"},
		{"two sources", "replicas_file: " + file + "\nreplicas: [{url: http://127.0.0.1:9}]\n", "replicas come from one source"},
		{"kubernetes without a namespace", "discovery: {kubernetes: {selector: app=vllm, port: 8000}}\n", "discovery.kubernetes.namespace"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, out, errs := runCmd(t, "", "serve", "--check-config", "--config", writeConfig(t, tc.yaml))
			if code != 2 || out != "" || !strings.Contains(errs, tc.want) {
				t.Fatalf("exit %d, stdout %q, stderr %q; want 2 and %q", code, out, errs, tc.want)
			}
		})
	}
}

// Every file the docs write (cat > FILE <<'EOF') that is a whole gateway
// configuration (it names listen, replicas or pools) passes --check-config
// as written (ports unmoved, unlike TestREADMECommands).
func TestREADMEConfigsCheck(t *testing.T) {
	readme, err := os.ReadFile(filepath.Join("..", "..", "docs", "configuration.md"))
	if err != nil {
		t.Fatal(err)
	}
	pools, err := os.ReadFile(filepath.Join("..", "..", "docs", "deploying.md"))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for i, block := range strings.Split(string(readme)+string(pools), "<<'EOF'\n")[1:] {
		body, _, _ := strings.Cut(block, "\nEOF\n")
		if !strings.Contains(body, "\nreplicas:") && !strings.HasPrefix(body, "listen:") && !strings.Contains(body, "\npools:") {
			continue
		}
		n++
		path := writeConfig(t, body)
		if code, _, errs := runCmd(t, "", "serve", "--check-config", "--config", path); code != 0 {
			t.Errorf("README yaml block %d: exit %d: %s\n%s", i+1, code, errs, body)
		}
	}
	if n < 2 {
		t.Fatalf("%d whole configurations found in docs/: want the gateway's and the pools' at least", n)
	}
}

// A file with three mistakes (a typo of a key, a duration without its
// unit, a URL that is not one) is refused with all three, each with its
// line and key, the same by --check-config and by serve at start (which
// then starts nothing); a flag that replaces a key takes its problem, and
// its line, away.
func TestConfigThreeMistakesReported(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	path := writeConfig(t, `listen: `+held.Addr().String()+`
scrape_intervall: 250ms
health_interval: 250
replicas:
  - url: http://127.0.0.1:1
  - url: htp://127.0.0.1:2
`)
	want := []string{
		"invalid configuration, 3 problems:",
		path + ":2: scrape_intervall: unknown key (did you mean scrape_interval?)",
		path + ":3: health_interval: 250 has no unit: write 250ms or 250s",
		path + `:6: replicas[1].url: "htp://127.0.0.1:2" is not an http(s) URL`,
	}
	for _, args := range [][]string{
		{"serve", "--check-config", "--config", path},
		{"serve", "--config", path},
	} {
		code, out, errs := runCmd(t, "", args...)
		if code != 2 || out != "" {
			t.Fatalf("%v: exit %d, stdout %q, stderr %q; want 2", args, code, out, errs)
		}
		lines := strings.Split(strings.TrimSpace(errs), "\n")
		if len(lines) != len(want) {
			t.Fatalf("%v: %d lines, want %d:\n%s", args, len(lines), len(want), errs)
		}
		for i, w := range want {
			if !strings.Contains(lines[i], w) {
				t.Errorf("%v: line %d is %q, want %q", args, i, lines[i], w)
			}
		}
	}
	code, _, errs := runCmd(t, "", "serve", "--check-config", "--config", path, "--replicas", "http://127.0.0.1:1",
		"--scrape-interval", "1s")
	if code != 2 || strings.Contains(errs, "replicas[1]") || !strings.Contains(errs, "2 problems") {
		t.Fatalf("with --replicas: exit %d, %s; want 2 problems, the URL's gone", code, errs)
	}
}
