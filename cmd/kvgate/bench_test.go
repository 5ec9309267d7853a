package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvgate/kvgate/internal/report"
)

// parsed returns verb name's flags struct after parsing args, and the
// invocation its run would get.
func parsed(t *testing.T, name string, args ...string) (command, invocation) {
	t.Helper()
	for _, v := range verbs() {
		if v.name != name {
			continue
		}
		fs := newFlags(name, v.synopsis, &bytes.Buffer{})
		c := v.flags()
		c.register(fs)
		if err := parseFlags(fs, args); err != nil {
			t.Fatalf("kvgate %s %s: %v", name, strings.Join(args, " "), err)
		}
		inv := invocation{verb: name, args: args, set: map[string]bool{}}
		fs.Visit(func(f *flag.Flag) { inv.set[f.Name] = true })
		return c, inv
	}
	t.Fatalf("no verb %q", name)
	return nil, invocation{}
}

// The README says what `kvgate demo` runs: keep it true.
func TestDemoIsBench(t *testing.T) {
	d, dinv := parsed(t, "demo")
	demo, err := d.(*demoFlags).config(dinv, "kvgate demo")
	if err != nil {
		t.Fatal(err)
	}
	readme := strings.Fields("--embedded --rate 6 --time-scale 5 --max-duration 5m --report kvgate-demo-report")
	b, binv := parsed(t, "bench", readme...)
	bench, err := b.(*benchFlags).config(binv, "kvgate demo")
	if err != nil {
		t.Fatal(err)
	}
	demo.meta["command"], bench.meta["command"] = nil, nil
	if !reflect.DeepEqual(demo, bench) {
		t.Errorf("kvgate demo is not kvgate bench %s:\ndemo  %+v\nbench %+v", strings.Join(readme, " "), demo, bench)
	}
}

func TestBenchPolicyParams(t *testing.T) {
	b, inv := parsed(t, "bench", "--embedded", "--policies", "sglang,ttft", "--requests", "4",
		"--policy-param", "sglang.cache_threshold=0.3", "--policy-param", "ttft.margin_ms=5", "--policy-param", "ttft.margin_ms=7")
	c, err := b.(*benchFlags).config(inv, "t")
	if err != nil {
		t.Fatal(err)
	}
	for pol, want := range map[string]map[string]any{"sglang": {"cache_threshold": 0.3}, "ttft": {"margin_ms": 7.0}} {
		if got := c.params.of(pol); !reflect.DeepEqual(got, want) {
			t.Errorf("%s's parameters %v, want %v", pol, got, want)
		}
	}
	b, inv = parsed(t, "bench", "--embedded", "--policies", "ttft", "--policy-param", "margin_ms=5", "--policy-param", "ttft.margin_ms=7")
	if c, err = b.(*benchFlags).config(inv, "t"); err != nil {
		t.Fatal(err)
	}
	if got := c.params.of("ttft")["margin_ms"]; got != 7.0 {
		t.Errorf("ttft.margin_ms=7 after margin_ms=5: %v, want the scoped 7", got)
	}
}

func TestBenchUsageErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string // in stderr
	}{
		{"neither target nor embedded", nil, "give exactly one of --target URL and --embedded"},
		{"param with target", []string{"--target", "http://127.0.0.1:1", "--policy-param", "margin_ms=1"}, "--policy-param needs --embedded"},
		{"param not name=value", []string{"--embedded", "--policy-param", "margin_ms"}, "want name=value"},
		{"param of an absent policy", []string{"--embedded", "--policies", "ttft", "--policy-param", "sglang.cache_threshold=1"}, "not in --policies"},
		{"param a policy rejects", []string{"--embedded", "--policies", "round_robin,ttft", "--policy-param", "margin_ms=1"}, "margin_ms"},
		{"unknown policy", []string{"--embedded", "--policies", "ttft,nope"}, "unknown policy \"nope\""},
		{"unknown workload param", []string{"--embedded", "--workload-param", "bogus=1"}, "bogus"},
		{"prefill without decode", []string{"--embedded", "--prefill-replicas", "2"}, "needs both"},
		{"negative non-cached tokens", []string{"--embedded", "--non-cached-tokens", "-1"}, "must be ≥ 0"},
		{"tenant beside rate", []string{"--embedded", "--tenant", "name=A,rate=1", "--rate", "3"}, "drop --rate"},
		{"closed-loop tenant", []string{"--embedded", "--tenant", "name=A,concurrency=4"}, "open loop"},
		{"flow with target", []string{"--target", "http://127.0.0.1:1", "--tenant", "name=A,rate=1,key=k", "--flow"}, "--flow describes the --embedded fleet"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, _, errs := runCmd(t, "", append([]string{"bench"}, tc.args...)...)
			if code != 2 || !strings.Contains(errs, tc.want) {
				t.Errorf("exit %d, stderr %q; want exit 2 and %q", code, errs, tc.want)
			}
		})
	}
}

