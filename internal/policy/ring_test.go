package policy

import (
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/cespare/xxhash/v2"
)

// refOrder is the ring written out plainly: every replica's 256 points
// xxhash64("url#v"), sorted; the positions of the distinct replicas met
// walking clockwise from xxhash64(key).
func refOrder(rs []ReplicaView, key string) []int {
	type pt struct {
		h   uint64
		pos int
	}
	var pts []pt
	for i, r := range rs {
		for v := range 256 {
			pts = append(pts, pt{xxhash.Sum64String(r.URL + "#" + strconv.Itoa(v)), i})
		}
	}
	sort.Slice(pts, func(a, b int) bool { return pts[a].h < pts[b].h })
	h := xxhash.Sum64String(key)
	start := sort.Search(len(pts), func(i int) bool { return pts[i].h >= h })
	var order []int
	seen := map[int]bool{}
	for k := range pts {
		p := pts[(start+k)%len(pts)].pos
		if !seen[p] {
			seen[p] = true
			order = append(order, p)
		}
	}
	return order
}

// TestCHWBLSpillsPastItsBound: the key's ring owner takes the request while
// its load ≤ (total + 1)/n × 1.25; past it, the first successor clockwise
// within the bound does.
func TestCHWBLSpillsPastItsBound(t *testing.T) {
	rs4 := peerViews(4)
	key := strings.Repeat("k", 100) // the key: the first 100 characters
	o := refOrder(rs4, key)
	rs2 := peerViews(2)
	o2 := refOrder(rs2, key)
	cases := []struct {
		name  string
		rs    []ReplicaView
		loads map[int]int // position → load
		down  []int
		want  int
	}{
		{"idle: the owner", rs4, nil, nil, o[0]},
		// total 1: bound 2/4×1.25 = 0.625 < 1.
		{"owner at 1 of total 1: spills", rs4, map[int]int{o[0]: 1}, nil, o[1]},
		// total 3: bound 4/4×1.25 = 1.25: owner 2 over, successor 1 within.
		{"successor within", rs4, map[int]int{o[0]: 2, o[1]: 1}, nil, o[1]},
		// total 6: bound 7/4×1.25 = 2.1875: owner and successor over.
		{"spills two steps", rs4, map[int]int{o[0]: 3, o[1]: 3}, nil, o[2]},
		// total 7: bound 8/2×1.25 = 5: load 5 ≤ 5 stays.
		{"load equal to the bound stays", rs2, map[int]int{o2[0]: 5, o2[1]: 2}, nil, o2[0]},
		// total 6: bound 7/2×1.25 = 4.375.
		{"just over the bound spills", rs2, map[int]int{o2[0]: 5, o2[1]: 1}, nil, o2[1]},
		{"owner down: the successor", rs4, nil, []int{o[0]}, o[1]},
		// Unhealthy loads do not count: healthy total 2, bound 3/3×1.25 = 1.25
		// (counting the unhealthy one: 53/4×1.25, and the owner would stay).
		{"unhealthy load ignored", rs4, map[int]int{o[0]: 2, o[3]: 50}, []int{o[3]}, o[1]},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			rs := append([]ReplicaView(nil), c.rs...)
			for pos, l := range c.loads {
				rs[pos].InFlight = l
			}
			for _, pos := range c.down {
				rs[pos].Healthy = false
			}
			p := peerNew(t, "chwbl", map[string]any{"count_request": false}) // the textbook bound
			req := peerReq(1, "", peerT0)
			req.KeyText = key + " and then the rest of the first user message"
			if got, d := peerPick(t, p, req, rs); got != c.want {
				t.Fatalf("picked %d (%s), want %d (ring order %v)", got, d.Reason, c.want, o)
			}
		})
	}
}

// TestCHWBLKey: the first 100 characters of KeyText plus the adapter.
func TestCHWBLKey(t *testing.T) {
	rs := peerViews(8)
	p := peerNew(t, "chwbl", nil)
	moved := 0
	for k := range 200 {
		head := fmt.Sprintf("%-100d", k) // 100 characters
		want := refOrder(rs, head+"lora-a")[0]
		req := peerReq(1, "", peerT0)
		req.KeyText, req.Adapter = head+fmt.Sprint(k*7919), "lora-a"
		if got, _ := peerPick(t, p, req, rs); got != want {
			t.Fatalf("key %q: %d, want %d", head, got, want)
		}
		req.Adapter = "lora-b"
		if got, _ := peerPick(t, p, req, rs); got != want {
			moved++
		}
	}
	if moved < 100 { // 7 of 8 keys move to another owner, in expectation
		t.Errorf("the adapter moved only %d of 200 keys", moved)
	}
}

