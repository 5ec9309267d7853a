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
