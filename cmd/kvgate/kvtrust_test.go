package main

import (
	"slices"
	"testing"
)

// --kv-events-trust sets kv_events_trust over the file's, as a comma list.
func TestServeKVEventsTrustFlag(t *testing.T) {
	file := writeConfig(t, "replicas: [{url: http://127.0.0.1:1}]\ntokenizer: remote\nkv_events_listen: tcp://127.0.0.1:5557\n"+
		"kv_events_trust: any\n")
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{[]string{"--config", file}, []string{"any"}},
		{[]string{"--config", file, "--kv-events-trust", "replica_address,10.0.0.0/8"}, []string{"replica_address", "10.0.0.0/8"}},
		{[]string{"--replicas", "http://127.0.0.1:1"}, []string{"replica_address"}},
	} {
		cfg, err := serveConfig(t, tc.args...)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(cfg.KVEventsTrust, tc.want) {
			t.Errorf("%v: trust %v, want %v", tc.args, cfg.KVEventsTrust, tc.want)
		}
	}
	cfg, err := serveConfig(t, "--config", file, "--kv-events-trust", "10.0.0.1")
	if err == nil {
		err = checkConfig(cfg)
	}
	if err == nil {
		t.Error("--kv-events-trust 10.0.0.1 (no prefix length) accepted")
	}
}
