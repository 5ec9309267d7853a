package bench

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/internal/report"
	"github.com/kvgate/kvgate/internal/sim"
	"github.com/kvgate/kvgate/internal/workload"
)

// standIn is a gateway stand-in: its /metrics lists four targets (two
// data-parallel ranks of a, then b and c, c out of rotation), and it answers
// every request from a#0, a#1 or b, never from c.
func standIn(t *testing.T) *httptest.Server {
	t.Helper()
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			_, _ = io.WriteString(w, `# HELP kvgate_replica_healthy 1 when the replica is in rotation.
# TYPE kvgate_replica_healthy gauge
kvgate_replica_healthy{replica="http://b:8000"} 1
kvgate_replica_healthy{replica="http://a:8000#0"} 1
kvgate_replica_healthy{replica="http://a:8000#1"} 1
kvgate_replica_healthy{replica="http://c:8000"} 0
go_goroutines 9
`)
			return
		}
		// a#0 takes half the requests, a#1 and b a quarter each.
		switch k := n.Add(1) % 4; k {
		case 0, 1:
			w.Header().Set("X-Kvgate-Replica", "http://a:8000")
			w.Header().Set("X-Kvgate-Rank", "0")
		case 2:
			w.Header().Set("X-Kvgate-Replica", "http://a:8000")
			w.Header().Set("X-Kvgate-Rank", "1")
		default:
			w.Header().Set("X-Kvgate-Replica", "http://b:8000")
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"a"}]}`+"\n\n"+
			`data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}`+"\n\ndata: [DONE]\n\n")
	}))
	t.Cleanup(srv.Close)
	return srv
}

func TestTargets(t *testing.T) {
	srv := standIn(t)
	all, down, err := Targets(context.Background(), srv.Client(), srv.URL+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"http://a:8000#0", "http://a:8000#1", "http://b:8000", "http://c:8000"}
	if !slices.Equal(all, want) || !slices.Equal(down, []string{"http://c:8000"}) {
		t.Fatalf("targets %v, down %v", all, down)
	}

	// Not a kvgate gateway: no targets, no error.
	plain := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "vllm:num_requests_running 0\n")
	}))
	defer plain.Close()
	if all, _, err := Targets(context.Background(), plain.Client(), plain.URL, nil); all != nil || err != nil {
		t.Errorf("vLLM-like target: %v, %v", all, err)
	}
}

// A target that gets no request counts in the imbalance: 12 requests,
// 6 to a#0, 3 to a#1, 3 to b, none to c. Over the four targets the busiest
// share is 1/2 against a mean of 1/4 (imbalance 2); over the three that
// answered, it would read 1.5.
func TestTargetImbalanceCountsSilentReplicas(t *testing.T) {
	srv := standIn(t)
	reqs := generate(t, "random", map[string]float64{"input_len": 8, "output_len": 1})[:12]
	for i := range reqs {
		reqs[i].Prev, reqs[i].At = -1, 0
	}
	targets, _, err := Targets(context.Background(), srv.Client(), srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	recs, wall, err := Run(context.Background(), Config{Target: srv.URL, Model: "m", Concurrency: 1, Replicas: targets}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	run := report.Summarize("target", recs, len(targets), wall)
	if run.Errors != 0 || len(run.ReplicaShare) != 4 || run.ReplicaShare[3] != 0 || run.Imbalance != 2 {
		t.Fatalf("errors %d, shares %v, imbalance %v", run.Errors, run.ReplicaShare, run.Imbalance)
	}
	// Without the list, only the targets that answered are known.
	recs, wall, _ = Run(context.Background(), Config{Target: srv.URL, Model: "m", Concurrency: 1}, reqs)
	if got := report.Summarize("target", recs, 0, wall).Imbalance; got != 1.5 {
		t.Errorf("imbalance over the answering targets %v, want 1.5", got)
	}
}

// A response from a target the list lacks (added to the gateway during the
// run) gets the next index, not none.
func TestReplicaIndexBeyondTheList(t *testing.T) {
	r := &runner{cfg: Config{Replicas: []string{"x", "y"}}}
	for _, tc := range []struct {
		name string
		want int
	}{{"y", 1}, {"z", 2}, {"x", 0}, {"w", 3}, {"z", 2}, {"", -1}} {
		if got := r.replicaIndex(tc.name); got != tc.want {
			t.Errorf("%q: %d, want %d", tc.name, got, tc.want)
		}
	}
}

// The real gateway's series names its targets as the responses do: a
// data-parallel server's ranks as URL#k.
func TestTargetsOfAGateway(t *testing.T) {
	e := embedded(2)
	simCfg := e.Sim
	simCfg.DataParallelSize = 2
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fl, err := sim.Start(ctx, simCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer fl.Close()
	target, stop, err := startGateway(ctx, e.Gateway, "round_robin", fl.URLs(), e.Sim, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	client := NewClient()
	defer client.CloseIdleConnections()
	all, down, err := Targets(ctx, client, target, nil)
	if err != nil {
		t.Fatal(err)
	}
	want := slices.Sorted(slices.Values(targetNames(fl.URLs(), 2)))
	if !slices.Equal(all, want) || len(down) != 0 {
		t.Fatalf("targets %v (down %v), want %v", all, down, want)
	}
}

// PolicyCounts sums kvgate_requests_total by policy; RoutedBy names those
// that grew over a run (several with pools), and none for a page without
// the series.
func TestPolicyCountsAndRoutedBy(t *testing.T) {
	var page atomic.Value
	page.Store("go_goroutines 9\n")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, page.Load().(string))
	}))
	defer srv.Close()
	ctx := context.Background()
	none, err := PolicyCounts(ctx, nil, srv.URL, nil)
	if err != nil || none != nil {
		t.Fatalf("no series: %v %v", none, err)
	}
	page.Store(`kvgate_requests_total{code="200",policy="ttft",replica="http://a"} 3
