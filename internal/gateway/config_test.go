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

// Replicas' roles: spelled right, and a prefill/decode fleet with a
// replica that can stream answers; non_cached_tokens at least 0. The
// errors name the key.
func TestReplicaRoles(t *testing.T) {
	tests := []struct {
		roles []string
		want  string // "" valid
	}{
		{[]string{"", ""}, ""},
		{[]string{"prefill", "decode"}, ""},
		{[]string{"prefill", "both"}, ""},
		{[]string{"decode", "decode"}, ""},
		{[]string{"prefill", "prefill"}, "at least one replica of role decode or both"},
		{[]string{"prefill", "Decode"}, `replicas[1].role: "Decode": want both, prefill or decode`},
	}
	for _, tc := range tests {
		cfg := baseConfig("http://127.0.0.1:1", "http://127.0.0.1:2")
		for i, r := range tc.roles {
			cfg.Replicas[i].Role = r
		}
		err := cfg.Validate()
		if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("roles %q: %v, want %q", tc.roles, err, tc.want)
		}
	}
	cfg, err := ParseConfig([]byte("replicas: [{url: 'http://a:1', role: decode}, {url: 'http://b:1', role: prefill}]\nnon_cached_tokens: 0\n"))
	if err != nil || cfg.Replicas[0].Role != "decode" || cfg.Replicas[1].Role != "prefill" || cfg.NonCachedTokens != 0 || cfg.Validate() != nil {
		t.Fatalf("YAML roles: %v %+v", err, cfg.Replicas)
	}
	if Defaults().NonCachedTokens != 16 {
		t.Fatalf("non_cached_tokens default %d, want llm-d's 16", Defaults().NonCachedTokens)
	}
	cfg.NonCachedTokens = -1
	if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "non_cached_tokens") {
		t.Fatalf("non_cached_tokens -1: %v", err)
	}
}

// --prefill-replicas: the replicas of --replicas decode, the prefill ones
// follow them (and --kv-events lists both, in that order).
func TestParseReplicaListPrefill(t *testing.T) {
	rs, err := ParseReplicaList("http://d1,http://d2", ReplicaLists{Prefill: "http://p1", KVEvents: "tcp://d1:1,tcp://d2:1,tcp://p1:1"})
	if err != nil || len(rs) != 3 {
		t.Fatalf("%v %+v", err, rs)
	}
	for i, want := range []ReplicaConfig{{URL: "http://d1", Role: "decode", KVEvents: "tcp://d1:1"},
		{URL: "http://d2", Role: "decode", KVEvents: "tcp://d2:1"}, {URL: "http://p1", Role: "prefill", KVEvents: "tcp://p1:1"}} {
		if rs[i] != want {
			t.Errorf("replica %d: %+v, want %+v", i, rs[i], want)
		}
	}
	if _, err := ParseReplicaList("", ReplicaLists{Prefill: "http://p1"}); err == nil || !strings.Contains(err.Error(), "--replicas") {
		t.Fatalf("prefill replicas alone: %v", err)
	}
	if rs, _ := ParseReplicaList("http://a", ReplicaLists{}); rs[0].Role != "" {
		t.Fatalf("without --prefill-replicas the role is the default: %+v", rs)
	}
}

// Index sizes are ≥ 0 (0: the router's default): a negative one is refused
// at validation, naming the keys, instead of later by New.
func TestIndexSizesValidated(t *testing.T) {
	for key, set := range map[string]func(c *Config){
		"index_max_entries: must be ≥ 0":  func(c *Config) { c.IndexMaxEntries = -1 },
		"blocks_per_replica: must be ≥ 0": func(c *Config) { c.BlocksPerReplica = -1 },
	} {
		cfg := baseConfig("http://127.0.0.1:1")
		set(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), key) {
			t.Fatalf("negative index size: %v, want %q", err, key)
		}
	}
	cfg := baseConfig("http://127.0.0.1:1")
	cfg.IndexMaxEntries, cfg.BlocksPerReplica = 0, 0
	if err := cfg.Validate(); err != nil {
		t.Fatalf("zero (the defaults): %v", err)
	}
}
