package gateway

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// FuzzParseConfig feeds arbitrary bytes to the configuration loader. The
// properties: ParseConfig and Validate never panic, and a configuration
// that parses is a fixed point of save-and-reload — written back as YAML
// (what an operator does with `kvgate serve --config`) it parses again to
// the same configuration. The comparison is on the JSON form, so that nil
// and empty slices, which the omitempty fields do not distinguish, compare
// equal.
func FuzzParseConfig(f *testing.F) {
	for _, seed := range []string{
		"",
		"null",
		"listen: 127.0.0.1:9000\npolicy: ttft\nreplicas:\n  - url: http://127.0.0.1:8000\n  - url: http://127.0.0.1:8001\n",
		"replicas: [{url: 'http://a:1', kv_events: 'tcp://127.0.0.1:5557', api_key: k}]\ntokenizer: remote\n",
		"retry_backoff: 25ms\nretry_backoff_max: 1s\nfirst_byte_timeout: 2s\nrequest_timeout: 10m\nqueue_timeout: 30s\n",
		"max_concurrency: 64\nmax_queue: 128\nmax_body_bytes: 1048576\neject_after: 3\neject_cooldown: 10s\n",
		"policy: score\npolicy_params: {cache_weight: 2, load_weight: 1, nested: {a: [1, 2, {b: c}]}}\n",
		`{"listen": ":8080", "replicas": [{"url": "http://x:1"}], "seed": 18446744073709551615}`,
		"api_keys: [a, b]\nadmin_token: secret\n",
		"retry_backoff: -1s\n",
		"retry_backoff: 5\n",
		"unknown_field: 1\n",
		"replicas: {url: x}\n",
		"seed: -1\n",
		"a: &x [*x]\n",
		"- 1\n- 2\n",
		"block_size: 1e400\n",
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := ParseConfig(data)
		if err != nil {
			return
		}
		_ = cfg.Validate() // must not panic on any parsed configuration
		first, err := json.Marshal(cfg)
		if err != nil {
			t.Fatalf("a parsed configuration does not marshal: %v", err)
		}
		saved, err := yaml.Marshal(cfg)
		if err != nil {
			t.Fatalf("a parsed configuration does not marshal to YAML: %v", err)
		}
		again, err := ParseConfig(saved)
		if err != nil {
			t.Fatalf("the configuration written back does not parse: %v\nwritten:\n%s", err, saved)
		}
		second, err := json.Marshal(again)
		if err != nil {
			t.Fatalf("the reloaded configuration does not marshal: %v", err)
		}
		if !bytes.Equal(first, second) {
			t.Fatalf("save and reload changed the configuration:\nfirst  %s\nsecond %s", first, second)
		}
	})
}

// The documented example configuration (docs/configuration.md) loads, and
// its values are the defaults where it says so (the docs must not drift).
func TestREADMEConfigLoads(t *testing.T) {
	data, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Skip("docs/configuration.md not found beside the module")
	}
	text := string(data)
	i := strings.Index(text, "<<'EOF'\nlisten: 127.0.0.1:8080")
	if i < 0 {
		t.Fatal("the documented gateway configuration (docs/configuration.md) is missing")
	}
	block := text[i+len("<<'EOF'\n"):]
	block = block[:strings.Index(block, "\nEOF\n")]
	cfg, err := ParseConfig([]byte(block))
	if err != nil {
		t.Fatalf("README configuration: %v", err)
	}
	d := Defaults()
	if cfg.FirstByteTimeout != d.FirstByteTimeout || cfg.StreamIdleTimeout != d.StreamIdleTimeout ||
		cfg.WriteTimeout != d.WriteTimeout || cfg.DrainTimeout != d.DrainTimeout || cfg.MaxBodyMemory != d.MaxBodyMemory ||
		cfg.MaxStreamLineBytes != d.MaxStreamLineBytes || cfg.TokenizeTimeout != d.TokenizeTimeout ||
		cfg.ScrapeStaleAfter != d.ScrapeStaleAfter || cfg.RequestTimeout != d.RequestTimeout {
		t.Fatalf("the README's example differs from the defaults it shows:\n%+v\n%+v", cfg, d)
	}
}