// With --target the result describes the target, not bench's embedded
// fleet: no replica count, profile, KV blocks or time scale of its own.
func TestBenchTargetMeta(t *testing.T) {
	b, inv := parsed(t, "bench", "--target", "http://127.0.0.1:1", "--requests", "4", "--rate", "5")
	c, err := b.(*benchFlags).config(inv, "t")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"replicas", "profile", "kv_blocks", "time_scale", "data_parallel_size", "concurrency"} {
		if v, ok := c.meta[k]; ok {
			t.Errorf("--target meta has %s = %v", k, v)
		}
	}
	for k, want := range map[string]any{"target": "http://127.0.0.1:1", "requests": 4, "rate": 5.0, "seed": uint64(1)} {
		if got := c.meta[k]; got != want {
			t.Errorf("meta %s = %v (%T), want %v", k, got, got, want)
		}
	}
	// A time scale the user gives applies: the latencies were scaled by it.
	b, inv = parsed(t, "bench", "--target", "http://127.0.0.1:1", "--time-scale", "20")
	if c, err = b.(*benchFlags).config(inv, "t"); err != nil || c.meta["time_scale"] != 20.0 || c.meta["concurrency"] != 16 {
		t.Errorf("meta %v, %v", c.meta, err)
	}
	// --embedded records its fleet.
	b, inv = parsed(t, "bench", "--embedded", "--replicas", "3")
	if c, err = b.(*benchFlags).config(inv, "t"); err != nil {
		t.Fatal(err)
	}
	for k, want := range map[string]any{"replicas": 3, "profile": "llama3-8b-h100", "kv_blocks": 30000, "time_scale": 20.0} {
		if got := c.meta[k]; got != want {
			t.Errorf("--embedded meta %s = %v, want %v", k, got, want)
		}
	}
	if _, ok := c.meta["target"]; ok {
		t.Error("--embedded meta names a target")
	}
}

func TestBenchTargetRejectsFleetFlags(t *testing.T) {
	for _, flag := range [][]string{{"--replicas", "8"}, {"--profile", "llama3-8b-h100"}, {"--kv-blocks", "10"},
		{"--data-parallel-size", "2"}, {"--policies", "ttft"}} {
		code, _, errs := runCmd(t, "", append([]string{"bench", "--target", "http://127.0.0.1:1"}, flag...)...)
		if code != 2 || !strings.Contains(errs, flag[0]+" describes the --embedded fleet") {
			t.Errorf("%v: exit %d, stderr %q", flag, code, errs)
		}
	}
}

// bench --target reads the gateway's targets before the run: the report
// and the JSON name them, and one that got nothing counts in the imbalance.
// A prefill/decode fleet in-process: the simulated replicas get their
// roles, the gateway routes both steps, and the shares are the decode
// replicas'.
func TestBenchEmbeddedPD(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pd.json")
	code, _, stderr := runCmd(t, "", "bench", "--embedded", "--prefill-replicas", "1", "--decode-replicas", "2",
		"--workload", "multiturn", "--workload-param", "conversations=4", "--workload-param", "turns=2",
		"--workload-param", "output_len=4", "--requests", "8", "--rate", "20", "--policies", "ttft", "--json", path)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	res := readResult(t, path)
	for k, want := range map[string]any{"replicas": 0.0, "prefill_replicas": 1.0, "decode_replicas": 2.0} {
		if got := res.Meta[k]; got != want {
			t.Errorf("meta %s = %v, want %v", k, got, want)
		}
	}
	r := res.Runs[0]
	if r.Errors != 0 || r.Requests != 8 || len(r.ReplicaShare) != 2 {
		t.Errorf("run: %d requests, %d errors, shares %v", r.Requests, r.Errors, r.ReplicaShare)
	}
	// The live stream's longest gaps are measured (4 tokens an answer).
	if d := r.ITLMaxms; d == nil || d.P50 <= 0 || d.P99 > r.E2Ems.P99 {
		t.Errorf("itl_max_ms %+v (e2e p99 %.1f ms)", d, r.E2Ems.P99)
	}
}

