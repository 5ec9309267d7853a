package kvevents

import "testing"

func TestOffsetPort(t *testing.T) {
	for _, c := range []struct {
		ep   string
		k    int
		want string
	}{
		{"tcp://10.0.0.1:5557", 0, "tcp://10.0.0.1:5557"},
		{"tcp://10.0.0.1:5557", 3, "tcp://10.0.0.1:5560"},
		{"tcp://*:5557", 1, "tcp://*:5558"},
		{"tcp://[::1]:5557", 2, "tcp://[::1]:5559"},
		{"ipc:///tmp/kv", 1, "ipc:///tmp/kv_dp1"},
		{"", 4, ""},
		{"tcp://host", 1, "tcp://host"},
	} {
		if got := OffsetPort(c.ep, c.k); got != c.want {
			t.Errorf("OffsetPort(%q, %d) = %q, want %q", c.ep, c.k, got, c.want)
		}
	}
}

func TestTopicParts(t *testing.T) {
	for _, c := range []struct{ topic, host, model string }{
		{"kv@10.0.0.1:8000@meta-llama/Llama-3.1-8B", "10.0.0.1:8000", "meta-llama/Llama-3.1-8B"},
		{"kv@[::1]:8000@m", "[::1]:8000", "m"},
		{"kv@pod-ip@m", "pod-ip", "m"},
		{"", "", ""},
		{"kv-events", "", ""},
	} {
		if h, m := TopicHost(c.topic), TopicModel(c.topic); h != c.host || m != c.model {
			t.Errorf("%q: host %q model %q, want %q %q", c.topic, h, m, c.host, c.model)
		}
	}
}
