package gateway

import (
	"strings"
	"testing"
)

// Precise mode with the approximate tokenizer can never match (no engine
// produces its token ids): refused at start, saying what to do.
func TestPreciseNeedsRemoteTokenizer(t *testing.T) {
	for _, set := range []func(c *Config){
		func(c *Config) { c.Replicas[0].KVEvents = "tcp://127.0.0.1:5557" },
		func(c *Config) { c.KVEventsListen = "tcp://127.0.0.1:5557" },
	} {
		cfg := baseConfig("http://127.0.0.1:1")
		set(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "tokenizer: remote") {
			t.Fatalf("precise mode with tokenizer approx: %v", err)
		}
		cfg.Tokenizer = "remote"
		if err := cfg.Validate(); err != nil {
			t.Fatalf("with the remote tokenizer: %v", err)
		}
	}
}

// shared_state must be a Redis URL; the error names the key.
func TestSharedStateURL(t *testing.T) {
	for url, ok := range map[string]bool{
		"redis://127.0.0.1:6379/0":   true,
		"rediss://10.0.0.1:6380/2":   true,
		"http://127.0.0.1:6379":      false,
		"127.0.0.1:6379":             false,
		"redis://127.0.0.1:6379/abc": false,
	} {
		cfg := baseConfig("http://127.0.0.1:1")
		cfg.SharedState = url
		err := cfg.Validate()
		if (err == nil) != ok || (err != nil && !strings.Contains(err.Error(), "shared_state")) {
			t.Errorf("%s: %v", url, err)
		}
	}
}
