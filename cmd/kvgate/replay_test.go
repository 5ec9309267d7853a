package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/internal/report"
)

// tinyWorkload replays in milliseconds: 16 requests in 4 groups.
var tinyWorkload = []string{
	"--workload", "shared_prefix",
	"--workload-param", "groups=4", "--workload-param", "prompts_per_group=4",
	"--workload-param", "system_prompt_len=256", "--workload-param", "question_len=32",
	"--workload-param", "output_len=8", "--replicas", "2",
}

func replayArgs(extra ...string) []string {
	return append(append([]string{"replay"}, tinyWorkload...), extra...)
}

func TestReplayUsageErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		code int
		want string // in stderr
	}{
		{"nothing to replay", []string{"replay"}, 2, "give --trace FILE, --workload NAME or --tenant SPEC"},
		{"both sources", []string{"replay", "--trace", "x.jsonl", "--workload", "random"}, 2, "not both"},
		{"missing trace", []string{"replay", "--trace", "/nonexistent/trace.jsonl"}, 1, "no such file"},
		{"unknown policy", replayArgs("--policies", "ttft,nope"), 2, "unknown policy \"nope\" (known: all, chwbl"},
		{"bad duration", replayArgs("--staleness", "5"), 2, "invalid value \"5\" for flag -staleness"},
		{"negative staleness", replayArgs("--staleness", "-1s"), 2, "--staleness -1s"},
		{"zero replicas", replayArgs("--replicas", "0"), 2, "--replicas 0"},
		{"unknown workload", []string{"replay", "--workload", "nope"}, 2, "multiturn"},
		{"unknown workload param", replayArgs("--workload-param", "bogus=1"), 2, "bogus"},
		{"unknown question", replayArgs("--question", "why"), 2, "--question \"why\""},
		{"slo without capacity", replayArgs("--slo-ttft-p90", "1s"), 2, "needs --capacity"},
		{"score surface with policies", replayArgs("--question", "score-surface", "--policies", "ttft"), 2, "drop --policies"},
		{"sharing on a random workload", []string{"replay", "--workload", "random", "--question", "sharing"}, 2, "shared_prefix"},
		{"stray argument", replayArgs("extra"), 2, "unexpected argument"},
		{"unknown policy param", replayArgs("--policies", "score", "--policy-param", "nope=1"), 2, "nope"},
		{"policy param for an absent policy", replayArgs("--policies", "ttft", "--policy-param", "score.cache_weight=2"), 2, "not in --policies"},
		{"zero gateways", replayArgs("--gateways", "0"), 2, "--gateways 0"},
		{"too many gateways", replayArgs("--gateways", "65"), 2, "--gateways 65"},
		{"unknown gateway sync", replayArgs("--gateways", "2", "--gateway-sync", "redis"), 2, "--gateway-sync \"redis\""},
		{"negative sync delay", replayArgs("--gateways", "2", "--sync-delay", "-1ms"), 2, "--sync-delay -1ms"},
		{"unknown sync loads", replayArgs("--gateways", "2", "--sync-loads", "never"), 2, "--sync-loads \"never\""},
		{"prefill without decode", replayArgs("--prefill-replicas", "2"), 2, "needs both"},
		{"decode without prefill", replayArgs("--decode-replicas", "2"), 2, "needs both"},
		{"negative non-cached tokens", replayArgs("--non-cached-tokens", "-1"), 2, "--non-cached-tokens -1"},
		{"itl slo without capacity", replayArgs("--slo-itl-p99", "50ms"), 2, "--slo-itl-p99 needs --capacity"},
		{"zero max seqs", replayArgs("--max-seqs", "0"), 2, "--max-seqs 0"},
		{"negative parallel", replayArgs("--parallel", "-1"), 2, "--parallel -1"},
		{"huge parallel", replayArgs("--parallel", "100000"), 2, "--parallel 100000"},
		{"replica profile past a P/D fleet", append(pdArgs(), "--replica-profile", "4=seed004"), 2, "4 replicas, numbered 0 to 3"},
		{"tenant and workload", replayArgs("--tenant", "name=A,rate=1"), 2, "--tenant makes the workload"},
		{"bad tenant", []string{"replay", "--tenant", "name=A"}, 2, "needs rate= or concurrency="},
		{"closed-loop tenant", []string{"replay", "--tenant", "name=A,concurrency=4"}, 2, "open loop"},
		{"bad flow queue", []string{"replay", "--tenant", "name=A,rate=1", "--flow", "--flow-queue-ms", "0"}, 2, "--flow-queue-ms"},
		{"bad sheddable", []string{"replay", "--tenant", "name=A,rate=1", "--flow", "--flow-sheddable", "x"}, 2, "--flow-sheddable"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			code, _, errs := runCmd(t, "", tc.args...)
			if code != tc.code || !strings.Contains(errs, tc.want) {
				t.Errorf("exit %d, stderr %q; want exit %d and %q", code, errs, tc.code, tc.want)
			}
		})
	}
}