// TestSession: a session key keeps its replica whatever the loads; a
// replica going down moves only its own sessions, to their successors;
// no key: least loaded.
func TestSession(t *testing.T) {
	rs := peerViews(5)
	p := peerNew(t, "session", nil)
	for k := range 100 {
		sess := "user-" + strconv.Itoa(k)
		o := refOrder(rs, sess)
		req := peerReq(1, "x", peerT0)
		req.Session = sess
		rs[o[0]].InFlight = 1000
		if got, _ := peerPick(t, p, req, rs); got != o[0] {
			t.Fatalf("%s: %d, want its owner %d", sess, got, o[0])
		}
		rs[o[0]].InFlight = 0
		rs[2].Healthy = false
		want := o[0]
		if want == 2 {
			want = o[1]
		}
		if got, _ := peerPick(t, p, req, rs); got != want {
			t.Fatalf("%s with replica 2 down: %d, want %d", sess, got, want)
		}
		rs[2].Healthy = true
	}
	for i := range rs {
		rs[i].InFlight = 3
	}
	rs[3].InFlight = 1
	if got, d := peerPick(t, p, peerReq(1, "x", peerT0), rs); got != 3 {
		t.Fatalf("no session key: %d (%s), want the least loaded 3", got, d.Reason)
	}
}

// TestSessionRingFollowsReplicas: the ring is rebuilt when the replica list
// changes, and only the new replica's keys move to it.
func TestSessionRingFollowsReplicas(t *testing.T) {
	p := peerNew(t, "session", nil)
	rs4, rs5 := peerViews(4), peerViews(5)
	moved := 0
	for k := range 300 {
		req := peerReq(1, "x", peerT0)
		req.Session = "s" + strconv.Itoa(k)
		a, _ := peerPick(t, p, req, rs4)
		b, _ := peerPick(t, p, req, rs5)
		if a != b {
			if b != 4 {
				t.Fatalf("%s moved from %d to %d, not to the new replica", req.Session, a, b)
			}
			moved++
		}
		if b != refOrder(rs5, req.Session)[0] {
			t.Fatalf("%s: %d, want %d", req.Session, b, refOrder(rs5, req.Session)[0])
		}
	}
	if moved < 30 || moved > 90 { // about 1/5 of 300
		t.Errorf("%d of 300 sessions moved to the new replica, want about 60", moved)
	}
}

func TestPrefixKey(t *testing.T) {
	rs := peerViews(6)
	head := "Translate to French:" // 20 characters
	cases := []struct {
		name         string
		params       map[string]any
		text, system string
		key          string
	}{
		{"first 20 characters", nil, head + " good morning", "", head},
		{"first 20 characters, multi-byte", nil, "ÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉ and more", "", "ÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉÉ"},
		{"short prompt: all of it", nil, "hi", "", "hi"},
		{"prefix_chars 5", map[string]any{"prefix_chars": 5}, head, "", "Trans"},
		{"system ignored by default", nil, head + "...", "You are terse.", head},
		{"key system", map[string]any{"key": "system"}, head + "...", "You are terse.", "You are terse."},
		{"key system, none: the prompt", map[string]any{"key": "system"}, head + "...", "", head},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p := peerNew(t, "prefix_key", c.params)
			req := peerReq(1, c.text, peerT0)
			req.System = c.system
			if got, want := func() int { g, _ := peerPick(t, p, req, rs); return g }(), refOrder(rs, c.key)[0]; got != want {
				t.Fatalf("%d, want %d (owner of %q)", got, want, c.key)
			}
		})
	}
	// Different heads spread over the replicas.
	p := peerNew(t, "prefix_key", nil)
	seen := map[int]bool{}
	for k := range 60 {
		pos, _ := peerPick(t, p, peerReq(1, fmt.Sprintf("%-20d tail", k), peerT0), rs)
		seen[pos] = true
	}
	if len(seen) != len(rs) {
		t.Errorf("60 heads reached %d of %d replicas", len(seen), len(rs))
	}
}

// TestRingPointsOrder: a ring's points are sorted by hash, and points of
// equal hash (forced here) by position, whatever order they were built in.
func TestRingPointsOrder(t *testing.T) {
	rs := peerViews(16)
	r := buildRing(rs, defaultVNodes)
	if len(r.points) != 16*defaultVNodes || !slices.IsSortedFunc(r.points, comparePoints) {
		t.Fatalf("%d points, sorted %v", len(r.points), slices.IsSortedFunc(r.points, comparePoints))
	}
	pts := []ringPoint{{7, 3}, {5, 2}, {7, 1}, {5, 9}, {7, 2}}
	slices.SortFunc(pts, comparePoints)
	want := []ringPoint{{5, 2}, {5, 9}, {7, 1}, {7, 2}, {7, 3}}
	if !slices.Equal(pts, want) {
		t.Fatalf("sorted %v, want %v", pts, want)
	}
}