kvgate_requests_total{code="503",policy="ttft",replica="http://b"} 1
kvgate_requests_total{code="200",policy="sglang",replica="http://c"} 5
`)
	before, err := PolicyCounts(ctx, nil, srv.URL, nil)
	if err != nil || before["ttft"] != 4 || before["sglang"] != 5 {
		t.Fatalf("counts %v %v", before, err)
	}
	page.Store(`kvgate_requests_total{code="200",policy="ttft",replica="http://a"} 9
kvgate_requests_total{code="200",policy="sglang",replica="http://c"} 5
kvgate_requests_total{code="200",policy="llmd",replica="http://d"} 2
`)
	after, _ := PolicyCounts(ctx, nil, srv.URL, nil)
	for _, tc := range []struct {
		before, after map[string]float64
		want          string
	}{{before, after, "llmd+ttft"}, {nil, before, "sglang+ttft"}, {after, after, ""}, {nil, nil, ""}} {
		if got := RoutedBy(tc.before, tc.after); got != tc.want {
			t.Errorf("RoutedBy(%v, %v) = %q, want %q", tc.before, tc.after, got, tc.want)
		}
	}
	if _, err := PolicyCounts(ctx, nil, "http://127.0.0.1:1", nil); err == nil {
		t.Error("a closed port: no error")
	}
}

// Tenants: each request goes with its tenant's key, its priority in the
// body (none when 0) and its deadline in wall milliseconds; each record
// names its tenant and priority.
func TestRunTenantKeys(t *testing.T) {
	type seen struct{ auth, deadline, priority string }
	got := make(chan seen, 4)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Priority json.RawMessage `json:"priority"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		got <- seen{r.Header.Get("Authorization"), r.Header.Get(headerDeadline), string(body.Priority)}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"a"}]}`+"\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()
	reqs := []workload.Request{
		{Index: 0, Prev: -1, InputTokens: 4, MaxTokens: 1, Tenant: "A", Priority: 2, Deadline: 4 * time.Second},
		{Index: 1, Prev: -1, InputTokens: 4, MaxTokens: 1, Tenant: "B"},
	}
	recs, _, err := Run(context.Background(), Config{Target: srv.URL, Model: "m", Concurrency: 1, TimeScale: 2,
		Keys: map[string]string{"A": "ka"}, SendPriority: true}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	want := []seen{{"Bearer ka", "2000", "2"}, {"", "", ""}}
	for i := range want {
		if s := <-got; s != want[i] {
			t.Errorf("request %d: %+v, want %+v", i, s, want[i])
		}
	}
	if recs[0].Tenant != "A" || recs[0].Priority != 2 || recs[1].Tenant != "B" || recs[1].Err {
		t.Errorf("records %+v", recs)
	}
}
