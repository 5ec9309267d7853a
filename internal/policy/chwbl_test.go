package policy

import (
	"fmt"
	"strings"
	"testing"
)

// TestCHWBLDefaults: KubeAI's Model CRD defaults for the PrefixHash
// strategy (api/k8s/v1/model_types.go: meanLoadPercentage 125,
// replication 256, prefixCharLength 100).
func TestCHWBLDefaults(t *testing.T) {
	want := chwblParams{LoadFactor: 1.25, PrefixChars: 100, VNodes: 256, CountRequest: true}
	if got := peerNew(t, "chwbl", nil).(*CHWBL).params; got != want {
		t.Fatalf("params %+v, want %+v", got, want)
	}
}

// TestCHWBLRule pins the rule of KubeAI's chwblGetAddr
// (internal/loadbalancer/balance_chwbl.go) on eight replicas: from the
// key's point clockwise, the first healthy replica whose load is within
// (total + 1) / replicas × 1.25, else the first one met; with
// count_request, within means load + 1 ≤ the bound (any replica while the
// total is 0), as KubeAI's chwblLoadOK has it.
func TestCHWBLRule(t *testing.T) {
	rs := peerViews(8)
	key := strings.Repeat("q", 100)
	o := refOrder(rs, key) // positions in ring order from the key
	count := map[string]any{"count_request": true}
	cases := []struct {
		name   string
		params map[string]any
		loads  map[int]int // ring rank → load
		down   []int       // ring ranks
		want   int         // ring rank
		reason string
	}{
		{"idle: the owner", nil, nil, nil, 0, "ring owner"},
		{"idle, request counted: the owner", count, nil, nil, 0, "ring owner"},
		// total 1: bound 2/8 × 1.25 = 0.3125.
		{"owner at 1 of 1: the idle successor", nil, map[int]int{0: 1}, nil, 1, "ring successor"},
		{"request counted: none within, the first met", count, map[int]int{0: 1}, nil, 0, "all replicas over"},
		// total 7: bound 8/8 × 1.25 = 1.25.
		{"owner at 7: the successor", nil, map[int]int{0: 7}, nil, 1, "ring successor"},
		{"request counted: 0 + 1 ≤ 1.25", count, map[int]int{0: 7}, nil, 1, "ring successor"},
		// total 9: bound 10/8 × 1.25 = 1.5625: load 1 within, 1 + 1 not.
		{"load 1 within 1.5625", nil, map[int]int{0: 8, 1: 1}, nil, 1, "ring successor"},
		{"request counted: 1 + 1 over 1.5625", count, map[int]int{0: 8, 1: 1}, nil, 2, "ring successor"},
		// total 31: bound 32/8 × 1.25 = 5 exactly.
		{"load equal to the bound stays", nil, map[int]int{0: 5, 1: 26}, nil, 0, "ring owner"},
		{"request counted: 5 + 1 over 5", count, map[int]int{0: 5, 1: 26}, nil, 2, "ring successor"},
		// total 16: bound 17/8 × 1.25 = 2.656: the owner at 2 stays.
		{"owner at 2 of 16 stays", nil, map[int]int{0: 2, 1: 2, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2}, nil, 0, "ring owner"},
		// total 7: bound 8/8 × 1.25 = 1.25, or × 2 = 2.
		{"owner at 2, successor at 5: the next", nil, map[int]int{0: 2, 1: 5}, nil, 2, "ring successor"},
		{"load_factor 2: the owner at 2 stays", map[string]any{"load_factor": 2, "count_request": false}, map[int]int{0: 2, 1: 5}, nil, 0, "ring owner"},
		// Healthy total 2 of 7 replicas: bound 3/7 × 1.25 = 0.536.
		{"owner down, its load ignored", nil, map[int]int{0: 50, 1: 2}, []int{0}, 2, "ring successor"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			params := c.params
			if params == nil {
				params = map[string]any{"count_request": false} // the textbook bound; count_request is the default
			}
			p := peerNew(t, "chwbl", params)
			rs := peerViews(8)
			for rank, l := range c.loads {
				rs[o[rank]].InFlight = l
			}
			for _, rank := range c.down {
				rs[o[rank]].Healthy = false
			}
			req := peerReq(1, "", peerT0)
			req.KeyText = key + ", and the rest of the first user message"
			got, d := peerPick(t, p, req, rs)
			if got != o[c.want] || !strings.HasPrefix(d.Reason, c.reason) {
				t.Fatalf("picked %d (%s), want %d (%s…); ring order %v", got, d.Reason, o[c.want], c.reason, o)
			}
		})
	}
}

// TestCHWBLKeyHead: only the first 100 characters (not bytes) of the first
// user message key the ring, so prompts sharing them share an owner
// whatever follows, as every prompt of the Mooncake conversation trace does.
func TestCHWBLKeyHead(t *testing.T) {
	rs := peerViews(8)
	p := peerNew(t, "chwbl", nil)
	for k := range 50 {
		head := fmt.Sprintf("%-98dé€", k) // 100 characters, 103 bytes
		want := refOrder(rs, head)[0]
		for _, tail := range []string{"", "x", "€ and more", strings.Repeat("tail ", 100)} {
			req := peerReq(1, "", peerT0)
			req.KeyText = head + tail
			if got, _ := peerPick(t, p, req, rs); got != want {
				t.Fatalf("head %q tail %q: %d, want %d", head, tail, got, want)
			}
		}
	}
}
