package main

import (
	"bytes"
	"flag"
	"reflect"
	"strings"
	"testing"
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