func TestReplayJSONDeterministic(t *testing.T) {
	dir := t.TempDir()
	var outs [2][]byte
	for i := range outs {
		path := filepath.Join(dir, []string{"a.json", "b.json"}[i])
		code, stdout, stderr := runCmd(t, "", replayArgs("--policies", "round_robin,ttft", "--seed", "3", "--json", path)...)
		if code != 0 {
			t.Fatalf("exit %d: %s", code, stderr)
		}
		for _, want := range []string{"policy", "round_robin", "ttft", "hit-rate bounds: prefix reuse"} {
			if !strings.Contains(stdout, want) {
				t.Errorf("stdout lacks %q:\n%s", want, stdout)
			}
		}
		for _, want := range []string{"replay: round_robin", "replay: ttft"} {
			if !strings.Contains(stderr, want) {
				t.Errorf("stderr lacks the progress line %q:\n%s", want, stderr)
			}
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		outs[i] = b
	}
	if !bytes.Equal(outs[0], outs[1]) {
		t.Fatalf("same seed, different JSON:\n%s\n%s", outs[0], outs[1])
	}
	res, err := report.ReadJSON(bytes.NewReader(outs[0]))
	if err != nil {
		t.Fatal(err)
	}
	if res.Bound == nil || len(res.Runs) != 2 || res.Runs[0].Requests != 16 {
		t.Fatalf("result %+v", res)
	}
	if cmd, _ := res.Meta["command"].(string); strings.Contains(cmd, "--json") || !strings.Contains(cmd, "--seed 3") {
		t.Errorf("meta command %q: want the experiment without its output flags", cmd)
	}
}

// A multi-tenant replay reports each tenant and band apart, and its meta
// names the tenants and the flow settings.
func TestReplayTenants(t *testing.T) {
	path := filepath.Join(t.TempDir(), "t.json")
	code, _, stderr := runCmd(t, "", "replay", "--tenant", "name=A,rate=20,requests=40,input_len=200,output_len=8",
		"--tenant", "name=B,rate=5,requests=10,input_len=100,output_len=8,priority=1", "--replicas", "2", "--policies", "ttft",
		"--flow", "--engine-priority", "--json", path)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	res := readResult(t, path)
	run := res.Runs[0]
	if run.Requests != 50 || run.Tenants["A"].Requests != 40 || run.Tenants["B"].Requests != 10 || run.Priorities["1"].Requests != 10 {
		t.Fatalf("tenants %+v priorities %+v", run.Tenants, run.Priorities)
	}
	if _, ok := res.Meta["flow"]; !ok || res.Meta["engine_priority"] != true {
		t.Fatalf("meta %v", res.Meta)
	}
}

func TestReplayPolicyParams(t *testing.T) {
	// score with load_weight 0 routes on the cache alone: each group's
	// prompts stay on one replica, so it hits more than the 1:1 default.
	hit := func(extra ...string) float64 {
		path := filepath.Join(t.TempDir(), "r.json")
		code, _, stderr := runCmd(t, "", replayArgs(append([]string{"--policies", "score,round_robin", "--json", path}, extra...)...)...)
		if code != 0 {
			t.Fatalf("exit %d: %s", code, stderr)
		}
		res := readResult(t, path)
		return res.Runs[0].HitRate
	}
	def, cacheOnly := hit(), hit("--policy-param", "score.load_weight=0")
	if cacheOnly <= def {
		t.Errorf("score with load_weight=0 hit %.3f, with the default %.3f", cacheOnly, def)
	}
}

func TestReplayCapacityAndTrace(t *testing.T) {
	dir := t.TempDir()
	trace := filepath.Join(dir, "t.jsonl")
	lines := `{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]}
{"timestamp": 100, "input_length": 900, "output_length": 5, "hash_ids": [1, 3]}
{"timestamp": 250, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
`
	if err := os.WriteFile(trace, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "c.json")
	code, _, stderr := runCmd(t, "", "replay", "--trace", trace, "--replicas", "2", "--policies", "ttft",
		"--capacity", "--slo-ttft-p90", "500ms", "--json", path)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	res := readResult(t, path)
	r := res.Runs[0]
	if r.Requests != 3 || r.CapacitySpeedup == nil || *r.CapacitySpeedup <= 1 {
		t.Fatalf("run %+v", r)
	}
	if res.Meta["trace"] != "t.jsonl" {
		t.Errorf("meta %v", res.Meta)
	}
}

// A replay too short to load the fleet (16 requests) meets the SLO at the
// capacity search's upper limit with every policy: the table, the JSON,
// the progress lines and the verdict say so, and why.
func TestReplayCapacityCeiling(t *testing.T) {
	path := filepath.Join(t.TempDir(), "c.json")
	code, stdout, stderr := runCmd(t, "", replayArgs("--policies", "ttft,round_robin", "--capacity", "--json", path)...)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{"verdict: none: every policy still meets p90 TTFT ≤ 2s at the capacity search's upper limit",
		"too short or too light", "≥ 4096.00x", "≥: the capacity search reached its upper limit"} {
		if !strings.Contains(stdout, want) {
			t.Errorf("stdout lacks %q:\n%s", want, stdout)
		}
	}
	if !strings.Contains(stderr, "capacity ≥ 4096.00x (the search's upper limit)") {
		t.Errorf("progress: %s", stderr)
	}
	for _, r := range readResult(t, path).Runs {
		if !r.CapacityCeiling {
			t.Errorf("%s: capacity_ceiling false in the JSON", r.Policy)
		}
	}
}

func TestReplayQuestionReport(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "report")
	code, stdout, stderr := runCmd(t, "", replayArgs("--question", "staleness", "--policies", "llmd", "--report", dir)...)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if !strings.Contains(stdout, "llmd staleness=5s") {
		t.Errorf("stdout lacks the 5 s run:\n%s", stdout)
	}
	for _, f := range []string{"index.html", "result.json", "staleness_ttft_p90.svg", "staleness_hit_rate.png"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("report: %v", err)
		}
	}
}

func TestReplayCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var out, errb bytes.Buffer
	if code := run(ctx, replayArgs("--policies", "ttft"), strings.NewReader(""), &out, &errb); code != 1 ||
		!strings.Contains(errb.String(), "context canceled") {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
}

// A question needs no --trace: it replays the default workload.
func TestReplayQuestionDefaultWorkload(t *testing.T) {
	for _, q := range []string{"sharing", "score-surface", "staleness"} {
		t.Run(q, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "q.json")
			args := []string{"replay", "--question", q, "--requests", "16", "--replicas", "2", "--json", path}
			if q != "score-surface" {
				args = append(args, "--policies", "ttft")
			}
			code, _, stderr := runCmd(t, "", args...)
			if code != 0 {
				t.Fatalf("exit %d: %s", code, stderr)
			}
			res := readResult(t, path)
			if w, _ := res.Meta["workload"].(string); !strings.HasPrefix(w, replayDefaultWorkload) || len(res.Runs) == 0 {
				t.Errorf("meta %v, %d runs", res.Meta, len(res.Runs))
			}
		})
	}
}

// readResult reads a result JSON file.
func readResult(t *testing.T, path string) report.Result {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	res, err := report.ReadJSON(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// Every run's JSON says how many gateways routed it; with several, the
// sync mode and delay, and each run its gateways and sync cost.
// pdArgs replays seed 004's conversations on 2 prefill and 2 decode replicas.
func pdArgs(extra ...string) []string {
	return append([]string{"replay", "--workload", "multiturn",
		"--workload-param", "conversations=20", "--workload-param", "turns=5", "--workload-param", "system_prompts=20",
		"--workload-param", "output_len=2", "--workload-param", "think_ms=4000", "--rate", "0.5",
		"--profile", "seed004", "--max-seqs", "1", "--prefill-replicas", "2", "--decode-replicas", "2",
		"--non-cached-tokens", "512"}, extra...)
}

// The README's seed 004 check, from the command line: the meta says the
// fleet, and ttft's follow-up turns skip the prefill step.
func TestReplayPDJSON(t *testing.T) {
	path := filepath.Join(t.TempDir(), "pd.json")
	code, _, stderr := runCmd(t, "", pdArgs("--policies", "ttft,round_robin", "--json", path)...)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	res := readResult(t, path)
	for k, want := range map[string]any{"replicas": 0.0, "prefill_replicas": 2.0, "decode_replicas": 2.0,
		"non_cached_tokens": 512.0, "max_seqs": 1.0} {
		if got := res.Meta[k]; got != want {
			t.Errorf("meta %s = %v, want %v", k, got, want)
		}
	}
	run := res.Runs[0]
	if run.Extra["pd_prefill_steps"] != 20 || run.Extra["pd_skipped_threshold"] != 80 || len(run.ReplicaShare) != 2 {
		t.Errorf("ttft: extra %v, shares %v", run.Extra, run.ReplicaShare)
	}
}

func TestReplayGatewaysJSON(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		args []string
		meta map[string]any
	}{
		{nil, map[string]any{"gateways": 1.0}},
		{[]string{"--gateways", "3", "--sync-delay", "20ms"},
			map[string]any{"gateways": 3.0, "gateway_sync": "shared", "sync_delay": "20ms", "sync_loads": "change"}},
		{[]string{"--gateways", "2", "--gateway-sync", "none"}, map[string]any{"gateways": 2.0, "gateway_sync": "none"}},
	} {
		path := filepath.Join(dir, "g.json")
		code, _, stderr := runCmd(t, "", replayArgs(append([]string{"--policies", "ttft", "--json", path}, tc.args...)...)...)
		if code != 0 {
			t.Fatalf("%v: exit %d: %s", tc.args, code, stderr)
		}
		res := readResult(t, path)
		for k, want := range tc.meta {
			if got := res.Meta[k]; got != want {
				t.Errorf("%v: meta %s = %v (%T), want %v", tc.args, k, got, got, want)
			}
		}
		for _, k := range []string{"gateway_sync", "sync_delay", "sync_loads"} {
			if _, ok := tc.meta[k]; !ok && res.Meta[k] != nil {
				t.Errorf("%v: meta %s = %v, want none", tc.args, k, res.Meta[k])
			}
		}
		run := res.Runs[0]
		if n := tc.meta["gateways"].(float64); n > 1 && run.Extra["gateways"] != n {
			t.Errorf("%v: run extra gateways %v", tc.args, run.Extra["gateways"])
		}
		if _, ok := run.Extra["sync_bytes"]; ok != (tc.meta["gateway_sync"] == "shared") {
			t.Errorf("%v: run extra %v", tc.args, run.Extra)
		}
	}
}