func TestBenchTargetRun(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			// Replicas nothing listens on (bench reads their /metrics: loopback only).
			_, _ = io.WriteString(w, "kvgate_replica_healthy{replica=\"http://127.0.0.1:1\"} 1\nkvgate_replica_healthy{replica=\"http://127.0.0.2:1\"} 1\n")
			return
		}
		w.Header().Set("X-Kvgate-Replica", "http://127.0.0.1:1")
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"a"}]}`+"\n\n"+
			`data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}`+"\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()
	dir := t.TempDir()
	path := filepath.Join(dir, "r.json")
	code, stdout, stderr := runCmd(t, "", "bench", "--target", srv.URL, "--workload", "random", "--requests", "6",
		"--workload-param", "input_len=16", "--workload-param", "output_len=1", "--json", path, "--report", filepath.Join(dir, "report"))
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	res := readResult(t, path)
	r := res.Runs[0]
	if r.Errors != 0 || len(r.ReplicaShare) != 2 || r.Imbalance != 2 {
		t.Errorf("run: errors %d, shares %v, imbalance %v", r.Errors, r.ReplicaShare, r.Imbalance)
	}
	if res.Meta["replicas"] != 2.0 || fmt.Sprint(res.Meta["targets"]) != "[http://127.0.0.1:1 http://127.0.0.2:1]" {
		t.Errorf("meta %v", res.Meta)
	}
	// The replicas' histograms cannot be read: no split, and it says so.
	if r.Split != nil || !strings.Contains(stderr, "no split of the time into the engines' and the rest") ||
		!strings.HasPrefix(fmt.Sprint(res.Meta["engine_split"]), "unavailable: no replica's /metrics could be read") {
		t.Errorf("split %+v, meta engine_split %v, stderr:\n%s", r.Split, res.Meta["engine_split"], stderr)
	}
	// One run: nothing to compare, no verdict.
	if strings.Contains(stdout, "verdict") {
		t.Errorf("a verdict on one run:\n%s", stdout)
	}
	page, err := os.ReadFile(filepath.Join(dir, "report", "index.html"))
	if err != nil {
		t.Fatal(err)
	}
	for _, absent := range []string{"<dt>profile</dt>", "<dt>kv_blocks</dt>", "<dt>time_scale</dt>"} {
		if strings.Contains(string(page), absent) {
			t.Errorf("the report's run description has %s", absent)
		}
	}
	if !strings.Contains(string(page), "<dt>targets</dt>") {
		t.Error("the report does not list the targets")
	}
}

// bench --target at an engine that exports vLLM's histograms (here the
// target itself: it lists no replicas) splits the run's TTFT and ITL into
// the engine's means over the run and the rest.
func TestBenchTargetEngineSplit(t *testing.T) {
	var served atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			// A first token of 20 ms and two gaps of 2 ms per request served.
			n := served.Load()
			fmt.Fprintf(w, "# TYPE vllm:time_to_first_token_seconds histogram\n"+
				"vllm:time_to_first_token_seconds_bucket{le=\"0.05\"} %d\nvllm:time_to_first_token_seconds_bucket{le=\"+Inf\"} %d\n"+
				"vllm:time_to_first_token_seconds_sum %g\nvllm:time_to_first_token_seconds_count %d\n"+
				"# TYPE vllm:inter_token_latency_seconds histogram\n"+
				"vllm:inter_token_latency_seconds_bucket{le=\"0.01\"} %d\nvllm:inter_token_latency_seconds_bucket{le=\"+Inf\"} %d\n"+
				"vllm:inter_token_latency_seconds_sum %g\nvllm:inter_token_latency_seconds_count %d\n",
				n, n, 0.02*float64(n), n, 2*n, 2*n, 0.002*float64(2*n), 2*n)
			return
		}
		served.Add(1)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, `data: {"choices":[{"index":0,"text":"a"}]}`+"\n\n"+`data: {"choices":[{"index":0,"text":"b"}]}`+"\n\n"+
			`data: {"choices":[{"index":0,"text":"c"}]}`+"\n\n"+
			`data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}`+"\n\ndata: [DONE]\n\n")
	}))
	defer srv.Close()
	path := filepath.Join(t.TempDir(), "r.json")
	code, stdout, stderr := runCmd(t, "", "bench", "--target", srv.URL, "--workload", "random", "--requests", "6",
		"--workload-param", "input_len=16", "--workload-param", "output_len=3", "--json", path)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	r := readResult(t, path).Runs[0]
	sp := r.Split
	if sp == nil || sp.Source != report.SplitEngineMetrics || sp.Requests != 6 || math.Abs(sp.EngineTTFTms.Mean-20) > 1e-9 ||
		math.Abs(sp.EngineITLms.Mean-2) > 1e-9 || math.Abs(sp.OutsideTTFTMeanms-(r.TTFTms.Mean-20)) > 1e-9 {
		t.Fatalf("split %+v (client TTFT mean %v)", sp, r.TTFTms.Mean)
	}
	if !strings.Contains(stdout, "outside ttft ms") || !strings.Contains(stdout, "the replicas' vLLM histograms") {
		t.Errorf("the table does not show the split:\n%s", stdout)
	}
}

// Several tenants in-process: with --flow the gateway has them configured
// (keys, priorities), each request goes with its tenant's key and the
// result is summarised per tenant and per priority, in the table too.
func TestBenchEmbeddedTenants(t *testing.T) {
	path := filepath.Join(t.TempDir(), "tenants.json")
	code, stdout, stderr := runCmd(t, "", "bench", "--embedded", "--replicas", "2", "--policies", "ttft", "--flow",
		"--tenant", "name=A,rate=40,requests=12,input_len=200,output_len=4",
		"--tenant", "name=B,rate=10,requests=4,input_len=200,output_len=4,priority=1", "--json", path)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	r := readResult(t, path).Runs[0]
	a, b := r.Tenants["A"], r.Tenants["B"]
	if r.Errors != 0 || a.Requests != 12 || b.Requests != 4 || r.Priorities["1"].Requests != 4 {
		t.Fatalf("run: %d errors, tenants %+v, priorities %+v", r.Errors, r.Tenants, r.Priorities)
	}
	for _, want := range []string{"ttft tenant A: 12 requests", "ttft tenant B: 4 requests", "ttft priority 1: 4 requests"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout)
		}
	}
}

// A workload that times its own arrivals (agents, rl, a trace) runs as an
// open loop: a closed loop of --concurrency clients held 100 agent
// programs' due turns back and doubled their makespans against the
// replay's. The others stay a closed loop unless --rate is given.
func TestBenchTimedWorkloadsRunOpen(t *testing.T) {
	trace := filepath.Join(t.TempDir(), "t.jsonl")
	if err := os.WriteFile(trace, []byte(`{"timestamp": 0, "input_length": 64, "output_length": 4, "hash_ids": [1]}`+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		args []string
		open bool
	}{
		{[]string{"--workload", "agents", "--workload-param", "programs=2"}, true},
		{[]string{"--workload", "rl", "--workload-param", "batches=1"}, true},
		{[]string{"--workload", "trace:" + trace}, true},
		{[]string{"--workload", "multiturn", "--requests", "4"}, false},
		{[]string{"--workload", "multiturn", "--requests", "4", "--rate", "2"}, true},
	} {
		b, inv := parsed(t, "bench", append([]string{"--embedded", "--policies", "ttft"}, c.args...)...)
		cfg, err := b.(*benchFlags).config(inv, "t")
		if err != nil {
			t.Fatalf("%v: %v", c.args, err)
		}
		if open := cfg.load.Concurrency == 0; open != c.open {
			t.Errorf("%v: concurrency %d (open loop %v), want open %v", c.args, cfg.load.Concurrency, open, c.open)
		}
		if _, closed := cfg.meta["concurrency"]; closed == c.open {
			t.Errorf("%v: meta %v names a concurrency on an open loop or none on a closed one", c.args, cfg.meta)
		}
	}
}
